"""Planted bugs: historical MLA bug mechanisms reintroduced into vLLM 0.26.0's own code, in-process.

Why this exists: a class that mla-diff names must be shown on what a real engine computes with
the bug, not only on its own engine paths. Each plant here is a monkeypatch of vLLM's Python code
(no file is edited) that brings back one mechanism a public vLLM, SGLang, llama.cpp, FlashInfer,
AITER, DeepSpeed or PyTorch report describes, at the place in vLLM where that mechanism would
act. A run records every plant it applied in the dump's `patches` as
`{"name": "plant:NAME", "reason": ..., "params": {...}}`, for provenance only: no mla-diff
detector reads it, and the tests judge each planted dump with its patches removed. The CPU
harness applies them with `python -m mla_diff_hooks.vllm_cpu run ... --plant NAME[:K=V,...]`;
a live runner applies the same functions in its worker, before the model is built.

Nothing here assumes a device: every tensor a plant makes is made on its inputs' device. Each
plant is applied once per process (`apply`); they patch classes and module functions, so they
act on every layer and every later model of the process. Reference (each plant, the reports,
the commands, the committed dumps): docs/engines.md, "Planted bugs".
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Plant:
    """One planted mechanism.

    name: kebab-case, recorded as `plant:{name}`; mechanism: what the patched code does wrong;
    where: the vLLM code patched; reports: the public reports it stands for; expected: the class
    mla-diff should name (documentation and tests; nothing at run time reads it); defaults: its
    parameters (strings, as on the command line); needs: what the run must have for the plant to
    show (a decode step, P = V, ...); apply: patches vLLM given the parsed parameters.
    """

    name: str
    mechanism: str
    where: str
    reports: str
    expected: str
    defaults: dict[str, str]
    needs: str
    apply: Callable[[dict[str, str]], None]

    def reason(self, params: dict[str, str]) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        return f"{self.mechanism} ({self.where}{'; ' + shown if shown else ''}); reports: {self.reports}"


REGISTRY: dict[str, Plant] = {}
_APPLIED: dict[str, dict[str, str]] = {}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME` or `NAME:key=value,key=value` -> (name, params). Errors: ValueError naming the
    plant or parameter for an unknown plant, an unknown parameter or an entry without `=`."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in REGISTRY:
        raise ValueError(f"unknown plant {name!r} (known: {', '.join(sorted(REGISTRY))})")
    params = dict(REGISTRY[name].defaults)
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"plant {name}: parameter {item!r} is not key=value")
        if key not in params:
            raise ValueError(
                f"plant {name}: unknown parameter {key!r} (known: {', '.join(params) or 'none'})"
            )
        params[key] = value
    return name, params


def apply(spec: str) -> dict[str, Any]:
    """Apply the plant `spec` (parse_spec) in this process and return its `patches` entry
    `{"name": "plant:NAME", "reason", "params"}`. Errors: ValueError for a bad spec, or a plant
    applied twice in one process (their patches would stack)."""
    name, params = parse_spec(spec)
    if name in _APPLIED:
        raise ValueError(f"plant {name} is already applied in this process")
    plant = REGISTRY[name]
    plant.apply(params)
    _APPLIED[name] = params
    return {"name": f"plant:{name}", "reason": plant.reason(params), "params": dict(params)}


def _register(**kw) -> Callable[[Callable[[dict[str, str]], None]], Callable[[dict[str, str]], None]]:
    def deco(fn):
        REGISTRY[kw["name"]] = Plant(apply=fn, **kw)
        return fn

    return deco


def _owner(cls: type, attr: str) -> type:
    """The class in `cls`'s MRO that defines `attr` (where a patch must go to reach every subclass)."""
    for c in cls.__mro__:
        if attr in c.__dict__:
            return c
    raise AttributeError(f"{cls.__name__}.{attr}")


def _int(params: dict[str, str], key: str) -> int:
    try:
        return int(params[key])
    except ValueError:
        raise ValueError(f"parameter {key}={params[key]!r} is not an integer") from None


def _float(params: dict[str, str], key: str) -> float:
    value = params[key].strip().lower()
    table = {"+inf": math.inf, "inf": math.inf, "-inf": -math.inf}
    if value in table:
        return table[value]
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"parameter {key}={params[key]!r} is not a number") from None


def _mla():
    from vllm.model_executor.layers.attention import mla_attention

    return mla_attention


def _triton_mla():
    from vllm.v1.attention.backends.mla import triton_mla

    return triton_mla


def _wrap_decode_call(change: Callable[[list, dict], None]) -> None:
    """Wrap Triton MLA's call of `decode_attention_fwd` (module `triton_mla`, as
    `TritonMLAImpl.forward_mqa` calls it): `change(args, kwargs)` edits the arguments in place
    before the kernel runs. Arguments: q, k_buffer, v_buffer, o, lse, req_to_token (the block
    table), b_seq_len, attn_logits, num_kv_splits, sm_scale, page_size, ..."""
    mod = _triton_mla()
    orig = mod.decode_attention_fwd

    def decode_attention_fwd(*args, **kwargs):
        args = list(args)
        change(args, kwargs)
        return orig(*args, **kwargs)

    mod.decode_attention_fwd = decode_attention_fwd


