"""mla_diff_hooks.vllm_cpu's pure-Python parts, without vLLM: the patch list a dump records, the
never-filled test of a GGUF linear layer, the Triton argument checks' CUDA view, and the table of
which TP rank's slice each loaded FFN weight holds.

Why this exists: the harness runs vLLM in a venv CI does not build (`python -m
mla_diff_hooks.vllm_cpu test` is run by hand), but these parts decide what a dump says about the
engine: a wrong patch list misstates provenance, a wrong never-filled test zeroes loaded layers,
a wrong slice table misnames the rank a weight came from.
"""

from __future__ import annotations

import pytest

from support import ROOT, hooks_module

np = pytest.importorskip("numpy", reason="the slice table needs numpy")

vllm_cpu = hooks_module("vllm_cpu")


def test_patch_list_records_what_was_applied_in_order():
    base = vllm_cpu.patch_list()
    assert base == vllm_cpu.PATCHES
    names = [n for n, _ in base]
    assert len(names) == len(set(names)) and "triton-cuda-check" in names
    assert names.index("triton-cuda-check") < names.index("unloaded-weights-report")
    fixed = vllm_cpu.patch_list(["fix-merged-column-rank", "fix-merged-column-rank"])
    assert fixed == base + [vllm_cpu.FIX_MERGED_COLUMN_RANK]
    assert "PR #106" in fixed[-1][1] and "get_tensor_model_parallel_rank()" in fixed[-1][1]
    zeroed = vllm_cpu.patch_list(
        [], ["model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj"]
    )
    assert zeroed[-2:] == [
        vllm_cpu.ZERO_UNLOADED,
        ("zeroed", "model.layers.0.self_attn.kv_b_proj, model.layers.1.self_attn.kv_b_proj"),
    ]
    known = (
        r"\(known: fix-merged-column-rank, fix-moe-name-map, load-split-kv-b, glm-dsa-name-map, "
        r"cpu-sparse-mla-backend\)"
    )
    with pytest.raises(ValueError, match=r"unknown patch 'fix-everything' " + known):
        vllm_cpu.patch_list(["fix-everything"])


def test_glm_dsa_name_map_is_the_hooks_patch_and_names_glm_moe_dsa_as_glm_dsa():
    """The harness records the same glm-dsa-name-map patch a GPU run applies, and the view of
    gguf-py's architecture names it gives the plugin finds glm-dsa for glm_moe_dsa first (the
    plugin's loop takes the first name equal to the model_type) and keeps every other name."""
    hooks = hooks_module("vllm")
    assert vllm_cpu.patch_list(["glm-dsa-name-map"])[-1] is hooks.GLM_DSA_NAME_MAP
    assert "Unknown gguf model_type: glm_moe_dsa" in hooks.GLM_DSA_NAME_MAP[1]
    names = {"DEEPSEEK2": "deepseek2", "GLM_DSA": "glm-dsa", "LLAMA": "llama"}
    view = hooks._GgufView(type("gguf", (), {"MODEL_ARCH_NAMES": names, "MODEL_ARCH": 7})())
    found = [arch for arch, name in view.MODEL_ARCH_NAMES.items() if name == "glm_moe_dsa"]
    assert found == ["GLM_DSA"]
    assert [a for a, n in view.MODEL_ARCH_NAMES.items() if n == "deepseek2"] == ["DEEPSEEK2"]
    assert view.MODEL_ARCH == 7 and view.MODEL_ARCH_NAMES["LLAMA"] == "llama"
    assert len(view.MODEL_ARCH_NAMES) == 3 and list(view.MODEL_ARCH_NAMES) == list(names)
    sparse = vllm_cpu.patch_list(["cpu-sparse-mla-backend"])[-1]
    assert sparse == vllm_cpu.CPU_SPARSE_MLA_BACKEND and "--weights-only" in sparse[1]


class _Param:
    """A parameter as the plugin leaves it: `numel()` and its shards waiting in `data_container`."""

    def __init__(self, numel: int, shards: int = 0):
        self._numel = numel
        self.data_container = [object()] * shards

    def numel(self) -> int:
        return self._numel


class UninitializedParameter(_Param):  # torch.nn.parameter's, matched by class name
    pass


class GGUFUninitializedWeightParameter(UninitializedParameter):
    pass


def test_never_filled_after_loading():
    # never touched by the loader: the plugin's lazy parameter
    assert vllm_cpu.never_filled(GGUFUninitializedWeightParameter(0))
    # materialized but empty, nothing waiting: a layer whose GGUF tensor the name map lacks
    assert vllm_cpu.never_filled(_Param(0))
    # a loaded single tensor, or a merged layer after process_weights_after_loading concatenated it
    assert not vllm_cpu.never_filled(_Param(128 * 136))
    # a merged layer read BEFORE that step: empty qweight, two shards waiting (loaded)
    assert not vllm_cpu.never_filled(_Param(0, shards=2))
    assert not vllm_cpu.never_filled(None)


