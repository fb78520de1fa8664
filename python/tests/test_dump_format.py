"""The dump contract (mla_diff_hooks.dump_format) against mla-diff's own: the site vocabulary, name
templates and format strings equal what `mla-diff sites --json` prints, and the format 1 and 2
writers reproduce the committed engine dumps.

Why this exists: the hooks write, and mla-diff reads, sites named by a vocabulary defined twice,
once per language (src/core/trace.rs `STAGES`, dump_format.STAGES). A stage added, renamed or
moved on one side only would make dumps that mla-diff reads with sites missing or misordered;
this test fails instead. It needs an mla-diff binary (support.find_mla_diff) and skips without
one; a binary that answers `sites --json` with anything else fails it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from support import GOLDEN, find_mla_diff, hooks_module

dump_format = hooks_module("dump_format")


def python_vocabulary() -> dict:
    """What `mla-diff sites --json` must print, from the Python side of the contract."""
    return {
        "stages": list(dump_format.STAGES),
        "ranked_weights": list(dump_format.RANKED_WEIGHTS),
        "site_templates": dict(dump_format.SITE_TEMPLATES),
        "dump_formats": list(dump_format.DUMP_FORMATS),
    }


def test_site_vocabulary_is_mla_diffs():
    exe = find_mla_diff()
    if exe is None:
        pytest.skip(
            "no mla-diff binary with `compare` (pip install the wheel, or cargo build --release, "
            "or set MLA_DIFF)"
        )
    r = subprocess.run([str(exe), "sites", "--json"], capture_output=True, text=True)
    if r.returncode == 2 and "sites" in r.stderr and os.environ.get("MLA_DIFF_TEST_WHEEL") != "1":
        pytest.skip(
            f"{exe} has no `sites` subcommand (a build older than the contract test): "
            f"{r.stderr.strip().splitlines()[0] if r.stderr.strip() else 'exit 2'}"
        )
    assert r.returncode == 0, f"{exe} sites --json: exit {r.returncode}\n{r.stderr}"
    rust = json.loads(r.stdout)
    python = python_vocabulary()
    assert sorted(rust) == sorted(python), "the keys of `mla-diff sites --json`"
    for key in python:
        assert python[key] == rust[key], (
            f"{key}: mla_diff_hooks.dump_format (left) differs from `{exe.name} sites --json` (right)"
        )


def test_name_builders_follow_the_templates():
    t = dump_format.SITE_TEMPLATES
    assert dump_format.site(3, "kv_c_normed") == t["layer"].format(layer=3, stage="kv_c_normed")
    assert dump_format.site(3, "kv_c_normed") == "L3.kv_c_normed"
    assert dump_format.weight_rank_site(1, "kv_b", 2) == t["weight_rank"].format(
        layer=1, weight="kv_b", rank=2
    )
    assert dump_format.o_proj_rank_site(0, 1) == t["o_proj_rank"].format(layer=0, rank=1)
    assert dump_format.ffn_gate_up_rank_site(2, 1) == "L2.ffn_gate_up.rank1"
    assert dump_format.ffn_down_rank_site(0, 3) == t["ffn_down_rank"].format(layer=0, rank=3)
    assert dump_format.weight_rank_site(0, "gate_up", 1) == "L0.w.gate_up.rank1"
    with pytest.raises(ValueError, match="not a ranked weight"):
        dump_format.weight_rank_site(0, "q_a", 0)
    assert dump_format.parse_site("L12.w.kv_b.rank1") == (12, "w.kv_b.rank1")
    assert dump_format.parse_site("tokens") is None and dump_format.parse_site("Lx.q") is None
    assert dump_format.step_tensor(2, "L0.lse") == "s2.L0.lse"
    assert dump_format.ffn_gate_up_rank_site(0, 1) == "L0.ffn_gate_up.rank1"
    assert dump_format.ffn_down_rank_site(2, 0) == t["ffn_down_rank"].format(layer=2, rank=0)
    assert dump_format.split_rank("w.gate_up.rank3") == ("w.gate_up", 3)
    assert dump_format.split_rank("o_proj") is None and dump_format.split_rank("x.rankA") is None
    for group in (
        dump_format.FFN_STAGES,
        dump_format.INDEXER_STAGES,
        dump_format.MOE_STAGES,
        dump_format.FFN_STAGES,
        dump_format.ABSORBED_STAGES,
        dump_format.WEIGHT_STAGES,
    ):
        assert set(group) <= set(dump_format.STAGES), group


def test_site_order():
    key = dump_format.site_order(["hidden_in", "q", "hidden_out"])
    names = ["tokens", "L1.q", "L0.zzz", "L0.hidden_out", "L0.aaa", "L0.q", "L0.hidden_in"]
    assert sorted(names, key=key) == [
        "L0.hidden_in",
        "L0.q",
        "L0.hidden_out",
        "L0.aaa",
        "L0.zzz",
        "L1.q",
        "tokens",
    ]


# ---- the writers against the committed dumps --------------------------------------------------

COMMITTED = sorted(p.name for p in (GOLDEN / "dumps").glob("*.safetensors"))


@pytest.mark.parametrize("name", COMMITTED)
def test_writers_reproduce_committed_dumps(tmp_path, name):
    """Each committed dump, read and written again through write_format1 / write_format2 (its
    tensors in the file's order, its metadata split into header, notes and the rest; a WEIGHTS
    file through st_io.save), gives the same tensors and metadata; byte for byte where the file's
    metadata keys are in sorted order, the order st_io writes (the live-engine dumps and three
    kernel dumps were written by the safetensors package, whose metadata order is random)."""
    pytest.importorskip("numpy", reason="the writers need numpy (pip install numpy)")
    from test_st_io import read  # the independent reader

    src = GOLDEN / "dumps" / name
    tensors, meta, header = read(src)
    out = tmp_path / name
    if meta["format"] == dump_format.FORMAT1:
        dump_format.write_format1(out, tensors, {k: v for k, v in meta.items() if k != "format"})
    elif meta["format"] == dump_format.VLLM_WEIGHTS:  # loaded weights alone (st_io.save)
        dump_format.st_io.save(tensors, out, metadata=meta)
    else:
        assert meta["format"] == dump_format.FORMAT2, meta["format"]
        h = json.loads(meta["header"])
        compact = dump_format.header_json(h) == meta["header"]
        notes = meta["notes"].split(" | ") if "notes" in meta else []
        extra = {k: v for k, v in meta.items() if k not in ("format", "header", "notes")}
        # a dump written before write_format2 stored bf16 values as BF16 keeps its F32 bytes
        bf16 = any(v.get("dtype") == "BF16" for k, v in header.items() if k != "__metadata__")
        dump_format.write_format2(out, tensors, h, notes=notes, extra=extra, compact=compact, bf16_steps=bf16)
    got, got_meta, got_header = read(out)
    assert got_meta == meta and list(got) == list(tensors)
    assert all(
        got[k].dtype == tensors[k].dtype
        and got[k].shape == tensors[k].shape
        and got[k].tobytes() == tensors[k].tobytes()
        for k in tensors
    )
    if list(header["__metadata__"]) == sorted(meta):
        want = hashlib.sha256(src.read_bytes()).hexdigest()
        assert hashlib.sha256(out.read_bytes()).hexdigest() == want, f"{name}: not byte-identical"


def test_kernel_runner_reproduces_its_committed_dump(tmp_path, monkeypatch):
    """kernels.write_dump, given the committed FA3 dump's own header, hook name, tensors and vLLM
    version, writes that file again byte for byte (its metadata keys happen to be in sorted
    order, the order st_io writes)."""
    torch = pytest.importorskip(
        "torch", reason="the kernel runner needs torch (pip install 'mla-diff[kernels]')"
    )
    from types import SimpleNamespace

    from test_st_io import read

    kernels = hooks_module("kernels")
    src = GOLDEN / "dumps" / "fa3-v3-bf16.kernel-fa3.safetensors"
    tensors, meta, _ = read(src)
    h = json.loads(meta["header"])
    assert h["hook"]["version"] == kernels.HOOK_VERSION and h["engine"]["version"] == "vllm 0.26.0"
    monkeypatch.setattr(kernels, "HOOK_NAME", h["hook"]["name"])
    (tmp_path / "root" / "vllm-0.26.0.dist-info").mkdir(parents=True)
    layer = int(next(iter(tensors)).split(".")[1][1:])
    t = {k.split(".", 2)[2]: torch.from_numpy(v.copy()) for k, v in tensors.items()}
    inp = SimpleNamespace(header=h, layer=layer, heads=tuple(h["heads"]), t={"hidden_in": t["hidden_in"]})
    args = SimpleNamespace(dtype=h["dtype"], plant=None)
    out = tmp_path / "fa3.safetensors"
    kernels.write_dump(out, inp, "fa3", tmp_path / "root", args, t["attn_out"], t["lse"], "e")
    assert out.read_bytes() == src.read_bytes()


def test_rank_sites_sort_before_the_stage_that_consumes_them():
    """mla-diff's order (src/core/trace.rs, `Stage::order`): a shard just before its consumer, a
    partial just before the all-reduce's output, ranks in order."""
    key = dump_format.site_order(dump_format.STAGES)
    names = [
        "L0.hidden_out",
        "L0.ffn_down.rank1",
        "L0.ffn_out",
        "L0.ffn_gate_up.rank0",
        "L0.w.gate_up.rank1",
        "L0.ffn_gate",
        "L0.o_proj",
        "L0.o_proj.rank10",
        "L0.o_proj.rank2",
        "L0.w.o_proj.rank0",
        "L0.w.kv_b.rank1",
        "L0.w.kv_b",
        "L0.k_nope",
        "L0.q",
        "L0.w.q_b.rank0",
        "L0.ffn_in",
    ]
    assert sorted(names, key=key) == [
        "L0.w.q_b.rank0",
        "L0.q",
        "L0.w.kv_b",
        "L0.w.kv_b.rank1",
        "L0.k_nope",
        "L0.w.o_proj.rank0",
        "L0.o_proj.rank2",
        "L0.o_proj.rank10",
        "L0.o_proj",
        "L0.ffn_in",
        "L0.w.gate_up.rank1",
        "L0.ffn_gate_up.rank0",
        "L0.ffn_gate",
        "L0.ffn_down.rank1",
        "L0.ffn_out",
        "L0.hidden_out",
    ]
