#!/usr/bin/env python3
"""Dump vLLM's MLA and FFN intermediates (and its weights as loaded) for `mla-diff compare`.

Why this exists: `mla-diff compare` judges what an engine really computed against mla-diff's
float64 reference on the same weights; this is vLLM's side (tested with vLLM 0.26.0). Forward
hooks on the root model, the decoder layers, the MLA modules and the SwiGLU MLP (dense, or an MoE
layer's shared experts), a wrapper of the attention backend's `forward_mqa` and, under tensor
parallelism, of the row-parallel linears' `quant_method.apply` (each rank's partial before the
all-reduce) record one or more forwards (a prefill, then decode steps) and write a format-2 dump
with the weights vLLM loaded; every TP rank writes one, and `join_rank_dumps` joins them. In a
process: `attach`, or `arm` / `finish` (plain functions of plain arguments, also what
`LLM.apply_model` ships to vLLM's workers); `python -m mla_diff_hooks.vllm` runs vLLM's `LLM` end
to end. Reference (sites, requirements, the WEIGHTS file, tensor parallelism, the vLLM source
relied on): docs/engines.md, "vLLM".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import dump_format, st_io
from ._deps import optional, require, run_cli
from .dump_format import site

np = optional("numpy", "mla_diff_hooks.vllm", "vllm")

# the folder holding the mla_diff_hooks package (a worker process imports it from there)
PACKAGE_PARENT = Path(__file__).resolve().parent.parent

# decode-only sites: captured around the backend's forward_mqa (the MQA/absorbed path vLLM runs for
# decode tokens); a prefill step never computes them
DECODE_SITES = (*dump_format.ABSORBED_STAGES, "lse")
# The activation sites these hooks reach: of a DSA layer's indexer only its selection
# (`idx_topk`, read from vLLM's topk_indices_buffer: the indexer's scores are fp8 DeepGEMM
# logits it never keeps), of an MoE block only the shared experts.
HOOKED_STAGES = tuple(
    s
    for s in dump_format.STAGES
    if s
    not in dump_format.WEIGHT_STAGES
    + tuple(x for x in dump_format.INDEXER_STAGES if x != "idx_topk")
    + dump_format.MOE_STAGES
    + dump_format.CONTEXT_STAGES
)
# File order: data-flow order, except that the decode-only sites follow the others, by name (the
# order the committed vLLM dumps in golden/dumps have).
_base_site_key = dump_format.site_order(
    [s for s in dump_format.STAGES if s not in DECODE_SITES + dump_format.CONTEXT_STAGES]
)
# The partial sites of the MHA prefill over cached context (docs/dump-format.md, format 2): after
# `lse`, before `attn_out`: ctx_out.c0, ctx_lse.c0, ctx_out.c1, ..., ctx_out, ctx_lse,
# suffix_out, suffix_lse.
CONTEXT_PARTIAL_STAGES = dump_format.CONTEXT_STAGES
# in the file they sit just before attn_out (the decode-only sites, `lse` among them, go last)
_PARTIAL_KEY = _base_site_key("L0.attn_out")[2] - 1


def partial_rank(stage: str) -> str | None:
    """The sort rank of a context-partial stage (`ctx_out.c3`, `suffix_lse`, ...), None for
    another stage."""
    base, _, chunk = stage.partition(".c")
    if base not in ("ctx_out", "ctx_lse") and stage not in CONTEXT_PARTIAL_STAGES:
        return None
    if chunk:
        if not chunk.isdigit():
            return None
        return f"0.{int(chunk):09d}.{0 if base == 'ctx_out' else 1}"
    return {"ctx_out": "1.0", "ctx_lse": "1.1", "suffix_out": "2.0", "suffix_lse": "2.1"}[stage]


def _site_key(name: str) -> tuple:
    parsed = dump_format.parse_site(name)
    if parsed is not None:
        rank = partial_rank(parsed[1])
        if rank is not None:
            return (0, parsed[0], _PARTIAL_KEY, rank)
    return _base_site_key(name)


def is_partial_site(name: str) -> bool:
    """Whether `name` (`L{n}.{stage}`) is a context-partial site (rows: the step's prefill rows
    with cached context, not every row)."""
    parsed = dump_format.parse_site(name)
    return parsed is not None and partial_rank(parsed[1]) is not None


# Sites whose heads are split across TP ranks, with the axis holding the heads.
HEAD_SHARDED = {
    "q": 1,
    "q_pe_roped": 1,
    "k_nope": 1,
    "v": 1,
    "ql_nope": 1,
    "attn_latent": 1,
    "lse": 1,
    "attn_out": 1,
    "w.kv_b": 0,
    "w.W_UK_T": 0,
    "w.W_UV": 0,
}
# Sites whose SwiGLU width I is split across TP ranks (rank r: columns r·I/tp..(r+1)·I/tp of the
# merged-column gate_up_proj's two halves), with the axis holding I.
FFN_SHARDED = {"ffn_gate": 1, "ffn_up": 1, "ffn_act": 1}
TESTED_VLLM = "0.26.0"
# the hook's name in a dump's metadata (format 1 `hook`, format 2 `header.hook.name`)
HOOK_NAME, HOOK_VERSION = "dump_vllm.py", "2"
# vLLM parameter names written to the WEIGHTS file, in this order when present.
WEIGHT_PARAMS = [
    "fused_qkv_a_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "q_proj",
    "kv_b_proj",
    "o_proj",
]
# vLLM parameter names of the layer's SwiGLU MLP written to the WEIGHTS file, in this order: the
# dense DeepseekV2MLP (`mlp.`), or the shared experts of a DeepseekV2MoE
# (`mlp.shared_experts.`, written as `shared_experts.<param>`).
FFN_PARAMS = ["gate_up_proj", "down_proj"]

_ACTIVE: VllmCapture | None = None  # the capture armed in this process (apply_model API)
# (model runner, scheduler output) of the GPU model runner's execute_model running now, set by
# watch_runner's wrapper: a forward inside it is planned from them (live_plan)
_LIVE: tuple | None = None
# whether watch_runner wrapped a GPU model runner in this process: a root forward outside its
# execute_model (_LIVE None) is then one of the runner's dummy forwards
_WATCHED = {"on": False}


def watch_runner() -> bool:
    """Wrap vLLM's GPU model runner's execute_model (vllm.v1.worker.gpu_model_runner, when this
    process has imported it) so that each forward it runs is planned from its scheduler output
    (live_plan). Idempotent; False when there is no such runner in this process."""
    mod = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    cls = getattr(mod, "GPUModelRunner", None)
    if cls is None or getattr(cls.execute_model, "_mla_diff_watched", False):
        _WATCHED["on"] = cls is not None
        return cls is not None
    orig = cls.execute_model

    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args, **kwargs):
        global _LIVE
        _LIVE = (self, scheduler_output)
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            _LIVE = None

    execute_model._mla_diff_watched = True
    cls.execute_model = execute_model
    _WATCHED["on"] = True
    return True


def live_plan(cap: VllmCapture, runner, scheduler_output) -> dict | None:
    """The plan (VllmCapture.plan_step) of the forward a GPU model runner is running: its
    requests in the order its input batch packed them (`input_batch.req_ids`, decodes first),
    each one's new tokens (`scheduler_output.num_scheduled_tokens`) and computed tokens before the
    step (`input_batch.num_computed_tokens_cpu`), every request seen before with 0 new tokens. A
    request first scheduled with computed tokens is a prefix-cache hit on the earliest request
    seen with the same first tokens. Each request's token ids so far are kept for the dump. None
    when the runner has no input batch."""
    ib = getattr(runner, "input_batch", None)
    sched = getattr(scheduler_output, "num_scheduled_tokens", None)
    if ib is None or not sched:
        return None
    ids = cap.__dict__.setdefault("_live_ids", {})
    done = cap.__dict__.setdefault("_live_done", {})
    hits = cap.__dict__.setdefault("_live_hits", {})
    token_ids = cap.__dict__.setdefault("token_ids", {})
    order, new, ctx = [], {}, {}
    for b, rid in enumerate(ib.req_ids):
        if rid is None or rid not in sched:
            continue
        first = rid not in ids
        i = ids.setdefault(rid, len(ids))
        order.append(i)
        new[i] = int(sched[rid])
        ctx[i] = int(ib.num_computed_tokens_cpu[b])
        toks = [int(x) for x in ib.token_ids_cpu[b, : ctx[i] + new[i]]]
        if len(toks) > len(token_ids.get(i, [])):
            token_ids[i] = toks
        if first and ctx[i] > 0:
            src = next((j for j, t in token_ids.items() if j != i and t[: ctx[i]] == toks[: ctx[i]]), None)
            if src is None:
                # computed before the recording started (or a cache hit on such a request):
                # write_format2 marks them `unrecorded`, mla-diff rebuilds them from the ids
                cap.step_note(f"request {rid}: its first {ctx[i]} tokens were computed before the recording")
            else:
                hits[i] = {"seq": src, "len": ctx[i]}
    seqs = []
    for i in range(len(ids)):
        if i in new:
            done[i] = ctx[i] + new[i]
            seqs.append({"new": new[i], "context": ctx[i], "prefix": hits.get(i)})
        else:
            seqs.append({"new": 0, "context": done.get(i, 0), "prefix": hits.get(i)})
    return {"seqs": seqs, "order": order}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _np(t) -> np.ndarray:
    """A detached host COPY (vLLM mutates many of these tensors in place right after the hook)."""
    torch = _torch()
    t = t.detach()
    want = torch.float64 if t.dtype == torch.float64 else torch.float32
    return np.array(t.to(want).cpu().numpy(), copy=True)


def _first(x):
    """vLLM linears return (output, bias); RMSNorm with a residual returns (normed, residual)."""
    return x[0] if isinstance(x, (tuple, list)) else x


def _dtype_name(dtype) -> str:
    torch = _torch()
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.float64: "f32"}.get(
        dtype, "f32"
    )


def vllm_version() -> str:
    try:
        import vllm

        return f"vllm {vllm.__version__}"
    except Exception:  # noqa: BLE001 - not installed (mock) or broken install
        return "vllm (version unknown)"


def parallel_info() -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) from vLLM's parallel state; (0, 1, 0, 1) without it."""
    tp_rank, tp_size, pp_rank, pp_size = 0, 1, 0, 1
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank, tp_size = int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - no vLLM, or distributed state not initialised
        pass
    try:
        from vllm.distributed import get_pp_group

        g = get_pp_group()
        pp_rank, pp_size = int(g.rank_in_group), int(g.world_size)
    except Exception:  # noqa: BLE001
        pass
    return tp_rank, tp_size, pp_rank, pp_size


