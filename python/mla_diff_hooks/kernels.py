#!/usr/bin/env python3
"""Run production MLA kernels on inputs exported by `mla-diff run --export-inputs` and write each
kernel's outputs as a format-2 dump that `mla-diff compare` judges against the f64 reference.

Why this exists: the kernels an engine calls (FlashMLA, vLLM's Triton MLA decode, FlashInfer MLA,
FlashAttention-3's prefill) are judged on the same GGUF layer as the reference, each called
through its own Python API, unmodified; `--plant` plants a caller's bug through the arguments
only. Reference (kernels, outputs, plants, `check` and `synth`): docs/engines.md, "Production
kernels".
"""

import argparse
import importlib.util
import json
import math
import os
import sys
import types

from . import dump_format
from ._deps import optional, run_cli
from .dump_format import site, step_tensor

torch = optional("torch", "mla_diff_hooks.kernels", "kernels")

# the kernel runner's name in a dump's header (`header.hook.name`)
HOOK_NAME, HOOK_VERSION = "engine_kernels.py", "1"
KERNELS = ("flashmla", "triton-mla", "flashinfer", "fa3")
PREFILL_KERNELS = ("fa3",)
# The kernels of vLLM's sparse MLA backends, run on a DSA layer's export (its `sparse.*` tensors):
# FLASHMLA_SPARSE's prefill kernel (which it also runs on decode rows with a bf16 cache), its
# sparse decode, and FLASH_ATTN_MLA_SPARSE's FA3 call (sm90's first sparse backend).
SPARSE_KERNELS = ("flashmla-sparse", "flashmla-sparse-decode", "fa3-sparse")
# vLLM's backend name for each, as a dump's `engine.attention_backend`.
SPARSE_BACKENDS = {
    "flashmla-sparse": "FLASHMLA_SPARSE",
    "flashmla-sparse-decode": "FLASHMLA_SPARSE",
    "fa3-sparse": "FLASH_ATTN_MLA_SPARSE",
}
# FlashMLA's sparse kernels read the indices in blocks of B_TOPK (64 for 64 heads, 128 for 128) and
# assert `topk % B_TOPK == 0`; 128 satisfies both, and −1 entries past `topk_length` are never read.
TOPK_ALIGN = 128
PLANTS = ("block-table", "no-yarn", "lse-base2", "phantom")


