#!/usr/bin/env python3
"""Test mla_diff_hooks.vllm against a plain-torch mock of vLLM's DeepSeek MLA module tree.

Why a mock: CI installs no vLLM (3.6 GiB of wheels), so this file rebuilds, in plain torch, the
parts of vLLM 0.26.0 that mla_diff_hooks.vllm hooks, with vLLM's module and parameter NAMES and the
forward-call SIGNATURES of its source (model_executor/models/deepseek_v2.py, layers/mla.py,
layers/attention/mla_attention.py, compilation/decorators.py). The real vLLM is exercised by
`python -m mla_diff_hooks.vllm_cpu test` (run by hand).
  DeepseekV3ForCausalLM.model = DeepseekV2Model(embed_tokens, layers, norm), the inner model
      decorated like @support_torch_compile: its __call__ calls self.forward() directly, so a
      hook on it never fires (the real vLLM's behaviour, which the hook must survive: it hooks
      the root, which vLLM's runner calls);
  DeepseekV2DecoderLayer.forward(positions, hidden_states, residual, llama_4_scaling=None)
      -> (hidden_states, residual), with vLLM's fused add + RMSNorm (input_layernorm /
      post_attention_layernorm(x, residual) -> (normed, sum), IN PLACE like the CUDA op) and
      vLLM's fp16 routed_scaling_factor rescale;
  mlp = DeepseekV2MLP(gate_up_proj, act_fn, down_proj) split across TP ranks as vLLM splits it;
  self_attn = DeepseekV2MLAAttention(fused_qkv_a_proj, q_a_layernorm, q_b_proj, kv_a_layernorm,
      kv_b_proj, o_proj, rotary_emb, mla_attn), linears returning (out, bias);
  mla_attn = MultiHeadLatentAttentionWrapper.forward(positions, hidden_states, llama_4_scaling)
      (copied from vLLM: split, q_a_layernorm, q_b_proj, view, rotary written back into q[..., P:]);
  mla_attn.mla_attn = MLAAttention.forward(q, kv_c_normed, k_pe, output_shape) writing a
      caller-allocated output through impl.forward_mha (kv_b_proj(kv_c_normed) -> k_nope | v)
      for a prefill, and for decode tokens the MQA path: ql_nope = q_nope W_UK_T,
      impl.forward_mqa((ql_nope, q_pe), latent cache) -> (o, lse), then o W_UV;
  W_UK_T / W_UV set by process_weights_after_loading: on the MLAAttention layer (newer vLLM) in
      layer 0 and on the impl object (older vLLM) in layer 1, so both lookups are exercised;
  one rotary module SHARED by all layers (vLLM's get_rope cache), interleaved (is_neox_style
      False), rotating in place like the flashinfer path;
  layer 1's kv_b_proj "quantized" (int8 + per-row scale, its own quant_method.apply), so the
      weights are dequantized through the identity-matrix path.
Dims: N=4 heads, H=64, Lq=32, L=32, P=16, R=8, V=16, 2 layers, T=5 tokens as two packed
sequences (3 + 2), bf16.

What is checked (each with its number printed): the dump's names, shapes, metadata; every site
against a float64 recomputation from the dumped input of that step (plus end to end against a
float64 forward from the checkpoint); hidden_in(L1) == hidden_out(L0) bit for bit; the WEIGHTS
file's names, shapes and values (== the mock's parameters; fused_qkv_a_proj split == q_a_proj |
kv_a_proj_with_mqa of the checkpoint; W_UK_T / W_UV == kv_b's rows; dequantized int8 kv_b); the
first forward after arm() is the one recorded; hooks are removed by finish(); TP=2 (two mock ranks
in threads with real all-reduces after o_proj and the MLP's down_proj): format-2 files per rank,
joined by join_rank_dumps == the TP=1 dump, the per-rank partials summing to the reduced sites,
every rank's `.rank{r}` weights, and a rank loading rank 0's gate_up_proj rows (vllm-gguf-plugin
#103) seen in its weights and FFN sites while attention is unchanged; fp16 rescale undone
(format 1) or declared as conventions.residual_scale (format 2);
a clear error when no hook fired. Finally [5] loads the mock
(float32) from golden/models/tiny-v3-f32.gguf (2 dense layers, no YaRN: the mock's layer is the
whole model), dumps two packed sequences and runs `mla-diff compare --map vllm` on the result
(all sites, w.* included, must pass; the same tensors labelled rope_order=hf must fail). The
binary is $MLA_DIFF or target/{release,debug}/mla-diff; without one that has `compare` that last
part is skipped (and says so). [6] records a prefill and two decode steps (steps=3): ql_nope,
attn_latent and lse from the wrapped forward_mqa against a float64 MQA over the dumped cached
context, and the format-2 file (docs/dump-format.md): header (model identity hashes recomputed
here, steps with their contexts, conventions, patches) and tensor names.

Run with a Python that has torch, numpy, safetensors and gguf but NOT vLLM (with vLLM importable,
mla_diff_hooks.vllm dequantizes the mock's int8 layer through vLLM's own helper instead):
    python -m pytest python/tests/test_vllm.py   (each group of checks is one pytest test), or
    python python/tests/vllm_mock.py             (exit 0 = all checks passed)
mla_diff_hooks is imported as installed (pip install), else from this checkout's python/.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the checkout (golden/, target/)
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True  # no __pycache__ left behind
from support import find_mla_diff, hooks_module  # noqa: E402

dump_vllm = hooks_module("vllm")

N, H, LQ, L, P, R, V = 4, 64, 32, 32, 16, 8, 16
N_LAYERS, VOCAB, INTER, EPS, BASE = 2, 50, 48, 1e-6, 10000.0
# the mock's dims (C0: the random-weight tests; the GGUF test builds its own from the file)
C0 = SimpleNamespace(
    N=N,
    H=H,
    LQ=LQ,
    L=L,
    P=P,
    R=R,
    V=V,
    N_LAYERS=N_LAYERS,
    VOCAB=VOCAB,
    INTER=INTER,
    EPS=EPS,
    BASE=BASE,
    name="mock-deepseek-v3",
)
TOKENS = [7, 3, 41, 12, 29]
SEQ_LENS = [3, 2]
POSITIONS = [p for n in SEQ_LENS for p in range(n)]
ENGINE = "vllm 0.0-mock (test_dump_vllm.py)"
CHECKS: list[str] = []


def check(cond: bool, msg: str) -> None:
    print(("  ok   " if cond else "  FAIL ") + msg)
    if not cond:
        raise SystemExit(f"FAILED: {msg}")
    CHECKS.append(msg)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


# ============================================================================================
# the mock vLLM tree
# ============================================================================================

_FORWARD_CONTEXT = SimpleNamespace(attn_metadata=None)  # vllm.forward_context stand-in


@contextlib.contextmanager
def set_forward_context(seq_lens, decode=False):
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(seq_lens)]), dtype=torch.int32)
    n = int(sum(seq_lens))
    _FORWARD_CONTEXT.attn_metadata = SimpleNamespace(
        num_actual_tokens=n,
        num_decode_tokens=n if decode else 0,
        num_decodes=n if decode else 0,
        num_prefills=0 if decode else len(seq_lens),
        query_start_loc=qsl,
    )
    try:
        yield
    finally:
        _FORWARD_CONTEXT.attn_metadata = None


class UnquantizedLinearMethod:
    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class Int8PerRowLinearMethod:
    """Stand-in for a quantized method: int8 weight, one bf16 scale per output row."""

    def apply(self, layer, x, bias=None):
        w = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None]
        return F.linear(x, w, bias)


class LinearBase(nn.Module):
    def __init__(self, in_size, out_size, dtype, *, tp_rank=0, tp_group=None):
        super().__init__()
        self.input_size_per_partition = in_size
        self.output_size_per_partition = out_size
        self.weight = nn.Parameter(torch.zeros(out_size, in_size, dtype=dtype), requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()
        self.return_bias = True
        self.tp_rank, self.tp_group = tp_rank, tp_group

    def forward(self, x):
        return self.quant_method.apply(self, x), None


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    pass


class MergedColumnParallelLinear(ColumnParallelLinear):
    pass


class DeepSeekV2FusedQkvAProjLinear(MergedColumnParallelLinear):
    pass


class RowParallelLinear(LinearBase):
    def __init__(self, *a, reduce_results=True, **kw):
        super().__init__(*a, **kw)
        self.reduce_results = reduce_results

    def forward(self, x):
        out = self.quant_method.apply(self, x)
        if self.tp_group is not None and self.reduce_results:
            out = self.tp_group.all_reduce(self.tp_rank, out)
        return out, None


class FakeTPGroup:
    """All-reduce across mock ranks running in threads: sum in rank order (deterministic)."""

    def __init__(self, size):
        self.size, self.buf, self.barrier = size, [None] * size, threading.Barrier(size)

    def all_reduce(self, rank, x):
        self.buf[rank] = x.float()
        self.barrier.wait()
        s = self.buf[0].clone()
        for b in self.buf[1:]:
            s = s + b
        self.barrier.wait()
        return s.to(x.dtype)


class RMSNorm(nn.Module):
    """vLLM RMSNorm: forward(x) -> normed; forward(x, residual) -> (normed, x + residual), written
    IN PLACE into x and residual like the fused_add_rms_norm CUDA op."""

    def __init__(self, size, dtype, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.variance_epsilon = eps

    def _norm(self, xf, dtype):
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return xf.to(dtype) * self.weight

    def forward(self, x, residual=None):
        if residual is None:
            return self._norm(x.float(), x.dtype)
        s = x.float() + residual.float()
        residual.copy_(s.to(residual.dtype))
        x.copy_(self._norm(residual.float(), x.dtype))
        return x, residual


class DeepseekScalingRotaryEmbedding(nn.Module):
    """GPT-J / interleaved rotation (is_neox_style=False), in place (flashinfer path)."""

    def __init__(self, rotary_dim, base, max_pos=64):
        super().__init__()
        self.head_size = self.rotary_dim = rotary_dim
        self.is_neox_style = False
        inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)

    def _rot(self, x, cos, sin):
        xf = x.float()
        x1, x2 = xf[..., ::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
        return out.to(x.dtype)

    def forward(self, positions, query, key=None, offsets=None):
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        query.copy_(self._rot(query, cos, sin))
        key.copy_(self._rot(key, cos, sin))
        return query, key


class MLACommonImpl:
    """Backend impl (plain object, as in vLLM). forward_mha as in mla/common.py."""

    def __init__(self, c, num_heads, scale, kv_b_proj):
        self.c, self.num_heads, self.scale, self.kv_b_proj = c, num_heads, scale, kv_b_proj
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = c.P, c.R, c.V
        self.kv_lora_rank = c.L

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output):
        P, R, V = self.c.P, self.c.R, self.c.V
        kv_nope = self.kv_b_proj(kv_c_normed)[0].view(-1, self.num_heads, P + V)
        k_nope, v = kv_nope.split([P, V], dim=-1)
        k = torch.empty(*k_nope.shape[:-1], P + R, dtype=k_nope.dtype)
        k[..., :P] = k_nope
        k[..., P:] = k_pe
        qsl = attn_metadata.query_start_loc.tolist()
        outs = []
        for a, b in zip(qsl[:-1], qsl[1:]):
            qs, ks, vs = q[a:b].float(), k[a:b].float(), v[a:b].float()
            logits = torch.einsum("tnd,snd->nts", qs, ks) * self.scale
            mask = torch.ones(b - a, b - a, dtype=torch.bool).tril()
            probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
            outs.append(torch.einsum("nts,snv->tnv", probs, vs))
        output.copy_(torch.cat(outs).to(output.dtype).reshape(output.shape))

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """Decode: q = (ql_nope [B, N, L], q_pe [B, N, R]) against the latent cache [S, L+R] of
        one sequence; returns (o [B, N, L], lse [B, N]) like TritonMLAImpl.forward_mqa."""
        qf = torch.cat(q, -1).float()
        cache = kv_c_and_k_pe_cache.float()
        logits = torch.einsum("bnd,sd->bns", qf, cache) * self.scale
        lse = logits.logsumexp(-1)
        o = torch.einsum("bns,sl->bnl", (logits - lse[..., None]).exp(), cache[:, : self.kv_lora_rank])
        return o.to(q[0].dtype), lse.to(q[0].dtype)


class MLAAttention(nn.Module):
    def __init__(self, c, num_heads, scale, kv_b_proj, holder):
        super().__init__()
        self.c, self.num_heads, self.scale, self.kv_b_proj = c, num_heads, scale, kv_b_proj
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = c.P, c.R, c.V
        self.kv_lora_rank = c.L
        self.impl = MLACommonImpl(c, num_heads, scale, kv_b_proj)
        self.holder = holder  # "layer" (newer vLLM) or "impl" (older vLLM)

    def process_weights_after_loading(self, act_dtype):
        # get_and_maybe_dequant_weights: identity through the layer's own quant method
        c, lin = self.c, self.kv_b_proj
        if isinstance(lin.quant_method, UnquantizedLinearMethod):
            w = lin.weight
        else:
            eye = torch.eye(lin.input_size_per_partition, dtype=act_dtype)
            w = lin.quant_method.apply(lin, eye, bias=None).T
        w = w.T.reshape(c.L, self.num_heads, c.P + c.V)
        W_UK, W_UV = w.split([c.P, c.V], dim=-1)
        target = self if self.holder == "layer" else self.impl
        target.W_UV = W_UV.transpose(0, 1)  # (N, L, V)
        target.W_UK_T = W_UK.permute(1, 2, 0)  # (N, P, L)

    def forward(self, q, kv_c_normed, k_pe, output_shape=None):
        output = torch.empty(output_shape, dtype=q.dtype)
        md = _FORWARD_CONTEXT.attn_metadata
        rows = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], -1)
        if md.num_decode_tokens == 0:  # prefill: the cache restarts (one sequence)
            self.kv_cache = rows.clone()
            self.impl.forward_mha(q, kv_c_normed, k_pe, None, md, None, output=output)
            return output
        # decode, as MLAAttention.forward_impl: absorb W_UK into q, MQA over the latent cache,
        # then W_UV
        self.kv_cache = torch.cat([self.kv_cache, rows])
        holder = self if getattr(self, "W_UK_T", None) is not None else self.impl
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), holder.W_UK_T).transpose(0, 1)
        o, lse = self.impl.forward_mqa((ql_nope, q_pe), self.kv_cache, md, self)
        out = torch.bmm(o.transpose(0, 1), holder.W_UV).transpose(0, 1)
        output.copy_(out.reshape(output.shape))
        return output


class MultiHeadLatentAttentionWrapper(nn.Module):
    def __init__(self, c, num_heads, scale, mods, holder):
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.qk_head_dim = c.P, c.R, c.P + c.R
        self.v_head_dim, self.q_lora_rank, self.kv_lora_rank, self.num_heads = c.V, c.LQ, c.L, num_heads
        for k, m in mods.items():
            setattr(self, k, m)
        self.mla_attn = MLAAttention(c, num_heads, scale, mods["kv_b_proj"], holder)

    def forward(self, positions, hidden_states, llama_4_scaling=None):  # as vllm layers/mla.py
        qkv_lora = self.fused_qkv_a_proj(hidden_states)[0]
        q_c, kv_lora = qkv_lora.split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
        q_c = self.q_a_layernorm(q_c)
        q = self.q_b_proj(q_c)[0]
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c)
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        k_pe = k_pe.unsqueeze(1)
        q[..., self.qk_nope_head_dim :], k_pe = self.rotary_emb(
            positions, q[..., self.qk_nope_head_dim :], k_pe
        )
        if llama_4_scaling is not None:
            q *= llama_4_scaling
        attn_out = self.mla_attn(
            q, kv_c_normed, k_pe, output_shape=(hidden_states.shape[0], self.num_heads * self.v_head_dim)
        )
        return self.o_proj(attn_out)[0]


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, c, dtype, rotary, holder, tp_rank, tp_size, tp_group):
        super().__init__()
        P, R, V, L, LQ, H = c.P, c.R, c.V, c.L, c.LQ, c.H
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.qk_head_dim = P, R, P + R
        self.v_head_dim, self.q_lora_rank, self.kv_lora_rank = V, LQ, L
        self.num_heads, self.num_local_heads = c.N, c.N // tp_size
        self.scaling = (P + R) ** -0.5
        nl = self.num_local_heads
        self.fused_qkv_a_proj = DeepSeekV2FusedQkvAProjLinear(H, LQ + L + R, dtype)
        self.q_a_layernorm = RMSNorm(LQ, dtype, c.EPS)
        self.q_b_proj = ColumnParallelLinear(LQ, nl * (P + R), dtype)
        self.kv_a_layernorm = RMSNorm(L, dtype, c.EPS)
        self.kv_b_proj = ColumnParallelLinear(L, nl * (P + V), dtype)
        self.o_proj = RowParallelLinear(nl * V, H, dtype, tp_rank=tp_rank, tp_group=tp_group)
        self.rotary_emb = rotary
        mods = {
            k: getattr(self, k)
            for k in (
                "fused_qkv_a_proj",
                "q_a_layernorm",
                "q_b_proj",
                "kv_a_layernorm",
                "kv_b_proj",
                "o_proj",
                "rotary_emb",
            )
        }
        self.mla_attn = MultiHeadLatentAttentionWrapper(c, nl, self.scaling, mods, holder)

    def forward(self, positions, hidden_states, llama_4_scaling):
        return self.mla_attn(positions, hidden_states, llama_4_scaling)


class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class DeepseekV2MLP(nn.Module):
    """The dense MLP under TP: gate_up_proj merged-column (this rank's gate columns, then its up
    columns), down_proj row-parallel with the all-reduce."""

    def __init__(self, c, dtype, tp_rank=0, tp_size=1, tp_group=None):
        super().__init__()
        i_r = c.INTER // tp_size
        self.gate_up_proj = MergedColumnParallelLinear(c.H, 2 * i_r, dtype, tp_rank=tp_rank)
        self.down_proj = RowParallelLinear(i_r, c.H, dtype, tp_rank=tp_rank, tp_group=tp_group)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, c, idx, dtype, rotary, holder, tp_rank, tp_size, tp_group, rsf):
        super().__init__()
        self.layer_idx = idx
        self.self_attn = DeepseekV2MLAAttention(c, dtype, rotary, holder, tp_rank, tp_size, tp_group)
        self.mlp = DeepseekV2MLP(c, dtype, tp_rank, tp_size, tp_group)
        self.input_layernorm = RMSNorm(c.H, dtype, c.EPS)
        self.post_attention_layernorm = RMSNorm(c.H, dtype, c.EPS)
        self.routed_scaling_factor = rsf

    def forward(self, positions, hidden_states, residual, llama_4_scaling=None):  # deepseek_v2.py
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, llama_4_scaling)
        if hidden_states.dtype == torch.float16:
            hidden_states *= 1.0 / self.routed_scaling_factor
            if self.layer_idx == 0:
                residual *= 1.0 / self.routed_scaling_factor
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if isinstance(self.mlp, DeepseekV2MLP) and hidden_states.dtype == torch.float16:
            hidden_states *= 1.0 / self.routed_scaling_factor
        return hidden_states, residual


def support_torch_compile(cls):
    """As vllm/compilation/decorators.py: the class gets a __call__ that calls self.forward()
    directly (dispatching to the compiled graph when there is one), so nn.Module hooks registered
    on an instance of it never run."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    cls.__call__ = __call__
    return cls