def _arg(args: list, kwargs: dict, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _set_arg(args: list, kwargs: dict, index: int, name: str, value) -> None:
    if len(args) > index:
        args[index] = value
    else:
        kwargs[name] = value


def _after_init(cls: type, fn: Callable[[Any], None]) -> None:
    """Run fn(self) after every `cls.__init__` (a per-instance patch made when the model is built)."""
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        fn(self)

    cls.__init__ = __init__


def _mla_attention_class():
    from vllm.model_executor.models import deepseek_v2

    return deepseek_v2.DeepseekV2MLAAttention


# =============================================================================================
# phantom output
# =============================================================================================


@_register(
    name="dropped-output-copy",
    mechanism="the prefill attention's result is computed but never copied into the caller's "
    "output buffer, which keeps what torch.empty handed out",
    where="MLACommonBaseImpl.forward_mha runs on a scratch buffer instead of the caller's `output`",
    reports="vLLM PR #26397 (an unzeroed, never-written context output in MLA prefill)",
    expected="phantom-output",
    defaults={},
    needs="a prefill step (attn_out of the prefill rows)",
)
def _dropped_output_copy(params: dict[str, str]) -> None:
    import torch

    cls = _owner(_mla().MLACommonBaseImpl, "forward_mha")
    orig = cls.forward_mha

    def forward_mha(self, *args, **kwargs):
        output = _arg(list(args), kwargs, 6, "output")
        scratch = torch.empty_like(output)
        args = list(args)
        _set_arg(args, kwargs, 6, "output", scratch)
        return orig(self, *args, **kwargs)

    cls.forward_mha = forward_mha


# =============================================================================================
# split-KV merge of the Triton MLA decode (stage 2)
# =============================================================================================


def _split_bounds(seq_lens, k: int):
    """[B, K] start and end of each split, as the Triton kernel cuts a row of `seq_lens` keys:
    ceil(seq_len / K) keys per split, the last ones short or empty."""
    import torch

    seq = seq_lens.to(torch.int64)
    per = (seq + k - 1) // k
    start = per[:, None] * torch.arange(k, device=seq.device)[None, :]
    end = torch.minimum(start + per[:, None], seq[:, None])
    return start, end


def merge_partials(part_o, part_l, has, rule: str, params: dict[str, str]):
    """Merge split-KV partials as a buggy stage 2 would. part_o [B, H, K, Lv]: each split's
    normalised output; part_l [B, H, K]: its natural-log LSE; has [B, H, K]: whether the split
    has keys (an empty split's entries are never written). `rule`: `exact` (the correct merge:
    softmax weights over the splits that have keys), `base2` (every LSE taken as base 2 and
    weighed with exp), `lost` / `twice` (params["split"]: an index or `last`, each row's last
    split with keys, left out / counted twice), `empty` (every empty split merged with output 0
    and LSE float(params["lse"])). Returns (out [B, H, Lv], lse [B, H]), float32."""
    import torch

    part_o = part_o.to(torch.float32)
    part_l = part_l.to(torch.float32)
    b, h, k = part_l.shape
    use = has.clone()
    mult = torch.ones_like(part_l)
    if rule == "base2":
        part_l = part_l * (1.0 / math.log(2.0))  # the LSE in base 2, read as natural
    elif rule in ("lost", "twice"):
        if params["split"] == "last":  # each row's last split that has keys
            j = (has.to(torch.int64) * torch.arange(k, device=has.device)).argmax(dim=-1, keepdim=True)
        else:
            j = torch.full((b, h, 1), _int(params, "split"), dtype=torch.int64, device=has.device)
        pick = torch.zeros_like(has).scatter_(-1, j.clamp(0, k - 1), True) & has & (j < k)
        if rule == "lost":
            use = use & ~pick
        else:
            mult = torch.where(pick, torch.full_like(mult, 2.0), mult)
    elif rule == "empty":
        empty = ~has
        use = use | empty
        part_o = torch.where(empty[..., None], torch.zeros_like(part_o), part_o)
        part_l = torch.where(empty, torch.full_like(part_l, _float(params, "lse")), part_l)
    elif rule != "exact":
        raise ValueError(f"merge rule {rule!r}")
    l_used = torch.where(use, part_l, torch.full_like(part_l, -math.inf))
    m = l_used.max(dim=-1, keepdim=True).values
    w = torch.where(use, torch.exp(l_used - m) * mult, torch.zeros_like(part_l))
    total = w.sum(dim=-1)
    out = (w[..., None] * part_o).sum(dim=-2) / total[..., None]
    return out, m[..., 0] + torch.log(total)


def _merge_splits(rule: str, params: dict[str, str]) -> None:
    """Replace the Triton decode's stage 2 (`_decode_softmax_reducev_fwd`, module
    triton_decode_attention) by merge_partials of the same stage-1 partials (each split's
    normalised output and natural-log LSE in `attn_logits` [B, H, K, Lv+1]) under `rule`."""
    from vllm.v1.attention.ops import triton_decode_attention as tda

    def reduce(logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits):
        k = int(num_kv_splits)
        lv = v_buffer.shape[-1]
        b, h = q.shape[0], q.shape[1]
        start, end = _split_bounds(b_seq_len[:b], k)
        has = (end > start)[:, None, :].expand(b, h, k)
        out, out_lse = merge_partials(logits[:b, :h, :k, :lv], logits[:b, :h, :k, lv], has, rule, params)
        o[:b, :h, :lv].copy_(out.to(o.dtype))
        lse[:b, :h].copy_(out_lse.to(lse.dtype))

    tda._decode_softmax_reducev_fwd = reduce


_MERGE_WHERE = (
    "the Triton MLA decode's stage 2, vllm/v1/attention/ops/triton_decode_attention.py "
    "_decode_softmax_reducev_fwd, replaced by a torch merge of the same stage-1 partials"
)


@_register(
    name="split-lse-base2",
    mechanism="each split's partial LSE is in base 2 and the merge weighs it as a natural log "
    "(exp instead of exp2): every split's weight is off by exp(lse·(log2 e − 1))",
    where=_MERGE_WHERE,
    reports="sglang#40903 (base-2 LSE fed to the natural-log merge_state_v2), sglang PR #35045",
    expected="lse-merge",
    defaults={},
    needs="a decode step with num_kv_splits >= 2",
)
def _split_lse_base2(params: dict[str, str]) -> None:
    _merge_splits("base2", params)


@_register(
    name="split-lost",
    mechanism="the merge skips one split's partial (`split`: an index, or `last`, each row's last "
    "split that has keys: a loop bound one short)",
    where=_MERGE_WHERE,
    reports="sglang#40903 and flashinfer#3047 (split-KV merges that weigh or drop partials wrongly)",
    expected="lse-merge",
    defaults={"split": "last"},
    needs="a decode step with num_kv_splits >= 2 and a row whose split `split` has keys",
)
def _split_lost(params: dict[str, str]) -> None:
    _merge_splits("lost", params)


@_register(
    name="split-twice",
    mechanism="the merge adds one split's partial twice (its weight counted double; `split`: an "
    "index, or `last`, each row's last split that has keys)",
    where=_MERGE_WHERE,
    reports="sglang#40903 and flashinfer#3047 (split-KV merges that weigh or drop partials wrongly)",
    expected="lse-merge",
    defaults={"split": "0"},
    needs="a decode step with num_kv_splits >= 2",
)
def _split_twice(params: dict[str, str]) -> None:
    _merge_splits("twice", params)


@_register(
    name="empty-split",
    mechanism="a split with no keys (a short row batched with a long one) is merged as if it had "
    "some: its partial output 0 with the LSE `lse` (+inf, 0 or a finite stale value) instead of "
    "being skipped",
    where=_MERGE_WHERE,
    reports="flashinfer#3047 (kv_len = 0 chunks poisoning the MLA merge), flashinfer PR #4975",
    expected="lse-merge",
    defaults={"lse": "0"},
    needs="a decode step with num_kv_splits >= 4 and a row shorter than the split count",
)
def _empty_split(params: dict[str, str]) -> None:
    _float(params, "lse")
    _merge_splits("empty", params)


# =============================================================================================
# paged KV
# =============================================================================================


@_register(
    name="page-size-ignored",
    mechanism="the decode kernel indexes the paged cache with another block size than it was "
    "written with: token n is read from block_table[n // read] at row n % read",
    where="TritonMLAImpl.forward_mqa's call of decode_attention_fwd gets page_size = `read`",
    reports="AITER #2996 (a paged-attention kernel reading with another block size)",
    expected="paged-kv",
    defaults={"read": "32"},
    needs="a decode step over more than `read` keys",
)
def _page_size_ignored(params: dict[str, str]) -> None:
    read = _int(params, "read")
    if read < 1:
        raise ValueError("page-size-ignored: read must be >= 1")

    def change(args, kwargs):
        _set_arg(args, kwargs, 10, "page_size", read)

    _wrap_decode_call(change)


@_register(
    name="block-table-offset",
    mechanism="the decode kernel reads each row's block table `shift` entries late: logical block "
    "j is read from entry j + shift (the table's padding, vLLM's null block 0, past the end)",
    where="TritonMLAImpl.forward_mqa's call of decode_attention_fwd gets the block table shifted",
    reports="vLLM#56380 / PR #56381 (MLA block-table entries naming other pages than the ones the "
    "cache was written to)",
    expected="paged-kv",
    defaults={"shift": "1"},
    needs="a decode step over more than one page",
)
def _block_table_offset(params: dict[str, str]) -> None:
    import torch

    shift = _int(params, "shift")

    def change(args, kwargs):
        bt = _arg(args, kwargs, 5, "req_to_token")
        pad = torch.zeros(bt.shape[0], abs(shift), dtype=bt.dtype, device=bt.device)
        moved = torch.cat([bt[:, shift:], pad], 1) if shift >= 0 else torch.cat([pad, bt[:, :shift]], 1)
        _set_arg(args, kwargs, 5, "req_to_token", moved.contiguous())

    _wrap_decode_call(change)


@_register(
    name="slot-mapping-offset",
    mechanism="every new latent row is written `shift` slots past the slot the scheduler mapped "
    "it to, so each cached position holds its neighbour's row",
    where="MLAAttention.forward's maybe_gather_mla_latent_cache_inputs returns the slot mapping "
    "shifted before do_kv_cache_update writes the cache",
    reports="vLLM#56380 / PR #56469 (slot mappings computed against the wrong block-table column)",
    expected="paged-kv",
    defaults={"shift": "1"},
    needs="a decode step (the prefill attends to its new rows without the cache)",
)
def _slot_mapping_offset(params: dict[str, str]) -> None:
    import torch

    shift = _int(params, "shift")
    mod = _mla()
    orig = mod.maybe_gather_mla_latent_cache_inputs

    def maybe_gather(*args, **kwargs):
        kv, kpe, slots = orig(*args, **kwargs)
        if slots is not None:
            slots = torch.where(slots >= 0, slots + shift, slots)
        return kv, kpe, slots

    mod.maybe_gather_mla_latent_cache_inputs = maybe_gather


@_register(
    name="block-id-truncated",
    mechanism="the decode kernel keeps only the low `bits` bits of each block id it loads from the "
    "block table, so blocks past 2^bits are read from the wrong page",
    where="TritonMLAImpl.forward_mqa's call of decode_attention_fwd gets the block ids masked",
    reports="ROCm/ATOM#702 (aiter ASM paged attention truncating block ids above 65,535)",
    expected="paged-kv",
    defaults={"bits": "3"},
    needs="a decode step whose block table holds ids >= 2^bits",
)
def _block_id_truncated(params: dict[str, str]) -> None:
    bits = _int(params, "bits")
    if not 1 <= bits <= 31:
        raise ValueError("block-id-truncated: bits must be 1..31")

    def change(args, kwargs):
        bt = _arg(args, kwargs, 5, "req_to_token")
        _set_arg(args, kwargs, 5, "req_to_token", bt & ((1 << bits) - 1))

    _wrap_decode_call(change)


# =============================================================================================
# residual stream
# =============================================================================================


def _scale_layer_residual(factor_of: Callable[[Any], float | None]) -> None:
    """After each DeepseekV2DecoderLayer.forward, multiply the residual it returns (h1 = hidden_in
    + attention output, which the next layer's fused add sums with the FFN output) by
    factor_of(layer) when that is not None."""
    from vllm.model_executor.models import deepseek_v2

    cls = deepseek_v2.DeepseekV2DecoderLayer
    orig = cls.forward

    def forward(self, *args, **kwargs):
        hidden, residual = orig(self, *args, **kwargs)
        f = factor_of(self)
        if f is not None and residual is not None:
            residual = residual * f
        return hidden, residual

    cls.forward = forward


@_register(
    name="residual-scale",
    mechanism="every dense layer multiplies the residual stream by 1/routed_scaling_factor (the "
    "fp16 overflow guard's `residual *= 1/routed_scaling_factor` run once per dense layer "
    "instead of once in layer 0), here in an f32 run with nothing else rescaled",
    where="DeepseekV2DecoderLayer.forward: the returned residual of a layer whose mlp is a "
    "DeepseekV2MLP is multiplied by 1/factor",
    reports="vLLM PR #14809 (fix deepseek fp16 scale bug, first_k_dense_replace > 1), vLLM PR #13232",
    expected="residual-scale",
    defaults={"factor": "config"},
    needs="a dense layer; factor = the config's routed_scaling_factor unless given",
)
def _residual_scale(params: dict[str, str]) -> None:
    given = None if params["factor"] == "config" else _float(params, "factor")
    if given is not None and not (given > 0 and math.isfinite(given)):
        raise ValueError("residual-scale: factor must be a positive number")
    from vllm.model_executor.models import deepseek_v2

    def factor_of(layer):
        if not isinstance(getattr(layer, "mlp", None), deepseek_v2.DeepseekV2MLP):
            return None
        f = given if given is not None else float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0)
        if f == 1.0:
            raise ValueError("residual-scale: routed_scaling_factor is 1 in this config; pass factor=")
        return 1.0 / f

    _scale_layer_residual(factor_of)


