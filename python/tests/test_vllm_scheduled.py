"""The scheduled runs of the vLLM hooks and the CPU harness, without vLLM: the harness's schedule
(which tokens each request gets per step, the runner's row order), the hooks' un-permuting of a
step recorded in the runner's order into the dump's sequence order with the per-chunk partial
sites cut to the prefill rows with cached context, the format-2 fields that step writes, and the
vLLM plugin's settings and loader wrapping.

Why this exists: a row put back in the wrong order, or a partial site holding another request's
rows, would make `compare` judge the engine against the wrong reference; the live runs that
show it on real vLLM (scripts/fixtures/make_live_cpu_dumps.py) need a venv CI does not build.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from support import ROOT, hooks_module

np = pytest.importorskip("numpy", reason="the capture's tensors are numpy arrays")

vllm_cpu = hooks_module("vllm_cpu")
vllm_hooks = hooks_module("vllm")
vllm_plugin = hooks_module("vllm_plugin")


def test_plan_schedule_chunks_each_prompt_from_its_arrival_and_starts_a_prefix_hit_late():
    prompts = [list(range(20)), list(range(10)), list(range(5))]
    steps = vllm_cpu.plan_schedule(prompts, 8, [0, 1, 0], {2: (0, 3)})
    assert steps == [
        [(0, 8), None, (3, 2)],
        [(8, 8), (0, 8), None],
        [(16, 4), (8, 2), None],
    ]
    assert vllm_cpu.plan_schedule([[1, 2, 3]], 0, [0], {}) == [[(0, 3)]]


def test_runner_order_packs_decodes_then_prefills_with_context_then_new_prefills():
    assert vllm_cpu.runner_order([8, 1, 0, 8, 1], [0, 40, 9, 16, 3]) == [1, 4, 3, 0]
    assert vllm_cpu.runner_order([0, 0], [1, 2]) == []


def test_parse_prefix_names_requests_and_refuses_what_it_cannot_set_up():
    assert vllm_cpu.parse_prefix("1=0:48", 2) == {1: (0, 48)}
    assert vllm_cpu.parse_prefix(None, 2) == {}
    with pytest.raises(SystemExit, match="I=J:N"):
        vllm_cpu.parse_prefix("1-0:48", 2)
    with pytest.raises(SystemExit, match="I != J"):
        vllm_cpu.parse_prefix("1=1:16", 2)


def test_partial_sites_sort_between_the_latent_sites_and_attn_out():
    names = [
        "L0.attn_out",
        "L0.suffix_lse",
        "L0.ctx_out.c10",
        "L0.ctx_lse",
        "L0.ctx_out.c2",
        "L0.ctx_lse.c2",
        "L0.ctx_out",
        "L0.suffix_out",
        "L0.v",
        "L1.hidden_in",
    ]
    assert sorted(names, key=vllm_hooks._site_key) == [
        "L0.v",
        "L0.ctx_out.c2",
        "L0.ctx_lse.c2",
        "L0.ctx_out.c10",
        "L0.ctx_out",
        "L0.ctx_lse",
        "L0.suffix_out",
        "L0.suffix_lse",
        "L0.attn_out",
        "L1.hidden_in",
    ]
    assert vllm_hooks.is_partial_site("L3.ctx_lse.c0") and not vllm_hooks.is_partial_site("L3.lse")


def _capture_with_step(plan, info, t):
    """A VllmCapture holding one recorded step (no model): `t` its sites in the runner's order."""
    cap = vllm_hooks.VllmCapture.__new__(vllm_hooks.VllmCapture)
    cap.plan, cap.info, cap.t = plan, info, t
    rows = next(a.shape[0] for k, a in t.items() if not vllm_hooks.is_partial_site(k))
    cap.tokens = np.arange(100, 100 + rows, dtype=np.int64)
    cap.positions = np.arange(rows, dtype=np.int64)
    return cap