@support_torch_compile
class DeepseekV2Model(nn.Module):
    def __init__(self, c, dtype, tp_rank, tp_size, tp_group, rsf):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.VOCAB, c.H, dtype=dtype)
        rotary = DeepseekScalingRotaryEmbedding(c.R, c.BASE)  # one instance, shared (get_rope cache)
        holders = ["layer", "impl"]
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(c, i, dtype, rotary, holders[i % 2], tp_rank, tp_size, tp_group, rsf)
            for i in range(c.N_LAYERS)
        )
        self.norm = RMSNorm(c.H, dtype, c.EPS)
        self.start_layer, self.end_layer = 0, c.N_LAYERS

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual, None)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, c, dtype=torch.bfloat16, tp_rank=0, tp_size=1, tp_group=None, rsf=2.5):
        super().__init__()
        self.config = SimpleNamespace(_name_or_path=c.name)
        self.model = DeepseekV2Model(c, dtype, tp_rank, tp_size, tp_group, rsf)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)


# ============================================================================================
# checkpoint and "loader"
# ============================================================================================


def make_checkpoint(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    ck = {"embed": rnd(VOCAB, H, scale=1.0), "norm": 1 + rnd(H, scale=0.1)}
    for n in range(N_LAYERS):
        ck[f"{n}.q_a"] = rnd(LQ, H, scale=H**-0.5)
        ck[f"{n}.kv_a"] = rnd(L + R, H, scale=H**-0.5)
        ck[f"{n}.q_b"] = rnd(N * (P + R), LQ, scale=LQ**-0.5 * 2)
        ck[f"{n}.kv_b"] = rnd(N * (P + V), L, scale=L**-0.5)
        ck[f"{n}.o"] = rnd(H, N * V, scale=(N * V) ** -0.5)
        for nm, size in (("in_norm", H), ("post_norm", H), ("q_a_norm", LQ), ("kv_a_norm", L)):
            ck[f"{n}.{nm}"] = 1 + rnd(size, scale=0.1)
        ck[f"{n}.gate_up"] = rnd(2 * INTER, H, scale=H**-0.5)
        ck[f"{n}.down"] = rnd(H, INTER, scale=INTER**-0.5)
    # layer 1's kv_b as int8 + per-row bf16 scale (quantized); its bf16 dequant is the true weight
    w = ck["1.kv_b"].float()
    scale = (w.abs().amax(1) / 127).to(torch.bfloat16)
    q = torch.clamp(torch.round(w / scale.float()[:, None]), -127, 127).to(torch.int8)
    ck["1.kv_b.int8"], ck["1.kv_b.scale"] = q, scale
    ck["1.kv_b"] = q.to(torch.bfloat16) * scale[:, None]  # what the kernel multiplies by
    return ck


def build_model(
    ck, dtype=torch.bfloat16, tp_rank=0, tp_size=1, tp_group=None, c=C0, gate_up_rank=None
) -> DeepseekV3ForCausalLM:
    """Build the mock and load `ck` the way vLLM's loader does (fused shards 0/1, TP row/col cuts).
    `gate_up_rank`: the rank whose gate_up_proj rows this rank loads (default its own; 0 is what
    vllm-gguf-plugin 0.0.5's merged-column loader does on every rank)."""
    m = DeepseekV3ForCausalLM(c, dtype, tp_rank, tp_size, tp_group)
    N, P, R, V = c.N, c.P, c.R, c.V
    nl = N // tp_size
    heads = slice(tp_rank * nl, (tp_rank + 1) * nl)

    def rows(w, per_head):  # ColumnParallelLinear: this rank's heads' rows
        return w.reshape(N, per_head, -1)[heads].reshape(nl * per_head, -1)

    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(ck["embed"])
        m.model.norm.weight.copy_(ck["norm"])
        for n, layer in enumerate(m.model.layers):
            a = layer.self_attn
            a.fused_qkv_a_proj.weight.copy_(torch.cat([ck[f"{n}.q_a"], ck[f"{n}.kv_a"]]))  # shards 0, 1
            a.q_b_proj.weight.copy_(rows(ck[f"{n}.q_b"], P + R))
            a.o_proj.weight.copy_(ck[f"{n}.o"][:, heads.start * V : heads.stop * V])
            if f"{n}.kv_b.int8" in ck:  # quantized kv_b_proj
                a.kv_b_proj.weight = nn.Parameter(rows(ck[f"{n}.kv_b.int8"], P + V), requires_grad=False)
                a.kv_b_proj.weight_scale = rows(ck[f"{n}.kv_b.scale"][:, None], P + V)[:, 0].contiguous()
                a.kv_b_proj.quant_method = Int8PerRowLinearMethod()
            else:
                a.kv_b_proj.weight.copy_(rows(ck[f"{n}.kv_b"], P + V))
            layer.input_layernorm.weight.copy_(ck[f"{n}.in_norm"])
            layer.post_attention_layernorm.weight.copy_(ck[f"{n}.post_norm"])
            a.q_a_layernorm.weight.copy_(ck[f"{n}.q_a_norm"])
            a.kv_a_layernorm.weight.copy_(ck[f"{n}.kv_a_norm"])
            i_r = c.INTER // tp_size
            g = tp_rank if gate_up_rank is None else gate_up_rank
            gate, up = ck[f"{n}.gate_up"][: c.INTER], ck[f"{n}.gate_up"][c.INTER :]
            layer.mlp.gate_up_proj.weight.copy_(  # shards gate, up: this rank's rows of each
                torch.cat([gate[g * i_r : (g + 1) * i_r], up[g * i_r : (g + 1) * i_r]])
            )
            layer.mlp.down_proj.weight.copy_(ck[f"{n}.down"][:, tp_rank * i_r : (tp_rank + 1) * i_r])
        for layer in m.model.layers:  # process_weights_after_loading
            layer.self_attn.mla_attn.mla_attn.process_weights_after_loading(dtype)
    return m.eval()


def run(model, tokens=TOKENS, seq_lens=SEQ_LENS, start=0, decode=False):
    ids = torch.tensor(tokens, dtype=torch.long)
    pos = torch.tensor([start + p for n in seq_lens for p in range(n)], dtype=torch.long)
    with torch.no_grad(), set_forward_context(seq_lens, decode=decode):
        return model(input_ids=ids, positions=pos)


# ============================================================================================
# float64 reference maths (from docs/mla.md, independent of the mock)
# ============================================================================================


def f64(t) -> np.ndarray:
    return t.detach().to(torch.float64).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)