@_register(
    name="residual-mp-scale",
    mechanism="every layer's residual add divides the residual by the model-parallel size `mp`, as "
    "a fused residual-add kernel does before an all-reduce that sums it once per rank, while no "
    "such all-reduce follows",
    where="DeepseekV2DecoderLayer.forward: the returned residual of every layer is multiplied by 1/mp",
    reports="DeepSpeed PR #2310 (gptj_residual_add scaling the residual by the mp size twice)",
    expected="residual-scale",
    defaults={"mp": "2"},
    needs="any layer",
)
def _residual_mp_scale(params: dict[str, str]) -> None:
    mp = _int(params, "mp")
    if mp < 2:
        raise ValueError("residual-mp-scale: mp must be >= 2")
    _scale_layer_residual(lambda layer: 1.0 / mp)


# =============================================================================================
# reduced precision
# =============================================================================================


def _dtype(name: str):
    import torch

    table = {"f16": torch.float16, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype {name!r}: f16 or bf16")
    return table[name]


def _bmm_mode(pick: Callable[[Any, Any, Any], bool], compute: Callable[[Any, Any], Any]):
    """A TorchFunctionMode under which `torch.bmm(a, b, out=o)` calls for which pick(self_layer, a,
    b) holds are computed by compute(a, b) (written into `out`, or returned)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.bmm and len(args) >= 2 and pick(self.layer, args[0], args[1]):
                r = compute(args[0], args[1])
                out = kwargs.get("out")
                if out is not None:
                    out.copy_(r.to(out.dtype))
                    return out
                return r.to(args[0].dtype)
            return func(*args, **kwargs)

    return Mode


def _in_forward_impl(mode_cls) -> None:
    """Run MLAAttention.forward_impl under mode_cls(layer)."""
    cls = _owner(_mla().MLAAttention, "forward_impl")
    orig = cls.forward_impl

    def forward_impl(self, *args, **kwargs):
        with mode_cls(self):
            return orig(self, *args, **kwargs)

    cls.forward_impl = forward_impl


@_register(
    name="fp16-ql-nope",
    mechanism="the absorbed decode's q_nope·W_UK (ql_nope) runs as a `dtype` GEMM (inputs and "
    "output in `dtype`) although the run is float32",
    where="MLAAttention.forward_impl's torch.bmm(q_nope, W_UK_T, out=ql_nope)",
    reports="llama.cpp PR #13137 (q_nope_absorbed computed by an FP16 cuBLAS GEMM despite GGML_PREC_F32)",
    expected="precision",
    defaults={"dtype": "f16"},
    needs="a decode step, a float32 run",
)
def _fp16_ql_nope(params: dict[str, str]) -> None:
    dt = _dtype(params["dtype"])
    import torch

    def pick(layer, a, b):
        return b is getattr(layer, "W_UK_T", None)

    def compute(a, b):
        return torch.bmm(a.to(dt), b.to(dt))

    _in_forward_impl(_bmm_mode(pick, compute))


@_register(
    name="bf16-accum-v-up",
    mechanism="the decode's attn_latent·W_UV (the V up-projection) accumulates in `dtype`: inputs "
    "rounded to `dtype` and the running sum rounded after every term",
    where="MLAAttention._v_up_proj's torch.bmm(x, W_UV, out=...), inside forward_impl",
    reports="pytorch#188492 / PR #188998 (Triton BMM templates accumulating bf16 products in bf16)",
    expected="precision",
    defaults={"dtype": "bf16"},
    needs="a decode step, a float32 run",
)
def _bf16_accum_v_up(params: dict[str, str]) -> None:
    dt = _dtype(params["dtype"])
    import torch

    def pick(layer, a, b):
        return b is getattr(layer, "W_UV", None)

    def compute(a, b):
        a, b = a.to(dt), b.to(dt)
        acc = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=dt, device=a.device)
        for i in range(a.shape[2]):
            acc = (acc.float() + (a[:, :, i : i + 1].float() * b[:, i : i + 1, :].float()).to(dt).float()).to(
                dt
            )
        return acc

    _in_forward_impl(_bmm_mode(pick, compute))


# =============================================================================================
# kv_b layout
# =============================================================================================


def _after_weights(change: Callable[[Any], None]) -> None:
    """Run change(layer) after MLAAttention.process_weights_after_loading (which builds W_UK_T
    [N, P, L] and W_UV [N, L, V] from kv_b_proj)."""
    cls = _owner(_mla().MLAAttention, "process_weights_after_loading")
    orig = cls.process_weights_after_loading

    def process_weights_after_loading(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        change(self)
        return out

    cls.process_weights_after_loading = process_weights_after_loading


def _set_weights(layer, w_uk_t, w_uv) -> None:
    """Give `layer` new W_UK_T and W_UV tensors. They are replaced, not written in place: for an
    unquantized kv_b_proj, process_weights_after_loading leaves them views of its weight."""
    import torch

    for name, new in (("W_UK_T", w_uk_t), ("W_UV", w_uv)):
        old = getattr(layer, name)
        new = new.detach().to(dtype=old.dtype, device=old.device).contiguous()
        if name in layer._parameters:
            layer._parameters[name] = torch.nn.Parameter(new, requires_grad=False)
        else:
            setattr(layer, name, new)


@_register(
    name="kv-b-halves-swapped",
    mechanism="each head's kv_b rows are split as [v | k_nope] instead of [k_nope | v]: W_UK comes "
    "from the value rows and W_UV from the key rows (same shapes only when P = V)",
    where="MLAAttention.process_weights_after_loading: W_UK_T and W_UV exchanged after it builds them",
    reports="llama.cpp#13094 (kv_b split variants: k_b / v_b cut from the wrong rows)",
    expected="kv-b-layout",
    defaults={},
    needs="P = V (qk_nope_head_dim == v_head_dim), the w.W_UK_T site dumped",
)
def _kv_b_halves_swapped(params: dict[str, str]) -> None:
    def change(layer):
        w_uk_t, w_uv = layer.W_UK_T, layer.W_UV  # [N, P, L], [N, L, V]
        if w_uk_t.shape[1] != w_uv.shape[2]:
            raise ValueError(
                f"kv-b-halves-swapped needs P = V (this model: P {w_uk_t.shape[1]}, V {w_uv.shape[2]})"
            )
        _set_weights(layer, w_uv.transpose(1, 2).clone(), w_uk_t.transpose(1, 2).clone())

    _after_weights(change)


@_register(
    name="kv-b-head-grouping",
    mechanism="kv_b's rows are read in `groups` blocks of heads, each [k_nope rows of its heads; v "
    "rows of its heads], instead of per head [k_nope_h; v_h] (groups=1: all k_nope rows, then all "
    "v rows)",
    where="MLAAttention.process_weights_after_loading: W_UK_T and W_UV rebuilt from kv_b_proj's "
    "weight read with that grouping",
    reports="llama.cpp#13094 (kv_b split variants: the per-head interleave read another way)",
    expected="kv-b-layout",
    defaults={"groups": "1"},
    needs="groups < N heads, N divisible by groups; the w.W_UK_T site dumped",
)
def _kv_b_head_grouping(params: dict[str, str]) -> None:
    groups = _int(params, "groups")
    import torch

    def change(layer):
        from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

        n, p, lat = layer.W_UK_T.shape
        v = layer.W_UV.shape[2]
        if groups < 1 or n % groups or groups >= n:
            raise ValueError(f"kv-b-head-grouping: groups={groups} must divide N = {n} and be below it")
        w = get_and_maybe_dequant_weights(layer.kv_b_proj, out_dtype=torch.float32)  # [N(P+V), L]
        per = n // groups
        ks, vs = [], []
        for g in range(groups):
            block = w[g * per * (p + v) : (g + 1) * per * (p + v)]
            ks.append(block[: per * p].reshape(per, p, lat))
            vs.append(block[per * p :].reshape(per, v, lat))
        _set_weights(layer, torch.cat(ks), torch.cat(vs).transpose(1, 2))

    _after_weights(change)


# =============================================================================================
# skipped norms
# =============================================================================================


def _skip_norm(attr: str) -> None:
    """Every MLA attention module's `attr` RMSNorm returns its input unchanged (a forward hook
    registered when the module is built, so it runs before any capture hook)."""

    def skip(self):
        norm = getattr(self, attr, None)
        if norm is not None:
            norm.register_forward_hook(lambda mod, args, out: args[0])

    _after_init(_mla_attention_class(), skip)


@_register(
    name="kv-a-norm-skipped",
    mechanism="the latent RMSNorm (kv_a_layernorm) is not applied: the cache and both attention "
    "paths get the raw kv_c",
    where="DeepseekV2MLAAttention.kv_a_layernorm returns its input",
    reports="vLLM PR #40009, PR #52494 (MLA's q/kv RMSNorm pair moved into one fused launch, a "
    "path where the latent norm can be bypassed)",
    expected="norm-skipped",
    defaults={},
    needs="any step",
)
def _kv_a_norm_skipped(params: dict[str, str]) -> None:
    _skip_norm("kv_a_layernorm")


@_register(
    name="q-a-norm-skipped",
    mechanism="the query-side RMSNorm (q_a_layernorm) is not applied: q_b_proj gets the raw q_c",
    where="DeepseekV2MLAAttention.q_a_layernorm returns its input",
    reports="vllm-project/vllm-metal#656 (a query norm silently skipped when the runtime looks it "
    "up under another attribute name)",
    expected="norm-skipped",
    defaults={},
    needs="a model with q_lora_rank",
)
def _q_a_norm_skipped(params: dict[str, str]) -> None:
    _skip_norm("q_a_layernorm")


# =============================================================================================
# strided views
# =============================================================================================


def _rope_pre_hook(change: Callable[[Any, Any, Any], tuple]) -> None:
    """A forward pre-hook on every MLA attention module's rotary_emb (registered once per rotary
    module, which get_rope shares between layers): change(attn, q_pe, k_pe) -> (q_pe, k_pe)
    replaces the views the rope receives."""
    hooked: set[int] = set()

    def install(self):
        rope = getattr(self, "rotary_emb", None)
        if rope is None or id(rope) in hooked:
            return
        hooked.add(id(rope))

        def pre(mod, args):
            if len(args) < 3 or args[2] is None:
                return None
            q_pe, k_pe = change(self, args[1], args[2])
            return (args[0], q_pe, k_pe, *args[3:])

        rope.register_forward_pre_hook(pre)

    _after_init(_mla_attention_class(), install)


@_register(
    name="k-pe-stride",
    mechanism="k_pe is cut out of the fused q_a|kv_a projection output with another row stride "
    "than the buffer's (`stride`: `rope` = R, the view read as if contiguous; `kv_a` = L+R, the "
    "stride of kv_a alone; or a number)",
    where="the k_pe view [T, 1, R] handed to DeepseekV2MLAAttention.rotary_emb",
    reports="llama.cpp#12956 (k_pe / kv_cmpr views of the fused kv projection with a wrong stride)",
    expected="strided-view",
    defaults={"stride": "rope"},
    needs="any step; a q_lora model (the fused buffer) for `kv_a`",
)
def _k_pe_stride(params: dict[str, str]) -> None:
    choice = params["stride"]

    def change(attn, q_pe, k_pe):
        r = k_pe.shape[-1]
        stride = {"rope": r, "kv_a": int(attn.kv_lora_rank) + r}.get(choice)
        if stride is None:
            stride = int(choice)
        t = k_pe.shape[0]
        view = k_pe.as_strided((t, 1, r), (stride, r, 1), k_pe.storage_offset())
        return q_pe, view

    _rope_pre_hook(change)


@_register(
    name="q-pe-stride",
    mechanism="the rope reads q_pe, the view q[..., P:] of q [T, N, P+R], as if it were a "
    "contiguous [T, N, R] tensor (strides N·R, R, 1 from the same start)",
    where="the q_pe view handed to DeepseekV2MLAAttention.rotary_emb",
    reports="vLLM#16658 / PR #17091 (the rope kernel ignoring the stride of MLA's q slice)",
    expected="strided-view",
    defaults={},
    needs="any step",
)
def _q_pe_stride(params: dict[str, str]) -> None:
    def change(attn, q_pe, k_pe):
        t, n, r = q_pe.shape
        view = q_pe.as_strided((t, n, r), (n * r, r, 1), q_pe.storage_offset())
        return view, k_pe

    _rope_pre_hook(change)


# =============================================================================================
# chunked prefill over cached context (MLACommonBaseImpl._compute_prefill_context, the merges)
# =============================================================================================


@_register(
    name="ctx-empty-lse-inf",
    mechanism="a context chunk that holds no key for a request returns LSE +inf for that "
    "request's rows (FlashAttention-2's sentinel for an empty softmax), output 0",
    where="vLLM's mask_empty_context (vllm/v1/attention/ops/triton_merge_attn_states.py, as "
    "mla_attention._compute_prefill_context calls it) replaced: the empty chunk's LSE set to +inf "
    "instead of -inf",
    reports="vLLM PR #15492 (FA2's +inf LSE of an empty chunk merged), vllm#27491 / PR #39148 "
    "(NaNs from merging empty context chunks)",
    expected="lse-merge",
    defaults={},
    needs="a chunked-context step where a request's chunk is empty (vllm_cpu --workspace-tokens "
    "with prompts of different lengths)",
)
def _ctx_empty_lse_inf(params: dict[str, str]) -> None:
    mla = _mla()

    def mask_empty_context(lse, output, query_start_loc, context_start_loc) -> None:
        qsl = query_start_loc.tolist()
        csl = context_start_loc.tolist()
        for r in range(len(qsl) - 1):
            if csl[r + 1] == csl[r]:
                lse[:, qsl[r] : qsl[r + 1]] = math.inf
                output[qsl[r] : qsl[r + 1]] = 0

    mla.mask_empty_context = mask_empty_context


@_register(
    name="merge-suffix-stride",
    mechanism="the merge of the cached context's output with the new tokens' reads the suffix "
    "with the prefix's head stride: the suffix sits in a buffer padded to V + pad per head (as "
    "FlashAttention returns its output padded to the QK head dim), the context output is "
    "compact, and merge_attn_states indexes both with the prefix's strides",
    where="the final merge_attn_states of MLACommonBaseImpl.forward_mha (mla_attention's "
    "merge_attn_states, the call with prefill_tokens_with_context), run through vLLM's Triton "
    "merge without the head-stride check of vllm/v1/attention/ops/merge_attn_states.py",
    reports="no public report number: the head-stride assertion of vLLM 0.26.0's merge_attn_states "
    "(vllm/v1/attention/ops/merge_attn_states.py: both its CUDA and Triton kernels derive the "
    "suffix's head stride from prefix_output)",
    expected="strided-view",
    defaults={"pad": "16"},
    needs="a prefill step over cached context (vllm_cpu --chunk-tokens)",
)
def _merge_suffix_stride(params: dict[str, str]) -> None:
    import torch

    pad = _int(params, "pad")
    if pad <= 0:
        raise ValueError("parameter pad must be positive")
    mla = _mla()
    orig = mla.merge_attn_states

    def merge_attn_states(*args, **kwargs):
        if "prefill_tokens_with_context" not in kwargs:
            return orig(*args, **kwargs)
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states as triton_merge

        names = ("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse")
        a = dict(zip(names, args))
        a.update({k: v for k, v in kwargs.items() if k in names})
        suffix = a["suffix_output"]
        t, n, v = suffix.shape
        padded = torch.zeros(t, n, v + pad, dtype=suffix.dtype, device=suffix.device)
        padded[..., :v] = suffix
        return triton_merge(
            a["output"],
            a["prefix_output"].contiguous(),
            a["prefix_lse"],
            padded[..., :v],
            a["suffix_lse"],
            None,
            kwargs["prefill_tokens_with_context"],
        )

    mla.merge_attn_states = merge_attn_states


@_register(
    name="ctx-chunk-unwritten",
    mechanism="one context chunk's attention output is never written: the chunk loop merges the "
    "buffer torch.empty handed out, with the chunk's true LSE",
    where="the prefill backend's run_prefill_context_chunk as MLACommonBaseImpl._compute_prefill_context "
    "calls it: chunk `chunk` returns torch.empty_like(its output)",
    reports="vLLM PR #26397 (an unzeroed, never-written context-chunk output in MLA chunked prefill)",
    expected="phantom-output",
    defaults={"chunk": "1"},
    needs="a chunked-context step with more than `chunk` context chunks (vllm_cpu --workspace-tokens)",
)
def _ctx_chunk_unwritten(params: dict[str, str]) -> None:
    import torch

    which = _int(params, "chunk")
    cls = _owner(_mla().MLACommonBaseImpl, "_compute_prefill_context")
    orig = cls._compute_prefill_context

    def _compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, *args, **kwargs):
        backend = attn_metadata.prefill.prefill_backend
        run = backend.run_prefill_context_chunk

        def run_prefill_context_chunk(chunk_idx, q, k, v):
            out, lse = run(chunk_idx=chunk_idx, q=q, k=k, v=v)
            return (torch.empty_like(out), lse) if chunk_idx == which else (out, lse)

        backend.run_prefill_context_chunk = run_prefill_context_chunk
        try:
            return orig(self, q, kv_c_and_k_pe_cache, attn_metadata, *args, **kwargs)
        finally:
            del backend.run_prefill_context_chunk

    cls._compute_prefill_context = _compute_prefill_context


# =============================================================================================
# block-FP8 checkpoints (Fp8LinearMethod)
# =============================================================================================

# where fp8-scale-transposed planted its scale in this process: [{"layer": prefix, "grid": [a, b],
# "moved": blocks whose scale changed}], for the runner to check that the plant met its layer
SCALE_PLANTED: list[dict[str, Any]] = []


def transposed_scale_grid(scale):
    """A block-scale grid `scale` [a, b] as a loader that reads it in the other order holds it:
    its transpose laid back into the original shape, `scale.t().contiguous().view(a, b)` (for a
    square grid, the plain transpose). Block (r, c) then gets the scale of flat index r·b + c of
    the transposed grid, scale[(r·b + c) % a, (r·b + c) // a]."""
    return scale.t().contiguous().view(scale.shape)


def _scale_target(prefix: str, layer: str, param: str) -> bool:
    """Whether a linear's vLLM prefix (`model.layers.0.self_attn.o_proj`) is decoder layer
    `layer`'s `param` (`o_proj`, under self_attn, or `mlp.down_proj`, under the layer)."""
    return prefix.endswith((f"layers.{layer}.self_attn.{param}", f"layers.{layer}.{param}"))


@_register(
    name="fp8-scale-transposed",
    mechanism="one block-FP8 linear's weight_scale_inv [ceil(out/128), ceil(in/128)] is read in the "
    "other order: its transpose laid back into the original shape (s.t().contiguous().view(s.shape); "
    "a square grid: s.t()), so most 128x128 blocks are dequantized with another block's scale",
    where="Fp8LinearMethod.process_weights_after_loading: after the kernel has processed the layer "
    "(CUTLASS and Triton keep the checkpoint layout), the weight_scale_inv of decoder layer `layer`'s "
    "`param` is overwritten in place; MLAAttention's W_UK_T/W_UV, built after every linear, see it "
    "when `param` is kv_b_proj",
    reports="vLLM PR #47116 (XPU's load-time transpose of weight_scale_inv read back through a view "
    "in the checkpoint's order: blocks scaled by other blocks' scales, DeepSeek-V4 GSM8K 96.5% -> "
    "89%), vLLM PR #50204 / PR #50349 (a transposed block scale reaching MLA's kv_b dequant: shape "
    "asserts on a non-square grid, silently wrong weights on a square one)",
    expected="quant-scale-layout",
    defaults={"layer": "0", "param": "o_proj"},
    needs="a block-FP8 checkpoint (quantization_config.weight_block_size) whose chosen linear has a "
    "scale grid the relayout changes (not 1 x b or a x 1, not symmetric): hf-v3-fp8's o_proj [2, 4] "
    "moves 6 of 8 scales, kv_b_proj [8, 4] 28 of 32",
)
def _fp8_scale_transposed(params: dict[str, str]) -> None:
    layer_n = _int(params, "layer")
    param = params["param"].strip()
    if layer_n < 0 or not param:
        raise ValueError("fp8-scale-transposed: layer must be >= 0 and param a linear's name")
    from vllm.model_executor.layers.quantization import fp8

    cls = _owner(fp8.Fp8LinearMethod, "process_weights_after_loading")
    orig = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer, *args, **kwargs):
        out = orig(self, layer, *args, **kwargs)
        prefix = str(getattr(layer, "prefix", ""))
        scale = getattr(layer, "weight_scale_inv", None)
        if scale is None or not _scale_target(prefix, str(layer_n), param):
            return out
        new = transposed_scale_grid(scale.data)
        moved = int((new != scale.data).sum())
        if moved == 0:
            raise ValueError(
                f"fp8-scale-transposed: {prefix}'s scale grid {list(scale.shape)} is unchanged by "
                "the relayout; choose a linear whose grid has at least 2 x 2 distinct scales"
            )
        scale.data.copy_(new)
        SCALE_PLANTED.append({"layer": prefix, "grid": list(scale.shape), "moved": moved})
        return out

    cls.process_weights_after_loading = process_weights_after_loading