def test_a_mixed_step_is_put_back_in_sequence_order_with_its_partials_cut_to_tc():
    # header order: seq 0 prefill 3 rows over context 5, seq 1 decode 1 row, seq 2 prefill 2
    # rows without context; the runner packed [1, 0, 2] (decodes first)
    plan = {
        "seqs": [{"new": 3, "context": 5}, {"new": 1, "context": 9}, {"new": 2, "context": 0}],
        "order": [1, 0, 2],
        "block_table": np.array([[3, 1], [2, 0], [4, 0]], dtype=np.int32),
    }
    runner_rows = np.array([10.0, 0.0, 1.0, 2.0, 20.0, 21.0], dtype=np.float32)  # seq of each row
    n_heads = 2
    prefill_rows = runner_rows[1:]  # the prefill kernel's rows: seq 0's 3, seq 2's 2
    info = {
        "num_decodes": 1,
        "slot_mapping": np.array([9, 5, 6, 7, 40, 41], dtype=np.int64),
        "context_chunks": (np.array([[0, 0], [4, 4]]), np.array([[4, 0], [1, 0]])),
    }
    t = {
        "L0.attn_out": np.repeat(runner_rows[:, None, None], n_heads, 1),
        "L0.w.kv_b": np.ones((6, 4), dtype=np.float32),
        "L0.ctx_out.c0": np.repeat(prefill_rows[:, None, None], n_heads, 1),
        "L0.ctx_lse.c1": np.repeat(prefill_rows[None, :], n_heads, 0),  # vLLM's [N, Tp]
    }
    cap = _capture_with_step(plan, info, t)
    cap._to_header_order()
    assert cap.t["L0.attn_out"][:, 0, 0].tolist() == [0.0, 1.0, 2.0, 10.0, 20.0, 21.0]
    assert cap.t["L0.w.kv_b"].shape == (6, 4)
    assert cap.t["L0.ctx_out.c0"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]  # Tc: seq 0's rows only
    assert cap.t["L0.ctx_lse.c1"].shape == (3, n_heads)
    assert cap.tokens.tolist() == [101, 102, 103, 100, 104, 105]
    assert cap.info["slot_mapping"].tolist() == [5, 6, 7, 9, 40, 41]
    assert plan["kernel"] == {1: "decode", 0: "prefill", 2: "prefill"}
    assert plan["context_chunks"] == {0: [[0, 4], [4, 5]], 2: [[0, 0], [0, 0]]}
    assert plan["context_chunk_tokens"] == 4
    spec = {"seqs": [{"new": 3, "context": 5}, {"new": 1, "context": 9}, {"new": 2, "context": 0}]}
    vllm_hooks.VllmCapture._plan_fields(spec, plan, [8, 10, 2])
    assert spec["order"] == [1, 0, 2]
    assert spec["context_chunk_tokens"] == 4
    assert [s.get("kernel") for s in spec["seqs"]] == ["prefill", "decode", "prefill"]
    assert spec["seqs"][0]["context_chunks"] == [[0, 4], [4, 5]] and "context_chunks" not in spec["seqs"][1]


def test_plugin_settings_from_the_environment():
    assert vllm_plugin.settings({}) is None
    cfg = vllm_plugin.settings(
        {"MLA_DIFF_VLLM_DUMP": "/tmp/d", "MLA_DIFF_VLLM_STEPS": "2:5", "MLA_DIFF_VLLM_LAYERS": "0,3"}
    )
    assert (cfg["skip"], cfg["steps"], cfg["layers"], cfg["sites"], cfg["write"]) == (
        2,
        5,
        [0, 3],
        None,
        True,
    )
    assert vllm_plugin.settings({"MLA_DIFF_VLLM_DUMP": "d", "MLA_DIFF_VLLM_WRITE": "0"})["write"] is False
    with pytest.raises(ValueError, match="MLA_DIFF_VLLM_STEPS='x'"):
        vllm_plugin.settings({"MLA_DIFF_VLLM_DUMP": "d", "MLA_DIFF_VLLM_STEPS": "x"})
    with pytest.raises(ValueError, match="N >= 1"):
        vllm_plugin.settings({"MLA_DIFF_VLLM_DUMP": "d", "MLA_DIFF_VLLM_STEPS": "0"})
    assert vllm_plugin.settings({"MLA_DIFF_VLLM_DUMP": "d", "MLA_DIFF_VLLM_HEADS": "2:4"})["heads"] == (2, 4)
    for bad in ("2", "3:1", "a:b"):
        with pytest.raises(ValueError, match="MLA_DIFF_VLLM_HEADS"):
            vllm_plugin.settings({"MLA_DIFF_VLLM_DUMP": "d", "MLA_DIFF_VLLM_HEADS": bad})


def test_a_gpu_runners_dummy_forwards_are_neither_recorded_nor_counted(monkeypatch):
    cap = vllm_hooks.VllmCapture.__new__(vllm_hooks.VllmCapture)
    cap.forward_index, cap.n_steps, cap.forwards, cap._skipped_dummy = 1, 1, 0, 0
    cap.plan, cap.capturing, cap.done, cap.tokens, cap.positions = None, False, False, None, None
    begun = []
    monkeypatch.setattr(
        cap, "_begin_forward", lambda: begun.append(1) or setattr(cap, "forwards", cap.forwards + 1)
    )
    monkeypatch.setattr(cap, "_end_step", lambda: None)
    monkeypatch.setattr(vllm_hooks, "_WATCHED", {"on": True})
    monkeypatch.setattr(vllm_hooks, "_LIVE", None)
    for _ in range(3):  # profile and warm-up forwards: outside execute_model
        cap._model_pre(None, (), {})
        cap._model_post(None, (), {}, None)
    assert (cap.forwards, cap._skipped_dummy, begun) == (0, 3, [])
    monkeypatch.setattr(vllm_hooks, "_WATCHED", {"on": False})  # no GPU runner (the CPU harness)
    cap._model_pre(None, (), {})
    assert (cap.forwards, cap._skipped_dummy) == (1, 3)