def die(msg):
    print(f"kernels: {msg}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


class Inputs:
    """`inputs.safetensors` of `mla-diff run --export-inputs` (see docs/dump-format.md)."""

    def __init__(self, path, device):
        if os.path.isdir(path):
            path = os.path.join(path, "inputs.safetensors")
        if not os.path.exists(path):
            die(f"{path}: no such file (make it with `mla-diff run ... --export-inputs DIR`)")
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            self.meta = f.metadata() or {}
            self.t = {k: f.get_tensor(k).to(device) for k in f.keys()}
        if self.meta.get("format") != dump_format.KERNEL_INPUTS:
            die(
                f"{path}: metadata `format` is {self.meta.get('format')!r}, not {dump_format.KERNEL_INPUTS!r}"
            )
        m = self.meta
        self.path = path
        self.scale = float(m["softmax_scale"])
        self.page = int(m["page_size"])
        self.layer = int(m["layer"])
        self.L = int(m["kv_lora_rank"])
        self.R = int(m["qk_rope_head_dim"])
        self.P = int(m["qk_nope_head_dim"])
        self.V = int(m["v_head_dim"])
        a, b = (int(x) for x in m["heads"].split(","))
        self.heads = (a, b)
        self.header = json.loads(m["dump_header"])
        for k in ("decode.q", "decode.kv_cache", "decode.block_table", "decode.cache_seqlens", "hidden_in"):
            if k not in self.t:
                die(f"{path}: tensor `{k}` missing")
        self.q = self.t["decode.q"]  # [T, nh, L+R]
        self.cache = self.t["decode.kv_cache"]  # [blocks, page, L+R]
        self.table = self.t["decode.block_table"].to(torch.int32)  # [T, max_blocks]
        self.seqlens = self.t["decode.cache_seqlens"].to(torch.int32)  # [T]
        T, nh, w = self.q.shape
        if w != self.L + self.R or self.cache.shape[1] != self.page or self.cache.shape[2] != w:
            die(
                f"{path}: decode.q {tuple(self.q.shape)} / decode.kv_cache {tuple(self.cache.shape)} "
                f"do not match L+R = {self.L + self.R}, page {self.page}"
            )
        self.T, self.nh = T, nh
        # Prefill (varlen, causal per sequence): q/k [T, nh, P+R], v [T, nh, V], cu_seqlens [S+1].
        self.pq = self.t.get("prefill.q")
        self.pk = self.t.get("prefill.k")
        self.pv = self.t.get("prefill.v")
        cu = self.t.get("prefill.cu_seqlens")
        self.cu = None if cu is None else cu.to(torch.int32)
        # A DSA layer: the reference's selection, [T, K] (docs/dump-format.md, "Kernel inputs").
        self.topk = int(m["index_topk"]) if "index_topk" in m else None
        if self.topk is not None:
            for k in SPARSE_TENSORS:
                if k not in self.t:
                    die(f"{path}: tensor `{k}` missing (a DSA export has every sparse.* tensor)")
            self.sp_pos = self.t["sparse.topk_indices"].to(torch.int32)  # [T, K] per-request positions
            self.sp_idx = self.t["sparse.indices"].to(torch.int32)  # [T, K] global cache slots
            self.sp_len = self.t["sparse.topk_length"].to(torch.int32)  # [T]
            self.sp_lat = self.t["sparse.expected_latent"]  # [T, nh, L] f64
            self.sp_lse = self.t["sparse.expected_lse"]  # [T, nh] f64
            if tuple(self.sp_idx.shape) != (T, self.topk) or tuple(self.sp_lat.shape) != (T, nh, self.L):
                die(
                    f"{path}: sparse.indices {tuple(self.sp_idx.shape)} / sparse.expected_latent "
                    f"{tuple(self.sp_lat.shape)} do not match T = {T}, K = {self.topk}, nh = {nh}, "
                    f"L = {self.L}"
                )


SPARSE_TENSORS = (
    "sparse.topk_indices",
    "sparse.indices",
    "sparse.topk_length",
    "sparse.expected_latent",
    "sparse.expected_lse",
)


def synth(out_dir, tokens, heads, page, seed, L=512, R=64, P=128, V=128, topk=None):
    """Random inputs in the export layout (one sequence, shuffled pages), for `check` only; with
    `topk`, a DSA layer's: a random selection of at most `topk` causal keys per row and its f64
    attention as the expected output (the `sparse.*` tensors)."""
    g = torch.Generator().manual_seed(seed)
    T = tokens
    q = torch.randn(T, heads, L + R, generator=g)
    rows = torch.randn(T, L + R, generator=g)
    blocks = -(-T // page)
    perm = torch.randperm(blocks, generator=g)
    cache = torch.zeros(blocks, page, L + R)
    for i in range(T):
        cache[perm[i // page], i % page] = rows[i]
    table = perm.to(torch.int32).unsqueeze(0).repeat(T, 1)
    seqlens = torch.arange(1, T + 1, dtype=torch.int32)
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "format": dump_format.KERNEL_INPUTS,
        "softmax_scale": repr((P + R) ** -0.5),
        "page_size": str(page),
        "n_head": str(heads),
        "heads": f"0,{heads}",
        "kv_lora_rank": str(L),
        "qk_rope_head_dim": str(R),
        "qk_nope_head_dim": str(P),
        "v_head_dim": str(V),
        "layer": "0",
        "seqs": str(T),
        "dump_header": json.dumps({"steps": [{"name": "kernel", "seqs": [{"new": T, "context": 0}]}]}),
    }
    from safetensors.torch import save_file

    tensors = {
        "hidden_in": torch.randn(T, 16, generator=g),
        "decode.q": q,
        "decode.kv_cache": cache,
        "decode.block_table": table,
        "decode.cache_seqlens": seqlens,
    }
    if topk is not None:
        meta["index_topk"] = str(topk)
        pos = torch.full((T, topk), -1, dtype=torch.int32)
        for i in range(T):
            keep = torch.randperm(i + 1, generator=g)[:topk].sort().values
            pos[i, : len(keep)] = keep.to(torch.int32)
        slots = torch.where(pos >= 0, perm[pos.clamp(min=0).long() // page] * page + pos % page, -1)
        lat, lse = sparse_reference_f64(q, cache, slots.to(torch.int32), L, (P + R) ** -0.5)
        tensors.update(
            {
                "sparse.topk_indices": pos,
                "sparse.indices": slots.to(torch.int32),
                "sparse.topk_length": (pos >= 0).sum(1).to(torch.int32),
                "sparse.expected_latent": lat,
                "sparse.expected_lse": lse,
            }
        )
    save_file(tensors, os.path.join(out_dir, "inputs.safetensors"), metadata=meta)
    print(
        f"kernels: wrote {out_dir}/inputs.safetensors (T={T}, heads {heads}, page {page}"
        + (f", top-k {topk})" if topk is not None else ")")
    )


# ---------------------------------------------------------------------------------------------
# Loading the kernels from their packages
# ---------------------------------------------------------------------------------------------


def vllm_dir(root):
    d = os.path.join(root, "vllm")
    if not os.path.isdir(d):
        die(f"--vllm-root {root}: no vllm/ directory there (unpack the vLLM wheel's vllm/ files into it)")
    return d


def load_file_module(name, path):
    if not os.path.exists(path):
        die(f"{path}: not found in the vLLM files")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stub_vllm(root):
    """`vllm`, `vllm.platforms` and `vllm.triton_utils` as the Triton files import them; `vllm`'s
    path is the real package directory, so `import vllm._flashmla_C` loads the wheel's extension."""
    import triton
    import triton.language as tl

    pkg = types.ModuleType("vllm")
    pkg.__path__ = [vllm_dir(root)]
    sys.modules.setdefault("vllm", pkg)
    plat = types.ModuleType("vllm.platforms")

    class _Platform:
        @staticmethod
        def is_rocm():
            return False

        @staticmethod
        def is_cuda():
            return True

        @staticmethod
        def fp8_dtype():
            return torch.float8_e4m3fn

    plat.current_platform = _Platform()
    sys.modules["vllm.platforms"] = plat
    tu = types.ModuleType("vllm.triton_utils")
    tu.triton, tu.tl = triton, tl
    sys.modules["vllm.triton_utils"] = tu


def flashmla_module(root):
    stub_vllm(root)
    return load_file_module(
        "flash_mla_interface",
        os.path.join(vllm_dir(root), "third_party", "flashmla", "flash_mla_interface.py"),
    )


def triton_decode_module(root):
    stub_vllm(root)
    return load_file_module(
        "triton_decode_attention",
        os.path.join(vllm_dir(root), "v1", "attention", "ops", "triton_decode_attention.py"),
    )


def triton_merge_module(root):
    stub_vllm(root)
    return load_file_module(
        "triton_merge_attn_states",
        os.path.join(vllm_dir(root), "v1", "attention", "ops", "triton_merge_attn_states.py"),
    )


def fa3_module(root):
    """vLLM's `vllm_flash_attn` package imported from the wheel's files: its `__init__` imports the
    interface, which loads `_vllm_fa3_C` (FA2's extension may be absent; the interface allows it)."""
    stub_vllm(root)
    import importlib

    try:
        return importlib.import_module("vllm.vllm_flash_attn")
    except ImportError as e:
        fai = sys.modules.get("vllm.vllm_flash_attn.flash_attn_interface")
        why = getattr(fai, "FA3_UNAVAILABLE_REASON", None) or str(e)
        die(f"vllm.vllm_flash_attn from {vllm_dir(root)}: FA3 not available: {why}")


def run_fa3(mod, inp, dt, scale):
    """FA3 varlen causal prefill over the export's prefill tensors -> (attn_out [T, nh, V] f32,
    lse [T, nh] f32, natural log)."""
    if inp.pq is None or inp.cu is None:
        die(f"{inp.path}: no prefill.* tensors (export again with this mla-diff)")
    q, k, v = (x.to(dt).contiguous() for x in (inp.pq, inp.pk, inp.pv))
    cu = inp.cu.contiguous()
    max_len = int((cu[1:] - cu[:-1]).max().item())
    out, lse = mod.flash_attn_varlen_func(
        q,
        k,
        v,
        max_len,
        cu,
        max_len,
        cu_seqlens_k=cu,
        softmax_scale=scale,
        causal=True,
        return_softmax_lse=True,
        fa_version=3,
    )
    # FA returns the LSE head-major, [nh, T].
    return out.float(), lse.float().transpose(0, 1).contiguous(), "e"


def vllm_version(root):
    for d in os.listdir(root):
        if d.startswith("vllm-") and d.endswith(".dist-info"):
            return d[len("vllm-") : -len(".dist-info")]
    return "0.26.0"


# ---------------------------------------------------------------------------------------------
# One decode call per kernel: q [T, nh, L+R], cache [blocks, page, L+R], table, seqlens
# -> (latent [T, nh, L] f32, lse [T, nh] f32, lse base)
# ---------------------------------------------------------------------------------------------


def run_flashmla(mod, q, cache, table, seqlens, L, scale):
    sched, _ = mod.get_mla_metadata()
    out, lse = mod.flash_mla_with_kvcache(
        q.unsqueeze(1), cache.unsqueeze(2), table, seqlens, L, sched, None, softmax_scale=scale, causal=False
    )
    return out[:, 0].float(), lse[:, :, 0].float(), "e"


def triton_splits(seqlens):
    """vLLM 0.26's rule (triton_mla.py): next power of 2 of max_seq_len // 512, at most 2·SMs."""
    ideal = 1 << max(0, (max(1, int(seqlens.max()) // 512) - 1).bit_length())
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1
    return min(ideal, 2 * sms)


def run_triton(mod, q, cache, table, seqlens, L, scale, splits=None, phantom=False):
    T, nh, _ = q.shape
    splits = splits or triton_splits(seqlens)
    o = torch.zeros(T, nh, L, dtype=q.dtype, device=q.device)
    lse = torch.zeros(T, nh, dtype=q.dtype, device=q.device)
    logits = torch.empty(T, nh, splits, L + 1, dtype=torch.float32, device=q.device)
    kv = cache.unsqueeze(2)
    mod.decode_attention_fwd(
        q, kv, kv[..., :L], o, lse, table, seqlens, logits, splits, scale, cache.shape[1], is_mla=True
    )
    if phantom:
        # The caller allocated `o`, the kernel wrote it, and the caller returns the zero-filled
        # output buffer it allocated for the layer and never handed to the kernel.
        never_written = torch.zeros_like(o)
        return never_written.float(), lse.float(), "e"
    return o.float(), lse.float(), "e"


def run_flashinfer(q, cache, table, seqlens, L, scale, base_e=False):
    import flashinfer

    T, nh, _ = q.shape
    page = cache.shape[1]
    dev = q.device
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=dev)
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="auto")
    pages = [(int(n) + page - 1) // page for n in seqlens.tolist()]
    kv_indptr = torch.tensor(
        [0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32, device=dev
    )
    kv_indices = torch.cat([table[i, : pages[i]] for i in range(T)]).to(torch.int32)
    qo_indptr = torch.arange(T + 1, dtype=torch.int32, device=dev)
    w.plan(
        qo_indptr,
        kv_indptr,
        kv_indices,
        seqlens,
        nh,
        L,
        q.shape[2] - L,
        page,
        False,
        scale,
        q.dtype,
        cache.dtype,
    )
    out, lse = w.run(
        q[..., :L].contiguous(),
        q[..., L:].contiguous(),
        cache[..., :L].contiguous(),
        cache[..., L:].contiguous(),
        return_lse=True,
        return_lse_base_on_e=base_e,
    )
    return out.float(), lse.float(), ("e" if base_e else "2")


def reference_f64(q, cache, table, seqlens, L, scale):
    """Plain attention in f64 over each row's context (for `check`)."""
    T, nh, w = q.shape
    page = cache.shape[1]
    lat = torch.empty(T, nh, L, dtype=torch.float64, device=q.device)
    lse = torch.empty(T, nh, dtype=torch.float64, device=q.device)
    flat = cache.double().reshape(-1, w)
    for i in range(T):
        n = int(seqlens[i])
        pos = torch.arange(n, device=q.device)
        slots = table[i, pos // page].long() * page + pos % page
        k = flat[slots]  # [n, L+R]
        s = (q[i].double() @ k.T) * scale  # [nh, n]
        lse[i] = torch.logsumexp(s, dim=-1)
        lat[i] = torch.softmax(s, dim=-1) @ k[:, :L]
    return lat, lse


def prefill_reference_f64(inp):
    """Plain causal attention in f64 per sequence over the prefill tensors (for `check`)."""
    q, k, v = inp.pq.double(), inp.pk.double(), inp.pv.double()
    T, nh, _ = q.shape
    out = torch.empty(T, nh, v.shape[2], dtype=torch.float64, device=q.device)
    lse = torch.empty(T, nh, dtype=torch.float64, device=q.device)
    cu = inp.cu.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        s = torch.einsum("ihd,jhd->hij", q[a:b], k[a:b]) * inp.scale  # [nh, n, n]
        n = b - a
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse[a:b] = torch.logsumexp(s, dim=-1).transpose(0, 1)
        out[a:b] = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v[a:b])
    return out, lse


def sparse_reference_f64(q, cache, slots, L, scale):
    """Attention in f64 of every row of `q` [T, nh, L+R] over the cache rows of its slots (`slots`
    [T, K], −1 padding; `cache` viewed as [slots, L+R]) -> (latent [T, nh, L], lse [T, nh])."""
    T, nh, w = q.shape
    flat = cache.double().reshape(-1, w)
    lat = torch.empty(T, nh, L, dtype=torch.float64, device=q.device)
    lse = torch.empty(T, nh, dtype=torch.float64, device=q.device)
    for i in range(T):
        k = flat[slots[i][slots[i] >= 0].long()]  # [n, L+R]
        s = (q[i].double() @ k.T) * scale  # [nh, n]
        lse[i] = torch.logsumexp(s, dim=-1)
        lat[i] = torch.softmax(s, dim=-1) @ k[:, :L]
    return lat, lse


def sparse_plan(kernel, inp, dtype, capability):
    """What `kernel` needs of the export on a device of compute `capability` ((major, minor), or
    None off a GPU), from vLLM 0.26's sparse backends and the kernels' checks. Returns (reason it
    cannot run or None, {"heads": padded head count, "topk": padded index width}, patches: the
    changes a run makes to fit the kernel, as vLLM's backend makes them)."""
    L, R, nh, K = inp.L, inp.R, inp.nh, inp.topk
    if K is None:
        return "the export has no DSA selection (a dense layer: export a deepseek32/glm-dsa layer)", {}, []
    if dtype != "bf16":
        return f"takes bf16 inputs only, not --dtype {dtype}", {}, []
    if kernel == "flashmla-sparse-decode":
        return (
            "FlashMLA's sparse decode reads only the fp8_ds_mla cache (656 bytes per token: "
            "flash_mla_with_kvcache asserts is_fp8_kvcache with indices, vllm/third_party/flashmla/"
            "flash_mla_interface.py); with a bf16 cache vLLM's FLASHMLA_SPARSE sends decode rows "
            "through flash_mla_sparse_fwd (FlashMLASparseImpl._forward_bf16_kv), which flashmla-sparse runs",
            {},
            [],
        )
    if kernel == "flashmla-sparse":
        if capability is not None and capability[0] not in (9, 10):
            return f"FlashMLA sparse runs on sm90/sm100 only, not sm{capability[0]}{capability[1]}", {}, []
        if (L, R) != (512, 64):
            return (
                f"flash_mla_sparse_fwd takes d_qk = 576 and d_v = 512 (L = 512, R = 64: "
                f"FlashMLASparseBackend.get_supported_head_sizes, vllm/v1/attention/backends/mla/"
                f"flashmla_sparse.py); the export has L = {L}, R = {R}",
                {},
                [],
            )
        # FlashMLASparseImpl._bf16_flash_mla_kernel: heads padded to 64 on Hopper (128 on
        # Blackwell) when they are not a multiple of it, which it must divide.
        pad = 128 if capability is not None and capability[0] == 10 else 64
        if nh % pad != 0 and pad % nh != 0:
            return f"{nh} heads neither a multiple nor a divisor of {pad} (vLLM asserts the padding)", {}, []
        heads = nh if nh % pad == 0 else pad
        if heads not in (64, 128):
            return f"{heads} heads: the kernel takes h_q = 64 or 128", {}, []
        topk = -(-K // TOPK_ALIGN) * TOPK_ALIGN
        patches = []
        if heads != nh:
            patches.append(
                {
                    "name": f"pad-heads:{nh}->{heads}",
                    "reason": "flash_mla_sparse_fwd takes 64 or 128 heads; vLLM's FlashMLASparseImpl pads "
                    "the query the same way and drops the padded heads' output",
                }
            )
        if topk != K:
            patches.append(
                {
                    "name": f"pad-topk:{K}->{topk}",
                    "reason": "the kernel reads indices in blocks of 64/128 (topk % B_TOPK == 0); "
                    "the added entries are -1, past topk_length",
                }
            )
        return None, {"heads": heads, "topk": topk}, patches
    if kernel == "fa3-sparse":
        if capability is not None and capability[0] != 9:
            return "FA3's q_v (MLA) mode runs on Hopper only (FLASH_ATTN_MLA_SPARSE: sm90)", {}, []
        # hopper/flash_api.cpp mha_fwd: q_v needs head_size <= 64 and a value head of 256 or more
        # (vLLM 0.26's build refuses L = 64 with "q_v is only supported for hdim_v <= 256.", its
        # check being hdim_v >= 256; L = 512 runs), at most 512 when it differs from head_size;
        # both multiples of 8 for bf16.
        if R > 64 or R % 8 or L < 256 or L > 512 or L % 8:
            return (
                f"FA3 with q_v takes a query/key head of at most 64 and a value head of 256 to 512, "
                f"multiples of 8; the export has R = {R}, L = {L}",
                {},
                [],
            )
        return None, {"heads": nh, "topk": K}, []
    return f"{kernel} is not a sparse kernel", {}, []


def run_flashmla_sparse(mod, inp, plan):
    """`flash_mla_sparse_fwd` as FlashMLASparseImpl._bf16_flash_mla_kernel calls it: the absorbed
    query [T, h, 576] (heads padded with zeros to `plan["heads"]`), the cache as [slots, 1, 576],
    the global indices [T, 1, topk] and `topk_length`. -> (latent [T, nh, L], lse [T, nh], base)."""
    T, nh = inp.T, inp.nh
    q = torch.zeros(T, plan["heads"], inp.L + inp.R, dtype=torch.bfloat16, device=inp.q.device)
    q[:, :nh] = inp.q.to(torch.bfloat16)
    kv = inp.cache.to(torch.bfloat16).reshape(-1, 1, inp.L + inp.R).contiguous()
    idx = torch.full((T, 1, plan["topk"]), -1, dtype=torch.int32, device=q.device)
    idx[:, 0, : inp.topk] = inp.sp_idx
    out, _max_logits, lse = mod.flash_mla_sparse_fwd(
        q, kv, idx, inp.scale, d_v=inp.L, topk_length=inp.sp_len.contiguous()
    )
    return out[:, :nh].float(), lse[:, :nh].float(), "e"


def run_fa3_sparse(mod, inp, plan):
    """FA3 as FlashAttnMLASparseImpl.forward_mqa calls it: one query row per batch entry
    (`cu_seqlens_q` 0..T), `q_rope` as the query, `q_nope` (ql_nope) as `q_v`, the cache as pages
    of one token (`k` its rope part, `v` its latent part), the global indices as the block table
    and the valid counts as `seqused_k`. -> (latent [T, nh, L], lse [T, nh], base)."""
    L, T = inp.L, inp.T
    q = inp.q.to(torch.bfloat16)
    kv = inp.cache.to(torch.bfloat16).contiguous()
    k = kv[:, :, L:].reshape(-1, 1, 1, inp.R)
    v = kv[:, :, :L].reshape(-1, 1, 1, L)
    cu = torch.arange(0, T + 1, dtype=torch.int32, device=q.device)
    out, lse = mod.flash_attn_varlen_func(
        q=q[..., L:].contiguous(),
        k=k,
        v=v,
        q_v=q[..., :L].contiguous(),
        max_seqlen_q=1,
        cu_seqlens_q=cu,
        max_seqlen_k=inp.topk,
        seqused_k=inp.sp_len.contiguous(),
        block_table=inp.sp_idx.contiguous(),
        softmax_scale=inp.scale,
        causal=True,
        return_softmax_lse=True,
        fa_version=3,
    )
    # FA returns the LSE head-major, [nh, T].
    return out.float(), lse.float().transpose(0, 1).contiguous(), "e"


def sparse_judge(inp, lat, lse, base):
    """rel_l2 of a sparse kernel's latent and natural-log LSE against the export's expected ones."""
    nat = lse.double() * (math.log(2.0) if base == "2" else 1.0)
    ref_lat, ref_lse = inp.sp_lat.to(lat.device), inp.sp_lse.to(lat.device)
    rl = ((lat.double() - ref_lat).norm() / ref_lat.norm()).item()
    rs = ((nat - ref_lse).norm() / ref_lse.norm()).item()
    return rl, rs


def call(kernel, mods, inp, q, cache, table, seqlens, scale, args, phantom=False, base_e=False):
    if kernel == "flashmla":
        return run_flashmla(mods["flashmla"], q, cache, table, seqlens, inp.L, scale)
    if kernel == "fa3":
        return run_fa3(mods["fa3"], inp, q.dtype, scale)
    if kernel == "triton-mla":
        return run_triton(mods["triton-mla"], q, cache, table, seqlens, inp.L, scale, args.splits, phantom)
    return run_flashinfer(q, cache, table, seqlens, inp.L, scale, base_e)


def decode(kernel, mods, inp, args):
    """The kernel over every row, with the fault of `--plant` if any. Returns (latent, lse, base)."""
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    q, cache = inp.q.to(dt).contiguous(), inp.cache.to(dt).contiguous()
    table, seqlens = inp.table.contiguous(), inp.seqlens.contiguous()
    scale = inp.scale
    plant = args.plant
    if kernel in PREFILL_KERNELS and plant in ("block-table", "lse-base2", "phantom"):
        die(f"--plant {plant} applies to the decode kernels, not {kernel}")
    if plant == "block-table":
        table = (
            torch.arange(table.shape[1], dtype=torch.int32, device=table.device).expand_as(table).contiguous()
        )
    if plant == "no-yarn":
        scale = (inp.P + inp.R) ** -0.5
    if plant != "lse-base2":
        return call(kernel, mods, inp, q, cache, table, seqlens, scale, args, phantom=plant == "phantom")
    # Split every row's context at a page boundary: keys [0, c) and [c, n), each half one kernel
    # call (the second through the table shifted by c / page), merged by vLLM's merge_attn_states,
    # which expects natural-log LSEs, with FlashInfer's LSEs as it returns them by default (base 2).
    if kernel != "flashinfer":
        die("--plant lse-base2 applies to flashinfer (the kernel whose LSE is base 2 by default)")
    page = inp.page
    c = (seqlens // 2) // page * page
    has_prefix = c > 0
    first = torch.where(has_prefix, c, seqlens).to(torch.int32).contiguous()
    o1, l1, _ = call(kernel, mods, inp, q, cache, table, first, scale, args)
    shift = (c // page).long()
    idx = (torch.arange(table.shape[1], device=table.device).unsqueeze(0) + shift.unsqueeze(1)).clamp(
        max=table.shape[1] - 1
    )
    table2 = torch.gather(table, 1, idx).contiguous()
    second = torch.where(has_prefix, seqlens - c, seqlens).to(torch.int32).contiguous()
    o2, l2, _ = call(kernel, mods, inp, q, cache, table2, second, scale, args)
    out = torch.empty_like(o1)
    # merge_attn_states takes and writes its LSEs head-major, [nh, T].
    head_major = torch.empty(l1.shape[1], l1.shape[0], dtype=l1.dtype, device=l1.device)
    mods["merge"].merge_attn_states(
        out, o1, l1.transpose(0, 1).contiguous(), o2, l2.transpose(0, 1).contiguous(), head_major
    )
    merged_lse = head_major.transpose(0, 1)
    # Rows without a prefix are whole in the first call.
    out = torch.where(has_prefix.view(-1, 1, 1), out, o1)
    merged_lse = torch.where(has_prefix.view(-1, 1), merged_lse, l1)
    # The merge's LSE is what the caller believes natural-log.
    return out, merged_lse, "e"


def load_mods(kernels, root, plant):
    mods = {}
    if "flashmla" in kernels:
        mods["flashmla"] = flashmla_module(root)
    if "flashmla-sparse" in kernels:
        mods["flashmla-sparse"] = flashmla_module(root)
    if "fa3-sparse" in kernels:
        mods["fa3-sparse"] = fa3_module(root)
    if "triton-mla" in kernels:
        mods["triton-mla"] = triton_decode_module(root)
    if "fa3" in kernels:
        mods["fa3"] = fa3_module(root)
    if plant == "lse-base2":
        mods["merge"] = triton_merge_module(root)
    return mods


def kernel_version(kernel, root):
    if kernel == "flashinfer":
        import flashinfer

        return f"flashinfer-python {flashinfer.__version__}"
    return f"vllm {vllm_version(root)}"


def write_dump(path, inp, kernel, root, args, latent, lse, base, fitted=()):
    """The kernel's outputs as a format-2 dump; `fitted`: the patches that made the export fit the
    kernel (a sparse kernel's padding), listed in the header's `patches`."""
    layer = inp.layer
    h = dict(inp.header)
    h["hook"] = {"name": HOOK_NAME, "version": HOOK_VERSION}
    prefill = kernel in PREFILL_KERNELS
    h["engine"] = {
        "name": kernel,
        "version": kernel_version(kernel, root),
        "attention_backend": None if prefill else SPARSE_BACKENDS.get(kernel, kernel),
        "prefill_backend": kernel if prefill else None,
    }
    h["dtype"] = args.dtype
    h["kernel_precision"] = args.dtype
    conv = dict(h.get("conventions") or {})
    conv["lse_base"] = base
    conv.setdefault("layout", "token-major")
    h["conventions"] = conv
    h["heads"] = list(inp.heads)
    patches = list(h.get("patches") or []) + list(fitted)
    if args.plant:
        patches.append(
            {"name": f"plant:{args.plant}", "reason": f"a planted caller bug ({HOOK_NAME} --plant)"}
        )
    h["patches"] = patches
    tensors = {
        site(layer, "hidden_in"): inp.t["hidden_in"],
        site(layer, "attn_out" if prefill else "attn_latent"): latent,
        site(layer, "lse"): lse,
    }
    # One step, float32, stored in name order with json.dumps's default spacing in the header:
    # the layout of the committed kernel dumps (golden/dumps/*.kernel-*).
    arrays = {step_tensor(0, k): tensors[k].float().cpu().contiguous().numpy() for k in sorted(tensors)}
    dump_format.write_format2(path, arrays, h, compact=False)


def cmd_run(args, check_only=False):
    kernels = [k for k in args.kernels.split(",") if k]
    for k in kernels:
        if k not in KERNELS + SPARSE_KERNELS:
            die(f"--kernels: unknown kernel {k!r} (known: {', '.join(KERNELS + SPARSE_KERNELS)})")
    if args.plant and args.plant not in PLANTS:
        die(f"--plant: unknown fault {args.plant!r} (known: {', '.join(PLANTS)})")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cap = torch.cuda.get_device_capability() if dev == "cuda" else None
    inp = Inputs(args.inputs, dev)
    # What runs: a dense kernel on a dense layer's export, a sparse one where the export meets
    # its constraints; the rest is reported as skipped, with the reason, and never faked.
    plans, runnable = {}, []
    for k in kernels:
        if k in SPARSE_KERNELS:
            if args.plant:
                die(f"--plant applies to the dense kernels, not {k}")
            reason, plan, patches = sparse_plan(k, inp, args.dtype, cap)
            plans[k] = (plan, patches)
        elif inp.topk is not None:
            reason = (
                "a dense kernel on a DSA layer's export: the layer attends only to the indexer's "
                f"selection (run {', '.join(SPARSE_KERNELS)})"
            )
        else:
            reason = None
        if reason:
            print(f"kernels: {k}: skipped: {reason}")
        else:
            runnable.append(k)
    mods = load_mods(runnable, args.vllm_root, args.plant)
    if not check_only:
        os.makedirs(args.out, exist_ok=True)
    refs = {}
    for k in runnable:
        if k in SPARSE_KERNELS:
            plan, patches = plans[k]
            run = run_flashmla_sparse if k == "flashmla-sparse" else run_fa3_sparse
            lat, lse, base = run(mods[k], inp, plan)
        else:
            lat, lse, base = decode(k, mods, inp, args)
        if dev == "cuda":
            torch.cuda.synchronize()
        if k in SPARSE_KERNELS:
            rl, rs = sparse_judge(inp, lat, lse, base)
            fit = ", ".join(p["name"] for p in patches) or "no padding"
            print(
                f"{k}: attn_latent rel_l2 {rl:.3e}, lse rel_l2 {rs:.3e} (lse base {base}) against the "
                f"export's f64 attention over the reference's selection (K = {inp.topk}; {fit})"
            )
            if check_only:
                continue
        elif check_only:
            prefill = k in PREFILL_KERNELS
            if prefill not in refs:
                refs[prefill] = (
                    prefill_reference_f64(inp)
                    if prefill
                    else reference_f64(inp.q, inp.cache, inp.table, inp.seqlens, inp.L, inp.scale)
                )
            ref = refs[prefill]
            nat = lse.double() * (math.log(2.0) if base == "2" else 1.0)
            rl = ((lat.double() - ref[0]).norm() / ref[0].norm()).item()
            rs = ((nat - ref[1]).norm() / ref[1].norm()).item()
            what = "attn_out" if prefill else "attn_latent"
            print(f"{k}: {what} rel_l2 {rl:.3e}, lse rel_l2 {rs:.3e} (lse base {base})")
            continue
        name = k + (f".{args.plant}" if args.plant else "")
        path = os.path.join(args.out, f"{name}.safetensors")
        if os.path.exists(path) and not args.force:
            die(f"{path} exists (use --force to overwrite)")
        fitted = plans[k][1] if k in plans else ()
        write_dump(path, inp, k, args.vllm_root, args, lat, lse, base, fitted)
        print(
            f"kernels: {k}: wrote {path} (T={inp.T}, heads {inp.heads[0]}..{inp.heads[1]}, lse base {base})"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "check"):
        p = sub.add_parser(name)
        p.add_argument("inputs", help="the --export-inputs directory (or its inputs.safetensors)")
        if name == "run":
            p.add_argument("out", help="directory for <kernel>.safetensors")
            p.add_argument("--force", action="store_true", help="overwrite existing dumps")
        p.add_argument(
            "--kernels",
            default="flashmla,triton-mla,flashinfer,fa3",
            help=f"comma list of {', '.join(KERNELS + SPARSE_KERNELS)}",
        )
        p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
        p.add_argument(
            "--vllm-root", default=os.environ.get("VLLM_ROOT", "."), help="directory holding vllm/"
        )
        p.add_argument(
            "--splits", type=int, default=None, help="triton-mla num_kv_splits (default: vLLM's rule)"
        )
        p.add_argument("--plant", default=None, help="|".join(PLANTS))
    p = sub.add_parser("synth")
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topk", type=int, default=None, help="a DSA layer's export: keys kept per row")
    args = ap.parse_args()
    if args.cmd == "synth":
        synth(args.out, args.tokens, args.heads, args.page, args.seed, topk=args.topk)
    elif args.cmd == "check":
        cmd_run(args, check_only=True)
    else:
        cmd_run(args)


if __name__ == "__main__":
    run_cli(main, "python -m mla_diff_hooks.kernels", "kernels")