# =============================================================================================
# fp8 compute and the fp8 latent cache
# =============================================================================================


def padded_rows(t: int) -> int:
    """The rows a CUDA-graph batch of `t` tokens is padded to: vLLM's capture sizes 1, 2, 4 and
    every multiple of 8 up to 512, the smallest at least `t`; past 512 a batch runs eagerly, `t`."""
    if t <= 2 or t > 512:
        return t
    return 4 if t <= 4 else -(-t // 8) * 8


@_register(
    name="fp8-act-padded-rows",
    mechanism="one block-FP8 linear's input is quantized with a single dynamic per-tensor scale "
    "taken over the batch padded to its CUDA-graph size, whose padded rows hold stale values "
    "`stale` x the batch's largest |value|; the batch's own rows fall among E4M3's subnormals",
    where="Fp8LinearMethod.apply: decoder layer `layer`'s `param` input is rounded through that "
    "per-tensor E4M3 scale before vLLM's own per-token-group quantization",
    reports="SGLang PR #26133 (a per-tensor dynamic activation scale over padded, uninitialized rows "
    "at the MLA input: gibberish with padded batches only)",
    expected="fp8-act-scale",
    defaults={"layer": "0", "param": "fused_qkv_a_proj", "stale": "65536"},
    needs="a block-FP8 checkpoint; a step whose token count is not a capture size (20 prompt tokens "
    "pad to 24; a 1-token decode step has nothing padded)",
)
def _fp8_act_padded_rows(params: dict[str, str]) -> None:
    layer_n, param, stale = _int(params, "layer"), params["param"].strip(), _float(params, "stale")
    if layer_n < 0 or not param or not stale > 1.0:
        raise ValueError("fp8-act-padded-rows: layer >= 0, param a linear's name, stale > 1")
    import torch
    from vllm.model_executor.layers.quantization import fp8

    cls = _owner(fp8.Fp8LinearMethod, "apply")
    orig = cls.apply

    def apply(self, layer, x, *args, **kwargs):
        t = int(x.reshape(-1, x.shape[-1]).shape[0])
        if t and padded_rows(t) > t and _scale_target(str(getattr(layer, "prefix", "")), str(layer_n), param):
            xf = x.float()
            scale = (xf.abs().max() * stale).clamp_min(1e-10) / 448.0
            xq = (xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
            x = xq.to(x.dtype)
        return orig(self, layer, x, *args, **kwargs)

    cls.apply = apply


def _set_kv_scale(layer, scale: float) -> None:
    """Give an MLAAttention layer the latent cache scale `scale` (k and v, tensor and float
    mirrors), as a checkpoint's k_scale would."""
    for kind in ("k", "v"):
        t = getattr(layer, f"_{kind}_scale", None)
        if t is not None:
            t.fill_(scale)
        if hasattr(layer, f"_{kind}_scale_float"):
            setattr(layer, f"_{kind}_scale_float", scale)
        cpu = getattr(layer, f"_{kind}_scale_cpu", None)
        if cpu is not None:
            cpu.fill_(scale)


@_register(
    name="kv-cache-scale",
    mechanism="the latent cache's fp8 scale S (every layer's k_scale, as a checkpoint's) is applied "
    "twice where rows are written (x/S^2 stored, read back x S: the cache x 1/S) or is missing "
    "there (x stored, read back x S: the cache x S); mode=none writes correctly (the baseline)",
    where="vllm._custom_ops.concat_and_cache_mla (the write of kv_c_normed and k_pe into the "
    "paged cache) gets S^2 or 1.0 for its scale; MLAAttention.process_weights_after_loading "
    "sets S",
    reports="vllm#38652 (the fp8 latent cache on FLASHMLA: fine single-turn, '!!!!' multi-turn on "
    "GLM-4.7-Flash), where a cache's rows are read back through a scale other than the write's",
    expected="kv-cache-scale",
    defaults={"scale": "0.5", "mode": "twice"},
    needs="an fp8 latent cache (kv_cache_dtype fp8); a decode step or a prefill over cached context",
)
def _kv_cache_scale(params: dict[str, str]) -> None:
    scale, mode = _float(params, "scale"), params["mode"].strip()
    if not (0.0 < scale < math.inf) or scale == 1.0:
        raise ValueError("kv-cache-scale: scale must be positive, finite and not 1")
    if mode not in ("twice", "missing", "none"):
        raise ValueError(f"kv-cache-scale: mode={mode!r} (twice, missing or none)")
    from vllm import _custom_ops as ops

    _after_weights(lambda layer: _set_kv_scale(layer, scale))
    if mode == "none":
        return
    orig = ops.concat_and_cache_mla

    def concat_and_cache_mla(*args, **kwargs):
        s = _arg(list(args), kwargs, 5, "scale")
        if s is not None:
            new = s * s if mode == "twice" else s.new_ones(s.shape)
            args, kwargs = list(args), dict(kwargs)
            _set_arg(args, kwargs, 5, "scale", new)
        return orig(*args, **kwargs)

    ops.concat_and_cache_mla = concat_and_cache_mla


@_register(
    name="fp8-query-scale",
    mechanism="the fp8 decode query is quantized with `factor` x the scale the kernel descales it "
    "with (descale_q): the query the kernel reads, and so every score, rope part included, is "
    "1/factor of the true one",
    where="MLAAttention._decode_concat_quant_fp8_op (ql_nope and q_pe concatenated and quantized "
    "for FLASHMLA's fp8 kernel) gets q_scale x factor",
    reports="vllm#38652 (the FLASHMLA fp8-cache decode, the path that quantizes the query)",
    expected="scale-only",
    defaults={"factor": "2"},
    needs="an fp8 latent cache on a backend that takes an fp8 query (FLASHMLA), a decode step",
)
def _fp8_query_scale(params: dict[str, str]) -> None:
    factor = _float(params, "factor")
    if not (0.0 < factor < math.inf) or factor == 1.0:
        raise ValueError("fp8-query-scale: factor must be positive, finite and not 1")

    def wrap(layer):
        op = getattr(layer, "_decode_concat_quant_fp8_op", None)
        if op is None:
            return
        orig = op.forward

        def forward(ql_nope, q_pe, scale, *args, **kwargs):
            return orig(ql_nope, q_pe, scale * factor, *args, **kwargs)

        op.forward = forward

    _after_init(_mla().MLAAttention, wrap)


def describe() -> list[dict[str, str]]:
    """Every plant as a row: name, expected class, parameters, mechanism, where, reports, needs."""
    return [
        {
            "name": p.name,
            "expected": p.expected,
            "params": ", ".join(f"{k}={v}" for k, v in p.defaults.items()),
            "mechanism": p.mechanism,
            "where": p.where,
            "reports": p.reports,
            "needs": p.needs,
        }
        for p in REGISTRY.values()
    ]


if __name__ == "__main__":  # pragma: no cover - a listing for the docs
    for row in describe():
        print(f"{row['name']}: {row['expected']} ({row['params'] or 'no parameters'})", file=sys.stdout)
