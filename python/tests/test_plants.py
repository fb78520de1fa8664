"""mla_diff_hooks.plants without vLLM: the registry and its specs, the split rule of the Triton
MLA decode, and the merge rules the split-KV plants put in its place.

Why this exists: a plant's dump is judged by what its merge or patch computes, and recorded by its
name and parameters; a merge rule that is wrong in the wrong way, or a spec parsed into other
parameters than the dump records, would make a committed dump stand for another mechanism than
its name. The plants' patches of vLLM itself run in the harness (scripts/fixtures/
make_plant_dumps.py), whose dumps tests/plant_dumps.rs judges.
"""

from __future__ import annotations

import math
import re

import pytest

from support import ROOT, hooks_module

plants = hooks_module("plants")

# the classes mla-diff names for the mechanisms (README's class table)
CLASSES = {
    "phantom-output",
    "lse-merge",
    "paged-kv",
    "residual-scale",
    "precision",
    "kv-b-layout",
    "norm-skipped",
    "strided-view",
    "quant-scale-layout",
    "fp8-act-scale",
    "kv-cache-scale",
    "scale-only",
}


def test_every_plant_names_its_class_reports_and_docs_row():
    docs = (ROOT / "docs" / "engines.md").read_text()
    assert len(plants.REGISTRY) == 26
    for name, p in plants.REGISTRY.items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), name
        assert p.name == name and p.expected in CLASSES, name
        assert p.mechanism and p.where and p.needs, name
        assert re.search(r"#\d+", p.reports) or p.reports.startswith("no public report number: "), (
            f"{name}: a report with its number, or where the mechanism is guarded"
        )
        assert f"| `{name}` |" in docs, f"{name}: no row in docs/engines.md's plant table"
    # every class the mechanisms map to has a plant, the new classes two
    per_class = {c: [p.name for p in plants.REGISTRY.values() if p.expected == c] for c in CLASSES}
    for c in ("paged-kv", "residual-scale", "precision", "norm-skipped", "strided-view"):
        assert len(per_class[c]) >= 2, (c, per_class[c])
    assert all(per_class.values()), per_class


def test_spec_parsing_fills_defaults_and_refuses_what_it_does_not_know():
    assert plants.parse_spec("split-lost") == ("split-lost", {"split": "last"})
    assert plants.parse_spec("empty-split:lse=+inf") == ("empty-split", {"lse": "+inf"})
    assert plants.parse_spec("page-size-ignored: read=64 ") == ("page-size-ignored", {"read": "64"})
    assert plants.parse_spec("dropped-output-copy") == ("dropped-output-copy", {})
    with pytest.raises(ValueError, match=r"unknown plant 'split-lose' \(known: .*split-lost"):
        plants.parse_spec("split-lose")
    with pytest.raises(ValueError, match=r"plant split-lost: unknown parameter 'splits' \(known: split\)"):
        plants.parse_spec("split-lost:splits=2")
    with pytest.raises(ValueError, match=r"parameter 'read' is not key=value"):
        plants.parse_spec("page-size-ignored:read")
    p = plants.REGISTRY["block-id-truncated"]
    reason = p.reason({"bits": "3"})
    assert "bits=3" in reason and "ROCm/ATOM#702" in reason


def test_the_fp8_plants_pad_as_vllm_and_refuse_a_scale_that_changes_nothing():
    # vLLM's CUDA-graph capture sizes: 1, 2, 4, then multiples of 8 up to 512; past it, eager
    assert [plants.padded_rows(t) for t in (1, 2, 3, 4, 5, 8, 9, 20, 512, 513)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        24,
        512,
        513,
    ]
    # the parameters are checked before vLLM is imported
    with pytest.raises(ValueError, match="not 1"):
        plants.REGISTRY["kv-cache-scale"].apply({"scale": "1", "mode": "twice"})
    with pytest.raises(ValueError, match="twice, missing or none"):
        plants.REGISTRY["kv-cache-scale"].apply({"scale": "0.5", "mode": "thrice"})
    with pytest.raises(ValueError, match="not 1"):
        plants.REGISTRY["fp8-query-scale"].apply({"factor": "1"})
    with pytest.raises(ValueError, match="stale > 1"):
        plants.REGISTRY["fp8-act-padded-rows"].apply(
            {"layer": "0", "param": "fused_qkv_a_proj", "stale": "1"}
        )


def test_a_plant_is_recorded_with_its_parameters_and_applied_once(monkeypatch):
    seen = []
    fake = plants.Plant(
        name="fake-plant",
        mechanism="does nothing",
        where="nowhere",
        reports="none#1",
        expected="precision",
        defaults={"x": "1"},
        needs="nothing",
        apply=seen.append,
    )
    monkeypatch.setitem(plants.REGISTRY, "fake-plant", fake)
    monkeypatch.setattr(plants, "_APPLIED", {})
    entry = plants.apply("fake-plant:x=2")
    assert entry == {"name": "plant:fake-plant", "reason": fake.reason({"x": "2"}), "params": {"x": "2"}}
    assert seen == [{"x": "2"}]
    with pytest.raises(ValueError, match="already applied"):
        plants.apply("fake-plant")