def test_the_entry_point_vllm_loads_is_the_one_pyproject_declares(tmp_path):
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["vllm.general_plugins"]
    name, _, target = vllm_plugin.ENTRY_POINT.partition(" = ")
    assert declared == {name: target}
    d = vllm_plugin.write_dist_info(tmp_path)
    assert (d / "entry_points.txt").read_text() == f"[vllm.general_plugins]\n{vllm_plugin.ENTRY_POINT}\n"


def test_register_arms_the_model_every_loader_returns_once(monkeypatch):
    # a stand-in for vllm.model_executor.model_loader.base_loader
    class BaseModelLoader:
        def load_model(self, vllm_config, model_config, prefix=""):
            return model_config.model_obj

    class EarlyLoader(BaseModelLoader):
        def load_model(self, vllm_config, model_config, prefix=""):
            return super().load_model(vllm_config, model_config, prefix)

    mod = types.ModuleType("base_loader")
    mod.BaseModelLoader = BaseModelLoader
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.base_loader", mod)
    armed = []
    monkeypatch.setattr(vllm_hooks, "arm", lambda model, **kw: armed.append((model, kw)) or "armed")
    monkeypatch.setattr(vllm_plugin, "_STATE", {"registered": False, "armed": None, "written": False})
    monkeypatch.setenv("MLA_DIFF_VLLM_DUMP", "/tmp/never-written")
    monkeypatch.setenv("MLA_DIFF_VLLM_STEPS", "3")
    monkeypatch.setenv("MLA_DIFF_VLLM_WRITE", "0")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may call it again: nothing doubles

    class LateLoader(BaseModelLoader):  # defined after register, as a plugin's loader may be
        def load_model(self, vllm_config, model_config, prefix=""):
            return super().load_model(vllm_config, model_config, prefix)

    cfg = types.SimpleNamespace(model="m.gguf", model_obj=object())
    for loader in (EarlyLoader(), LateLoader(), BaseModelLoader()):
        cfg.model_obj = object()
        assert loader.load_model(None, cfg) is cfg.model_obj
        assert armed[-1][0] is cfg.model_obj
    assert len(armed) == 3 and vllm_plugin._STATE["model_path"] == "m.gguf"
    # `vllm serve M.gguf --hf-config-path DIR`: vllm-gguf-plugin names DIR as the model and keeps
    # the GGUF in model_weights, which the dump must name
    cfg = types.SimpleNamespace(model="/cfg", model_weights="/w/m.gguf", model_obj=object())
    BaseModelLoader().load_model(None, cfg)
    assert vllm_plugin._STATE["model_path"] == "/w/m.gguf"
    assert len(armed) == 4, "each model armed once, though subclass and base both returned it"
    assert armed[0][1] == {"forward_index": 0, "steps": 3, "layers": None, "sites": None, "heads": None}


def test_live_plan_follows_the_runners_batch_and_finds_a_prefix_hit():
    cap = vllm_hooks.VllmCapture.__new__(vllm_hooks.VllmCapture)
    cap.step_notes = []
    tok = np.zeros((3, 64), dtype=np.int64)
    tok[0, :40] = np.arange(40)
    tok[1, :40] = np.arange(40)  # request b shares a's first 40 tokens
    tok[1, 40:44] = 99
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(
            req_ids=["a"], num_computed_tokens_cpu=np.array([0, 0, 0]), token_ids_cpu=tok
        )
    )
    plan = vllm_hooks.live_plan(cap, runner, types.SimpleNamespace(num_scheduled_tokens={"a": 40}))
    assert plan == {"seqs": [{"new": 40, "context": 0, "prefix": None}], "order": [0]}
    # next step: b arrives with 32 cached tokens and is packed after a's decode row
    tok[0, 40] = 7
    runner.input_batch.req_ids = ["a", "b"]
    runner.input_batch.num_computed_tokens_cpu = np.array([40, 32, 0])
    plan = vllm_hooks.live_plan(cap, runner, types.SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 12}))
    assert plan["order"] == [0, 1]
    assert plan["seqs"] == [
        {"new": 1, "context": 40, "prefix": None},
        {"new": 12, "context": 32, "prefix": {"seq": 0, "len": 32}},
    ]
    assert cap.token_ids[0] == list(range(40)) + [7] and len(cap.token_ids[1]) == 44
    # a finished: it stays a sequence, with 0 new tokens
    runner.input_batch.req_ids = ["b"]
    runner.input_batch.num_computed_tokens_cpu = np.array([44, 0, 0])
    plan = vllm_hooks.live_plan(cap, runner, types.SimpleNamespace(num_scheduled_tokens={"b": 1}))
    assert plan["order"] == [1] and plan["seqs"][0] == {"new": 0, "context": 41, "prefix": None}