def test_cuda_view_answers_is_cuda_and_nothing_else():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = vllm_cpu.CudaView(a)
    assert v.is_cuda is True and v.shape == (2, 3) and v.dtype == np.float32
    assert v.reshape(3, 2) is not None and np.array_equal(v.reshape(3, 2), a.reshape(3, 2))
    with pytest.raises(AttributeError):
        v.is_cuda = False


def test_slices_of_merged_column_and_row_parallel_weights():
    rng = np.random.default_rng(7)
    i, h, tp = 8, 4, 2
    gate, up, down = (rng.standard_normal(s) for s in ((i, h), (i, h), (h, i)))
    s1 = vllm_cpu.merged_column_slice(gate, up, 1, tp)
    assert s1.shape == (i, h) and np.array_equal(s1[:4], gate[4:]) and np.array_equal(s1[4:], up[4:])
    assert np.array_equal(vllm_cpu.row_parallel_slice(down, 1, tp), down[:, 4:])
    gguf = {"blk.0.ffn_gate.weight": gate, "blk.0.ffn_up.weight": up, "blk.0.ffn_down.weight": down}
    gguf.update({f"blk.1.ffn_{k}_shexp.weight": v for k, v in (("gate", gate), ("up", up), ("down", down))})
    loaded = {
        # vllm-gguf-plugin 0.0.5 at TP 2: rank 1 holds rank 0's rows of the merged gate_up_proj
        "L0.gate_up_proj.rank0": vllm_cpu.merged_column_slice(gate, up, 0, tp),
        "L0.gate_up_proj.rank1": vllm_cpu.merged_column_slice(gate, up, 0, tp),
        "L0.down_proj.rank1": vllm_cpu.row_parallel_slice(down, 1, tp),
        "L1.shared_experts.gate_up_proj.rank1": s1,
        "L0.o_proj.rank1": np.zeros((h, h)),  # not an FFN weight: not in the table
    }
    rows = vllm_cpu.slice_table(loaded, gguf, tp)
    got = {(r["layer"], r["param"], r["rank"]): r for r in rows}
    assert sorted(got) == [
        (0, "down_proj", 1),
        (0, "gate_up_proj", 0),
        (0, "gate_up_proj", 1),
        (1, "shared_experts.gate_up_proj", 1),
    ]
    bug = got[(0, "gate_up_proj", 1)]
    assert bug["holds"] == 0 and bug["vs"][0] == 0.0 and bug["vs"][1] > 0.5
    assert got[(0, "down_proj", 1)]["holds"] == 1 and got[(0, "down_proj", 1)]["vs"][1] == 0.0
    assert got[(1, "shared_experts.gate_up_proj", 1)]["holds"] == 1
    assert vllm_cpu.rel_l2(np.ones(3), np.ones(4)) == float("inf")


def test_loader_hint_names_the_plugin_for_the_moe_name_map():
    # vllm-gguf-plugin 0.0.5 on golden/models/moe-v3-q8_0.gguf (transformers 5.25)
    err = (
        "Failed to map GGUF parameters (2): ['model.layers.1.mlp.experts.gate_up_proj', "
        "'model.layers.2.mlp.experts.gate_up_proj']"
    )
    hint = vllm_cpu.loader_hint(err)
    assert hint == vllm_cpu.MOE_MAP_HINT
    assert "a plugin bug, not the file" in hint and "build_name_map" in hint
    assert "--patch fix-moe-name-map" in hint
    assert vllm_cpu.loader_hint("Failed to map GGUF parameters (1): ['model.layers.0.self_attn.foo']") is None
    assert vllm_cpu.loader_hint("size mismatch") is None


def test_prompts_one_or_several_requests():
    assert vllm_cpu.parse_prompts("1, 2,3", None) == [[1, 2, 3]]
    assert vllm_cpu.parse_prompts(None, "1,2;3") == [[1, 2], [3]]
    for tokens, prompts in (("1", "2"), (None, None), (None, "1;"), (None, "1;-2"), ("a,b", None)):
        with pytest.raises(SystemExit):
            vllm_cpu.parse_prompts(tokens, prompts)


def test_prefill_keep_selects_activation_stages_and_weight_sites():
    assert vllm_cpu.prefill_keep(None, None) == (None, True)
    keep, weights = vllm_cpu.prefill_keep("hidden_in,kv_c_normed", "none")
    assert keep == {0: ["hidden_in", "kv_c_normed"]} and weights is False
    keep, weights = vllm_cpu.prefill_keep(None, "w.W_UK_T")
    assert weights and keep[0][-1] == "w.W_UK_T" and "hidden_out" in keep[0] and "w.kv_b" not in keep[0]
    with pytest.raises(SystemExit, match="w.kv_b not among"):
        vllm_cpu.prefill_keep("w.kv_b", None)
    with pytest.raises(SystemExit, match="hidden_in not among"):
        vllm_cpu.prefill_keep(None, "hidden_in")