torch = pytest.importorskip("torch", reason="the merge rules are torch code")


def split_partials(scores, values, k):
    """The Triton decode's stage 1 in float64: per row b, head h, the cdiv split of its keys into
    k splits; each split's softmax-normalised output and natural LSE (empty splits: zeros)."""
    b, h, s = scores.shape
    seq = torch.full((b,), s, dtype=torch.int64)
    start, end = plants._split_bounds(seq, k)
    out = torch.zeros(b, h, k, values.shape[-1], dtype=torch.float64)
    lse = torch.zeros(b, h, k, dtype=torch.float64)
    for j in range(k):
        a, e = int(start[0, j]), int(end[0, j])
        if e > a:
            sc = scores[..., a:e]
            lse[..., j] = torch.logsumexp(sc, -1)
            out[..., j, :] = torch.softmax(sc, -1) @ values[a:e]
    return out, lse, (end > start)[:, None, :].expand(b, h, k)


def test_split_bounds_follow_the_kernel_and_leave_short_rows_empty_splits():
    b = plants._split_bounds(torch.tensor([2, 3, 101, 193]), 4)
    has = (b[1] > b[0]).tolist()
    assert has == [[True, True, False, False], [True, True, True, False], [True] * 4, [True] * 4]
    assert b[0][2].tolist() == [0, 26, 52, 78] and b[1][2].tolist() == [26, 52, 78, 101]
    assert (
        plants._split_bounds(torch.tensor([2]), 8)[1] > plants._split_bounds(torch.tensor([2]), 8)[0]
    ).sum() == 2


def test_merge_rules_against_attention_over_every_key():
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 2, 13, generator=g, dtype=torch.float64) * 2
    values = torch.randn(13, 5, generator=g, dtype=torch.float64)
    want = torch.softmax(scores, -1) @ values
    want_lse = torch.logsumexp(scores, -1)
    po, pl, has = split_partials(scores, values, 4)  # 4 keys per split: 4, 4, 4, 1
    out, lse = plants.merge_partials(po, pl, has, "exact", {})
    assert torch.allclose(out.double(), want, atol=1e-6) and torch.allclose(lse.double(), want_lse, atol=1e-6)
    # base 2 read as natural: each split weighed by exp(lse / ln 2)
    out, lse = plants.merge_partials(po, pl, has, "base2", {})
    w = torch.softmax(pl / math.log(2.0), -1)
    assert torch.allclose(out.double(), (w[..., None] * po).sum(-2), atol=1e-6)
    assert torch.allclose(lse.double(), torch.logsumexp(pl / math.log(2.0), -1), atol=1e-5)
    # the last split (one key) lost: attention over the first 12 keys
    out, lse = plants.merge_partials(po, pl, has, "lost", {"split": "last"})
    assert torch.allclose(out.double(), torch.softmax(scores[..., :12], -1) @ values[:12], atol=1e-6)
    # split 0 twice: its keys counted twice
    out, _ = plants.merge_partials(po, pl, has, "twice", {"split": "0"})
    w = torch.exp(scores - scores.max(-1, keepdim=True).values)
    w[..., :4] *= 2
    assert torch.allclose(out.double(), (w / w.sum(-1, keepdim=True)) @ values, atol=1e-6)


def test_empty_splits_change_only_the_rows_that_have_them():
    g = torch.Generator().manual_seed(3)
    long_ = torch.randn(1, 2, 13, generator=g, dtype=torch.float64)  # 4 splits, none empty
    short = torch.randn(1, 2, 2, generator=g, dtype=torch.float64)
    values = torch.randn(13, 4, generator=g, dtype=torch.float64)
    pl_, ps = split_partials(long_, values, 4), split_partials(short, values[:2], 4)
    po = torch.cat([pl_[0], ps[0]]).float()
    lse = torch.cat([pl_[1], ps[1]]).float()
    has = torch.cat([pl_[2], ps[2]])
    exact, exact_lse = plants.merge_partials(po, lse, has, "exact", {})
    assert torch.equal(plants.merge_partials(po, lse, has, "empty", {"lse": "-inf"})[0], exact)
    for value in ("0", "3.5"):
        out, out_lse = plants.merge_partials(po, lse, has, "empty", {"lse": value})
        assert torch.allclose(out[0], exact[0]) and torch.allclose(out_lse[0], exact_lse[0])
        assert not torch.allclose(out[1], exact[1], atol=1e-3)
        # two empty splits of output 0 and LSE v: the weights of the real ones shrink
        real = torch.exp(exact_lse[1])[:, None]
        assert torch.allclose(out[1], exact[1] * real / (real + 2 * math.exp(float(value))), atol=1e-5)
    out, _ = plants.merge_partials(po, lse, has, "empty", {"lse": "+inf"})
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