def rank_path(path, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> Path:
    """`out/d.safetensors` -> `out/d.rank1.safetensors` (+ `.pp2`) when there is more than one rank."""
    path = Path(path)
    tag = (f".rank{tp_rank}" if tp_size > 1 else "") + (f".pp{pp_rank}" if pp_size > 1 else "")
    return path.with_name(path.stem + tag + path.suffix) if tag else path


def find_model(obj) -> Any:
    """The nn.Module behind what apply_model / collective_rpc hands us (model or worker)."""
    torch = _torch()
    if isinstance(obj, torch.nn.Module):
        return obj
    if hasattr(obj, "get_model"):
        return obj.get_model()
    runner = getattr(obj, "model_runner", None)
    if runner is not None:
        return runner.get_model() if hasattr(runner, "get_model") else runner.model
    raise TypeError(f"cannot find a model in {type(obj).__name__}")


def find_decoder_layers(root) -> list[tuple[int, Any]]:
    """(layer index, DeepseekV2DecoderLayer) for every layer of this pipeline rank.

    Layers of other pipeline ranks are PPMissingLayer (no self_attn) and are skipped.
    """
    torch = _torch()
    cands = []
    inner = getattr(root, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        cands.append(inner.layers)
    if hasattr(root, "layers"):
        cands.append(root.layers)
    if not cands:
        for _, mod in root.named_modules():
            if isinstance(getattr(mod, "layers", None), torch.nn.ModuleList):
                cands.append(mod.layers)
                break
    for layers in cands:
        found = [(i, layer) for i, layer in enumerate(layers) if hasattr(layer, "self_attn")]
        if found:
            return found
    raise RuntimeError(
        f"{type(root).__name__}: no decoder layers with `self_attn` found "
        "(expected model.model.layers of a DeepseekV2/V3ForCausalLM)"
    )


def find_w_uk_holder(attn) -> tuple[Any, str] | tuple[None, None]:
    """The object holding W_UK_T / W_UV, and its attribute path from self_attn.

    Newer vLLM: the MLAAttention layer itself (self_attn.mla_attn.mla_attn); older: its backend
    impl (....impl, MLACommonImpl). Breadth-first over the attributes mla_attn, attn, impl.
    """
    queue = [(attn, "self_attn")]
    seen = set()
    while queue:
        obj, path = queue.pop(0)
        if id(obj) in seen or path.count(".") > 4:
            continue
        seen.add(id(obj))
        if getattr(obj, "W_UK_T", None) is not None and getattr(obj, "W_UV", None) is not None:
            return obj, path
        for name in ("mla_attn", "attn", "impl"):
            child = getattr(obj, name, None)
            if child is not None:
                queue.append((child, f"{path}.{name}"))
    return None, None


def find_mqa_impl(attn) -> Any:
    """The attention backend impl whose forward_mqa runs the decode tokens (MLAAttention.impl)."""
    queue, seen = [(attn, 0)], set()
    while queue:
        obj, depth = queue.pop(0)
        if id(obj) in seen or depth > 4:
            continue
        seen.add(id(obj))
        impl = getattr(obj, "impl", None)
        if impl is not None and callable(getattr(impl, "forward_mqa", None)):
            return impl
        for name in ("mla_attn", "attn"):
            child = getattr(obj, name, None)
            if child is not None:
                queue.append((child, depth + 1))
    return None


def find_attention_layer(attn) -> Any:
    """The MLAAttention module under self_attn (the module that owns the KV cache and is named
    in the forward context: `layer_name`, `kv_cache`), breadth-first over mla_attn / attn."""
    torch = _torch()
    queue, seen = [(attn, 0)], set()
    while queue:
        obj, depth = queue.pop(0)
        if id(obj) in seen or depth > 4:
            continue
        seen.add(id(obj))
        if (
            isinstance(obj, torch.nn.Module)
            and obj is not attn
            and hasattr(obj, "layer_name")
            and hasattr(obj, "kv_cache")
        ):
            return obj
        for name in ("mla_attn", "attn"):
            child = getattr(obj, name, None)
            if child is not None:
                queue.append((child, depth + 1))
    return None


def attention_step_info(layer) -> dict[str, Any]:
    """What the engine's attention metadata says about the running step, for one MLAAttention
    `layer`, read from vLLM's forward context: `block_table` [S, B] int32 (the decode requests'
    rows, then the prefill requests', as vLLM orders a batch; a narrower table padded with 0,
    vLLM's null block), `slot_mapping` [T] int64 (the cache slot each new row is written to),
    `query_start_loc` [S+1] int64 and `page_size` (the KV cache's block size, from its shape
    [num_blocks, block_size, L+R]). The values are the metadata's, as the scheduler assigned
    them, before the attention backend uses them. Empty without a forward context."""
    try:
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
    except Exception:  # noqa: BLE001 - no vLLM, or called outside a forward
        return {}
    name = getattr(layer, "layer_name", None)
    md = getattr(ctx, "attn_metadata", None)
    if isinstance(md, list):
        md = md[0] if md else None
    if isinstance(md, dict):
        md = md.get(name)
    if md is None:
        return {}
    out: dict[str, Any] = {}
    n = getattr(md, "num_actual_tokens", None)
    slots = getattr(ctx, "slot_mapping", None)
    slots = slots.get(name) if isinstance(slots, dict) else getattr(md, "slot_mapping", None)
    if slots is not None:
        a = _np_int(slots).reshape(-1)
        out["slot_mapping"] = a[: int(n)] if n is not None else a
    rows = []
    for part in (getattr(md, "decode", None), getattr(md, "prefill", None)):
        bt = getattr(part, "block_table", None) if part is not None else None
        if bt is not None:
            rows.append(_np_int(bt).astype(np.int32).reshape(-1, bt.shape[-1]))
    if rows:
        width = max(r.shape[1] for r in rows)
        out["block_table"] = np.concatenate(
            [np.pad(r, ((0, 0), (0, width - r.shape[1]))) for r in rows]
        ).astype(np.int32)
    qsl = getattr(md, "query_start_loc", None)
    if qsl is not None:
        out["query_start_loc"] = _np_int(qsl).reshape(-1)
    if getattr(md, "num_decodes", None) is not None:
        out["num_decodes"] = int(md.num_decodes)
    cc = getattr(getattr(md, "prefill", None), "chunked_context", None)
    if cc is not None and getattr(cc, "starts", None) is not None:
        # chunk c of prefill request j (the step's prefills, in the runner's order) reads context
        # positions starts[c][j] .. + (cu_seq_lens[c][j+1] - cu_seq_lens[c][j])
        cu = _np_int(cc.cu_seq_lens)
        out["context_chunks"] = (_np_int(cc.starts), cu[:, 1:] - cu[:, :-1])
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, (list, tuple)):
        cache = cache[0] if cache else None
    shape = getattr(cache, "shape", None)
    if shape is not None and len(shape) >= 3 and int(cache.numel()) > 0:
        out["page_size"] = int(shape[1])
    return out


def _np_int(t) -> np.ndarray:
    """An integer tensor (or array) as a host int64 numpy copy."""
    if isinstance(t, np.ndarray):
        return t.astype(np.int64).copy()
    return np.array(t.detach().cpu().to(_torch().int64).numpy(), copy=True)


def find_ffn(layer) -> tuple[Any, str] | tuple[None, None]:
    """The decoder layer's SwiGLU MLP and the prefix of its weights' names: the dense
    DeepseekV2MLP (`layer.mlp`, prefix ""), or the shared experts of a DeepseekV2MoE
    (`layer.mlp.shared_experts`, prefix "shared_experts."); (None, None) without either."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None, None
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
        return mlp, ""
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None and hasattr(shared, "gate_up_proj") and hasattr(shared, "down_proj"):
        return shared, "shared_experts."
    return None, None


def _backend_name(obj) -> str | None:
    """A backend object's registered name (its class's get_name()), else its class name."""
    if obj is None:
        return None
    get = getattr(type(obj), "get_name", None)
    try:
        name = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a name is informative only
        name = None
    return str(name) if name else type(obj).__name__


def backend_names(root) -> dict:
    """The attention backends the first MLA layer really uses: `attention_backend` (the impl that
    runs forward_mqa: FLASHMLA, TRITON_MLA, ...; its impl class in `attention_impl`) and
    `prefill_backend` (the MLA prefill backend of forward_mha: FLASH_ATTN, ...), as recorded in
    the dump's engine metadata. Empty when the model has no MLA layer this hook knows."""
    for _, layer in find_decoder_layers(root):
        attn = getattr(layer, "self_attn", None)
        impl = find_mqa_impl(attn) if attn is not None else None
        if impl is None:
            continue
        info = {"attention_impl": type(impl).__name__}
        backend = getattr(impl, "backend", None) or getattr(
            getattr(attn, "mla_attn", None), "attn_backend", None
        )
        name = _backend_name(backend) if backend is not None and not isinstance(backend, str) else backend
        if name is None:
            table = {
                "FlashMLAImpl": "FLASHMLA",
                "TritonMLAImpl": "TRITON_MLA",
                "FlashAttnMLAImpl": "FLASH_ATTN_MLA",
                "CutlassMLAImpl": "CUTLASS_MLA",
            }
            name = table.get(type(impl).__name__, type(impl).__name__)
        info["attention_backend"] = str(name)
        for holder in (impl, getattr(attn, "mla_attn", None), attn):
            pb = getattr(holder, "prefill_backend", None) if holder is not None else None
            if pb is not None:
                info["prefill_backend"] = _backend_name(pb)
                break
        return info
    return {}


def check_layout(root) -> list[str]:
    """The names this hook relies on (as in vLLM 0.26.0) that the model lacks, empty if none.

    Checked: decoder layers with self_attn / input_layernorm; on self_attn: fused_qkv_a_proj (or
    q_a_proj, or kv_a_proj_with_mqa + q_proj), q_a_layernorm (q_lora models), q_b_proj or q_proj,
    kv_a_layernorm, kv_b_proj, o_proj, rotary_emb, the MLAAttention holding W_UK_T / W_UV after
    process_weights_after_loading, and its impl.forward_mqa (decode sites).
    """
    missing = []
    try:
        layers = find_decoder_layers(root)
    except RuntimeError:
        return [f"{type(root).__name__}.model.layers[i].self_attn (DeepseekV2DecoderLayer)"]
    n, layer = layers[0]
    for x in ("input_layernorm", "post_attention_layernorm"):
        if not hasattr(layer, x):
            missing.append(f"{type(layer).__name__}.{x}")
    if find_ffn(layer)[0] is None:
        missing.append(f"{type(layer).__name__}.mlp.gate_up_proj/down_proj (DeepseekV2MLP)")
    attn = layer.self_attn
    an = type(attn).__name__
    if not any(hasattr(attn, x) for x in ("fused_qkv_a_proj", "q_a_proj", "kv_a_proj_with_mqa")):
        missing.append(f"{an}.fused_qkv_a_proj (or q_a_proj / kv_a_proj_with_mqa)")
    if getattr(attn, "q_lora_rank", None) is not None and not hasattr(attn, "q_a_layernorm"):
        missing.append(f"{an}.q_a_layernorm")
    if not any(hasattr(attn, x) for x in ("q_b_proj", "q_proj")):
        missing.append(f"{an}.q_b_proj (or q_proj)")
    for x in (
        "kv_a_layernorm",
        "kv_b_proj",
        "o_proj",
        "rotary_emb",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "kv_lora_rank",
        "q_lora_rank",
    ):
        if not hasattr(attn, x):
            missing.append(f"{an}.{x}")
    if find_mqa_impl(attn) is None:
        missing.append(f"{an}.mla_attn.mla_attn.impl.forward_mqa (MLAAttention's backend impl)")
    return missing


def version_note(missing: list[str]) -> str:
    return f"dump_vllm.py was tested with vLLM {TESTED_VLLM}; this is {vllm_version()}; " + (
        f"not found: {', '.join(missing)}" if missing else "every module and attribute it relies on was found"
    )


def block_dequant(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """A block-quantized weight dequantized: `weight` [N, K] (the e4m3 values, widened exactly to
    float32), `scale` [ceil(N/bn), ceil(K/bk)] float32 (DeepSeek's `weight_scale_inv`: the
    multiplier of each bn x bk block, the last row or column of blocks cut short where N or K is
    not a multiple), `block` (bn, bk). Returns float32 [N, K], element (r, c) =
    weight[r, c] * scale[r // bn, c // bk], one float32 product (what vLLM's scaled_dequantize
    computes where it accepts the shapes). Errors: ValueError naming both shapes when the grid is
    not the one the weight's shape and block imply."""
    bn, bk = (int(x) for x in block)
    if weight.ndim != 2 or scale.ndim != 2 or bn < 1 or bk < 1:
        raise ValueError(
            f"block dequant needs a 2-D weight and scale and a positive block, got "
            f"{list(weight.shape)}, {list(scale.shape)}, {[bn, bk]}"
        )
    n, k = weight.shape
    grid = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"weight {[n, k]} in {bn}x{bk} blocks has a {list(grid)} scale grid, "
            f"the scale is {list(scale.shape)}"
        )
    full = np.repeat(np.repeat(scale.astype(np.float32), bn, axis=0), bk, axis=1)[:n, :k]
    return (weight.astype(np.float32) * full).astype(np.float32)