def test_a_dsa_layers_selection_is_recorded_as_idx_topk_where_the_reader_takes_it():
    torch = pytest.importorskip("torch", reason="the indexer stand-in returns a torch buffer")
    # vLLM's topk_indices_buffer after a 3-row forward: rows in the kernel's order, -1 for none,
    # rows past the forward's stale
    buf = torch.tensor([[0, -1, -1, -1], [1, 0, -1, -1], [2, 0, 1, -1], [9, 9, 9, 9]], dtype=torch.int32)
    cap = _capture_with_step(None, {}, {"L0.hidden_in": np.zeros((3, 2), np.float32)})
    cap.capturing, cap.done, cap.step_sites, cap.keep_sites, cap.repeats = True, False, {}, None, {}
    cap.steps, cap.indexer_quant = [], None
    cap._indexer(0, None, (torch.zeros(3, 8),), buf)
    got = cap.t["L0.idx_topk"]
    assert got.dtype == np.float32 and got.tolist() == [
        [0, -1, -1, -1],
        [0, 1, -1, -1],
        [0, 1, 2, -1],
    ]
    assert vllm_hooks.topk_rows(np.array([[5, -1, 3]])).tolist() == [[3, 5, -1]]
    # the dump's width is the reader's and the reference's [T, min(K, S)], S the longest sequence
    # with its cached context: a decode step's single row of a 301-token sequence is K wide
    assert vllm_hooks.topk_width(128, [300]) == 128
    assert vllm_hooks.topk_width(128, [100, 30]) == 100  # S = 100: every key kept
    assert vllm_hooks.topk_width(128, [301]) == 128  # a decode step
    assert vllm_hooks.topk_width(128, [3]) == 3
    assert "idx_topk" in vllm_hooks.HOOKED_STAGES and "idx_scores" not in vllm_hooks.HOOKED_STAGES
    # the indexer's fp8 quantization, read from the live module the hook fired on
    assert cap.indexer_quant is None  # the stand-in module (None) has no quant_block_size
    indexer = types.SimpleNamespace(
        quant_block_size=128, scale_fmt="ue8m0", indexer_op=types.SimpleNamespace(use_fp4_cache=False)
    )
    assert vllm_hooks.indexer_quant_field(indexer, torch.bfloat16) == {
        "dtype": "fp8_e4m3",
        "block": 128,
        "scale": "ue8m0",
        "q_amax_floor": 1e-10,
        "k_amax_floor": 1e-4,
        "input": "bf16",
    }
    indexer.scale_fmt = None
    assert vllm_hooks.indexer_quant_field(indexer, torch.float32)["scale"] == "f32"
    indexer.indexer_op.use_fp4_cache = True
    assert vllm_hooks.indexer_quant_field(indexer, torch.bfloat16) is None


def test_the_plugin_registers_from_a_checkout_without_an_install(tmp_path, capsys):
    """`python -m mla_diff_hooks.vllm_plugin DIR` (docs/engines.md, a GPU machine without cargo or
    network): the entry point vLLM's load_general_plugins reads, found by importlib.metadata once
    DIR is on sys.path, and the PYTHONPATH line to export; an unwritable folder is exit 2."""
    import importlib.metadata as md

    assert vllm_plugin.main([str(tmp_path / "ep")]) == 0
    line = capsys.readouterr().out.strip()
    package_parent = Path(vllm_plugin.__file__).resolve().parent.parent
    ep = (tmp_path / "ep").resolve()
    assert line == f"export PYTHONPATH={ep}:{package_parent}${{PYTHONPATH:+:$PYTHONPATH}}"
    sys.path.insert(0, str(tmp_path / "ep"))
    try:
        eps = md.entry_points(group="vllm.general_plugins")
        # an installed wheel declares the same entry point beside the written one
        assert {e.value for e in eps if e.name == "mla_diff_hooks"} == {"mla_diff_hooks.vllm_plugin:register"}
    finally:
        sys.path.remove(str(tmp_path / "ep"))
    (tmp_path / "file").write_text("")
    assert vllm_plugin.main([str(tmp_path / "file" / "ep")]) == 2
    assert "cannot write" in capsys.readouterr().err