def test_kv_split_rule_names_the_work_and_the_sm_count():
    name, reason = vllm_cpu.kv_split_rule(32)
    assert name == "kv-split-rule" and "set to 32" in reason and "132" in reason and "512" in reason


def test_split_kv_b_weights_rebuild_kv_b_per_head():
    gguf = pytest.importorskip("gguf", reason="reads a GGUF")
    path = ROOT / "golden" / "models" / "tiny-v3-f32.gguf"
    w = vllm_cpu.split_kv_b_weights(path)
    assert sorted(w) == [f"model.layers.{n}.self_attn.kv_b_proj.weight" for n in (0, 1)]
    kv_b = w["model.layers.1.self_attn.kv_b_proj.weight"]
    assert kv_b.shape == (6 * (32 + 64), 96) and kv_b.dtype == np.float32
    rd = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    k_b = np.asarray(rd["blk.1.attn_k_b.weight"].data).reshape(6, 96, 32)  # ne {P, L, N}
    v_b = np.asarray(rd["blk.1.attn_v_b.weight"].data).reshape(6, 64, 96)  # ne {L, V, N}
    for h in (0, 5):
        rows = kv_b[h * 96 : (h + 1) * 96]
        assert np.array_equal(rows[:32], k_b[h].T) and np.array_equal(rows[32:], v_b[h])
    assert vllm_cpu.split_kv_b_weights(ROOT / "golden" / "models" / "legacy-kvb-f32.gguf") == {}


def test_a_hugging_face_run_records_no_gguf_patch_and_the_fp8_stand_ins():
    fp8 = hooks_module("fp8_cpu").patch_entries("weight-only")
    got = vllm_cpu.patch_list(fp8=fp8)
    names = [n for n, _ in got]
    assert "triton-cuda-check" not in names and "unloaded-weights-report" not in names
    assert names[: len(names) - 3] == [n for n, _ in vllm_cpu.PATCHES if n not in vllm_cpu.GGUF_ONLY_PATCHES]
    assert got[-3:] == fp8
    assert vllm_cpu.patch_list(fp8=[])[-1][0] == "block-pool-history"  # an unquantized folder


def _run_args(**kw):
    import argparse

    base = dict(gguf=None, model=None, patch=[], config_dir=None, zero_unloaded=False, fp8_compute=None)
    return argparse.Namespace(**{**base, **kw})


def test_one_model_source_and_no_gguf_option_with_a_folder():
    fp8 = str(ROOT / "golden" / "hf-v3-fp8")
    vllm_cpu.check_source(_run_args(model=fp8))
    vllm_cpu.check_source(_run_args(gguf="x.gguf", patch=["fix-merged-column-rank"]))
    for bad, msg in (
        (_run_args(), "give one of --gguf FILE"),
        (_run_args(gguf="x.gguf", model=fp8), "give one of --gguf FILE"),
        (_run_args(model=str(ROOT / "golden")), "a Hugging Face checkpoint folder with config.json"),
        (_run_args(gguf="x.gguf", fp8_compute="weight-only"), "--fp8-compute: for a block-FP8 Hugging"),
        (
            _run_args(model=fp8, patch=["load-split-kv-b"], zero_unloaded=True),
            "--patch load-split-kv-b, --zero-unloaded: for a GGUF through vllm-gguf-plugin",
        ),
    ):
        with pytest.raises(SystemExit, match=msg):
            vllm_cpu.check_source(bad)
    assert vllm_cpu.hf_quant_method(fp8) == "fp8"
    assert vllm_cpu.hf_quant_method(ROOT / "golden" / "hf-v3-bf16") is None


def test_weights_keep_leaves_only_the_named_params(tmp_path):
    st_io = hooks_module("st_io")
    p = tmp_path / "w.safetensors"
    names = ["L0.o_proj", "L0.q_b_proj", "L1.o_proj", "L0.shared_experts.down_proj.rank1", "L0.W_UV.rank0"]
    st_io.save({n: np.full((2, 2), i, np.float32) for i, n in enumerate(names)}, p, metadata={"engine": "e"})
    vllm_cpu.keep_weights(p, None)
    assert list(st_io.load(p)[0]) == names
    vllm_cpu.keep_weights(p, "o_proj, shared_experts.down_proj")
    t, meta = st_io.load(p)
    assert list(t) == ["L0.o_proj", "L1.o_proj", "L0.shared_experts.down_proj.rank1"]
    assert t["L1.o_proj"][0, 0] == 2 and meta["engine"] == "e"
    assert (
        meta["kept"] == "only o_proj, shared_experts.down_proj (--weights-keep); the other tensors left out"
    )
    with pytest.raises(SystemExit, match="--weights-keep kv_b_proj: no tensor of"):
        vllm_cpu.keep_weights(p, "kv_b_proj")