def _fp8_block_layer(linear) -> tuple[Any, Any, tuple[int, int], str] | None:
    """(weight, weight_scale_inv, block, kernel class name) of a linear whose quant method is
    vLLM's block-quantized Fp8LinearMethod and whose tensors keep the checkpoint's layout after
    process_weights_after_loading: weight float8 [N, K], weight_scale_inv [ceil(N/bn),
    ceil(K/bk)], the kernel's process_weights_after_loading being Fp8BlockScaledMMLinearKernel's
    own (CUTLASS and Triton: on CUDA it replaces both parameters by themselves), neither Marlin
    (repacked) nor DeepGEMM (scales re-laid out). None otherwise."""
    qm = getattr(linear, "quant_method", None)
    if type(qm).__name__ != "Fp8LinearMethod" or not getattr(qm, "block_quant", False):
        return None
    if getattr(qm, "use_marlin", False) or getattr(qm, "use_deep_gemm", False):
        return None
    kernel = getattr(qm, "fp8_linear", None)
    owner = next((c for c in type(kernel).__mro__ if "process_weights_after_loading" in c.__dict__), None)
    if kernel is None or owner is None or owner.__name__ != "Fp8BlockScaledMMLinearKernel":
        return None
    w, s = getattr(linear, "weight", None), getattr(linear, "weight_scale_inv", None)
    block = getattr(linear, "weight_block_size", None) or getattr(qm, "weight_block_size", None)
    if w is None or s is None or block is None or len(block) != 2 or w.dim() != 2 or s.dim() != 2:
        return None
    if "float8" not in str(w.dtype):
        return None
    bn, bk = int(block[0]), int(block[1])
    if tuple(s.shape) != (-(-w.shape[0] // bn), -(-w.shape[1] // bk)):
        return None
    return w, s, (bn, bk), type(kernel).__name__


def dequant_weight(linear, act_dtype) -> tuple[np.ndarray, str]:
    """A vLLM linear layer's weight as float32 [out, in], and how it was obtained: the weight as
    is (unquantized); else vLLM's own get_and_maybe_dequant_weights (for a block Fp8LinearMethod:
    float32(weight) x the scale broadcast over its 128x128 blocks); where that refuses the shapes
    (its scaled_dequantize asserts N and K are whole multiples of the block, so a fused
    q_a|kv_a of 704 rows in 6 row blocks stops there) and the layer keeps the checkpoint layout
    (_fp8_block_layer), block_dequant of its `weight` and `weight_scale_inv`, the same product;
    else the layer applied to an identity matrix through its quant method."""
    torch = _torch()
    qm = getattr(linear, "quant_method", None)
    if qm is None or type(qm).__name__ == "UnquantizedLinearMethod":
        return _np(linear.weight).astype(np.float32), "unquantized"
    fp8 = _fp8_block_layer(linear)
    refused = None
    try:
        from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

        w = get_and_maybe_dequant_weights(linear, out_dtype=torch.float32)
        how = f"{type(qm).__name__} via vllm get_and_maybe_dequant_weights"
        if fp8 is not None:
            how += f" ({fp8[3]}, block {fp8[2][0]}x{fp8[2][1]})"
        return _np(w).astype(np.float32), how
    except (ImportError, TypeError):
        pass
    except (AssertionError, ValueError, RuntimeError) as e:
        if fp8 is None:
            raise
        refused = f"{type(e).__name__}{': ' + str(e) if str(e) else ''}"
    if fp8 is not None:
        w, s, block, kernel = fp8
        out = block_dequant(_np(w), _np(s), block)
        why = f"; vLLM's get_and_maybe_dequant_weights refused it ({refused})" if refused else ""
        return out, (
            f"{type(qm).__name__} ({kernel}, block {block[0]}x{block[1]}): weight x "
            f"weight_scale_inv[r // {block[0]}, c // {block[1]}] in f32{why}"
        )
    # older vLLM's MLACommonImpl.process_weights_after_loading method: identity through the quant kernel.
    dev = None
    for name in ("weight", "qweight", "weight_packed"):
        if hasattr(linear, name):
            dev = getattr(linear, name).device
            break
    eye = torch.eye(int(linear.input_size_per_partition), dtype=act_dtype, device=dev)
    with torch.no_grad():
        out = qm.apply(linear, eye, bias=None)
    return (
        _np(out).T.copy().astype(np.float32),
        f"{type(qm).__name__} via quant_method.apply(identity, {_dtype_name(act_dtype)})",
    )


def quantization_info(root) -> dict | None:
    """What the engine's quantized layers run, for `header.engine.quantization`: the linear
    method and kernel class of the first decoder layer's first quantized attention linear
    (`linear_method` Fp8LinearMethod, `linear_kernel` CutlassFp8BlockScaledMMKernel, ...),
    `weight_block_size` [bn, bk] (block FP8), `weight_dtype` (float8_e4m3fn) and `scale_dtype`
    (float32), `compute` where the kernel is a stand-in that says its arithmetic
    (mla_diff_hooks.fp8_cpu: `w8a8-block`, `weight-only`), and, where an MoE layer has them,
    `moe_method` and `moe_backend` (its fp8_backend). None when no attention linear is
    quantized."""
    info: dict[str, Any] = {}
    try:
        layers = find_decoder_layers(root)
    except RuntimeError:
        return None
    for _, layer in layers:
        attn = getattr(layer, "self_attn", None)
        for pname in WEIGHT_PARAMS:
            mod = getattr(attn, pname, None)
            qm = getattr(mod, "quant_method", None)
            if qm is None or type(qm).__name__ == "UnquantizedLinearMethod":
                continue
            info["linear_method"] = type(qm).__name__
            kernel = getattr(qm, "fp8_linear", None) or getattr(qm, "kernel", None)
            if kernel is not None:
                info["linear_kernel"] = type(kernel).__name__
                # a stand-in's arithmetic (mla_diff_hooks.fp8_cpu: w8a8-block, weight-only)
                if isinstance(getattr(kernel, "compute", None), str):
                    info["compute"] = kernel.compute
            block = getattr(mod, "weight_block_size", None) or getattr(qm, "weight_block_size", None)
            if block is not None:
                info["weight_block_size"] = [int(x) for x in block]
            w = getattr(mod, "weight", None)
            if w is not None:
                info["weight_dtype"] = str(w.dtype).replace("torch.", "")
            s = getattr(mod, "weight_scale_inv", getattr(mod, "weight_scale", None))
            if s is not None:
                info["scale_dtype"] = str(s.dtype).replace("torch.", "")
            break
        if info:
            break
    if not info:
        return None
    for _, mod in root.named_modules():
        qm = getattr(mod, "quant_method", None)
        backend = getattr(qm, "fp8_backend", None)
        if backend is not None:
            info["moe_method"] = type(qm).__name__
            info["moe_backend"] = str(getattr(backend, "name", backend))
            break
    return info


def act_quant_field(quant: dict | None, dtype: str) -> dict | None:
    """The format-2 header's `act_quant` for the quantized linears `quantization_info` describes
    (`quant`), in a dump of activation dtype `dtype`: a block-FP8 `Fp8LinearMethod` whose kernel
    quantizes its activations (every block kernel vLLM 0.26 picks on a GPU runs
    `per_token_group_quant_fp8` in groups of the weight's block width first; the CPU stand-in's
    `w8a8-block` does the same) reads its inputs per token in groups of `weight_block_size[1]`
    with f32 scales, from `dtype` values. None for unquantized layers, per-tensor or channel
    scales (not described), and a weight-only kernel (`compute` "weight-only", Marlin)."""
    if not quant or quant.get("linear_method") != "Fp8LinearMethod":
        return None
    block = quant.get("weight_block_size")
    kernel = str(quant.get("linear_kernel", ""))
    if not block or len(block) != 2 or quant.get("compute") == "weight-only" or "Marlin" in kernel:
        return None
    field: dict[str, Any] = {"dtype": "fp8_e4m3", "granularity": "token-group", "group": int(block[1])}
    if dtype in ("bf16", "f16", "f32"):
        field["input"] = dtype
    return field


# the fp8 latent-cache dtypes `kv_cache_quant` describes: E4M3 with one per-tensor k_scale
# ("fp8_e5m2" and DeepSeek's tiled "fp8_ds_mla" are other formats)
FP8_E4M3_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def kv_cache_quant_field(root, dtype: str) -> dict | None:
    """The format-2 header's `kv_cache_quant` for the first attention layer under `root` that
    has a `kv_cache_dtype` and a `_k_scale` (vLLM 0.26's `MLAAttention`): with `kv_cache_dtype`
    "fp8" or "fp8_e4m3", E4M3 with that layer's `_k_scale_float` (read when the dump is written,
    so a scale `calculate_kv_scales` computed at the first forward is the one used), read from
    `dtype` values. When the layer's backend takes an fp8 decode query
    (`impl.supports_quant_query_input`: vLLM quantizes `ql_nope ‖ q_pe` with the layer's
    `_q_scale` before FLASHMLA's fp8 kernel; TRITON_MLA keeps it bf16) the field gains
    `"query": {"scale": q_scale}`. None for an unquantized cache and for formats the field does
    not describe."""
    for _, mod in root.named_modules():
        kd = getattr(mod, "kv_cache_dtype", None)
        if kd is None or not hasattr(mod, "_k_scale"):
            continue
        if kd not in FP8_E4M3_CACHE_DTYPES:
            return None
        scale = getattr(mod, "_k_scale_float", None)
        if scale is None:
            scale = float(mod._k_scale.reshape(-1)[0])
        field: dict[str, Any] = {"dtype": "fp8_e4m3", "scale": float(scale)}
        if dtype in ("bf16", "f16", "f32"):
            field["input"] = dtype
        impl = getattr(mod, "impl", None)
        if impl is not None and bool(getattr(impl, "supports_quant_query_input", False)):
            q_scale = getattr(mod, "_q_scale_float", None)
            if q_scale is None and hasattr(mod, "_q_scale"):
                q_scale = float(mod._q_scale.reshape(-1)[0])
            field["query"] = {"scale": float(1.0 if q_scale is None else q_scale)}
        return field
    return None


def patch_entry(patch) -> dict[str, Any]:
    """A header `patches` entry from (name, reason), (name, reason, params) or such a dict:
    `{"name", "reason"}`, plus `"params"` when given (a planted bug's parameters)."""
    if isinstance(patch, dict):
        entry = {"name": str(patch["name"]), "reason": str(patch.get("reason", ""))}
        params = patch.get("params")
    else:
        entry = {"name": str(patch[0]), "reason": str(patch[1])}
        params = patch[2] if len(patch) > 2 else None
    if params is not None:
        entry["params"] = params
    return entry


def step_seq_lens(query_start_loc, positions, n_rows: int) -> list[int]:
    """The new tokens of each sequence in a step: from the attention metadata's
    `query_start_loc` [S+1] when it covers the step's `n_rows` rows (the engine's own split,
    which also tells apart two requests whose positions happen to follow each other), else
    inferred from the positions (infer_seq_lens), else one sequence."""
    if query_start_loc is not None:
        q = [int(x) for x in query_start_loc]
        if len(q) >= 2 and q[0] == 0 and q[-1] == n_rows and all(b >= a for a, b in zip(q, q[1:])):
            return [b - a for a, b in zip(q, q[1:])]
    if positions is not None:
        return infer_seq_lens(positions)
    return [n_rows]


def infer_seq_lens(positions: np.ndarray) -> list[int]:
    """Sequence lengths of a token-major batch: a new sequence where a position does not follow."""
    if len(positions) == 0:
        return []
    lens = [1]
    for a, b in zip(positions[:-1], positions[1:]):
        if b == a + 1:
            lens[-1] += 1
        else:
            lens.append(1)
    return lens


def topk_rows(buffer: np.ndarray) -> np.ndarray:
    """vLLM's topk_indices_buffer rows [T, K] int (each row: the key positions a token keeps,
    within its own request, in the kernel's order, −1 for none) in the `idx_topk` layout
    (docs/dump-format.md): each row's positions ascending, then −1; float32 (positions below
    2^24 are exact)."""
    a = np.asarray(buffer, dtype=np.int64)
    out = np.full(a.shape, -1.0, dtype=np.float32)
    for i, row in enumerate(a):
        kept = np.sort(row[row >= 0])
        out[i, : kept.size] = kept
    return out


def topk_width(width: int, totals: list[int]) -> int:
    """The width of a step's `idx_topk` in the dump: min(index_topk, S), S the step's longest
    sequence after it (`totals`: the lengths, cached context included), as mla-diff's reader and
    reference lay it out (docs/dump-format.md). vLLM's buffer is index_topk wide; a token keeps
    at most its own position + 1 ≤ S keys, so the columns from S on hold only −1."""
    return min(width, max(totals, default=0))


# What vLLM 0.26's DSA indexer does to its query and key before scoring, beyond what its Indexer
# module exposes (quant_block_size, scale_fmt): fp8 E4M3 (current_platform.fp8_dtype() on CUDA),
# and the floors under a block's largest magnitude, written into its kernels: 1e-10 in
# _fused_indexer_q_rope_quant_kernel and per_token_group_quant_fp8 (the query), 1e-4 in
# indexer_k_quant_and_cache (the key cache).
INDEXER_Q_AMAX_FLOOR = 1e-10
INDEXER_K_AMAX_FLOOR = 1e-4


def indexer_quant_field(indexer, act_dtype) -> dict | None:
    """The format-2 header's `indexer_quant` for vLLM's DSA `Indexer` module (deepseek_v2.py)
    running in `act_dtype`: fp8 E4M3 in blocks of its `quant_block_size`, `ue8m0` scales when its
    `scale_fmt` is set (vLLM's q quantizer takes any scale_fmt as ue8m0, its k cache
    "ue8m0" only: "ue8m0" is what vLLM sets), read from `act_dtype` values. None for a module
    without `quant_block_size` or one whose cache holds MXFP4 (`use_fp4_cache`), which the
    field does not describe."""
    block = getattr(indexer, "quant_block_size", None)
    if block is None or getattr(getattr(indexer, "indexer_op", None), "use_fp4_cache", False):
        return None
    fmt = getattr(indexer, "scale_fmt", None)
    field: dict[str, Any] = {
        "dtype": "fp8_e4m3",
        "block": int(block),
        "scale": "ue8m0" if fmt == "ue8m0" else "f32",
        "q_amax_floor": INDEXER_Q_AMAX_FLOOR,
        "k_amax_floor": INDEXER_K_AMAX_FLOOR,
    }
    name = _dtype_name(act_dtype) if act_dtype is not None else None
    if name in ("bf16", "f16", "f32"):
        field["input"] = name
    return field


# --------------------------------------------------------------------------------------------
# the capture
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Dims:
    n_local: int
    p: int
    r: int
    v: int
    l: int  # noqa: E741 - the MLA dim name L (kv_lora_rank)
    lq: int | None


def _dims(attn) -> _Dims:
    n = getattr(attn, "num_local_heads", None) or attn.num_heads
    return _Dims(
        int(n),
        int(attn.qk_nope_head_dim),
        int(attn.qk_rope_head_dim),
        int(attn.v_head_dim),
        int(attn.kv_lora_rank),
        None if attn.q_lora_rank is None else int(attn.q_lora_rank),
    )


class VllmCapture:
    """Forward hooks on a vLLM DeepSeek MLA model; records one forward pass.

    model: DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (anything with model.layers[i].self_attn).
    forward_index: which forward after arm() to record (0 = the first).
    tp_rank/tp_size/pp_rank/pp_size: default from vLLM's parallel state (override for tests).
    layers: the decoder layers to hook and whose weights to write (default: every layer of this
    pipeline rank); a dump of fewer layers is judged on those (it holds their `hidden_in`).
    step_sites: {recorded step index: stages} keeps only those stages' sites in that step, the
    weight sites (`w.kv_b`, ...) of step 0 included (the other steps are recorded in full); a
    long prompt's prefill can keep `hidden_in`, `kv_c_normed` and `k_pe_roped` (what a decode
    step's context needs) and leave the rest out of the dump.
    sites: the stages every step not in `step_sites` keeps (a context-partial stage `ctx_out`
    keeps its chunks `ctx_out.c{c}` too); default all.
    heads: `(a, b)`: write_format2 keeps only heads a..b of the per-head sites (header `heads`;
    docs/dump-format.md): a dump of a 128-head model holds one head's attention for 1/128 of
    the bytes, and o_proj, hidden_out and the latent cache stay whole. TP 1 only.
    """

    def __init__(
        self,
        model,
        *,
        forward_index: int = 0,
        steps: int = 1,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        pp_rank: int | None = None,
        pp_size: int | None = None,
        undo_fp16_residual_scaling: bool = True,
        engine: str | None = None,
        layers: list[int] | tuple[int, ...] | None = None,
        step_sites: dict[int, Iterable[str]] | None = None,
        sites: Iterable[str] | None = None,
        heads: tuple[int, int] | None = None,
    ):
        self.root = find_model(model)
        self.missing = check_layout(self.root)  # names this vLLM lacks (see check_layout)
        ver = vllm_version()
        other = ver.startswith("vllm ") and "unknown" not in ver and ver != f"vllm {TESTED_VLLM}"
        self.version_msg = version_note(self.missing) if (self.missing or other) else None
        self.layers = find_decoder_layers(self.root)
        if layers is not None:
            unknown = sorted(set(layers) - {n for n, _ in self.layers})
            if unknown:
                raise ValueError(f"layers {unknown} are not decoder layers of this rank")
            self.layers = [(n, layer) for n, layer in self.layers if n in set(layers)]
        self.forward_index = forward_index
        self.n_steps = steps
        self.step_sites = {int(k): frozenset(v) for k, v in (step_sites or {}).items()}
        self.keep_sites = frozenset(sites) if sites is not None else None
        p = parallel_info()
        self.tp_rank = p[0] if tp_rank is None else tp_rank
        self.tp_size = p[1] if tp_size is None else tp_size
        self.pp_rank = p[2] if pp_rank is None else pp_rank
        self.pp_size = p[3] if pp_size is None else pp_size
        self.undo_fp16 = undo_fp16_residual_scaling
        self.heads = None
        if heads is not None:
            a, b = (int(x) for x in heads)
            n = _dims(self.layers[0][1].self_attn).n_local
            if self.tp_size > 1:
                raise ValueError(
                    f"heads {a}:{b}: a head subset is written at TP 1 only (this is TP {self.tp_size})"
                )
            if not 0 <= a < b <= n:
                raise ValueError(f"heads {a}:{b}: expected 0 <= a < b <= {n} (the model's heads)")
            self.heads = (a, b)
        self.engine = engine or vllm_version()
        self.handles: list = []
        self._wrapped: list = []  # (object, attribute) wrapped at instance level
        self._module_wrapped: list = []  # (module, attribute, original) wrapped module functions
        self.reset()
        if self.version_msg:
            print("dump_vllm: " + self.version_msg, file=sys.stderr)

    # ---- state ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.forwards = 0  # forwards seen since arm()
        self.capturing = False
        self.act_dtype = None
        self.notes: list[str] = [self.version_msg] if getattr(self, "version_msg", None) else []
        self.steps: list[dict] = []  # finished steps: t, tokens, positions, repeats, notes
        self._in_root = False
        self._skipped_dummy = 0  # the GPU runner's dummy forwards passed over (_model_pre)
        self.lse_base = "e"
        # the DSA indexer's quantization (header `indexer_quant`), read from the live module
        self.indexer_quant: dict | None = None
        self._hooks_fired = 0
        self._weights_cache = None
        self._new_step()

    def _new_step(self) -> None:
        """Per-forward state (one step: the prefill, or one decode step)."""
        self.done = False
        self.cur_layer: int | None = None
        self.t: dict[str, np.ndarray] = {}
        self.tokens: np.ndarray | None = None
        self.positions: np.ndarray | None = None
        self.repeats: dict[str, int] = {}
        self.step_notes: list[str] = []
        self._pending_hidden_in: dict[int, np.ndarray] = {}
        self._kv_b_seen: set[int] = set()
        # the step's attention facts (STEP_INFO): num_kv_splits, page_size, block_table,
        # slot_mapping, query_start_loc, num_decodes, context_chunks
        self.info: dict[str, Any] = {}
        # what the scheduler gave this step (plan_step), None when unknown
        self.plan: dict | None = None
        # the MHA prefill over cached context being recorded: (layer, merges seen)
        self._ctx: list | None = None

    def plan_step(self, plan: dict) -> None:
        """What the scheduler gives the next forward, in the dump's sequence (header) order:
        `seqs` [{"new", "context", "prefix": {"seq", "len"} (optional)}] for every sequence,
        `order` (the sequences with new > 0 in the order the runner packs their rows, decodes
        first), `block_table` [S, B] int32 (header order, optional), `context_chunk_tokens`
        (optional). The rows the hooks record in the runner's order are written in header
        order; the kernel of each row is read from the attention metadata (its num_decodes)."""
        self._next_plan = plan

    def _end_step(self) -> None:
        if self.capturing and self.t and self.plan is not None:
            self._to_header_order()
        if self.capturing and self.t:
            self.steps.append(
                {
                    "t": self.t,
                    "tokens": self.tokens,
                    "positions": self.positions,
                    "repeats": self.repeats,
                    "notes": self.step_notes,
                    "info": self.info,
                    "plan": self.plan,
                }
            )
        self.capturing = False
        self.done = True

    def _to_header_order(self) -> None:
        """Rows recorded in the runner's order (plan["order"], decodes first) put in header
        sequence order: every per-row site, the tokens, positions and slot mapping; the partial
        sites (rows: the step's prefill rows) cut to the prefill rows with cached context (Tc),
        in header order, their LSEs [N, Tp] transposed to [Tc, N]. Sets plan["kernel"]."""
        plan = self.plan
        seqs = plan["seqs"]
        order = [int(i) for i in plan["order"]]
        new = [int(x["new"]) for x in seqs]
        n_dec = int(self.info.get("num_decodes", 0))
        kernel = {i: ("decode" if j < n_dec else "prefill") for j, i in enumerate(order)}
        plan["kernel"] = kernel
        start, off = {}, 0
        for i in order:
            start[i] = off
            off += new[i]
        t_rows = off
        perm = np.array([start[i] + r for i in range(len(seqs)) for r in range(new[i])], dtype=np.int64)
        p_start, p_off = {}, 0
        for i in order:
            if kernel[i] == "prefill":
                p_start[i] = p_off
                p_off += new[i]
        tc = [
            p_start[i] + r
            for i in range(len(seqs))
            if kernel.get(i) == "prefill" and int(seqs[i]["context"]) > 0
            for r in range(new[i])
        ]
        tc_idx = np.array(tc, dtype=np.int64)
        for key, a in list(self.t.items()):
            if is_partial_site(key):
                a = a.T if key.split(".", 1)[1].startswith(("ctx_lse", "suffix_lse")) else a
                self.t[key] = np.ascontiguousarray(a[tc_idx])
            elif ".w." not in key and a.ndim >= 1 and a.shape[0] >= t_rows:
                self.t[key] = np.ascontiguousarray(a[:t_rows][perm])  # padding rows dropped
        for name in ("tokens", "positions"):
            a = getattr(self, name)
            if a is not None and a.shape[0] >= t_rows:
                setattr(self, name, a[:t_rows][perm])
        sm = self.info.get("slot_mapping")
        if sm is not None and sm.shape[0] >= t_rows:
            self.info["slot_mapping"] = sm[:t_rows][perm]
        if plan.get("block_table") is not None:
            self.info["block_table"] = np.asarray(plan["block_table"], dtype=np.int32)
        elif self.info.get("block_table") is not None and self.info["block_table"].shape[0] >= len(order):
            rows = self.info["block_table"]  # the metadata's rows: the step's requests, runner order
            table = np.zeros((len(seqs), rows.shape[1]), dtype=np.int32)
            for j, i in enumerate(order):
                table[i] = rows[j]
            self.info["block_table"] = table
        raw = self.info.pop("context_chunks", None)
        if raw is not None:
            starts, lens = raw
            pre = [i for i in order if kernel[i] == "prefill"]
            chunks = {}
            for j, i in enumerate(pre):
                ctx = int(seqs[i]["context"])
                chunks[i] = [
                    [min(int(starts[c][j]), ctx), min(int(starts[c][j]), ctx) + int(lens[c][j])]
                    for c in range(starts.shape[0])
                ]
            plan["context_chunks"] = chunks
            if plan.get("context_chunk_tokens") is None and starts.shape[0] > 1:
                plan["context_chunk_tokens"] = int(starts[1][0])

    def _arm_context_partials(self, n: int, d: _Dims, impl) -> None:
        """Record layer n's MHA prefill over cached context (vLLM `_compute_prefill_context`, then
        `merge_attn_states` with the new tokens' attention): each context chunk's output and LSE
        as the chunk loop merges it (after vLLM masks an empty chunk), the merged context, and
        the suffix (the new tokens' causal attention) the final merge reads."""
        if not callable(getattr(impl, "_compute_prefill_context", None)):
            return

        def make(orig):
            def compute(*args, **kwargs):
                if not self._on():
                    return orig(*args, **kwargs)
                self._ctx = [n, 0]
                try:
                    out, lse = orig(*args, **kwargs)
                finally:
                    merges = self._ctx[1]
                    self._ctx = None
                if merges == 0:
                    self.put(n, "ctx_out.c0", _np(out[..., : d.v]))
                    self.put(n, "ctx_lse.c0", _np(lse))
                self.put(n, "ctx_out", _np(out[..., : d.v]))
                self.put(n, "ctx_lse", _np(lse))
                return out, lse

            return compute

        self._wrap(impl, "_compute_prefill_context", make)
        mod = sys.modules.get("vllm.model_executor.layers.attention.mla_attention")
        if mod is None or not callable(getattr(mod, "merge_attn_states", None)):
            return
        if any(m is mod and a == "merge_attn_states" for m, a, _ in self._module_wrapped):
            return

        def make_merge(orig):
            def merge_attn_states(*args, **kwargs):
                if self._on() and self.cur_layer is not None:
                    names = ("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse")
                    a = dict(zip(names, args))
                    a.update({k: v for k, v in kwargs.items() if k in names})
                    layer = self.cur_layer
                    v = self._v_of(layer)
                    if self._ctx is not None:
                        self._ctx[1] += 1
                        c = self._ctx[1]
                        if c == 1:
                            self.put(layer, "ctx_out.c0", _np(a["prefix_output"][..., :v]))
                            self.put(layer, "ctx_lse.c0", _np(a["prefix_lse"]))
                        self.put(layer, f"ctx_out.c{c}", _np(a["suffix_output"][..., :v]))
                        self.put(layer, f"ctx_lse.c{c}", _np(a["suffix_lse"]))
                    else:
                        self.put(layer, "suffix_out", _np(a["suffix_output"][..., :v]))
                        self.put(layer, "suffix_lse", _np(a["suffix_lse"]))
                return orig(*args, **kwargs)

            return merge_attn_states

        self._wrap_module(mod, "merge_attn_states", make_merge)

    def _v_of(self, n: int) -> int:
        for m, layer in self.layers:
            if m == n:
                return _dims(layer.self_attn).v
        return 1 << 30

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)

    def step_note(self, msg: str) -> None:
        if msg not in self.step_notes:
            self.step_notes.append(msg)

    def put(self, layer: int, stage: str, value: np.ndarray) -> None:
        self.put_site(site(layer, stage), value)

    def put_site(self, key: str, value: np.ndarray) -> None:
        """Store site `key` (`L{n}.{stage}`) of this step; the first value wins. A stage that
        `step_sites` leaves out of this step is dropped."""
        keep = self.step_sites.get(len(self.steps), self.keep_sites)
        stage = key.split(".", 1)[-1]
        if keep is not None and stage not in keep and stage.split(".c", 1)[0] not in keep:
            return
        if key in self.t:  # first value wins (e.g. a second rotary call in the layer)
            self.repeats[key] = self.repeats.get(key, 1) + 1
            return
        self.t[key] = value

    # ---- hooks ---------------------------------------------------------------------------
    def arm(self) -> VllmCapture:
        """Register every hook (idempotent: re-arming removes the old ones first)."""
        self.remove()
        self.reset()
        # The root (DeepseekV3ForCausalLM) is what vLLM's runner calls. Not its inner
        # DeepseekV2Model: @support_torch_compile gives that class a __call__ that calls
        # self.forward() directly, so hooks on it never run (vllm/compilation/decorators.py).
        self.handles.append(self.root.register_forward_pre_hook(self._model_pre, with_kwargs=True))
        self.handles.append(self.root.register_forward_hook(self._model_post, with_kwargs=True))
        hooked_rotary: set[int] = set()
        for n, layer in self.layers:
            attn = layer.self_attn
            self.handles.append(
                layer.register_forward_pre_hook(functools.partial(self._layer_pre, n), with_kwargs=True)
            )
            self.handles.append(
                layer.register_forward_hook(functools.partial(self._layer_post, n), with_kwargs=True)
            )
            self.handles.append(
                layer.input_layernorm.register_forward_hook(functools.partial(self._input_norm, n))
            )
            d = _dims(attn)

            def hook(mod_name: str, fn: Callable) -> None:
                mod = getattr(attn, mod_name, None)  # noqa: B023 - called in this iteration
                if mod is not None:
                    self.handles.append(mod.register_forward_hook(fn))

            hook("fused_qkv_a_proj", functools.partial(self._fused_qkv_a, n, d))
            hook("q_a_proj", functools.partial(self._simple, n, "q_c"))
            hook("kv_a_proj_with_mqa", functools.partial(self._kv_a, n, d))
            hook("q_a_layernorm", functools.partial(self._simple, n, "q_c_normed"))
            hook("q_b_proj", functools.partial(self._q, n, d))
            hook("q_proj", functools.partial(self._q, n, d))
            hook("kv_a_layernorm", functools.partial(self._simple, n, "kv_c_normed"))
            hook("kv_b_proj", functools.partial(self._kv_b, n, d))
            o_proj = attn.o_proj
            self.handles.append(o_proj.register_forward_pre_hook(functools.partial(self._o_pre, n, d)))
            self.handles.append(o_proj.register_forward_hook(functools.partial(self._o_post, n, o_proj)))
            if self.tp_size > 1 and getattr(o_proj, "reduce_results", True):
                self._wrap_partial(o_proj, dump_format.o_proj_rank_site(n, self.tp_rank))
            self._arm_ffn(n, layer)
            indexer = getattr(attn, "indexer", None)
            if isinstance(indexer, _torch().nn.Module):
                self.handles.append(indexer.register_forward_hook(functools.partial(self._indexer, n)))
            rot = getattr(attn, "rotary_emb", None)
            if rot is not None and id(rot) not in hooked_rotary:  # shared across layers
                hooked_rotary.add(id(rot))
                self.handles.append(rot.register_forward_hook(self._rotary))
            impl = find_mqa_impl(attn)
            if impl is not None:
                self._arm_context_partials(n, d, impl)
                self._wrap(impl, "forward_mqa", functools.partial(self._forward_mqa, n, d))
                # FlashInfer / TokenSpeed MLA return a base-2 lse (their lse_base_on_e = False)
                self.lse_base = "e" if getattr(impl, "lse_base_on_e", True) else "2"
        if self.layers:
            self._arm_step_info(self.layers[0][1].self_attn)
        return self

    def _arm_step_info(self, attn) -> None:
        """Record the step's attention facts (STEP_INFO) from the first hooked layer: a forward
        pre-hook on its MLAAttention reads the forward context (block tables, slot mapping,
        query_start_loc) and its KV cache's block size; the decode kernel's split count is
        taken from the call of the backend module's `decode_attention_fwd` (Triton MLA)."""
        layer = find_attention_layer(attn)
        if layer is not None:
            self.handles.append(layer.register_forward_pre_hook(functools.partial(self._attn_pre, layer)))
        impl = find_mqa_impl(attn)
        module = sys.modules.get(type(impl).__module__) if impl is not None else None
        if module is not None and callable(getattr(module, "decode_attention_fwd", None)):

            def make(orig):
                def decode_attention_fwd(*args, **kwargs):
                    if self._on() and "num_kv_splits" not in self.info:
                        k = args[8] if len(args) > 8 else kwargs.get("num_kv_splits")
                        if k is not None:
                            self.info["num_kv_splits"] = int(k)
                    return orig(*args, **kwargs)

                return decode_attention_fwd

            self._wrap_module(module, "decode_attention_fwd", make)

    def _attn_pre(self, layer, mod, args) -> None:
        if not self._on() or "query_start_loc" in self.info:
            return
        info = attention_step_info(layer)
        self.info.update({k: v for k, v in info.items() if k not in self.info})

    def _arm_ffn(self, n: int, layer) -> None:
        """Hooks on the layer's post-attention norm (`ffn_in`) and SwiGLU MLP: the dense MLP
        (`ffn_gate`, `ffn_up`, `ffn_act`, `ffn_out`) or an MoE layer's shared experts (the same
        but `shared_out` for their output); at TP > 1 also each rank's `ffn_gate_up.rank<r>` and
        `ffn_down.rank<r>` (the row-parallel partial before the all-reduce, taken from the
        linear's quant_method.apply, whose output the all-reduce then overwrites in place)."""
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is not None:
            self.handles.append(norm.register_forward_hook(functools.partial(self._simple, n, "ffn_in")))
        ffn, prefix = find_ffn(layer)
        if ffn is None:
            return
        shared = prefix != ""
        self.handles.append(ffn.gate_up_proj.register_forward_hook(functools.partial(self._gate_up, n)))
        act = getattr(ffn, "act_fn", None)
        if act is not None:
            self.handles.append(act.register_forward_hook(functools.partial(self._simple, n, "ffn_act")))
        down = ffn.down_proj
        reduce = bool(getattr(down, "reduce_results", True))
        self.handles.append(down.register_forward_hook(functools.partial(self._down, n, shared, reduce)))
        if self.tp_size > 1 and reduce:
            self._wrap_partial(down, dump_format.ffn_down_rank_site(n, self.tp_rank))

    def _wrap_partial(self, linear, key: str) -> None:
        """Record `linear`'s output before its TP all-reduce as site `key`: a
        RowParallelLinear computes `quant_method.apply(self, x, bias)` and then all-reduces that
        tensor (in place on a CPU/gloo communicator), so the partial is copied as apply returns."""
        qm = getattr(linear, "quant_method", None)
        if qm is None or not callable(getattr(qm, "apply", None)):
            self.note(f"{key}: {type(linear).__name__} has no quant_method.apply: not dumped")
            return

        def make(orig):
            def apply(layer, x, *args, **kwargs):
                out = orig(layer, x, *args, **kwargs)
                if layer is linear and self._on():
                    self.put_site(key, _np(out))
                return out

            return apply

        self._wrap(qm, "apply", make)

    def _wrap(self, obj, attr: str, make: Callable) -> None:
        """Replace obj.attr (a bound method) by make(original) on this instance only."""
        orig = getattr(obj, attr)
        setattr(obj, attr, make(orig))
        self._wrapped.append((obj, attr))

    def _wrap_module(self, module, attr: str, make: Callable) -> None:
        """Replace a module's function by make(original) until remove() puts it back."""
        orig = getattr(module, attr)
        setattr(module, attr, make(orig))
        self._module_wrapped.append((module, attr, orig))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for obj, attr in self._wrapped:
            try:
                delattr(obj, attr)  # the class's method shows through again
            except AttributeError:
                pass
        self._wrapped = []
        for module, attr, orig in reversed(getattr(self, "_module_wrapped", [])):
            setattr(module, attr, orig)
        self._module_wrapped = []

    def _on(self) -> bool:
        return self.capturing and not self.done

    def _model_pre(self, mod, args, kwargs):
        self._in_root = True
        if _WATCHED["on"] and _LIVE is None:
            # the GPU runner's profile, warm-up or padding forward (its _dummy_run, outside
            # execute_model): no request's tokens; neither recorded nor counted, so that
            # MLA_DIFF_VLLM_STEPS counts the forwards that serve requests
            self.capturing = False
            self._skipped_dummy += 1
            return
        self._begin_forward()
        if not self.capturing:
            return
        if self.plan is None and _LIVE is not None:
            self.plan = live_plan(self, *_LIVE)
            if self.plan is not None:
                # named by the forward's index since arm(): a windowed dump's steps keep the
                # engine's numbering
                self.plan.setdefault("name", f"step-{self.forwards - 1}")
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if ids is not None:
            self.tokens = _np(ids).astype(np.int64).reshape(-1)
        if pos is not None:
            self.positions = _np(pos).astype(np.int64).reshape(-1)

    def _begin_forward(self) -> None:
        self.forwards += 1
        idx = self.forwards - 1 - self.forward_index
        self._new_step()
        self.plan, self._next_plan = getattr(self, "_next_plan", None), None
        self.capturing = 0 <= idx < self.n_steps

    def _model_post(self, mod, args, kwargs, output):
        self._in_root = False
        if _WATCHED["on"] and _LIVE is None:
            return
        self._end_step()

    def _layer_pre(self, n, mod, args, kwargs):
        if not self._in_root and n == self.layers[0][0]:
            # the layers were called without the root (a caller running the inner model itself):
            # the first layer marks a new forward, the last one ends it (_layer_post)
            self._begin_forward()
        if not self._on():
            return
        self._hooks_fired += 1
        self.cur_layer = n
        names = ["positions", "hidden_states", "residual"]
        vals = {k: kwargs[k] for k in names if k in kwargs}
        for k, a in zip(names, args):
            vals.setdefault(k, a)
        pos, hs, res = vals.get("positions"), vals.get("hidden_states"), vals.get("residual")
        if self.act_dtype is None and hs is not None:
            self.act_dtype = hs.dtype
        if pos is not None and self.positions is None:
            self.positions = _np(pos).astype(np.int64).reshape(-1)
        if hs is None:
            return
        if pos is not None and hs.shape[0] != pos.shape[0]:
            self.note(
                f"L{n}: hidden_states has {hs.shape[0]} rows for {pos.shape[0]} positions "
                "(sequence-parallel MoE?): hidden_in/hidden_out not dumped"
            )
            return
        # residual None (first layer): hidden_states IS the stream; else the fused add's sum, in
        # the model dtype (what RMSNorm(x, residual) stores as its new residual).
        summed = hs if res is None else hs + res
        self._pending_hidden_in[n] = _np(summed)

    def _input_norm(self, n, mod, args, output):
        if not self._on():
            return
        self.put(n, "attn_in", _np(_first(output)))
        pending = self._pending_hidden_in.pop(n, None)
        if isinstance(output, (tuple, list)) and len(output) > 1 and output[1] is not None:
            engine_sum = _np(output[1])  # the engine's own residual sum
            if pending is not None and pending.shape == engine_sum.shape:
                diff = float(np.max(np.abs(pending - engine_sum))) if pending.size else 0.0
                if diff != 0.0:
                    self.note(
                        f"L{n}.hidden_in: fused add differs from hidden_states + residual "
                        f"by up to {diff:.3g} (engine's sum kept)"
                    )
            self.put(n, "hidden_in", engine_sum)
        elif pending is not None:
            self.put(n, "hidden_in", pending)

    def _layer_post(self, n, mod, args, kwargs, output):
        if not self._on():
            return
        if isinstance(output, (tuple, list)):
            hs, res = output[0], (output[1] if len(output) > 1 else None)
            out = hs if res is None else hs + res
        else:
            out = output
        pos = kwargs.get("positions", args[0] if args else None)
        if pos is not None and out.shape[0] != pos.shape[0]:
            pass  # noted in _layer_pre
        else:
            self.put(n, "hidden_out", _np(out))
        self.cur_layer = None
        if n == self.layers[-1][0]:
            if self._in_root:
                self.done = True  # the root's post hook stores the step
            else:
                self._end_step()

    def _simple(self, n, stage, mod, args, output):
        if self._on():
            self.put(n, stage, _np(_first(output)))

    def _fused_qkv_a(self, n, d: _Dims, mod, args, output):
        if not self._on():
            return
        out = _np(_first(output))
        lq = d.lq or 0
        if out.shape[-1] != lq + d.l + d.r:
            self.note(
                f"L{n}: fused_qkv_a_proj output width {out.shape[-1]} != Lq+L+R = "
                f"{lq + d.l + d.r}: q_c/kv_a not dumped"
            )
            return
        self.put(n, "q_c", out[:, :lq].copy())
        self.put(n, "kv_a", out[:, lq:].copy())
        self.put(n, "k_pe", out[:, lq + d.l :].copy())

    def _kv_a(self, n, d: _Dims, mod, args, output):
        if not self._on():
            return
        kv_a = _np(_first(output))
        self.put(n, "kv_a", kv_a)
        self.put(n, "k_pe", kv_a[:, d.l :].copy())

    def _q(self, n, d: _Dims, mod, args, output):
        if self._on():
            q = _np(_first(output))
            self.put(n, "q", q.reshape(q.shape[0], d.n_local, d.p + d.r))

    def _kv_b(self, n, d: _Dims, mod, args, output):
        if not self._on() or n in self._kv_b_seen:
            return
        self._kv_b_seen.add(n)  # only the first call: forward_mha's new prefill tokens
        kv = _np(_first(output))
        rows = kv.shape[0]
        t = self._t_of(n)
        if t is None or rows != t:
            self.step_note(
                f"L{n}: first kv_b_proj call had {rows} rows for T = {t} (decode tokens or "
                "chunked context in the batch): k_nope/v not dumped"
            )
            return
        kv = kv.reshape(rows, d.n_local, d.p + d.v)
        self.put(n, "k_nope", kv[:, :, : d.p].copy())
        self.put(n, "v", kv[:, :, d.p :].copy())

    def _t_of(self, n) -> int | None:
        for st in ("hidden_in", "attn_in", "kv_a"):
            a = self.t.get(site(n, st))
            if a is not None:
                return a.shape[0]
        return None

    def _rotary(self, mod, args, output):
        if not self._on() or self.cur_layer is None:
            return
        n = self.cur_layer
        key = site(n, "q_pe_roped")
        if key in self.t:
            self.repeats[key] = self.repeats.get(key, 1) + 1
            return
        q_pe, k_pe = output[0], output[1]
        q = _np(q_pe)
        t = q.shape[0]
        r = q.shape[-1]
        self.put(n, "q_pe_roped", q.reshape(t, -1, r))
        if k_pe is not None:
            self.put(n, "k_pe_roped", _np(k_pe).reshape(t, r))

    def _indexer(self, n, mod, args, output):
        """A DSA layer's Indexer.forward(hidden_states, q_c, positions, rotary_emb) returns
        vLLM's topk_indices_buffer [max_num_batched_tokens, index_topk] int32 after writing the
        selection of the forward's T rows into its first T (deepseek_v2.py, `Indexer`;
        layers/sparse_attn_indexer.py): those rows, as `idx_topk` [T, index_topk]. The sparse
        backend's forward_mqa reads the same rows."""
        if not self._on() or output is None or not args:
            return
        rows = int(args[0].shape[0])
        if self.indexer_quant is None:
            self.indexer_quant = indexer_quant_field(mod, getattr(args[0], "dtype", None))
        self.put(n, "idx_topk", topk_rows(_np_int(output[:rows])))

    def _forward_mqa(self, n, d: _Dims, orig):
        """Wraps impl.forward_mqa(q, kv_cache, attn_metadata, layer) -> (o, lse) of layer n.

        q is (ql_nope [B, N, L], q_pe [B, N, R]) or their concatenation: ql_nope is
        q_nope x W_UK_T, computed by MLAAttention.forward_impl. Over an fp8 cache a backend
        that takes an fp8 query (FLASHMLA) gets the concatenation in E4M3, quantized with the
        layer's q_scale: ql_nope is dumped as the kernel reads it, times that q_scale (the
        layer is forward_mqa's last argument). o [B, N, L] is the attention
        output in the latent space (before W_UV), lse [B, N] its log-sum-exp. B = the decode
        tokens, which vLLM orders first in a batch.
        """

        def wrapped(q, *args, **kwargs):
            on = self._on()
            ql = None
            if on:
                ql = _np(q[0]) if isinstance(q, (tuple, list)) else _np(q[..., : d.l])
                if not isinstance(q, (tuple, list)) and "float8" in str(getattr(q, "dtype", "")):
                    layer = kwargs.get("layer", args[-1] if args else None)
                    ql = ql * float(getattr(layer, "_q_scale_float", 1.0))
            res = orig(q, *args, **kwargs)
            if on:
                o, lse = (res[0], res[1]) if isinstance(res, (tuple, list)) else (res, None)
                t = self._t_of(n)
                b = ql.shape[0]
                if t is not None and b != t:
                    self.step_note(
                        f"L{n}: forward_mqa ran on {b} of {t} tokens (prefill and decode "
                        "mixed in one batch): ql_nope/attn_latent/lse not dumped"
                    )
                    return res
                self.put(n, "ql_nope", ql.reshape(b, -1, d.l))
                self.put(n, "attn_latent", _np(o)[:b].reshape(b, -1, d.l))
                if lse is not None:
                    lse_np = _np(lse)
                    if lse_np.shape[0] != b and lse_np.ndim == 2 and lse_np.shape[1] == b:
                        lse_np = lse_np.T.copy()  # head-major [N, B]
                    elif lse_np.ndim == 3 and lse_np.shape[0] * lse_np.shape[2] == b:
                        # FlashMLA: [requests, N, q_len] (a request's q_len tokens decoded at once)
                        lse_np = lse_np.transpose(0, 2, 1).copy()
                    self.put(n, "lse", lse_np.reshape(b, -1))
            return res

        return wrapped

    def _o_pre(self, n, d: _Dims, mod, args):
        if self._on():
            x = _np(args[0])
            self.put(n, "attn_out", x.reshape(x.shape[0], d.n_local, d.v))

    def _o_post(self, n, o_proj, mod, args, output):
        if not self._on():
            return
        if self.tp_size > 1 and getattr(o_proj, "reduce_results", True) is False:
            self.note(f"L{n}: o_proj has reduce_results=False under TP (a partial sum): not dumped")
            return
        self.put(n, "o_proj", _np(_first(output)))

    def _gate_up(self, n, mod, args, output):
        """gate_up_proj's output [T, 2·I_r] (I_r = I/tp): this rank's gate columns, then its up
        columns (MergedColumnParallelLinear of [I, I], gather_output False)."""
        if not self._on():
            return
        out = _np(_first(output))
        half = out.shape[-1] // 2
        self.put(n, "ffn_gate", out[:, :half].copy())
        self.put(n, "ffn_up", out[:, half:].copy())
        if self.tp_size > 1:
            self.put_site(dump_format.ffn_gate_up_rank_site(n, self.tp_rank), out)

    def _down(self, n, shared: bool, reduce: bool, mod, args, output):
        """down_proj's output: the dense MLP's `ffn_out` (after the all-reduce); the shared
        experts' `shared_out` at TP 1, or this rank's partial `ffn_down.rank<r>` at TP > 1 (they
        run with reduce_results=False: FusedMoE all-reduces their sum with the routed experts')."""
        if not self._on():
            return
        out = _np(_first(output))
        if shared:
            if self.tp_size == 1:
                self.put(n, "shared_out", out)
            elif not reduce:
                self.put_site(dump_format.ffn_down_rank_site(n, self.tp_rank), out)
        elif self.tp_size == 1 or reduce:
            self.put(n, "ffn_out", out)
        else:
            self.note(
                f"L{n}: mlp.down_proj has reduce_results=False under TP (a partial sum): ffn_out not dumped"
            )

    # ---- results -------------------------------------------------------------------------
    def weights(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The WEIGHTS file's tensors (vLLM names, float32 [out, in]) and metadata (cached)."""
        if self._weights_cache is None:
            self._weights_cache = self._collect_weights()
        return self._weights_cache

    def _collect_weights(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        torch = _torch()
        act = self.act_dtype or _model_dtype(self.root) or torch.bfloat16
        suffix = f".rank{self.tp_rank}" if self.tp_size > 1 else ""
        out: dict[str, np.ndarray] = {}
        quantized, dequant, derived, holders = [], [], [], []
        dims = None
        for n, layer in self.layers:
            attn = layer.self_attn
            d = _dims(attn)
            dims = d
            for pname in WEIGHT_PARAMS:
                mod = getattr(attn, pname, None)
                if mod is None:
                    continue
                w, how = dequant_weight(mod, act)
                out[f"L{n}.{pname}{suffix}"] = w
                if how != "unquantized":
                    quantized.append(f"L{n}.{pname}")
                    dequant.append(f"L{n}.{pname}: {how}")
            fused = out.get(f"L{n}.fused_qkv_a_proj{suffix}")
            if fused is not None and d.lq is not None:
                for pname, part in (("q_a_proj", fused[: d.lq]), ("kv_a_proj_with_mqa", fused[d.lq :])):
                    key = f"L{n}.{pname}{suffix}"
                    if key not in out:
                        out[key] = part.copy()
                        derived.append(f"L{n}.{pname}")
            ffn, prefix = find_ffn(layer)
            for pname in FFN_PARAMS if ffn is not None else ():
                w, how = dequant_weight(getattr(ffn, pname), act)
                out[f"L{n}.{prefix}{pname}{suffix}"] = w
                if how != "unquantized":
                    quantized.append(f"L{n}.{prefix}{pname}")
                    dequant.append(f"L{n}.{prefix}{pname}: {how}")
            holder, path = find_w_uk_holder(attn)
            if holder is None:
                self.note(
                    f"L{n}: no W_UK_T/W_UV found under self_attn (ROCm aiter BMM path, or "
                    "process_weights_after_loading not run): not written"
                )
            else:
                out[f"L{n}.W_UK_T{suffix}"] = _np(holder.W_UK_T).astype(np.float32)
                out[f"L{n}.W_UV{suffix}"] = _np(holder.W_UV).astype(np.float32)
                holders.append(path)
        meta = {
            "format": dump_format.VLLM_WEIGHTS,
            "engine": self.engine,
            # the activation dtype: W_UK_T/W_UV are vLLM's copies in it (weights --check's row)
            "dtype": _dtype_name(act),
            "tp_size": str(self.tp_size),
            "rank": str(self.tp_rank),
            "pp_size": str(self.pp_size),
            "pp_rank": str(self.pp_rank),
            "layout": "[out, in] float32 (W_UK_T [N_r, P, L], W_UV [N_r, L, V]; gate_up_proj "
            "[2·I_r, H] = [gate rows | up rows] of this rank, down_proj [H, I_r])",
            "quantized": ",".join(quantized) or "none",
            "dequant": "; ".join(dequant) or "none (all unquantized; values exact)",
            "derived": ("; ".join(derived) + ": row slices [:Lq] / [Lq:] of fused_qkv_a_proj")
            if derived
            else "none",
            "w_uk_t_holder": ",".join(sorted(set(holders))) or "not found",
        }
        if dims is not None:
            meta["dims"] = (
                f"N_local={dims.n_local},P={dims.p},R={dims.r},V={dims.v},"
                f"L={dims.l},Lq={dims.lq if dims.lq is not None else 'none'}"
            )
        return out, meta

    def _weight_sites(self) -> dict[str, np.ndarray]:
        """w.fused_qkv_a / w.kv_b / w.W_UK_T / w.W_UV of this rank, from the engine's weights."""
        w, _ = self.weights()
        suffix = f".rank{self.tp_rank}" if self.tp_size > 1 else ""
        out = {}
        for n, layer in self.layers:
            g = lambda name: w.get(f"L{n}.{name}{suffix}")  # noqa: E731, B023 - used in this iteration
            if g("fused_qkv_a_proj") is not None and layer.self_attn.q_lora_rank is not None:
                out[site(n, "w.fused_qkv_a")] = g("fused_qkv_a_proj")
            elif g("q_a_proj") is not None and g("kv_a_proj_with_mqa") is not None:
                out[site(n, "w.fused_qkv_a")] = np.concatenate([g("q_a_proj"), g("kv_a_proj_with_mqa")])
            if g("kv_b_proj") is not None:
                out[site(n, "w.kv_b")] = g("kv_b_proj")
            if g("W_UK_T") is not None:
                out[site(n, "w.W_UK_T")] = g("W_UK_T")
                out[site(n, "w.W_UV")] = g("W_UV")
        return out

    def _no_capture_error(self) -> RuntimeError:
        msg = (
            f"no vLLM forward was captured ({self.forwards} forward(s) of "
            f"{type(self.root).__name__} seen after arm(), {self._hooks_fired} layer hook(s) "
            "fired). Hooks do not run inside torch.compile'd / CUDA-graph code: start vLLM "
            "with enforce_eager=True, and run the prompt between arm() and finish()."
        )
        if self.version_msg:
            msg += " " + self.version_msg
        return RuntimeError(msg)

    def result(
        self,
        *,
        num_tokens: int | None = None,
        expect_tokens=None,
        weight_sites: bool = True,
        step: int = 0,
        lse_natural: bool = True,
        residual_natural: bool = True,
    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The dump's tensors (ordered) and metadata of one recorded step, for this rank.

        lse_natural: a base-2 lse (see lse_base) is converted to natural log (format 1 has no
        field for the base; format 2 declares it and keeps the engine's values).
        residual_natural: the fp16 residual-stream scale is multiplied back (with
        undo_fp16_residual_scaling; format 1 has no field for it; format 2 declares it as
        conventions.residual_scale, fp16_residual_scale(), and keeps the engine's values)."""
        if self._hooks_fired == 0 or not self.steps:
            raise self._no_capture_error()
        if step >= len(self.steps):
            raise RuntimeError(f"step {step} not recorded ({len(self.steps)} step(s) captured)")
        torch = _torch()
        rec = self.steps[step]
        tensors = dict(rec["t"])
        tokens, positions = rec["tokens"], rec["positions"]
        notes = list(self.notes) + list(rec["notes"])
        if expect_tokens is not None:
            exp = np.asarray(list(expect_tokens), dtype=np.int64)
            if tokens is None or len(tokens) < len(exp) or not np.array_equal(tokens[: len(exp)], exp):
                got = None if tokens is None else tokens[: len(exp) + 4].tolist()
                raise RuntimeError(
                    f"captured tokens {got} do not start with the expected "
                    f"{exp.tolist()} (prefix caching on? several steps? request order?)"
                )
            num_tokens = len(exp)
        if num_tokens is not None:
            for k, a in tensors.items():
                if a.shape[0] < num_tokens:
                    raise RuntimeError(f"{k} has {a.shape[0]} rows, fewer than {num_tokens} tokens")
                tensors[k] = a[:num_tokens]
            tokens = None if tokens is None else tokens[:num_tokens]
            positions = None if positions is None else positions[:num_tokens]
        # fp16 residual-stream rescale (docs/engines.md, "fp16 models")
        if residual_natural and self.undo_fp16 and self.act_dtype == torch.float16:
            undone = []
            for n, layer in self.layers:
                rsf = float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0)
                if rsf == 1.0 or type(layer.self_attn).__name__ == "DeepseekAttention":
                    continue
                layer_idx = getattr(layer, "layer_idx", n)
                if layer_idx > 0 and site(n, "hidden_in") in tensors:
                    tensors[site(n, "hidden_in")] = tensors[site(n, "hidden_in")] * np.float32(rsf)
                    undone.append(site(n, "hidden_in"))
                if site(n, "hidden_out") in tensors:
                    tensors[site(n, "hidden_out")] = tensors[site(n, "hidden_out")] * np.float32(rsf)
                    undone.append(site(n, "hidden_out"))
            if undone:
                notes.append(
                    "fp16: vLLM's residual stream is scaled by 1/routed_scaling_factor; "
                    f"multiplied back on {', '.join(undone)}"
                )
        if lse_natural and self.lse_base == "2":
            conv = [k for k in tensors if k.endswith(".lse")]
            for k in conv:
                tensors[k] = (tensors[k].astype(np.float64) * np.log(2.0)).astype(np.float32)
            if conv:
                notes.append("lse: the backend returns log2; multiplied by ln 2")
        if weight_sites:
            keep = self.step_sites.get(step, self.keep_sites)
            tensors.update(
                {k: v for k, v in self._weight_sites().items() if keep is None or k.split(".", 1)[1] in keep}
            )
        ordered = {k: np.ascontiguousarray(tensors[k]) for k in sorted(tensors, key=_site_key)}
        if tokens is not None:
            ordered["tokens"] = tokens.astype(np.int64)
        if positions is not None:
            ordered["positions"] = positions.astype(np.int64)
        decode = any(k.endswith((".ql_nope", ".attn_latent")) for k in ordered)
        missing = []
        for n, layer in self.layers:
            for st in HOOKED_STAGES:
                if st in ("q_c", "q_c_normed") and layer.self_attn.q_lora_rank is None:
                    continue
                if st == "idx_topk" and getattr(layer.self_attn, "indexer", None) is None:
                    continue
                if site(n, st) not in ordered:
                    missing.append(site(n, st))
        for k, c in sorted(rec["repeats"].items()):
            notes.append(f"{k}: {c} calls in one forward, the first kept")
        meta = {
            "format": dump_format.FORMAT1,
            "engine": self.engine,
            "dtype": _dtype_name(self.act_dtype) if self.act_dtype is not None else "bf16",
            "rope_order": "interleaved",
            "layout": "token-major",
            "kv_a_order": "latent-rope",
            "model": _model_name(self.root),
            "tp_size": str(self.tp_size),
            "tp_rank": str(self.tp_rank),
            "pp_size": str(self.pp_size),
            "pp_rank": str(self.pp_rank),
            "capture": f"forward #{self.forward_index + step} after arm() "
            f"({'decode' if decode else 'prefill'} step {step}); hooks on "
            f"{type(self.root).__name__} (root), DeepseekV2DecoderLayer, input_layernorm, "
            "self_attn.{fused_qkv_a_proj|q_a_proj|kv_a_proj_with_mqa, q_a_layernorm, "
            "q_b_proj|q_proj, kv_a_layernorm, kv_b_proj, rotary_emb, o_proj}, "
            "post_attention_layernorm, mlp[.shared_experts].{gate_up_proj, act_fn, down_proj}; "
            "MLAAttention.impl.forward_mqa wrapped",
            "hook": f"{HOOK_NAME} (tested with vLLM {TESTED_VLLM})",
            "not_dumped": ",".join(sorted(set(m.split(".", 1)[1] for m in missing)))
            + (
                " (k_nope/v: the decode path never expands the latent)"
                if decode
                else " (ql_nope/attn_latent/lse: computed only for decode tokens)"
            ),
        }
        if self.tp_size > 1:
            meta["sharded_sites"] = ",".join(f"{k}:{v}" for k, v in HEAD_SHARDED.items())
        if positions is not None:
            lens = infer_seq_lens(positions)
            if len(lens) > 1:
                meta["seq_lens"] = ",".join(str(x) for x in lens)
            starts = []
            off = 0
            for ln in lens:
                if positions[off] != 0:
                    starts.append(f"token {off} starts at position {int(positions[off])}")
                off += ln
            if starts:
                notes.append(
                    "sequences not starting at position 0 (prefix cache, a continued "
                    "chunk or a decode step: the earlier context is not in this dump): " + "; ".join(starts)
                )
        notes = list(dict.fromkeys(notes))
        if notes:
            meta["notes"] = " | ".join(notes)
        return ordered, meta

    def _one_rank(self, what: str) -> None:
        if self.tp_size > 1 or self.pp_size > 1:
            raise RuntimeError(
                f"{what} writes format 1, one step of one rank; under tensor or pipeline "
                "parallelism every rank writes format 2 (write_format2, or finish(model_path=...)) "
                "and join_rank_dumps joins the ranks' files"
            )

    def write_dump(self, path, **kw) -> Path:
        self._one_rank("write_dump")
        tensors, meta = self.result(**kw)
        return dump_format.write_format1(path, tensors, meta)

    def fp16_residual_scale(self) -> float | None:
        """The factor vLLM's fp16 path carries in its residual stream, 1/routed_scaling_factor
        (docs/engines.md, "fp16 models"), or None when it runs no such scaling (bf16/f32 activations,
        routed_scaling_factor 1, or only non-MLA DeepseekAttention layers)."""
        if self.act_dtype != _torch().float16:
            return None
        for _, layer in self.layers:
            rsf = float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0)
            if rsf != 1.0 and type(layer.self_attn).__name__ != "DeepseekAttention":
                return 1.0 / rsf
        return None

    def write_format2(
        self,
        path,
        *,
        model_path,
        step_names: list[str] | None = None,
        engine: dict | None = None,
        patches: list[tuple[str, str]] | None = None,
        weights: bool = True,
        extra_meta: dict[str, str] | None = None,
        weight_sites: bool = True,
    ) -> Path:
        """Every recorded step in one file, docs/dump-format.md's format 2.

        Tensors s{k}.L{n}.{stage} (weight sites w.* in step 0 only), s{k}.tokens,
        s{k}.positions and, with weights=True, weights.L{n}.{param} (the WEIGHTS file's
        tensors). The header names the GGUF (`model_path`: size, sha256 of the bytes before the
        tensor data and of each dumped layer's raw tensor bytes), this hook, the engine
        (`engine`: name, version, attention_backend, prefill_backend), the conventions and the
        harness's `patches` [(name, reason) or (name, reason, params)]. Steps: every step holds
        the same sequences in the same order (split by the attention metadata's
        query_start_loc, else where a position does not follow its predecessor); a sequence's
        context is the position of its first new token, which must equal the tokens earlier
        steps computed for it. What the step's attention metadata said is written with it: the
        step fields `num_kv_splits` (the Triton MLA decode's split count) and `page_size`, and
        the tensors `s{k}.block_table` [S, B] int32 and `s{k}.slot_mapping` [T] int64
        (attention_step_info), when the engine had them.
        """
        if self._hooks_fired == 0 or not self.steps:
            raise self._no_capture_error()
        tensors: dict[str, np.ndarray] = {}
        specs, notes, dtypes = [], [], set()
        done_per_seq: list[int] | None = None
        started: set[int] = set()  # sequences with new tokens in a step written so far
        no_hit: set[int] = set()  # prefix-cache hits whose source the recording never saw
        known_ids = getattr(self, "token_ids", None) or {}
        n_seqs = max((len(r["plan"]["seqs"]) for r in self.steps if r.get("plan")), default=0)
        for r in self.steps:
            plan = r.get("plan")
            if plan is not None and len(plan["seqs"]) < n_seqs:  # requests not yet arrived
                plan["seqs"] = plan["seqs"] + [{"new": 0, "context": 0}] * (n_seqs - len(plan["seqs"]))
                bt = r["info"].get("block_table")
                if bt is not None and bt.shape[0] < n_seqs:
                    r["info"]["block_table"] = np.pad(bt, ((0, n_seqs - bt.shape[0]), (0, 0)))
        for k in range(len(self.steps)):
            t, meta = self.result(
                step=k, weight_sites=weight_sites and k == 0, lse_natural=False, residual_natural=False
            )
            dtypes.add(meta["dtype"])
            pos = t.get("positions")
            n_rows = next(
                a.shape[0]
                for name, a in t.items()
                if name.startswith("L") and ".w." not in name and not is_partial_site(name)
            )
            info = self.steps[k].get("info") or {}
            plan = self.steps[k].get("plan")
            if plan is not None:
                lens = [int(x["new"]) for x in plan["seqs"]]
                ctx = [int(x["context"]) for x in plan["seqs"]]
                if sum(lens) != n_rows:
                    raise RuntimeError(f"step {k}: the plan has {sum(lens)} rows, the step {n_rows}")
            else:
                lens = step_seq_lens(info.get("query_start_loc"), pos, n_rows)
                starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(int)
                ctx = [int(pos[a]) if pos is not None else 0 for a in starts]
            if done_per_seq is None:
                done_per_seq = [0] * len(lens)
            if len(lens) != len(done_per_seq):
                raise RuntimeError(
                    f"step {k} has {len(lens)} sequence(s), step 0 had "
                    f"{len(done_per_seq)}: format 2 needs every sequence in every step"
                )
            unrecorded: dict[int, int] = {}
            for i, (c, n) in enumerate(zip(ctx, lens)):
                hit = (plan["seqs"][i].get("prefix") if plan is not None else None) or {}
                if hit and i not in started and int(hit["seq"]) not in started:
                    hit = {}  # a hit on a request never recorded: rebuilt from token ids below
                    no_hit.add(i)
                if hit and done_per_seq[i] == 0 and n > 0:
                    done_per_seq[i] = int(hit["len"])  # a prefix-cache hit: never computed for i
                if c > 0 and n > 0 and not hit and i not in started and c <= len(known_ids.get(i, ())):
                    # the request's first recorded step starts at position c: its positions
                    # 0..c were computed in forwards before the recording (a window, or a
                    # prefix-cache hit on a request never recorded); the reference rebuilds
                    # them from seq{i}.token_ids (docs/dump-format.md, `unrecorded`)
                    unrecorded[i] = c
                    done_per_seq[i] = c
                if c != done_per_seq[i] and n > 0:
                    raise RuntimeError(
                        f"step {k}, sequence {i}: first position {c}, but the recorded "
                        f"steps computed {done_per_seq[i]} of its tokens (a step "
                        "missed, prefix caching, or sequences reordered)"
                    )
                done_per_seq[i] += n
                if n > 0:
                    started.add(i)
            name = (
                step_names[k]
                if step_names and k < len(step_names)
                else plan["name"]
                if plan is not None and plan.get("name")
                else ("prefill" if k == 0 else f"decode-{k}")
                if self.forward_index == 0
                else f"step-{self.forward_index + k}"
            )
            spec: dict[str, Any] = {
                "name": name,
                "seqs": [{"new": int(n), "context": int(c)} for c, n in zip(ctx, lens)],
            }
            for field in ("num_kv_splits", "page_size"):
                if info.get(field) is not None:
                    spec[field] = int(info[field])
            if plan is not None:
                self._plan_fields(spec, plan, done_per_seq)
            for i in no_hit:
                spec["seqs"][i].pop("prefix", None)
            for i, c in unrecorded.items():
                spec["seqs"][i]["unrecorded"] = c
            specs.append(spec)
            totals = [int(c) + int(x) for c, x in zip(ctx, lens) if x > 0]
            for nm in [x for x in t if x.endswith(".idx_topk")]:
                width = topk_width(int(t[nm].shape[1]), totals)
                if width < t[nm].shape[1]:
                    if (t[nm][:, width:] >= 0).any():
                        notes.append(f"{name}: {nm} keeps keys past its longest sequence ({width})")
                    t[nm] = np.ascontiguousarray(t[nm][:, :width])
            for nm, a in t.items():
                if self.heads is not None:
                    a = self._head_subset(nm, a)
                tensors[dump_format.step_tensor(k, nm)] = a
            if info.get("block_table") is not None:
                tensors[dump_format.step_tensor(k, "block_table")] = np.ascontiguousarray(
                    info["block_table"], dtype=np.int32
                )
            if info.get("slot_mapping") is not None:
                tensors[dump_format.step_tensor(k, "slot_mapping")] = np.ascontiguousarray(
                    info["slot_mapping"][:n_rows], dtype=np.int64
                )
            if meta.get("notes"):
                notes.append(f"{name}: {meta['notes']}")
        for i, ids in sorted((getattr(self, "token_ids", None) or {}).items()):
            ids = np.asarray(ids, dtype=np.int64).copy()
            # A token the engine sampled reaches the runner's host copy of the ids only as a
            # placeholder (-1) under async scheduling; the step's own input ids hold it.
            for k, spec in enumerate(specs):
                step_ids = tensors.get(dump_format.step_tensor(k, "tokens"))
                if step_ids is None:
                    continue
                row = sum(sq["new"] for sq in spec["seqs"][:i])
                if i < len(spec["seqs"]):
                    c, a = spec["seqs"][i]["context"], spec["seqs"][i]["new"]
                    if a and c + a <= len(ids):
                        ids[c : c + a] = np.asarray(step_ids[row : row + a], dtype=np.int64)
            tensors[f"seq{int(i)}.token_ids"] = ids
        if weights:
            w, _ = self.weights()
            for nm in sorted(w, key=_site_key):
                tensors[dump_format.weights_tensor(nm)] = w[nm]
        layers = sorted(
            {
                p[0]
                for nm in tensors
                if nm.startswith("s")
                for p in [dump_format.parse_site(nm.split(".", 1)[1])]
                if p is not None
            }
        )
        eng = {
            "name": "vllm",
            "version": self.engine.split()[1] if self.engine.startswith("vllm ") else self.engine,
        }
        eng.update(engine or {})
        header = {
            "model": dump_format.model_identity(model_path, layers),
            "hook": {"name": HOOK_NAME, "version": f"{HOOK_VERSION} (tested with vLLM {TESTED_VLLM})"},
            "engine": eng,
            "dtype": sorted(dtypes)[0] if len(dtypes) == 1 else ",".join(sorted(dtypes)),
            "conventions": {
                "rope_order": "interleaved",
                "layout": "token-major",
                "kv_a_order": "latent-rope",
                "lse_base": self.lse_base,
                "residual_scale": self.fp16_residual_scale(),
            },
            "steps": specs,
            "patches": [patch_entry(x) for x in (patches or [])],
        }
        if self.indexer_quant is not None:
            header["indexer_quant"] = dict(self.indexer_quant)
        act_quant = act_quant_field(eng.get("quantization"), header["dtype"])
        if act_quant is not None:
            header["act_quant"] = act_quant
        kv_quant = kv_cache_quant_field(self.root, header["dtype"])
        if kv_quant is not None:
            header["kv_cache_quant"] = kv_quant
        if self.tp_size > 1:
            header["heads"] = list(self.head_range())
            header["tp"] = {"size": self.tp_size, "rank": self.tp_rank}
        elif self.heads is not None:
            header["heads"] = list(self.heads)
        # a bf16 engine's activations are stored as BF16 (exact, half the bytes)
        return dump_format.write_format2(
            path, tensors, header, notes=notes, extra=extra_meta, bf16_steps=True
        )

    def _head_subset(self, name: str, a: np.ndarray) -> np.ndarray:
        """Heads self.heads of site `name` (`L{n}.{stage}`) when its stage is per head (the
        TP-sharded ones, HEAD_SHARDED, and the context partials; head axis 1 of activations,
        axis 0 of the weight sites, N blocks of equal rows there); other sites whole."""
        parsed = dump_format.parse_site(name)
        if parsed is None:
            return a
        stage = parsed[1]
        axis = HEAD_SHARDED.get(stage, 1 if partial_rank(stage) is not None else None)
        if axis is None or a.ndim <= axis:
            return a
        n = _dims(self.layers[0][1].self_attn).n_local
        if a.shape[axis] % n:
            raise RuntimeError(f"{name}: axis {axis} of shape {a.shape} is not {n} heads")
        per = a.shape[axis] // n
        h0, h1 = self.heads
        return np.ascontiguousarray(np.take(a, np.arange(h0 * per, h1 * per), axis=axis))

    @staticmethod
    def _plan_fields(spec: dict, plan: dict, done: list[int]) -> None:
        """The scheduler's fields of a step (docs/dump-format.md, format 2): `order`, and per
        sequence `kernel`, `prefix`, `context_chunks`; `context_chunk_tokens`."""
        spec["order"] = [int(i) for i in plan["order"]]
        kernel = plan.get("kernel") or {}
        chunks = plan.get("context_chunks") or {}
        for i, sq in enumerate(spec["seqs"]):
            src = plan["seqs"][i]
            if sq["new"] > 0 and i in kernel:
                sq["kernel"] = kernel[i]
            if src.get("prefix") and sq["new"] + sq["context"] > 0:
                sq["prefix"] = {"seq": int(src["prefix"]["seq"]), "len": int(src["prefix"]["len"])}
            if i in chunks:
                sq["context_chunks"] = chunks[i]
        if chunks and plan.get("context_chunk_tokens") is not None:
            spec["context_chunk_tokens"] = int(plan["context_chunk_tokens"])

    def head_range(self) -> tuple[int, int]:
        """The heads `[a, b)` this TP rank computes: `r·N/tp .. (r+1)·N/tp` (vLLM's
        ColumnParallelLinear split of q_b_proj / kv_b_proj by heads)."""
        nl = _dims(self.layers[0][1].self_attn).n_local
        return self.tp_rank * nl, (self.tp_rank + 1) * nl

    def write_steps(
        self, path, *, extra_meta: dict[str, str] | None = None, weight_sites: bool = True
    ) -> list[Path]:
        """Format 1: step 0 (the prefill) to `path`, what `mla-diff compare` reads as format 1;
        decode step k to `<stem>.decode{k}<suffix>` (same names; the cached context they attended
        to is in the earlier files, so format 1 cannot judge them: use write_format2)."""
        if self._hooks_fired == 0 or not self.steps:
            raise self._no_capture_error()
        self._one_rank("write_steps")
        path = Path(path)
        out = []
        for i in range(len(self.steps)):
            tensors, meta = self.result(step=i, weight_sites=weight_sites)
            meta.update(extra_meta or {})
            p = path if i == 0 else path.with_name(f"{path.stem}.decode{i}{path.suffix}")
            if i > 0:
                pos = self.steps[i]["positions"]
                meta["step"] = f"decode {i} of {len(self.steps) - 1}"
                meta["context"] = (
                    f"positions 0..{int(pos[0]) - 1} from the earlier steps "
                    f"({path.name} and its decode files)"
                    if pos is not None
                    else ""
                )
            out.append(dump_format.write_format1(p, tensors, meta))
        return out

    def write_weights(self, path, extra_meta: dict[str, str] | None = None) -> Path:
        tensors, meta = self.weights()
        st_io.save(tensors, Path(path), metadata={**meta, **(extra_meta or {})})
        return Path(path)


def _model_dtype(root):
    torch = _torch()
    for p in root.parameters():
        if p.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return p.dtype
    return None


def _model_name(root) -> str:
    cfg = getattr(root, "config", None)
    name = getattr(cfg, "_name_or_path", "") if cfg is not None else ""
    return str(name) or type(root).__name__


# --------------------------------------------------------------------------------------------
# apply_model / collective_rpc entry points (run inside each worker)
# --------------------------------------------------------------------------------------------


def attach(model_or_worker, **kwargs) -> VllmCapture:
    """Hooks on a model (or worker) in this process: `VllmCapture(model_or_worker, **kwargs)`,
    armed. Run the forwards, then `cap.remove()` and `cap.write_format2(...)` (or write_dump).
    Without numpy, torch or vLLM: ModuleNotFoundError with one line naming the [vllm] extra."""
    require("mla_diff_hooks.vllm.attach", "vllm", ("numpy", "torch", "vllm"))
    return VllmCapture(model_or_worker, **kwargs).arm()


def arm(model_or_worker, **kwargs) -> str:
    """Hooks on (in this worker). kwargs go to VllmCapture. Returns a one-line summary."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.remove()
    _ACTIVE = VllmCapture(model_or_worker, **kwargs).arm()
    c = _ACTIVE
    return (
        f"armed {len(c.layers)} layers, {len(c.handles)} hooks, tp {c.tp_rank}/{c.tp_size}, "
        f"pp {c.pp_rank}/{c.pp_size}"
    )


def finish(
    model_or_worker=None,
    *,
    dump_path,
    weights_path=None,
    num_tokens=None,
    expect_tokens=None,
    weight_sites: bool = True,
    model_path=None,
    engine_info: dict | None = None,
    patches: list[tuple[str, str]] | None = None,
    extra_meta: dict[str, str] | None = None,
    weights: bool = True,
) -> dict:
    """Hooks off; write this rank's dump (and weights). Returns paths and a summary.

    With `model_path` (the GGUF the engine loaded): every recorded step in format 2
    (write_format2: the weights go into the dump as weights.*; `weights=False` leaves them out),
    at any TP: a rank of a TP > 1 run writes `rank_path(dump_path)` with its head range and
    per-rank sites, and join_rank_dumps joins the ranks' files into one. Without `model_path`
    (a model that is no GGUF file): format 1 of the first step, one rank only. All arguments are
    plain values: a process arms and finishes its own rank with them (no callable crosses a
    process boundary).
    """
    global _ACTIVE
    cap = _ACTIVE
    if cap is None:
        raise RuntimeError("finish() without arm() in this process")
    cap.remove()
    _ACTIVE = None
    dp = rank_path(dump_path, cap.tp_rank, cap.tp_size, cap.pp_rank, cap.pp_size)
    if model_path is None and (cap.tp_size > 1 or cap.pp_size > 1):
        raise RuntimeError(
            f"tp {cap.tp_size} / pp {cap.pp_size}: every rank writes format 2, which names the GGUF "
            "the engine loaded: pass model_path"
        )
    if model_path is not None:
        if expect_tokens is not None and cap.steps:
            got = cap.steps[0]["tokens"]
            exp = list(expect_tokens)
            if got is None or got[: len(exp)].tolist() != exp:
                raise RuntimeError(
                    f"captured prefill tokens {None if got is None else got.tolist()} "
                    f"are not the expected {exp} (prefix caching on? request order?)"
                )
        engine = dict(engine_info or backend_names(cap.root))
        quant = quantization_info(cap.root)
        if quant is not None:
            engine.setdefault("quantization", quant)
        cap.write_format2(
            dp,
            model_path=model_path,
            engine=engine,
            patches=patches,
            weight_sites=weight_sites,
            weights=weights,
            extra_meta=extra_meta,
        )
    else:
        cap.write_dump(dp, num_tokens=num_tokens, expect_tokens=expect_tokens, weight_sites=weight_sites)
    res = {
        "dump": str(dp),
        "tp_rank": cap.tp_rank,
        "tp_size": cap.tp_size,
        "pp_rank": cap.pp_rank,
        "pp_size": cap.pp_size,
        "sites": len(cap.steps[0]["t"]) if cap.steps else 0,
        "notes": list(cap.notes),
    }
    if weights_path is not None:
        wp = rank_path(weights_path, cap.tp_rank, cap.tp_size, cap.pp_rank, cap.pp_size)
        cap.write_weights(wp)
        res["weights"] = str(wp)
    return res


def write_weights(
    model_or_worker, *, weights_path, extra_meta: dict[str, str] | None = None, **kwargs
) -> str:
    """Only the WEIGHTS file (no forward needed), with `extra_meta` added to its metadata (e.g.
    the patches a harness applied). kwargs go to VllmCapture. Returns the path this rank wrote."""
    cap = VllmCapture(model_or_worker, **kwargs)
    wp = rank_path(weights_path, cap.tp_rank, cap.tp_size, cap.pp_rank, cap.pp_size)
    cap.write_weights(wp, extra_meta=extra_meta)
    return str(wp)


# --------------------------------------------------------------------------------------------
# joining per-rank files (driver side; needs only numpy)
# --------------------------------------------------------------------------------------------


def _read(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return st_io.load(path)


def _step_site(name: str) -> tuple[int, str] | None:
    """`s{k}.L{n}.{stage}` -> (k, stage); None for any other name."""
    if not name.startswith("s"):
        return None
    step, _, rest = name.partition(".")
    parsed = dump_format.parse_site(rest)
    if not step[1:].isdigit() or parsed is None:
        return None
    return int(step[1:]), parsed[1]


def join_ranks(
    ranks: list[tuple[dict[str, np.ndarray], dict]],
) -> tuple[dict[str, np.ndarray], dict, list[str]]:
    """One format-2 dump from the format-2 dumps of every TP rank of one run.

    `ranks`: (tensors, header) per rank, any order; each header carries `tp = {"size", "rank"}`
    and `heads = [a, b]` (write_format2 at TP > 1). Returns (tensors, header, notes):
      * head-sharded sites (HEAD_SHARDED: q, k_nope, v, attn_out, w.kv_b, ...) concatenated on
        their head axis in rank order, and the SwiGLU sites split by width (FFN_SHARDED:
        ffn_gate, ffn_up, ffn_act) on their columns in rank order: the whole model's values;
      * per-rank sites (`o_proj.rank<r>`, `ffn_gate_up.rank<r>`, `ffn_down.rank<r>`) and the
        loaded weights (`weights.L{n}.{param}.rank<r>`), each from the rank that wrote it;
      * every other site (replicated: hidden_in, o_proj after the all-reduce, ffn_out, ...)
        and tokens/positions from rank 0, a rank that differs named in the notes;
      * the header of rank 0 without `heads`, with `tp = {"size": tp, "heads": [[a, b] of
        rank 0, ...]}`.
    Tensors are ordered step by step in mla-diff's site order, then the weights.
    Errors: ValueError when the ranks are not 0..tp-1 of one size, or their models or steps differ.
    """
    if not ranks:
        raise ValueError("no rank dumps to join")
    info = []
    for t, h in ranks:
        tp = h.get("tp") or {}
        if "rank" not in tp or "size" not in tp or "heads" not in h:
            raise ValueError(
                "a rank dump's header needs tp.rank, tp.size and heads (write_format2 at TP > 1)"
            )
        info.append((int(tp["rank"]), int(tp["size"]), t, h))
    info.sort(key=lambda x: x[0])
    size = info[0][1]
    have = [r for r, *_ in info]
    if have != list(range(size)) or any(s != size for _, s, _, _ in info):
        raise ValueError(
            f"have TP ranks {have} of sizes {sorted({s for _, s, _, _ in info})}, need 0..{size - 1}"
        )
    h0 = info[0][3]
    for field in ("model", "steps"):
        for r, _, _, h in info[1:]:
            if h.get(field) != h0.get(field):
                raise ValueError(f"rank {r}'s header.{field} differs from rank 0's: not one run")
    names: list[str] = []
    seen: set[str] = set()
    for _, _, t, _ in info:
        for k in t:
            if k not in seen:
                seen.add(k)
                names.append(k)
    out: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for name in names:
        held = [(r, t[name]) for r, _, t, _ in info if name in t]
        parsed = _step_site(name)
        stage = parsed[1] if parsed is not None else None
        split = HEAD_SHARDED.get(stage, FFN_SHARDED.get(stage)) if stage is not None else None
        per_rank = name.startswith("weights.") or (
            stage is not None and dump_format.split_rank(stage) is not None
        )
        if per_rank:
            if len(held) > 1 and any(not np.array_equal(a, held[0][1]) for _, a in held[1:]):
                raise ValueError(f"{name}: written by ranks {[r for r, _ in held]} with different values")
            out[name] = held[0][1]
        elif split is not None:
            if len(held) != size:
                notes.append(f"{name}: on ranks {[r for r, _ in held]} only, dropped")
                continue
            out[name] = np.concatenate([a for _, a in held], axis=split)
        else:
            a0 = held[0][1]
            for r, a in held[1:]:
                if a.shape != a0.shape:
                    notes.append(
                        f"{name}: rank {r} has shape {list(a.shape)}, rank 0 {list(a0.shape)}; rank 0 kept"
                    )
                elif not np.array_equal(a, a0):
                    d = float(np.max(np.abs(a.astype(np.float64) - a0.astype(np.float64))))
                    notes.append(f"{name}: rank {r} differs from rank 0 by up to {d:.3g}; rank 0 kept")
            out[name] = a0

    def key(name: str) -> tuple:
        if name.startswith("weights."):
            return (1, 0, _site_key(name[len("weights.") :]))
        step, _, rest = name.partition(".")
        k = int(step[1:]) if step[1:].isdigit() else 0
        tail = {"tokens": 1, "positions": 2}.get(rest, 0)
        return (0, k, (tail, _site_key(rest)))

    ordered = {k: np.ascontiguousarray(out[k]) for k in sorted(out, key=key)}
    header = {k: v for k, v in h0.items() if k != "heads"}
    header["tp"] = {"size": size, "heads": [list(h["heads"]) for _, _, _, h in info]}
    return ordered, header, notes


def join_rank_dumps(paths, out_path, *, extra_meta: dict[str, str] | None = None) -> Path:
    """Join the format-2 dumps every TP rank wrote (finish / write_format2 at TP > 1) into one
    format-2 dump at `out_path` (join_ranks), keeping each rank's notes. Returns the path."""
    import json

    ranks, notes, meta0 = [], [], None
    for p in paths:
        t, meta = _read(p)
        if meta.get("format") != dump_format.FORMAT2:
            raise ValueError(f"{p}: not a `{dump_format.FORMAT2}` dump (format {meta.get('format')!r})")
        h = json.loads(meta["header"])
        ranks.append((t, h))
        rank = (h.get("tp") or {}).get("rank", "?")
        if meta.get("notes"):
            notes.append(f"rank {rank}: {meta['notes']}")
        if rank == 0:
            meta0 = meta
    tensors, header, join_notes = join_ranks(ranks)
    extra = {k: v for k, v in (meta0 or {}).items() if k not in ("format", "header", "notes")}
    extra["joined_from"] = ",".join(Path(p).name for p in paths)
    extra.update(extra_meta or {})
    return dump_format.write_format2(out_path, tensors, header, notes=notes + join_notes, extra=extra)


def merge_weight_files(paths, out_path) -> Path:
    """Union of per-rank WEIGHTS files (names already carry .rank{r})."""
    out: dict[str, np.ndarray] = {}
    meta = None
    for p in paths:
        t, m = _read(p)
        meta = meta or m
        for k, a in t.items():
            if k in out and not np.array_equal(out[k], a):
                raise ValueError(f"{k}: two files disagree")
            out[k] = a
    meta = {k: v for k, v in (meta or {}).items() if k not in ("rank", "pp_rank")}
    meta["merged_from"] = ",".join(Path(p).name for p in paths)
    st_io.save({k: out[k] for k in sorted(out, key=_site_key)}, Path(out_path), metadata=meta)
    return Path(out_path)


# --------------------------------------------------------------------------------------------
# command line: run vLLM's LLM end to end (needs a GPU; on a CPU use mla_diff_hooks.vllm_cpu)
# --------------------------------------------------------------------------------------------

# (name, reason) of the one change --zero-unloaded makes to vLLM's behaviour (recorded in the dump)
ZERO_UNLOADED = (
    "zero-unloaded-weights",
    "a linear layer whose GGUF weight the loader never filled gets an all-zero weight "
    "in the model dtype (UnquantizedLinearMethod) instead of an empty GGUF parameter, so "
    "vLLM loads and runs and the dump shows what a never-loaded weight computes",
)


def zero_unloaded(applied: list) -> None:
    """Patches vllm-gguf-plugin's process_weights_after_loading, in this process: every linear
    layer whose GGUF parameter the loader never filled (an empty `qweight`) gets an all-zero
    weight in the model dtype, and is named on stderr. Without it vLLM 0.26.0 stops at load on
    such a model (MLAAttention.process_weights_after_loading: `size mismatch, ..., vec (0)`)."""
    import torch
    import vllm_gguf_plugin.loader as gl
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    orig = gl.process_weights_after_loading

    def process_weights_after_loading(model, model_config, target_device):
        bad = []
        for name, mod in model.named_modules():
            q = getattr(mod, "qweight", None)
            if q is not None and (isinstance(q, torch.nn.parameter.UninitializedParameter) or q.numel() == 0):
                bad.append((name, mod))
        if bad:
            print(
                "dump_vllm: linear layers the GGUF loader never filled: " + ", ".join(n for n, _ in bad),
                file=sys.stderr,
            )
            for _, mod in bad:
                for attr in ("qweight", "qweight_type"):
                    mod._parameters.pop(attr, None)
                mod.quant_method = UnquantizedLinearMethod()
                mod.weight = torch.nn.Parameter(
                    torch.zeros(
                        int(mod.output_size_per_partition),
                        int(mod.input_size_per_partition),
                        dtype=model_config.dtype,
                        device=target_device,
                    ),
                    requires_grad=False,
                )
            applied.append(ZERO_UNLOADED)
            applied.append(("zeroed", ", ".join(n for n, _ in bad)))
        return orig(model, model_config, target_device)

    gl.process_weights_after_loading = process_weights_after_loading


# (name, reason) of the loader patch that lets vllm-gguf-plugin 0.0.5 load a glm-dsa GGUF
GLM_DSA_NAME_MAP = (
    "glm-dsa-name-map",
    "vllm-gguf-plugin 0.0.5's GGUF-to-HF name map, in-process: GGUFWeightsAdapter.build_name_map "
    "looks the HF config's model_type up among gguf-py's architecture names and renames only "
    "cohere, gemma3_text, deepseek_v2/v3, qwen2/3_moe and minimax_m2, so a GLM-5 config "
    "(glm_moe_dsa) stops at 'Unknown gguf model_type: glm_moe_dsa'; here glm_moe_dsa is taken "
    "as gguf-py's glm-dsa, whose tensor table names the attention, the indexer (wq_b, wk, "
    "k_norm, weights_proj) and the FFN. The weights are the file's own, loaded unchanged",
)
# the model_type of a GLM-5 HF config and the gguf-py architecture it is looked up as
GLM_DSA_MODEL_TYPE, GLM_DSA_ARCH = "glm_moe_dsa", "glm-dsa"


class _ArchNames:
    """gguf-py's MODEL_ARCH_NAMES as build_name_map iterates it (`.items()`), with the
    architecture `glm-dsa` also answering to the HF model_type `glm_moe_dsa`."""

    def __init__(self, names: dict):
        self._names = names

    def items(self):
        for arch, name in self._names.items():
            if name == GLM_DSA_ARCH:
                yield arch, GLM_DSA_MODEL_TYPE
        yield from self._names.items()

    def __getitem__(self, key):
        return self._names[key]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _GgufView:
    """The gguf module as vllm-gguf-plugin's default weights adapter sees it: every name its
    own, MODEL_ARCH_NAMES wrapped in _ArchNames."""

    def __init__(self, module):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "MODEL_ARCH_NAMES", _ArchNames(module.MODEL_ARCH_NAMES))

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def map_glm_dsa_names(applied: list | None = None) -> tuple[str, str]:
    """Apply GLM_DSA_NAME_MAP in this process (before vLLM loads the model): vllm-gguf-plugin's
    default weights adapter module (vllm_gguf_plugin/weights_adapter/default.py) gets a view of
    gguf-py in which `glm_moe_dsa` names the `glm-dsa` architecture, so its build_name_map maps
    a GLM-5 HF config's parameters through gguf-py's glm-dsa tensor table. Idempotent; appends
    the patch to `applied` and returns it. Errors: ImportError without vllm-gguf-plugin."""
    import vllm_gguf_plugin.weights_adapter.default as adapter

    if not isinstance(adapter.gguf, _GgufView):
        adapter.gguf = _GgufView(adapter.gguf)
    if applied is not None and GLM_DSA_NAME_MAP not in applied:
        applied.append(GLM_DSA_NAME_MAP)
    return GLM_DSA_NAME_MAP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "model", help="model path or name for vllm.LLM (a HF folder or a .gguf, which vllm-gguf-plugin loads)"
    )
    ap.add_argument(
        "--hf-config-path",
        default=None,
        help="folder with the HF config.json for a "
        ".gguf (vllm-gguf-plugin needs one; python -m mla_diff_hooks.vllm_cpu config derives it)",
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=0,
        help="also record this many decode steps (format 2: a local .gguf or HF checkpoint folder)",
    )
    ap.add_argument("--tokens", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--dump", required=True, type=Path, help="activation dump to write")
    ap.add_argument("--weights", type=Path, default=None, help="WEIGHTS file to write")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (default 1)")
    ap.add_argument("--dtype", default="auto", help="vllm dtype (default auto)")
    ap.add_argument(
        "--tokenizer", default=None, help="tokenizer (default: none is loaded; the prompt is token ids)"
    )
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM attention backend for the decode (e.g. FLASHMLA, TRITON_MLA; default: vLLM's choice)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="vllm max_model_len (a small value keeps the KV cache small)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm gpu_memory_utilization")
    ap.add_argument(
        "--zero-unloaded",
        action="store_true",
        help="give a linear layer the GGUF "
        "loader never filled an all-zero weight so vLLM runs (recorded in the dump as a "
        "patch); runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    )
    ap.add_argument("--no-weight-sites", action="store_true", help="leave w.* sites out of the dump")
    ap.add_argument("--force", action="store_true", help="overwrite existing outputs")
    args = ap.parse_args()
    for p in (args.dump, args.weights):
        if p is not None and p.exists() and not args.force:
            raise SystemExit(f"{p} exists (use --force to overwrite)")
    ids = [int(x) for x in args.tokens.split(",") if x.strip()]
    # the worker processes unpickle arm/finish by module name, and must accept pickled callables
    os.environ["PYTHONPATH"] = str(PACKAGE_PARENT) + (
        os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
    )
    # under `python -m` this module is __main__: ship the importable module's functions instead
    hooks = importlib.import_module("mla_diff_hooks.vllm")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    applied: list[tuple[str, str]] = []
    if args.zero_unloaded:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patch must be in the engine's process
        zero_unloaded(applied)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=args.model,
        enforce_eager=True,
        enable_prefix_caching=False,
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
    )
    if args.tokenizer:
        kw["tokenizer"] = args.tokenizer
    else:
        kw["skip_tokenizer_init"] = True
    if args.hf_config_path:
        kw["hf_config_path"] = args.hf_config_path
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.gpu_memory_utilization:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    gguf = args.model.endswith(".gguf") and Path(args.model).is_file()
    local = gguf or (Path(args.model) / "config.json").is_file()  # a GGUF or an HF checkpoint folder
    if (args.decode_steps or args.tp > 1) and not local:
        raise SystemExit(
            "--decode-steps and --tp > 1 write format 2, which needs a local .gguf or HF checkpoint folder"
        )
    llm = LLM(**kw)
    print(llm.apply_model(functools.partial(hooks.arm, steps=1 + args.decode_steps)))
    llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=1 + args.decode_steps, temperature=0.0, ignore_eos=True),
    )
    dump_tmp = args.dump if args.tp == 1 else args.dump.with_name(args.dump.stem + ".part" + args.dump.suffix)
    res = llm.apply_model(
        functools.partial(
            hooks.finish,
            dump_path=str(dump_tmp),
            weights_path=None if args.weights is None else str(args.weights),
            expect_tokens=ids,
            weight_sites=not args.no_weight_sites,
            patches=applied or None,
            model_path=str(Path(args.model).resolve()) if local else None,
        )
    )
    if args.tp > 1:
        join_rank_dumps([r["dump"] for r in res], args.dump)
        if args.weights is not None:
            merge_weight_files([r["weights"] for r in res], args.weights)
    for r in res:
        print(r)
    print(f"{args.dump}: written" + (f"; {args.weights}: written" if args.weights else ""))


if __name__ == "__main__":
    run_cli(main, "python -m mla_diff_hooks.vllm", "vllm")