def rmsnorm(x, w, eps=EPS):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * f64(w)


def rope(x, pos, neox=False, base=BASE):
    x = np.asarray(x, np.float64)
    r = x.shape[-1]
    inv = base ** (-np.arange(0, r, 2) / r)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]  # [T, R/2]
    shp = (len(pos),) + (1,) * (x.ndim - 2) + (r // 2,)
    cos, sin = np.cos(ang).reshape(shp), np.sin(ang).reshape(shp)
    if neox:
        a, b = x[..., : r // 2], x[..., r // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def attention(q, k, v, seq_lens, scale):
    out, off = [], 0
    for n in seq_lens:
        qs, ks, vs = q[off : off + n], k[off : off + n], v[off : off + n]
        lg = np.einsum("tnd,snd->nts", qs, ks) * scale
        lg = np.where(np.tril(np.ones((n, n), bool))[None], lg, -np.inf)
        pr = np.exp(lg - lg.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        out.append(np.einsum("nts,snv->tnv", pr, vs))
        off += n
    return np.concatenate(out)


def mlp(x, n, ck):
    gu = x @ f64(ck[f"{n}.gate_up"]).T
    inter = gu.shape[-1] // 2
    g, u = gu[:, :inter], gu[:, inter:]
    return (g / (1 + np.exp(-g)) * u) @ f64(ck[f"{n}.down"]).T


def full_forward64(ck, tokens=TOKENS, seq_lens=SEQ_LENS, c=C0):
    """Plain float64 forward from the checkpoint: per layer hidden_out."""
    N, L, P, R, V = c.N, c.L, c.P, c.R, c.V
    pos = [p for n in seq_lens for p in range(n)]
    h = f64(ck["embed"])[tokens]
    outs = []
    for n in range(c.N_LAYERS):
        x = rmsnorm(h, ck[f"{n}.in_norm"], c.EPS)
        q_c = rmsnorm(x @ f64(ck[f"{n}.q_a"]).T, ck[f"{n}.q_a_norm"], c.EPS)
        q = (q_c @ f64(ck[f"{n}.q_b"]).T).reshape(-1, N, P + R)
        kv_a = x @ f64(ck[f"{n}.kv_a"]).T
        kv_c = rmsnorm(kv_a[:, :L], ck[f"{n}.kv_a_norm"], c.EPS)
        k_pe = rope(kv_a[:, L:], pos, base=c.BASE)
        kv = (kv_c @ f64(ck[f"{n}.kv_b"]).T).reshape(-1, N, P + V)
        qq = np.concatenate([q[..., :P], rope(q[..., P:], pos, base=c.BASE)], -1)
        kk = np.concatenate([kv[..., :P], np.broadcast_to(k_pe[:, None], (len(pos), N, R))], -1)
        o = attention(qq, kk, kv[..., P:], seq_lens, (P + R) ** -0.5).reshape(-1, N * V)
        h = h + o @ f64(ck[f"{n}.o"]).T
        h = h + mlp(rmsnorm(h, ck[f"{n}.post_norm"], c.EPS), n, ck)
        outs.append(h)
    return outs


# ============================================================================================
# tests
# ============================================================================================


def read(path):
    return dump_vllm._read(path)


def all_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_single_rank(tmp: Path, ck) -> dict:
    print("[1] one rank, bf16, two packed sequences (3 + 2 tokens), via arm()/finish() on a worker")
    model = build_model(ck)
    run(model, tokens=[1, 2, 3, 4, 5, 6], seq_lens=[6])  # warm-up before arm (profile run)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    summary = dump_vllm.arm(worker, engine=ENGINE)
    print("      " + summary)
    run(model)  # recorded
    run(model, tokens=[9, 9, 9, 9, 9], seq_lens=[5])  # ignored (second forward)
    res = dump_vllm.finish(
        worker, dump_path=tmp / "d.safetensors", weights_path=tmp / "w.safetensors", expect_tokens=TOKENS
    )
    check(all_hooks(model) == 0, "finish() removed every hook (0 left)")
    check(
        Path(res["dump"]).name == "d.safetensors" and Path(res["weights"]).name == "w.safetensors",
        f"tp_size 1: files named without rank suffix ({Path(res['dump']).name}, {Path(res['weights']).name})",
    )
    t, meta = read(res["dump"])

    # ---- names, shapes, metadata --------------------------------------------------------
    shapes = {
        "hidden_in": (5, H),
        "attn_in": (5, H),
        "q_c": (5, LQ),
        "q_c_normed": (5, LQ),
        "q": (5, N, P + R),
        "kv_a": (5, L + R),
        "kv_c_normed": (5, L),
        "k_pe": (5, R),
        "q_pe_roped": (5, N, R),
        "k_pe_roped": (5, R),
        "k_nope": (5, N, P),
        "v": (5, N, V),
        "attn_out": (5, N, V),
        "o_proj": (5, H),
        "ffn_in": (5, H),
        "ffn_gate": (5, INTER),
        "ffn_up": (5, INTER),
        "ffn_act": (5, INTER),
        "ffn_out": (5, H),
        "hidden_out": (5, H),
        "w.fused_qkv_a": (LQ + L + R, H),
        "w.kv_b": (N * (P + V), L),
        "w.W_UK_T": (N, P, L),
        "w.W_UV": (N, L, V),
    }
    want = {f"L{n}.{s}" for n in range(N_LAYERS) for s in shapes} | {"tokens", "positions"}
    check(
        set(t) == want,
        f"dump holds exactly the {len(want)} expected tensors "
        f"({len(shapes)} sites x {N_LAYERS} layers + tokens, positions)",
    )
    bad = [(k, t[k].shape) for k in t if k.startswith("L") and t[k].shape != shapes[k.split(".", 1)[1]]]
    check(not bad, f"every site has docs/design.md's shape (mismatches: {bad})")
    check(all(t[k].dtype == np.float32 for k in t if k.startswith("L")), "sites stored as F32")
    check(
        t["tokens"].tolist() == TOKENS and t["positions"].tolist() == POSITIONS,
        f"tokens {t['tokens'].tolist()} / positions {t['positions'].tolist()} are the recorded forward's",
    )
    for k, v in (
        ("format", dump_vllm.dump_format.FORMAT1),
        ("engine", ENGINE),
        ("dtype", "bf16"),
        ("rope_order", "interleaved"),
        ("layout", "token-major"),
        ("kv_a_order", "latent-rope"),
        ("seq_lens", "3,2"),
        ("model", "mock-deepseek-v3"),
        ("tp_size", "1"),
    ):
        check(meta.get(k) == v, f"metadata {k} = {meta.get(k)!r}")
    check(
        "lse" in meta["not_dumped"] and "k_nope" not in meta["not_dumped"],
        f"metadata not_dumped = {meta['not_dumped']!r}",
    )
    check("notes" not in meta, f"no notes on a clean capture ({meta.get('notes')!r})")

    # ---- values, step by step from the dumped inputs ---------------------------------------
    d = {k: f64(v) for k, v in t.items()}
    pos = POSITIONS
    check(
        np.array_equal(t["L0.hidden_in"], f64(ck["embed"])[TOKENS].astype(np.float32)),
        "L0.hidden_in == embed_tokens(tokens) exactly",
    )
    check(
        np.array_equal(t["L1.hidden_in"], t["L0.hidden_out"]),
        "L1.hidden_in == L0.hidden_out bit for bit (fused add + RMSNorm residual handled)",
    )
    tol = 1e-2  # one bf16 rounding of the op's output: ~2^-9 rel per element
    for n in range(N_LAYERS):
        g = lambda s: d[f"L{n}.{s}"]  # noqa: E731, B023 - used in this iteration
        e = {}
        e["attn_in"] = rel(g("attn_in"), rmsnorm(g("hidden_in"), ck[f"{n}.in_norm"]))
        e["q_c"] = rel(g("q_c"), g("attn_in") @ f64(ck[f"{n}.q_a"]).T)
        e["kv_a"] = rel(g("kv_a"), g("attn_in") @ f64(ck[f"{n}.kv_a"]).T)
        e["q_c_normed"] = rel(g("q_c_normed"), rmsnorm(g("q_c"), ck[f"{n}.q_a_norm"]))
        e["q"] = rel(g("q"), (g("q_c_normed") @ f64(ck[f"{n}.q_b"]).T).reshape(-1, N, P + R))
        e["kv_c_normed"] = rel(g("kv_c_normed"), rmsnorm(g("kv_a")[:, :L], ck[f"{n}.kv_a_norm"]))
        e["q_pe_roped"] = rel(g("q_pe_roped"), rope(g("q")[..., P:], pos))
        e["k_pe_roped"] = rel(g("k_pe_roped"), rope(g("k_pe"), pos))
        kv = (g("kv_c_normed") @ f64(ck[f"{n}.kv_b"]).T).reshape(-1, N, P + V)
        e["k_nope"] = rel(g("k_nope"), kv[..., :P])
        e["v"] = rel(g("v"), kv[..., P:])
        qq = np.concatenate([g("q")[..., :P], g("q_pe_roped")], -1)
        kk = np.concatenate([g("k_nope"), np.broadcast_to(g("k_pe_roped")[:, None], (5, N, R))], -1)
        e["attn_out"] = rel(g("attn_out"), attention(qq, kk, g("v"), SEQ_LENS, (P + R) ** -0.5))
        e["o_proj"] = rel(g("o_proj"), g("attn_out").reshape(5, N * V) @ f64(ck[f"{n}.o"]).T)
        h1 = g("hidden_in") + g("o_proj")
        e["hidden_out"] = rel(g("hidden_out"), h1 + mlp(rmsnorm(h1, ck[f"{n}.post_norm"]), n, ck))
        e["ffn_in"] = rel(g("ffn_in"), rmsnorm(h1, ck[f"{n}.post_norm"]))
        gu = f64(ck[f"{n}.gate_up"])
        e["ffn_gate"] = rel(g("ffn_gate"), g("ffn_in") @ gu[:INTER].T)
        e["ffn_up"] = rel(g("ffn_up"), g("ffn_in") @ gu[INTER:].T)
        e["ffn_act"] = rel(g("ffn_act"), g("ffn_gate") / (1 + np.exp(-g("ffn_gate"))) * g("ffn_up"))
        e["ffn_out"] = rel(g("ffn_out"), g("ffn_act") @ f64(ck[f"{n}.down"]).T)
        worst = max(e, key=e.get)
        check(
            all(x < tol for x in e.values()),
            f"L{n}: 18 sites match float64 recomputation from their dumped inputs "
            f"(max rel_l2 {e[worst]:.2e} at {worst}, bound {tol})",
        )
        check(np.array_equal(t[f"L{n}.k_pe"], t[f"L{n}.kv_a"][:, L:]), f"L{n}.k_pe == kv_a[:, L:] exactly")
        neox = rel(g("q_pe_roped"), rope(g("q")[..., P:], pos, neox=True))
        check(neox > 0.2, f"L{n}.q_pe_roped is interleaved, not NeoX (rel_l2 vs NeoX rotation {neox:.2f})")
        check(
            np.array_equal(
                t[f"L{n}.w.fused_qkv_a"], torch.cat([ck[f"{n}.q_a"], ck[f"{n}.kv_a"]]).float().numpy()
            ),
            f"L{n}.w.fused_qkv_a == [q_a | kv_a_mqa] of the checkpoint exactly",
        )
        check(
            np.array_equal(t[f"L{n}.w.kv_b"], ck[f"{n}.kv_b"].float().numpy()),
            f"L{n}.w.kv_b == checkpoint kv_b exactly" + (" (dequantized int8)" if n == 1 else ""),
        )
    ref = full_forward64(ck)
    e2e = [rel(d[f"L{n}.hidden_out"], ref[n]) for n in range(N_LAYERS)]
    check(
        max(e2e) < 3e-2,
        f"end to end: hidden_out vs float64 forward from the checkpoint, rel_l2 "
        f"{', '.join(f'L{n} {x:.2e}' for n, x in enumerate(e2e))} (< 3e-2)",
    )

    # ---- weights file ----------------------------------------------------------------------
    w, wm = read(res["weights"])
    names = [
        "fused_qkv_a_proj",
        "q_a_proj",
        "kv_a_proj_with_mqa",
        "q_b_proj",
        "kv_b_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
        "W_UK_T",
        "W_UV",
    ]
    check(
        set(w) == {f"L{n}.{p}" for n in range(N_LAYERS) for p in names},
        f"weights file holds L{{n}}.{{{','.join(names)}}} for 2 layers ({len(w)} tensors)",
    )
    wshapes = {
        "fused_qkv_a_proj": (LQ + L + R, H),
        "q_a_proj": (LQ, H),
        "kv_a_proj_with_mqa": (L + R, H),
        "q_b_proj": (N * (P + R), LQ),
        "kv_b_proj": (N * (P + V), L),
        "o_proj": (H, N * V),
        "gate_up_proj": (2 * INTER, H),
        "down_proj": (H, INTER),
        "W_UK_T": (N, P, L),
        "W_UV": (N, L, V),
    }
    bad = [(k, w[k].shape) for k in w if w[k].shape != wshapes[k.split(".", 1)[1]]]
    check(
        not bad and all(a.dtype == np.float32 for a in w.values()),
        f"weights are float32 in [out, in] layout with the expected shapes (mismatches: {bad})",
    )
    for n, layer in enumerate(model.model.layers):
        a = layer.self_attn
        for p in ("fused_qkv_a_proj", "q_b_proj", "o_proj") + (("kv_b_proj",) if n == 0 else ()):
            check(
                np.array_equal(w[f"L{n}.{p}"], getattr(a, p).weight.float().numpy()),
                f"L{n}.{p} == the mock's parameter exactly",
            )
        for p in ("gate_up_proj", "down_proj"):
            check(
                np.array_equal(w[f"L{n}.{p}"], getattr(layer.mlp, p).weight.float().numpy()),
                f"L{n}.{p} (mlp) == the mock's parameter exactly",
            )
        check(
            np.array_equal(
                np.concatenate([w[f"L{n}.q_a_proj"], w[f"L{n}.kv_a_proj_with_mqa"]]),
                w[f"L{n}.fused_qkv_a_proj"],
            )
            and np.array_equal(w[f"L{n}.q_a_proj"], ck[f"{n}.q_a"].float().numpy())
            and np.array_equal(w[f"L{n}.kv_a_proj_with_mqa"], ck[f"{n}.kv_a"].float().numpy()),
            f"L{n}: fused_qkv_a_proj split at Lq={LQ} == q_a_proj | kv_a_proj_with_mqa of the checkpoint",
        )
        kvb = w[f"L{n}.kv_b_proj"].reshape(N, P + V, L)
        check(
            np.array_equal(w[f"L{n}.W_UK_T"], kvb[:, :P, :])
            and np.array_equal(w[f"L{n}.W_UV"], kvb[:, P:, :].transpose(0, 2, 1)),
            f"L{n}: W_UK_T[h,p,l] == kv_b[h(P+V)+p, l] and W_UV[h,l,v] == kv_b[h(P+V)+P+v, l]",
        )
    dq = (ck["1.kv_b.int8"].to(torch.bfloat16) * ck["1.kv_b.scale"][:, None]).float().numpy()
    check(
        np.array_equal(w["L1.kv_b_proj"], dq),
        "L1.kv_b_proj (int8 + scale) dequantized through "
        "quant_method.apply(identity) == int8 x scale in bf16, exactly",
    )
    check(
        wm.get("quantized") == "L1.kv_b_proj"
        and "Int8PerRowLinearMethod via quant_method.apply" in wm["dequant"],
        f"weights metadata quantized={wm.get('quantized')!r}, dequant={wm.get('dequant')!r}",
    )
    check(
        "q_a_proj" in wm["derived"] and wm["tp_size"] == "1" and wm["rank"] == "0" and wm["engine"] == ENGINE,
        f"weights metadata derived/tp_size/rank/engine ({wm['derived']!r})",
    )
    check(
        wm["w_uk_t_holder"] == "self_attn.mla_attn.mla_attn,self_attn.mla_attn.mla_attn.impl",
        "W_UK_T found on the MLAAttention layer (newer vLLM) and on its impl (older): "
        f"{wm['w_uk_t_holder']!r}",
    )
    return t


def _run_ranks(models) -> None:
    group = models[0].model.layers[0].self_attn.o_proj.tp_group
    errs = []

    def go(m):
        try:
            run(m)
        except BaseException as ex:  # noqa: BLE001
            errs.append(ex)
            group.barrier.abort()

    th = [threading.Thread(target=go, args=(m,)) for m in models]
    for x in th:
        x.start()
    for x in th:
        x.join()
    check(not errs, f"both ranks ran ({errs})")


def _tp2_dump(tmp: Path, ck, name: str, gate_up_rank=None) -> tuple[list[Path], Path]:
    """Two mock ranks in threads (o_proj and down_proj all-reduce), each written in format 2 by
    write_format2, then joined by join_rank_dumps. Returns (rank files, joined file)."""
    group = FakeTPGroup(2)
    models = [
        build_model(ck, tp_rank=r, tp_size=2, tp_group=group, gate_up_rank=gate_up_rank) for r in range(2)
    ]
    caps = [dump_vllm.VllmCapture(m, tp_rank=r, tp_size=2, engine=ENGINE).arm() for r, m in enumerate(models)]
    _run_ranks(models)
    gguf_path = ROOT / "golden" / "models" / "tiny-v3-f32.gguf"  # any GGUF: the identity is not judged here
    paths = []
    for c in caps:
        c.remove()
        paths.append(c.write_format2(dump_vllm.rank_path(tmp / name, c.tp_rank, 2), model_path=gguf_path))
    return paths, dump_vllm.join_rank_dumps(paths, tmp / name)


def test_tp2(tmp: Path, ck, tp1: dict) -> None:
    print("[2] tensor parallel 2: two mock ranks in threads, format 2 per rank, joined")
    paths, joined = _tp2_dump(tmp, ck, "tp.safetensors")
    check(
        [p.name for p in paths] == ["tp.rank0.safetensors", "tp.rank1.safetensors"],
        f"per-rank dumps {[p.name for p in paths]}",
    )
    r1, m1 = read(paths[1])
    h1 = json.loads(m1["header"])
    check(
        r1["s0.L0.q"].shape == (5, 2, P + R)
        and r1["s0.L0.ffn_gate"].shape == (5, INTER // 2)
        and r1["s0.L0.ffn_gate_up.rank1"].shape == (5, INTER)
        and h1["heads"] == [2, 4]
        and h1["tp"] == {"size": 2, "rank": 1},
        f"rank 1 holds its heads 2..4 and its I/2 FFN columns (header heads {h1['heads']}, tp {h1['tp']})",
    )
    t, meta = read(joined)
    h = json.loads(meta["header"])
    check(
        h["tp"] == {"size": 2, "heads": [[0, 2], [2, 4]]} and "heads" not in h,
        f"joined header: tp {h['tp']}, no heads (every head is in the gathered sites)",
    )
    s0 = {k[3:]: v for k, v in t.items() if k.startswith("s0.")}
    ranked = {k for k in s0 if ".rank" in k}
    want_ranked = {
        f"L{n}.{s}.rank{r}"
        for n in range(N_LAYERS)
        for s in ("o_proj", "ffn_gate_up", "ffn_down")
        for r in (0, 1)
    }
    check(ranked == want_ranked, f"per-rank sites o_proj/ffn_gate_up/ffn_down .rank0/.rank1 ({len(ranked)})")
    rest = {k: v for k, v in s0.items() if k not in ranked}
    check(
        set(rest) == set(tp1) and all(rest[k].shape == tp1[k].shape for k in rest),
        f"joined step 0 has the TP=1 dump's {len(rest)} names and shapes besides the per-rank sites",
    )
    check("notes" not in meta, f"replicated sites agree across ranks (join notes: {meta.get('notes')!r})")
    exact = [
        f"L{n}.{s}" for n in range(N_LAYERS) for s in ("w.fused_qkv_a", "w.kv_b", "w.W_UK_T", "w.W_UV")
    ] + [
        f"L0.{s}"
        for s in ("hidden_in", "attn_in", "q_c", "q_c_normed", "kv_a", "kv_c_normed", "k_pe", "k_pe_roped")
    ]
    check(
        all(np.array_equal(rest[k], tp1[k]) for k in exact),
        f"{len(exact)} replicated / weight sites equal the TP=1 dump exactly (head blocks in rank order)",
    )
    worst = max((rel(rest[k], tp1[k]), k) for k in rest if k.startswith("L"))
    # bf16: each rank's partial is rounded before the all-reduce sums it, TP=1 rounds the full sum
    # once; L1 compounds L0's difference (measured: 1.2e-2 at L1.ffn_out)
    check(
        worst[0] < 3e-2,
        f"every joined site within rel_l2 {worst[0]:.2e} of TP=1 (worst {worst[1]}; "
        "the all-reduces sum bf16 partials)",
    )
    for n in range(N_LAYERS):
        g = lambda k: s0[f"L{n}.{k}"].astype(np.float64)  # noqa: E731, B023
        i2 = INTER // 2
        check(
            all(
                np.array_equal(
                    s0[f"L{n}.ffn_gate_up.rank{r}"][:, :i2], s0[f"L{n}.ffn_gate"][:, r * i2 : (r + 1) * i2]
                )
                and np.array_equal(
                    s0[f"L{n}.ffn_gate_up.rank{r}"][:, i2:], s0[f"L{n}.ffn_up"][:, r * i2 : (r + 1) * i2]
                )
                for r in (0, 1)
            ),
            f"L{n}: ffn_gate_up.rank{{r}} == [gate cols r·I/2.. | up cols r·I/2..] of the gathered sites",
        )
        e_o = rel(g("o_proj.rank0") + g("o_proj.rank1"), g("o_proj"))
        e_d = rel(g("ffn_down.rank0") + g("ffn_down.rank1"), g("ffn_out"))
        check(
            e_o < 1e-2 and e_d < 1e-2,
            f"L{n}: the partials before the all-reduce sum to o_proj ({e_o:.1e}) and ffn_out ({e_d:.1e})",
        )
    w = {k[len("weights.") :]: v for k, v in t.items() if k.startswith("weights.")}
    gate, up = ck["0.gate_up"].float().numpy()[:INTER], ck["0.gate_up"].float().numpy()[INTER:]
    i2 = INTER // 2
    check(
        np.array_equal(w["L0.gate_up_proj.rank1"], np.concatenate([gate[i2:], up[i2:]]))
        and np.array_equal(w["L0.down_proj.rank1"], ck["0.down"].float().numpy()[:, i2:])
        and np.array_equal(
            w["L0.q_b_proj.rank1"], ck["0.q_b"].float().numpy().reshape(N, P + R, LQ)[2:].reshape(-1, LQ)
        )
        and np.array_equal(w["L0.o_proj.rank1"], ck["0.o"].float().numpy()[:, 2 * V :]),
        "weights.L0.{gate_up,down,q_b,o}_proj.rank1 hold rank 1's slices (gate_up: gate, up rows I/2..)",
    )
    check(
        sum(1 for k in w if k.endswith(".rank0")) == sum(1 for k in w if k.endswith(".rank1")) > 0,
        f"every rank's weights are in the joined dump ({len(w)} tensors)",
    )

    print("[2b] the same with every rank loading rank 0's gate_up_proj rows (vllm-gguf-plugin#103)")
    _, bad = _tp2_dump(tmp, ck, "tp-rank0.safetensors", gate_up_rank=0)
    tb, _ = read(bad)
    wb = {k[len("weights.") :]: v for k, v in tb.items() if k.startswith("weights.")}
    check(
        np.array_equal(wb["L0.gate_up_proj.rank1"], wb["L0.gate_up_proj.rank0"])
        and np.array_equal(wb["L0.down_proj.rank1"], w["L0.down_proj.rank1"]),
        "rank 1's loaded gate_up_proj is rank 0's slice; its down_proj is its own",
    )
    e_gate = rel(tb["s0.L0.ffn_gate"], t["s0.L0.ffn_gate"])
    e_out = rel(tb["s0.L0.ffn_out"], t["s0.L0.ffn_out"])
    e_o = rel(tb["s0.L0.o_proj"], t["s0.L0.o_proj"])
    check(
        e_o == 0.0 and e_gate > 0.3 and e_out > 0.3,
        f"attention unchanged (o_proj rel_l2 {e_o}); ffn_gate {e_gate:.2f}, ffn_out {e_out:.2f} off",
    )


def test_fp16(tmp: Path, ck) -> None:
    print("[3] fp16: vLLM's residual stream is scaled by 1/routed_scaling_factor (2.5)")
    model = build_model(ck, dtype=torch.float16)
    cap = dump_vllm.VllmCapture(model, engine=ENGINE).arm()
    run(model)
    cap.remove()
    t, meta = cap.result()
    raw = dump_vllm.VllmCapture(model, engine=ENGINE, undo_fp16_residual_scaling=False).arm()
    run(model)
    raw.remove()
    t_raw, _ = raw.result()
    ref = full_forward64(ck)
    e = rel(t["L1.hidden_out"], ref[1])
    ratio = float(np.linalg.norm(t_raw["L1.hidden_out"]) / np.linalg.norm(ref[1]))
    check(
        meta["dtype"] == "f16" and "fp16" in meta.get("notes", ""),
        f"metadata dtype f16, note {meta.get('notes')!r}",
    )
    check(
        e < 3e-2 and abs(ratio - 1 / 2.5) < 0.02,
        f"rescale undone: L1.hidden_out rel_l2 {e:.2e} vs f64 "
        f"(raw vLLM stream norm ratio {ratio:.3f} = 1/2.5)",
    )
    check(
        np.array_equal(t["L0.hidden_in"], t_raw["L0.hidden_in"])
        and np.allclose(t["L1.hidden_in"], t["L0.hidden_out"]),
        "L0.hidden_in untouched (taken before the scale); L1.hidden_in == L0.hidden_out after undo",
    )
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("  skip format 2 (no gguf-py for the model identity)")
        return
    import json

    out = cap.write_format2(
        tmp / "f16.safetensors", model_path=ROOT / "golden" / "models" / "tiny-v3-f32.gguf"
    )
    t2, meta2 = read(out)
    conv = json.loads(meta2["header"])["conventions"]
    check(
        conv["residual_scale"] == 1 / 2.5
        and all(
            np.array_equal(t2[f"s0.{k}"], t_raw[k]) for k in ("L0.hidden_in", "L1.hidden_in", "L1.hidden_out")
        ),
        "format 2: vLLM's values kept, conventions.residual_scale = "
        f"{conv['residual_scale']} (1/2.5) declared",
    )
    t32 = dump_vllm.VllmCapture(build_model(ck, dtype=torch.float32), engine=ENGINE)
    check(t32.fp16_residual_scale() is None, "f32 activations: no residual scale to declare")


def test_no_forward(tmp: Path, ck) -> None:
    print("[4] no forward between arm() and finish() (e.g. a compiled graph): clear error")
    model = build_model(ck)
    dump_vllm.arm(model, engine=ENGINE)
    try:
        dump_vllm.finish(model, dump_path=tmp / "none.safetensors")
    except RuntimeError as ex:
        check(
            "enforce_eager=True" in str(ex) and not (tmp / "none.safetensors").exists(),
            f"RuntimeError, nothing written: {str(ex)[:70]}...",
        )
    else:
        check(False, "finish() without a forward should raise")
    check(all_hooks(model) == 0, "hooks removed even so")
    fired = []
    h = model.model.register_forward_pre_hook(lambda *a: fired.append(1))
    run(model)
    h.remove()
    check(
        not fired,
        "a hook on the inner DeepseekV2Model never fires (@support_torch_compile's "
        "__call__ calls forward() directly): the capture hooks the root instead",
    )
    for layer in model.model.layers:  # a tree that moved a name the hook relies on
        layer.self_attn.mla_attn.mla_attn.impl.forward_mqa = None
        del layer.self_attn.kv_a_layernorm
    cap = dump_vllm.VllmCapture(model, engine=ENGINE)
    check(
        cap.version_msg is not None
        and "tested with vLLM 0.26.0" in cap.version_msg
        and "DeepseekV2MLAAttention.kv_a_layernorm" in cap.version_msg
        and "impl.forward_mqa" in cap.version_msg
        and cap.version_msg in cap.notes,
        f"another layout: says what it was tested with and what it lacks: {cap.version_msg[:90]}...",
    )


def test_decode_steps(tmp: Path, ck) -> None:
    print(
        "[6] prefill + 2 decode steps (f32, one sequence): ql_nope / attn_latent / lse around "
        "forward_mqa, format 2"
    )
    model = build_model(ck, dtype=torch.float32)
    cap = dump_vllm.VllmCapture(model, steps=3, engine=ENGINE).arm()
    prompt, dec = [7, 3, 41, 12], [29, 5]
    run(model, tokens=prompt, seq_lens=[len(prompt)])
    for i, tok in enumerate(dec):
        run(model, tokens=[tok], seq_lens=[1], start=len(prompt) + i, decode=True)
    run(model, tokens=[9], seq_lens=[1], start=6, decode=True)  # a 4th forward: ignored
    cap.remove()
    check(
        all_hooks(model) == 0
        and all(
            "forward_mqa" not in vars(layer.self_attn.mla_attn.mla_attn.impl) for layer in model.model.layers
        ),
        "remove(): hooks gone and forward_mqa unwrapped",
    )
    check(len(cap.steps) == 3, f"3 steps recorded of {cap.forwards} forwards")
    t1, m1 = cap.result(step=1)
    shapes = {k: t1[k].shape for k in ("L0.ql_nope", "L0.attn_latent", "L0.lse", "L1.lse")}
    check(
        shapes == {"L0.ql_nope": (1, N, L), "L0.attn_latent": (1, N, L), "L0.lse": (1, N), "L1.lse": (1, N)}
        and "L0.k_nope" not in t1,
        f"decode step: ql_nope/attn_latent/lse dumped, k_nope/v not (never computed): {shapes}",
    )
    t0, _ = cap.result(step=0)
    check(not any(k.endswith((".ql_nope", ".lse")) for k in t0), "prefill step: no decode-only sites")
    worst = {}
    for k in (1, 2):
        tk, _ = cap.result(step=k)
        steps = [cap.result(step=j)[0] for j in range(k + 1)]
        for n, layer in enumerate(model.model.layers):
            a = layer.self_attn.mla_attn.mla_attn
            hold = a if getattr(a, "W_UK_T", None) is not None else a.impl
            wk, wv = f64(hold.W_UK_T), f64(hold.W_UV)
            kv = np.concatenate([f64(st[f"L{n}.kv_c_normed"]) for st in steps])
            kp = np.concatenate([f64(st[f"L{n}.k_pe_roped"]) for st in steps])
            q, qpe = f64(tk[f"L{n}.q"]), f64(tk[f"L{n}.q_pe_roped"])
            ql = np.einsum("tnp,npl->tnl", q[..., :P], wk)
            sc = (np.einsum("tnl,sl->tns", ql, kv) + np.einsum("tnr,sr->tns", qpe, kp)) * (P + R) ** -0.5
            lse = np.log(np.exp(sc).sum(-1))
            lat = np.einsum("tns,sl->tnl", np.exp(sc - lse[..., None]), kv)
            for site, ref in (
                ("ql_nope", ql),
                ("lse", lse),
                ("attn_latent", lat),
                ("attn_out", np.einsum("tnl,nlv->tnv", lat, wv)),
            ):
                worst[site] = max(worst.get(site, 0), rel(tk[f"L{n}.{site}"], ref))
    check(
        max(worst.values()) < 1e-5,
        "decode sites vs float64 over the cached context from the "
        "dumped steps: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()),
    )
    gguf_path = ROOT / "golden" / "models" / "tiny-v3-f32.gguf"
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("  skip format 2 (no gguf-py for the model identity)")
        return
    out = cap.write_format2(
        tmp / "f2.safetensors",
        model_path=gguf_path,
        engine={"attention_backend": "MOCK_MLA"},
        patches=[("mock", "a test")],
    )
    t, meta = read(out)
    import hashlib
    import json

    h = json.loads(meta["header"])
    raw = gguf_path.read_bytes()
    rd = gguf.GGUFReader(str(gguf_path))
    want_l0 = hashlib.sha256(
        b"".join(
            raw[x.data_offset : x.data_offset + x.n_bytes] for x in rd.tensors if x.name.startswith("blk.0.")
        )
    ).hexdigest()
    check(
        meta["format"] == dump_vllm.dump_format.FORMAT2
        and h["model"]["file"] == "tiny-v3-f32.gguf"
        and h["model"]["bytes"] == len(raw)
        and h["model"]["index_sha256"] == hashlib.sha256(raw[: rd.data_offset]).hexdigest()
        and h["model"]["layer_sha256"]["0"] == want_l0
        and set(h["model"]["layer_sha256"]) == {"0", "1"},
        "format 2 header: model file, bytes, index and layer sha256 (recomputed here)",
    )
    check(
        [(st["name"], st["seqs"]) for st in h["steps"]]
        == [
            ("prefill", [{"new": 4, "context": 0}]),
            ("decode-1", [{"new": 1, "context": 4}]),
            ("decode-2", [{"new": 1, "context": 5}]),
        ],
        f"format 2 steps: {[(st['name'], st['seqs']) for st in h['steps']]}",
    )
    check(
        h["conventions"]
        == {
            "rope_order": "interleaved",
            "layout": "token-major",
            "kv_a_order": "latent-rope",
            "lse_base": "e",
            "residual_scale": None,
        }
        and h["patches"] == [{"name": "mock", "reason": "a test"}]
        and h["engine"]["attention_backend"] == "MOCK_MLA"
        and h["hook"]["name"] == "dump_vllm.py",
        "format 2 conventions, patches, engine, hook",
    )
    check(
        np.array_equal(t["s1.L0.lse"], t1["L0.lse"])
        and "s0.L0.w.kv_b" in t
        and "s1.L0.w.kv_b" not in t
        and "weights.L0.kv_b_proj" in t
        and t["s2.positions"].tolist() == [5],
        "format 2 tensors: s{k}.L{n}.{stage}, weight sites in step 0, weights.L{n}.{param}, s{k}.positions",
    )
    # The same forwards recorded from the first decode on (a window: the prefill's positions are
    # `unrecorded`, rebuilt by mla-diff from the token ids) with heads 1..3 of the per-head sites.
    model = build_model(ck, dtype=torch.float32)
    win = dump_vllm.VllmCapture(model, forward_index=1, steps=2, heads=(1, 3), engine=ENGINE).arm()
    run(model, tokens=prompt, seq_lens=[len(prompt)])
    for i, tok in enumerate(dec):
        run(model, tokens=[tok], seq_lens=[1], start=len(prompt) + i, decode=True)
    win.remove()
    win.token_ids = {0: prompt + dec}
    out = win.write_format2(tmp / "window.safetensors", model_path=gguf_path, weights=False)
    tw, mw = read(out)
    hw = json.loads(mw["header"])
    check(
        hw["heads"] == [1, 3]
        and [(st["name"], st["seqs"]) for st in hw["steps"]]
        == [
            ("step-1", [{"new": 1, "context": 4, "unrecorded": 4}]),
            ("step-2", [{"new": 1, "context": 5}]),
        ]
        and tw["seq0.token_ids"].tolist() == prompt + dec,
        f"window: heads and unrecorded context {hw.get('heads')} {[st['seqs'] for st in hw['steps']]}",
    )
    for site in ("lse", "attn_out", "ql_nope", "q"):
        check(
            np.array_equal(tw[f"s0.L0.{site}"], t[f"s1.L0.{site}"][:, 1:3]),
            f"window: s0.L0.{site} is heads 1..3 of the full capture's decode step",
        )
    check(
        np.array_equal(tw["s0.L0.kv_c_normed"], t["s1.L0.kv_c_normed"])
        and np.array_equal(tw["s0.L0.hidden_out"], t["s1.L0.hidden_out"])
        and tw["s0.L0.w.kv_b"].shape[0] == 2 * (P + V),
        "window: latent cache and hidden_out whole, kv_b's rows of heads 1..3",
    )


def test_gguf_compare(tmp: Path) -> None:
    print("[5] mock loaded from golden/models/tiny-v3-f32.gguf (f32), dumped, judged by `mla-diff compare`")
    import subprocess

    gguf_path = ROOT / "golden" / "models" / "tiny-v3-f32.gguf"
    try:
        import gguf
    except ImportError:
        print("  skip (no gguf-py)")
        return
    if not gguf_path.is_file():
        print(f"  skip ({gguf_path} missing)")
        return
    rd = gguf.GGUFReader(str(gguf_path))
    kv = {k: f.contents() for k, f in rd.fields.items() if k.startswith("deepseek2.")}
    te = {t.name: np.array(t.data) for t in rd.tensors}
    a = "deepseek2."
    c = SimpleNamespace(
        N=kv[a + "attention.head_count"],
        H=kv[a + "embedding_length"],
        LQ=kv[a + "attention.q_lora_rank"],
        L=kv[a + "attention.kv_lora_rank"],
        R=kv[a + "rope.dimension_count"],
        V=kv[a + "attention.value_length_mla"],
        N_LAYERS=kv[a + "block_count"],
        VOCAB=kv[a + "vocab_size"],
        INTER=kv[a + "feed_forward_length"],
        EPS=kv[a + "attention.layer_norm_rms_epsilon"],
        BASE=kv[a + "rope.freq_base"],
        name="tiny-v3-f32.gguf",
    )
    c.P = kv[a + "attention.key_length_mla"] - c.R
    check(
        kv[a + "leading_dense_block_count"] >= c.N_LAYERS and "rope.scaling.type" not in "".join(kv),
        f"tiny-v3: {c.N_LAYERS} dense layers, no YaRN: the mock's layer fits "
        f"(N={c.N} H={c.H} Lq={c.LQ} L={c.L} P={c.P} R={c.R} V={c.V})",
    )
    T = lambda name: torch.from_numpy(te[name].astype(np.float32))  # noqa: E731
    ck = {"embed": T("token_embd.weight"), "norm": T("output_norm.weight")}
    for n in range(c.N_LAYERS):
        b = f"blk.{n}."
        ck[f"{n}.q_a"], ck[f"{n}.kv_a"] = T(b + "attn_q_a.weight"), T(b + "attn_kv_a_mqa.weight")
        ck[f"{n}.q_b"], ck[f"{n}.o"] = T(b + "attn_q_b.weight"), T(b + "attn_output.weight")
        k_b, v_b = T(b + "attn_k_b.weight"), T(b + "attn_v_b.weight")  # [N, L, P], [N, V, L]
        ck[f"{n}.kv_b"] = torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(c.N * (c.P + c.V), c.L)
        for k, g in (
            ("in_norm", "attn_norm"),
            ("post_norm", "ffn_norm"),
            ("q_a_norm", "attn_q_a_norm"),
            ("kv_a_norm", "attn_kv_a_norm"),
        ):
            ck[f"{n}.{k}"] = T(b + g + ".weight")
        ck[f"{n}.gate_up"] = torch.cat([T(b + "ffn_gate.weight"), T(b + "ffn_up.weight")])
        ck[f"{n}.down"] = T(b + "ffn_down.weight")
    model = build_model(ck, dtype=torch.float32, c=c)
    tokens, seq_lens = [104, 33, 96, 191, 236, 221, 28], [2, 5]
    dump_vllm.arm(model, engine=ENGINE)
    run(model, tokens=tokens, seq_lens=seq_lens)
    res = dump_vllm.finish(model, dump_path=tmp / "gguf.safetensors", expect_tokens=tokens)
    t, meta = read(res["dump"])
    ref = full_forward64(ck, tokens, seq_lens, c)
    e2e = max(rel(t[f"L{n}.hidden_out"], ref[n]) for n in range(c.N_LAYERS))
    check(
        meta["dtype"] == "f32" and meta["seq_lens"] == "2,5" and e2e < 1e-5,
        f"f32 dump, seq_lens 2,5, hidden_out vs float64 forward rel_l2 {e2e:.2e}",
    )
    # f32 activations: .to(float32) is no copy, so this catches a hook that keeps a view of a
    # tensor vLLM later mutates in place (q's rope half, the fused add's residual)
    pos = [p for n in seq_lens for p in range(n)]
    eq = max(
        rel(t[f"L{n}.q_pe_roped"], rope(f64(t[f"L{n}.q"])[..., c.P :], pos, base=c.BASE))
        for n in range(c.N_LAYERS)
    )
    check(
        eq < 1e-5 and np.array_equal(t["L1.hidden_in"], t["L0.hidden_out"]),
        f"f32: q holds the pre-RoPE values (q_pe_roped == rope(q[..., P:]), rel_l2 {eq:.1e}); "
        "L1.hidden_in == L0.hidden_out",
    )
    exe = find_mla_diff()
    if exe is None:
        print("  skip `mla-diff compare` (no binary with `compare`: build it, or set MLA_DIFF)")
        return
    cmd = [str(exe), "compare", "--model", str(gguf_path), "--dump", res["dump"], "--map", "vllm", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    last = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    n_sites = sum(1 for k in t if k.startswith("L"))
    check(
        r.returncode == 0 and "within tolerance" in last[0],
        f"mla-diff compare --map vllm: exit {r.returncode}, {last[0].strip()!r} ({n_sites} sites incl. w.*)",
    )
    # the metadata matters: the same tensors claimed to be in HF rope order must fail
    st_hf = tmp / "gguf-hf-order.safetensors"
    dump_vllm.st_io.save(t, st_hf, metadata={**meta, "rope_order": "hf"})
    r = subprocess.run(
        [str(exe), "compare", "--model", str(gguf_path), "--dump", str(st_hf), "--quiet"],
        capture_output=True,
        text=True,
    )
    out = r.stdout + r.stderr
    check(
        r.returncode == 1 and "pe_roped" in out,
        f"same dump labelled rope_order=hf: exit {r.returncode}, q_pe_roped/k_pe_roped flagged",
    )
    # fp16: vLLM's residual stream carries 1/routed_scaling_factor; format 2 declares it and
    # compare divides it out. The same file with the declaration removed: scale-only.
    import json

    model16 = build_model(ck, dtype=torch.float16, c=c)
    cap = dump_vllm.VllmCapture(model16, engine=ENGINE).arm()
    run(model16, tokens=tokens, seq_lens=seq_lens)
    cap.remove()
    f2 = cap.write_format2(tmp / "gguf-f16.safetensors", model_path=gguf_path, weights=False)
    base = [
        str(exe),
        "compare",
        "--model",
        str(gguf_path),
        "--json",
        str(tmp / "f16.json"),
        "--force",
        "--quiet",
    ]
    r = subprocess.run(base + ["--dump", str(f2)], capture_output=True, text=True)
    doc = json.loads((tmp / "f16.json").read_text()) if (tmp / "f16.json").exists() else {}
    undone = [c for c in doc.get("dump", {}).get("conversions", []) if "residual_scale" in c]
    check(
        r.returncode == 0 and len(undone) == 3,
        f"fp16 format 2 with residual_scale 0.4 declared: compare exit {r.returncode}, "
        f"{len(undone)} residual-stream sites divided back ({(r.stdout + r.stderr).strip()[-80:]!r})",
    )
    t16, meta16 = read(f2)
    h16 = json.loads(meta16["header"])
    h16["conventions"]["residual_scale"] = None
    undeclared = tmp / "gguf-f16-undeclared.safetensors"
    dump_vllm.st_io.save(t16, undeclared, metadata={**meta16, "header": json.dumps(h16)})
    r = subprocess.run(base + ["--dump", str(undeclared)], capture_output=True, text=True)
    doc = json.loads((tmp / "f16.json").read_text())
    f = (doc.get("findings") or [{}])[0]
    check(
        r.returncode == 1 and f.get("class") == "scale-only" and f.get("site") == "L0.hidden_out",
        f"the same values undeclared: exit {r.returncode}, {f.get('class')} at {f.get('site')}",
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ck = make_checkpoint()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tp1 = test_single_rank(tmp, ck)
        test_tp2(tmp, ck, tp1)
        test_fp16(tmp, ck)
        test_no_forward(tmp, ck)
        test_gguf_compare(tmp)
        test_decode_steps(tmp, ck)
    print(
        f"all {len(CHECKS)} checks passed (mock vLLM tree; the real vLLM 0.26.0: "
        "python -m mla_diff_hooks.vllm_cpu test)"
    )


if __name__ == "__main__":
    main()
