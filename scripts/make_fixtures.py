#!/usr/bin/env python3
"""Make mla-diff's GGUF fixtures and HF float64 goldens from seeded random DeepSeek models.

Why this exists: no model hub is reachable and real DeepSeek checkpoints are far too big for a
repository, yet mla-diff must be tested on GGUF files whose key names, tensor splits, layouts and
quant blocks are exactly what llama.cpp's tools produce. So, for every fixture below, this script

  1. builds a tiny random HF `DeepseekV3ForCausalLM` (2 layers, vocab 256, every layer a dense
     FFN; or, for `moe-v3`, 3 layers, vocab 128, a dense layer 0 and MoE layers 1 and 2) and
     re-initialises every parameter with seeded normal data whose std makes attention
     informative (scaled logit std between 1 and 3, measured and printed); MoE fixtures also get
     a seeded random score-correction bias (HF initialises it to zeros, which would hide it);
     `dsa-v32`, `dsa-glm` and `minicpm3` are the same recipe on transformers'
     `DeepseekV32ForCausalLM`, `GlmMoeDsaForCausalLM` and `MiniCPM3ForCausalLM` (GGUF archs
     deepseek32, glm-dsa, minicpm3; see FAMILIES): DSA lightning indexers, a GLM "shared"
     indexer layer, MiniCPM3's embedding/residual/logit scalings;
  2. converts it to F32 GGUF with llama.cpp's official converter (convert_offline.py: the real
     convert_hf_to_gguf.py, only its tokenizer step swapped for a synthetic 256-token vocab);
  3. derives the special variants with gguf-py (legacy `attn_kv_b` file; a `q_lora_rank = 0` copy
     when llama.cpp's quantizer refuses a file without the key); `fa3-v3` instead gets BF16 files
     (the converter's --outtype bf16 output, fused to a legacy `attn_kv_b`, and a copy keeping
     the split `attn_k_b`/`attn_v_b` in F32) and the HF config.json vLLM's GGUF plugin needs;
  4. quantizes with llama.cpp's own quantizer (quantize_gguf.py);
  5. runs the HF model in float64 on seeded tokens, captures every MLA site and, in MoE layers,
     the MoE sites (hf_hooks.py), checks the capture against an independent numpy recomputation
     (mla_check.py: attention from the captured tensors, MoE from the F32 GGUF's own tensors and
     metadata; DSA indexers: projections, scores, top-k and the gap at the top-k cut; MiniCPM3:
     the scalings) and against the GGUF's own tensors, and writes golden/hf/<fixture>.safetensors.

Everything is deterministic for a given --seed: re-running reproduces the same bytes.
Large intermediates (HF checkpoints, the k256 F32 file, extra quant types, logs, report.json) go
to --tmp, outside the repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

DEFAULT_TMP = Path("/work/fixtures-tmp")
SDIST = "llama_cpp_python-0.3.36"

# --------------------------------------------------------------------------------------------
# fixture table
# --------------------------------------------------------------------------------------------

YARN_V3 = dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=16,
               beta_fast=32.0, beta_slow=1.0)
YARN_LITE = dict(YARN_V3, original_max_position_embeddings=32)
# HF config of the MoE fixture (DeepSeek-V3's routing; `scoring_func`/`topk_method` are not
# DeepseekV3Config fields, but real DeepSeek-V3 config.json files carry them and the converter
# turns `scoring_func` into `expert_gating_func` = 2, sigmoid).
MOE_V3 = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
              moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
              bias_std=0.1)
# MoE of the DSA fixtures: as small as possible (one group, so no group limit).
MOE_DSA = dict(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
               moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
               norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
               bias_std=0.1)
# DSA lightning indexer: 8 heads (more heads, fewer exact-zero ReLU ties), top-k 8, head dim 64:
# it must be >= R, and llama.cpp multiplies the indexer q and k by a Hadamard matrix of at least
# 64 x 64 (llama_kv_cache::build_input_k_rot), so with 32 its graph aborts in ggml_mul_mat
# (GGML_ASSERT(ggml_can_mul_mat(a, b))). `gain` multiplies the std of wq_b and wk (init_weights).
DSA_INDEXER = dict(index_n_heads=8, index_head_dim=64, index_topk=8, gain=1.0)
# llama.cpp's minicpm3 graph hard-codes these three (src/models/minicpm3.cpp).
MINICPM3 = dict(scale_emb=12, scale_depth=1.4, dim_model_base=256)


@dataclasses.dataclass(frozen=True)
class Fixture:
    name: str
    N: int                      # attention heads
    H: int                      # hidden size
    Lq: int | None              # q_lora_rank (None: no q compression, q_proj)
    L: int                      # kv_lora_rank
    P: int                      # qk_nope_head_dim
    R: int                      # qk_rope_head_dim
    V: int                      # v_head_dim
    inter: int                  # dense FFN intermediate size
    seed_offset: int            # fixture seed = --seed + seed_offset
    attn_gain: float            # std multiplier of q_b/q_proj and kv_b weights (see init_weights)
    yarn: dict | None = None    # YaRN rope parameters (None: plain rope)
    tokens: int = 24            # golden sequence length
    quants: tuple[str, ...] = ()        # committed quantized files (llama.cpp ftype names)
    tmp_quants: tuple[str, ...] = ()    # extra quantized files kept in --tmp (dequant vectors)
    commit_f32: bool = True             # F32 file goes to golden/models (else --tmp)
    golden: bool = True                 # write golden/hf/<name>.safetensors
    legacy_kvb: bool = False            # rewrite to one attn_kv_b + legacy keys
    layers: int = 2                     # num_hidden_layers
    vocab: int = 256                    # vocab_size (the converter's synthetic vocab follows it)
    moe: dict | None = None             # MoE config (None: every layer dense, no expert tensors)
    family: str = "v3"                  # HF class / GGUF arch, see FAMILIES
    indexer: dict | None = None         # DSA indexer config (v32, glm families)
    minicpm: dict | None = None         # MiniCPM3 scalings (scale_emb, scale_depth, dim_model_base)
    # BF16 files (see make_bf16_files): every weight rounded to a bf16 value after init, the
    # converter run with --outtype bf16, the F32 file kept in --tmp for the llama.cpp check
    bf16: bool = False

    def dims(self) -> dict:
        return dict(N=self.N, H=self.H, Lq=self.Lq, L=self.L, P=self.P, R=self.R, V=self.V)

    @property
    def arch(self) -> str:
        return FAMILIES[self.family]["arch"]


# HF class and GGUF architecture per family. Main-attention rope order: every DeepSeek-style
# family pairs adjacent elements (interleaved); MiniCPM3 uses NeoX (rotate_half). The DSA
# indexer's own rope: NeoX half-split in DeepSeek-V3.2, interleaved in GLM-MoE-DSA.
FAMILIES = {
    "v3": dict(arch="deepseek2", hf_class="DeepseekV3ForCausalLM", rope="interleaved"),
    "v32": dict(arch="deepseek32", hf_class="DeepseekV32ForCausalLM", rope="interleaved",
                idx_rope="neox"),
    "glm": dict(arch="glm-dsa", hf_class="GlmMoeDsaForCausalLM", rope="interleaved",
                idx_rope="interleaved"),
    "minicpm3": dict(arch="minicpm3", hf_class="MiniCPM3ForCausalLM", rope="neox"),
}


FIXTURES = [
    Fixture("tiny-v3", N=6, H=256, Lq=64, L=96, P=32, R=16, V=64, inter=128, seed_offset=100,
            attn_gain=1.45, quants=("Q8_0", "Q4_K_M")),
    Fixture("yarn-v3", N=4, H=256, Lq=96, L=64, P=32, R=32, V=32, inter=128, seed_offset=200,
            attn_gain=1.2, yarn=YARN_V3, tokens=40),  # Q8_0 variant dropped for the golden/ size budget
    Fixture("lite-v2", N=3, H=192, Lq=None, L=128, P=32, R=16, V=64, inter=128, seed_offset=300,
            attn_gain=1.2, yarn=YARN_LITE, quants=("Q8_0",)),
    # V = 64 != P+R = 48, so a reader that swaps key_length and value_length is caught.
    Fixture("legacy-kvb", N=4, H=128, Lq=64, L=64, P=32, R=16, V=64, inter=128, seed_offset=400,
            attn_gain=1.45, legacy_kvb=True),
    # H, Lq, L and N·V = 1024 are multiples of 256 (real K-quant blocks on the MLA matrices), and
    # N·V/tp stays a multiple of 256 for every TP size dividing N (1, 2, 4), so every clean TP cut
    # of o_proj lands on a block boundary.
    Fixture("k256", N=4, H=256, Lq=256, L=256, P=64, R=32, V=256, inter=256, seed_offset=500,
            attn_gain=1.45, quants=("Q4_K_M", "Q6_K"),
            tmp_quants=("Q2_K", "Q3_K_M", "Q5_K_M", "IQ4_NL", "IQ4_XS"),
            commit_f32=False, golden=False),
    # DeepSeek-V3-style MoE: layer 0 dense, layers 1-2 MoE with 8 routed experts in 4 groups
    # (2 groups used, 2 experts per token), 1 shared expert, sigmoid scores with a random
    # score-correction bias, normalised top-k weights and a routed scaling factor != 1. Every row
    # length is a multiple of 32 (Q8_0 blocks); the dims are as small as that allows, so that
    # golden/ stays near its size budget.
    Fixture("moe-v3", N=2, H=64, Lq=32, L=96, P=32, R=16, V=16, inter=96, seed_offset=600,
            attn_gain=1.45, tokens=16, quants=("Q8_0",), layers=3, vocab=128,
            moe=MOE_V3),
    # DeepSeek-V3.2 (DSA): layer 0 dense, layer 1 MoE (4 experts, 2 used, one group, sigmoid with
    # a random score-correction bias, 1 shared expert); every layer has a lightning indexer.
    # 24 golden tokens, 3x the indexer's top-k of 8, so most rows really select.
    Fixture("dsa-v32", N=2, H=64, Lq=32, L=64, P=32, R=16, V=16, inter=64, seed_offset=700,
            attn_gain=1.45, tokens=24, quants=("Q8_0",), layers=2, vocab=128, moe=MOE_DSA,
            family="v32", indexer=DSA_INDEXER),
    # GLM-MoE-DSA (GLM-5): layer 0 dense, layers 1-2 MoE; layer 2's indexer is "shared": it
    # reuses layer 1's top-k (glm-dsa.attention.indexer.types = [true, true, false]).
    Fixture("dsa-glm", N=2, H=64, Lq=32, L=64, P=32, R=16, V=32, inter=64, seed_offset=800,
            attn_gain=1.45, tokens=24, quants=("Q8_0",), layers=3, vocab=128, moe=MOE_DSA,
            family="glm", indexer=dict(DSA_INDEXER, types=["full", "full", "shared"])),
    # MiniCPM3: 2 dense layers, q_lora, plain NeoX rope, llama.cpp's hard-coded scalings, one
    # fused attn_kv_b, V = H / N (the converter writes no value_length).
    Fixture("minicpm3", N=2, H=64, Lq=32, L=64, P=32, R=16, V=32, inter=64, seed_offset=900,
            attn_gain=1.45, tokens=24, quants=("Q8_0",), layers=2, vocab=128,
            family="minicpm3", minicpm=MINICPM3),
    # DeepSeek-V3's own attention head dims on tiny everything else, for vLLM's GPU kernels: on
    # sm_90 its only MLA prefill backend (FA3) takes (P, R, V) = (128, 64, 128) among three
    # shapes, and FlashMLA's decode wants a latent cache row of L + R = 576. BF16, 2 dense
    # layers, the fused attn_kv_b that vllm-gguf-plugin maps (fa3-v3-bf16.gguf) and a copy with
    # the converter's split attn_k_b / attn_v_b in F32, which the plugin does not map
    # (fa3-v3-split.gguf), plus the HF config.json both need (fa3-v3/config.json). N = 4 heads:
    # kv_b alone is N·(P+V)·L = 4·256·512 values per layer, 2 MiB of the BF16 file. P = V, so
    # this fixture cannot tell k from v by shape; the P != V fixtures above keep covering that.
    # No HF golden is committed (size); its checks run all the same.
    Fixture("fa3-v3", N=4, H=64, Lq=32, L=512, P=128, R=64, V=128, inter=64, seed_offset=1000,
            attn_gain=1.45, tokens=24, layers=2, vocab=128, commit_f32=False, golden=False,
            bf16=True),
]

COMMON = dict(rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=1024)

LOGIT_STD_RANGE = (1.0, 3.0)


# --------------------------------------------------------------------------------------------
# HF model
# --------------------------------------------------------------------------------------------

def hf_config(fx: Fixture):
    if fx.family != "v3":
        return hf_config_other(fx)
    from transformers import DeepseekV3Config

    if fx.yarn is None:
        rope = {"rope_type": "default", "rope_theta": COMMON["rope_theta"]}
    else:
        rope = {"rope_type": "yarn", "rope_theta": COMMON["rope_theta"], **fx.yarn}
    if fx.moe is None:
        # MoE present in the config but never used: every layer is dense
        moe = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                   moe_intermediate_size=64, first_k_dense_replace=fx.layers)
        extra = {}
    else:
        moe = {k: v for k, v in fx.moe.items() if k not in ("scoring_func", "topk_method", "bias_std")}
        extra = {k: fx.moe[k] for k in ("scoring_func", "topk_method")}
    cfg = DeepseekV3Config(
        vocab_size=fx.vocab, hidden_size=fx.H, intermediate_size=fx.inter,
        num_hidden_layers=fx.layers,
        num_attention_heads=fx.N, num_key_value_heads=fx.N,
        q_lora_rank=fx.Lq, kv_lora_rank=fx.L, qk_nope_head_dim=fx.P, qk_rope_head_dim=fx.R,
        v_head_dim=fx.V, **moe,
        max_position_embeddings=COMMON["max_position_embeddings"], rms_norm_eps=COMMON["rms_norm_eps"],
        rope_parameters=rope, rope_interleave=True, attention_bias=False,
        tie_word_embeddings=False, num_mtp_layers=0, bos_token_id=0, eos_token_id=1,
    )
    for k, v in extra.items():          # saved to config.json like any other field
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    if fx.moe is not None:
        cfg._experts_implementation = "eager"    # the per-expert loop (hf_hooks needs it)
    return cfg


def hf_config_other(fx: Fixture):
    """Config of the DeepSeek-V3.2, GLM-MoE-DSA and MiniCPM3 fixtures (plain rope, no YaRN)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": COMMON["rope_theta"]}
    common = dict(vocab_size=fx.vocab, hidden_size=fx.H, intermediate_size=fx.inter,
                  num_hidden_layers=fx.layers, num_attention_heads=fx.N, num_key_value_heads=fx.N,
                  q_lora_rank=fx.Lq, kv_lora_rank=fx.L, qk_nope_head_dim=fx.P, qk_rope_head_dim=fx.R,
                  v_head_dim=fx.V, max_position_embeddings=COMMON["max_position_embeddings"],
                  rms_norm_eps=COMMON["rms_norm_eps"], rope_parameters=rope, attention_bias=False,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    extra = {}
    if fx.family == "minicpm3":
        assert fx.V == fx.H // fx.N, "llama.cpp's minicpm3 takes V = H / N"
        cfg = transformers.MiniCPM3Config(**common, **fx.minicpm)
    else:
        assert fx.Lq is not None and fx.moe is not None and fx.indexer is not None
        moe = {k: v for k, v in fx.moe.items() if k not in ("scoring_func", "topk_method", "bias_std")}
        extra = {k: fx.moe[k] for k in ("scoring_func", "topk_method")}
        idx = {k: fx.indexer[k] for k in ("index_n_heads", "index_head_dim", "index_topk")}
        if fx.family == "v32":
            cfg = transformers.DeepseekV32Config(**common, **moe, **idx)
        else:
            cfg = transformers.GlmMoeDsaConfig(**common, **moe, **idx, indexer_types=list(fx.indexer["types"]))
    for k, v in extra.items():          # saved to config.json like any other field
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    if fx.moe is not None:
        cfg._experts_implementation = "eager"
    return cfg


def init_weights(model, fx: Fixture, seed: int) -> None:
    """Seeded normal re-initialisation of every parameter (float32).

    * token embedding: N(0, 1) (so the residual stream starts at unit scale);
    * RMSNorm weights (every 1-D parameter): 1 + 0.2 * N(0, 1);
    * linear weights [out, in]: N(0, (g / sqrt(in))^2): g = 1 keeps unit-scale activations;
      g = fx.attn_gain on the q projection (q_b_proj or q_proj) and on kv_b_proj, tuned per fixture
      so that the scaled attention logits have a std between 1 and 3;
    * MoE experts (3-D [E, out, in]: experts.gate_up_proj, experts.down_proj): N(0, 1/in) per
      expert, like a linear weight; the router (mlp.gate.weight) like a linear weight, so its
      logits have a std near 1 and sigmoid scores spread over (0, 1);
    * MoE score-correction bias (a buffer, e_score_correction_bias [E]): N(0, bias_std^2), drawn
      after every parameter (HF initialises it to zeros, which would leave the bias untested).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1 and name.endswith(".bias"):       # LayerNorm bias (DSA indexer k_norm)
                p.copy_(0.1 * noise)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("embed_tokens.weight"):
                # MiniCPM3 multiplies the embedding by scale_emb: keep the residual stream unit-scale
                p.copy_(noise / (fx.minicpm["scale_emb"] if fx.minicpm else 1.0))
            elif p.ndim == 2:
                gain = fx.attn_gain if name.endswith(("q_b_proj.weight", "q_proj.weight",
                                                      "kv_b_proj.weight")) else 1.0
                if name.endswith(("indexer.wq_b.weight", "indexer.wk.weight")):
                    gain = fx.indexer["gain"]
                p.copy_(noise * (gain / math.sqrt(p.shape[1])))
            elif p.ndim == 3 and ".mlp.experts." in name:
                p.copy_(noise / math.sqrt(p.shape[2]))
            else:
                raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
        if fx.moe is not None:
            for name, buf in sorted(model.named_buffers()):
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(fx.moe["bias_std"] * torch.randn(buf.shape, generator=gen, dtype=torch.float32))


def build_model(fx: Fixture, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)                    # construction-time init is overwritten anyway
    model = getattr(transformers, FAMILIES[fx.family]["hf_class"])(hf_config(fx))
    init_weights(model, fx, seed)
    if fx.bf16:
        # the BF16 files must hold the model's own weights: round each to its nearest bf16 value
        # (kept in float32, so the F32 file and the f64 golden see the same values)
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.eval()
    return model


def token_ids(fx: Fixture, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    # ids 0..2 are the synthetic vocab's control tokens: keep to ordinary tokens
    return torch.randint(3, fx.vocab, (fx.tokens,), generator=gen, dtype=torch.long)


# --------------------------------------------------------------------------------------------
# conversion, rewriting, quantization
# --------------------------------------------------------------------------------------------

def run_converter(hf_dir: Path, out: Path, name: str, llama_dir: Path, log: Path,
                  outtype: str = "f32") -> None:
    cmd = [sys.executable, str(HERE / "convert_offline.py"), "--llama-cpp-dir", str(llama_dir),
           str(hf_dir), "--outfile", str(out), "--outtype", outtype, "--model-name", name]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"converter failed for {name} (rc {rc}), see {log}")


def make_legacy_kvb(src: Path, dst: Path, fx: Fixture) -> None:
    """Rewrite the converter's split-kv_b file into the legacy layout (one attn_kv_b per layer,
    stored in attn_v_b's type: F32, or BF16 for a BF16 file)."""
    import gguf
    from gguf_tools import rewrite_gguf

    arch = "deepseek2"
    drop = {f"{arch}.attention.key_length_mla", f"{arch}.attention.value_length_mla"}
    set_u32 = {f"{arch}.attention.key_length": fx.P + fx.R,
               f"{arch}.attention.value_length": fx.V,
               f"{arch}.attention.head_count_kv": fx.N}
    pending: dict[int, np.ndarray] = {}

    def key_edit(name, val, vtype, sub):
        if name in drop:
            return
        if name in set_u32:
            yield name, set_u32[name], gguf.GGUFValueType.UINT32, None
            return
        yield name, val, vtype, sub

    def tensor_edit(name, arr):
        if ".attn_k_b." in name:                       # [N, L, P] (PyTorch order)
            pending[int(name.split(".")[1])] = arr
            return
        if ".attn_v_b." in name:                       # [N, V, L]
            i = int(name.split(".")[1])
            k_b = pending.pop(i)
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), arr], axis=1)   # [N, P+V, L]
            yield f"blk.{i}.attn_kv_b.weight", kv_b.reshape(fx.N * (fx.P + fx.V), fx.L)
            return
        yield name, arr

    rewrite_gguf(src, dst, key_edit, tensor_edit)
    assert not pending


def make_bf16_files(fx: Fixture, hf_dir: Path, model, models_dir: Path, args, rep: dict) -> None:
    """The committed files of a BF16 fixture, made from the converter's BF16 output (in --tmp):

    * `<name>-bf16.gguf`: rewritten to the legacy layout, one fused `attn_kv_b` per layer in BF16
      (what vllm-gguf-plugin 0.0.5 maps to kv_b_proj); every other tensor as the converter wrote
      it (BF16 matrices, F32 norms);
    * `<name>-split.gguf`: the converter's split `attn_k_b` / `attn_v_b` stored as F32, every other
      tensor as the converter wrote it (the plugin maps neither: kv_b_proj is never loaded);
    * `<name>/config.json`: the HF config the plugin needs, derived from the fused file's metadata
      by vllm_cpu.config_from_gguf with torch_dtype bfloat16 and checked against the HF model's
      config (the split file must derive the same config).

    Every tensor of every file is checked to hold the HF weight bit for bit (the weights were
    rounded to bf16 values in build_model).
    """
    import gguf
    import vllm_cpu
    from gguf_tools import rewrite_gguf, tensor_types

    conv = args.tmp / "models" / f"{fx.name}-converter-bf16.gguf"
    run_converter(hf_dir, conv, fx.name, args.llama_cpp_dir, args.tmp / "logs" / f"convert-{fx.name}-bf16.log",
                  outtype="bf16")
    fused = models_dir / f"{fx.name}-bf16.gguf"
    make_legacy_kvb(conv, fused, fx)
    split = models_dir / f"{fx.name}-split.gguf"

    def kv_b_halves_f32(name, arr):
        if ".attn_k_b." in name or ".attn_v_b." in name:
            yield name, arr, gguf.GGMLQuantizationType.F32
        else:
            yield name, arr

    rewrite_gguf(conv, split, tensor_edit=kv_b_halves_f32)
    for path in (conv, fused, split):
        n = check_gguf_matches_hf(path, model, fx)
        types = tensor_types(path)
        counts: dict[str, int] = {}
        for _, t, _ in types:
            counts[t] = counts.get(t, 0) + 1
        print(f"{rel(path)}: {n} tensors, all bit-identical to the HF weights; "
              + ", ".join(f"{t} x{c}" for t, c in sorted(counts.items())))
        rep["files"][path.name] = {"path": rel(path), "committed": path != conv,
                                   "types": {name: t for name, t, _ in types}}

    cfg = vllm_cpu.config_from_gguf(fused, torch_dtype="bfloat16")
    if vllm_cpu.config_from_gguf(split, torch_dtype="bfloat16") != cfg:
        raise SystemExit(f"{split.name} and {fused.name} derive different HF configs")
    hf = model.config
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id")
    diff = {k: (cfg.get(k), getattr(hf, k)) for k in keys if cfg.get(k) != getattr(hf, k)}
    if cfg["rope_theta"] != COMMON["rope_theta"] or "rope_scaling" in cfg:
        diff["rope"] = (cfg["rope_theta"], cfg.get("rope_scaling"))
    if not math.isclose(cfg["rms_norm_eps"], hf.rms_norm_eps, rel_tol=1e-7):     # stored as f32
        diff["rms_norm_eps"] = (cfg["rms_norm_eps"], hf.rms_norm_eps)
    if cfg["architectures"] != [FAMILIES[fx.family]["hf_class"]] or cfg["first_k_dense_replace"] < fx.layers:
        diff["class / dense layers"] = (cfg["architectures"], cfg["first_k_dense_replace"])
    if diff:
        raise SystemExit(f"{fused.name}: derived config.json differs from the HF config: {diff}")
    cfg_path = models_dir / fx.name / "config.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{rel(cfg_path)}: DeepseekV3ForCausalLM, first_k_dense_replace {cfg['first_k_dense_replace']} "
          f"(no MoE layer), torch_dtype {cfg['torch_dtype']}")
    rep["files"]["config.json"] = {"path": rel(cfg_path), "committed": True, "bytes": cfg_path.stat().st_size,
                                   "sha256": sha256(cfg_path)}


def add_q_lora_rank_zero(src: Path, dst: Path) -> None:
    """Copy a no-Lq file adding deepseek2.attention.q_lora_rank = 0 (before kv_lora_rank)."""
    import gguf
    from gguf_tools import rewrite_gguf

    def key_edit(name, val, vtype, sub):
        if name == "deepseek2.attention.kv_lora_rank":
            yield "deepseek2.attention.q_lora_rank", 0, gguf.GGUFValueType.UINT32, None
        yield name, val, vtype, sub

    rewrite_gguf(src, dst, key_edit)


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------

def check_gguf_matches_hf(gguf_path: Path, model, fx: Fixture) -> int:
    """Every tensor of an F32 GGUF must equal (bit for bit) the HF weight it came from."""
    from gguf_tools import load_f32_tensors

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    g = load_f32_tensors(gguf_path)
    simple = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
              "output_norm.weight": "model.norm.weight"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                 "attn_q_b": "self_attn.q_b_proj", "attn_q": "self_attn.q_proj",
                 "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                 "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                 "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                 "ffn_up_shexp": "mlp.shared_experts.up_proj",
                 "ffn_down_shexp": "mlp.shared_experts.down_proj"}
    # DSA indexer (blk.N.indexer.<base>.<weight|bias>)
    indexer = {"k_norm": "k_norm", "proj": "weights_proj", "attn_k": "wk", "attn_q_b": "wq_b"}
    F = fx.moe["moe_intermediate_size"] if fx.moe else 0
    checked = 0
    hf_indexer_params = {k for k in sd if ".self_attn.indexer." in k}
    seen_indexer = set()
    for name, arr in g.items():
        if name in simple:
            ref = sd[simple[name]]
        elif ".indexer." in name:
            _, i, _idx, base, kind = name.split(".")
            key = f"model.layers.{i}.self_attn.indexer.{indexer[base]}.{kind}"
            ref = sd[key]
            seen_indexer.add(key)
        else:
            _, i, base, _w = name.split(".")
            pre = f"model.layers.{i}.mlp."
            if base == "exp_probs_b":     # the score-correction bias (a buffer)
                ref = sd[pre + "gate.e_score_correction_bias"]
            elif base in ("ffn_gate_exps", "ffn_up_exps"):    # gate_up_proj [E, 2F, H] = [gate; up]
                gu = sd[pre + "experts.gate_up_proj"]
                ref = gu[:, :F, :] if base == "ffn_gate_exps" else gu[:, F:, :]
            elif base == "ffn_down_exps":                      # [E, H, F]
                ref = sd[pre + "experts.down_proj"]
            if base in ("exp_probs_b", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                if arr.shape != ref.shape or not np.array_equal(arr, ref):
                    raise SystemExit(f"{gguf_path.name}: {name} differs from the HF weight")
                checked += 1
                continue
            kv_b = sd[f"model.layers.{i}.self_attn.kv_b_proj.weight"].reshape(fx.N, fx.P + fx.V, fx.L)
            if base == "attn_k_b":      # stored transposed: [N, L, P]
                ref = kv_b[:, : fx.P, :].transpose(0, 2, 1)
            elif base == "attn_v_b":    # [N, V, L]
                ref = kv_b[:, fx.P:, :]
            else:
                ref = sd[f"model.layers.{i}.{per_layer[base]}.weight"]
        if arr.shape != ref.shape or not np.array_equal(arr, ref):
            raise SystemExit(f"{gguf_path.name}: {name} differs from the HF weight")
        checked += 1
    if seen_indexer != hf_indexer_params:
        raise SystemExit(f"{gguf_path.name}: indexer tensors missing: {sorted(hf_indexer_params - seen_indexer)}")
    # every HF tensor is in the file: gate_up_proj and a split kv_b_proj give two GGUF tensors each
    want = len(sd) + sum(1 for k in sd if k.endswith("experts.gate_up_proj"))
    if any(".attn_k_b." in k for k in g):
        want += sum(1 for k in sd if k.endswith("kv_b_proj.weight"))
    if checked != want:
        raise SystemExit(f"{gguf_path.name}: {checked} GGUF tensors for {len(sd)} HF tensors (want {want})")
    return checked


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def check_moe(fx: Fixture, f32: Path, t: dict, rep: dict) -> None:
    """Independent numpy check of every MoE layer of the capture (mla_check.check_moe_layer),
    from the F32 GGUF's own tensors and MoE metadata; the fixture must exercise the bias and the
    group limit (each changes at least one token's selection) and have no near tie at the top-k
    cut (an f32 engine would then legitimately pick another expert)."""
    import mla_check
    from gguf_tools import load_f32_tensors, read_kv

    kv = read_kv(f32)
    a = fx.arch + "."
    meta = dict(E=int(kv[a + "expert_count"]), K=int(kv[a + "expert_used_count"]),
                G=int(kv.get(a + "expert_group_count", 1)), G_used=int(kv.get(a + "expert_group_used_count", 1)),
                gating=int(kv.get(a + "expert_gating_func", 1)), norm=bool(kv.get(a + "expert_weights_norm", False)),
                scale=float(kv.get(a + "expert_weights_scale", 0.0)) or 1.0,
                first_moe=int(kv[a + "leading_dense_block_count"]))
    m = fx.moe
    want = dict(E=m["n_routed_experts"], K=m["num_experts_per_tok"], G=m["n_group"], G_used=m["topk_group"],
                gating=2 if m["scoring_func"] == "sigmoid" else 1, norm=m["norm_topk_prob"],
                scale=m["routed_scaling_factor"], first_moe=m["first_k_dense_replace"])
    if meta != want:
        raise SystemExit(f"{f32.name}: MoE metadata {meta} != HF config {want}")
    rep["moe_metadata"] = meta
    w = load_f32_tensors(f32)
    rep["moe_checks"] = {}
    bias_changes = group_changes = 0
    for layer in range(meta["first_moe"], fx.layers):
        res = mla_check.check_moe_layer(t, layer, w, meta, COMMON["rms_norm_eps"])
        rep["moe_checks"][layer] = res
        print(f"L{layer} MoE: router logits err {res['router_logits_max_err']:.1e}  "
              f"moe_out err {res['moe_out_max_err']:.1e}  shared_out err {res['shared_out_max_err']:.1e}  "
              f"hidden_out err {res['hidden_out_max_err']:.1e}  top-k set mismatches {res['topk_set_mismatches']}  "
              f"tokens changed by the bias {res['tokens_bias_changes_selection']}, by the group limit "
              f"{res['tokens_group_limit_changes_selection']}  min gap at the cut {res['min_choice_gap_at_cut']:.2e}")
        worst = max(res["router_logits_max_err"], res["moe_out_max_err"], res["shared_out_max_err"],
                    res["hidden_out_max_err"])
        if worst > 1e-9 or res["topk_set_mismatches"]:
            raise SystemExit(f"{fx.name} L{layer}: MoE self-check failed ({res})")
        if res["min_choice_gap_at_cut"] < 1e-5:
            raise SystemExit(f"{fx.name} L{layer}: near tie at the top-k cut ({res['min_choice_gap_at_cut']:.2e})")
        bias_changes += res["tokens_bias_changes_selection"]
        group_changes += res["tokens_group_limit_changes_selection"]
    if bias_changes == 0 or (group_changes == 0 and meta["G"] > 1):
        raise SystemExit(f"{fx.name}: the bias changes {bias_changes} and the group limit {group_changes} "
                         f"token selections; both must change at least one (the group limit only with "
                         f"G > 1; adjust bias_std or the seed)")


IDX_MIN_REL_GAP = 1e-4     # smallest allowed (K-th - (K+1)-th score) / row max at the top-k cut


def check_indexer(fx: Fixture, f32: Path, t: dict, extras: dict, rep: dict) -> None:
    """Independent numpy check of every DSA indexer layer (mla_check.check_indexer) from the F32
    GGUF's own tensors and indexer metadata; the selection must match HF's and have no near tie
    at the top-k cut (HF scores in float32: a near tie could flip in another engine), and no
    exact-zero (ReLU) score may sit at the cut."""
    import mla_check
    from gguf_tools import load_f32_tensors, read_kv

    kv = read_kv(f32)
    a = fx.arch + ".attention.indexer."
    meta = dict(index_n_heads=int(kv[a + "head_count"]), index_head_dim=int(kv[a + "key_length"]),
                index_topk=int(kv[a + "top_k"]))
    want = {k: fx.indexer[k] for k in meta}
    if meta != want:
        raise SystemExit(f"{f32.name}: indexer metadata {meta} != HF config {want}")
    types = fx.indexer.get("types")
    if types is not None and list(kv.get(a + "types", [])) != [x == "full" for x in types]:
        raise SystemExit(f"{f32.name}: {a}types = {kv.get(a + 'types')} != {types}")
    rep["indexer_metadata"] = dict(meta, types=kv.get(a + "types"))
    w = load_f32_tensors(f32)
    rep["indexer_checks"] = {}
    rope = FAMILIES[fx.family]["idx_rope"]
    for layer in range(fx.layers):
        if f"L{layer}.idx_scores" not in t:
            if f"L{layer}.idx_topk" in t:           # GLM shared layer: the previous full layer's top-k
                prev = max(n for n in range(layer) if f"L{n}.idx_scores" in t)
                same = np.array_equal(t[f"L{layer}.idx_topk"], t[f"L{prev}.idx_topk"])
                print(f"L{layer} indexer: shared, reuses L{prev}'s top-k (identical: {same})")
                rep["indexer_checks"][layer] = {"shared_from": prev, "identical": same}
                if not same:
                    raise SystemExit(f"{fx.name} L{layer}: shared top-k differs from L{prev}'s")
            continue
        res = mla_check.check_indexer(t, layer, w, fx.indexer, fx.R, extras["cos"], extras["sin"], rope)
        res["hf_scores_dtype"] = extras["idx_scores_dtype"].get(layer)
        rep["indexer_checks"][layer] = res
        print(f"L{layer} indexer ({rope} rope): idx_q/k/weights rel err {res['idx_q_max_rel_err']:.1e}/"
              f"{res['idx_k_max_rel_err']:.1e}/{res['idx_weights_max_rel_err']:.1e}  scores rel err "
              f"{res['idx_scores_max_rel_err']:.1e} (other rope order {res['idx_scores_other_rope_max_rel_diff']:.2f})  "
              f"top-k set mismatches {res['topk_set_mismatches']}  min rel gap at the cut "
              f"{res['min_rel_gap_at_cut']:.2e} over {res['rows_with_cut']} rows  exact-zero scores "
              f"{res['exact_zero_scores']} (HF {res['hf_exact_zero_scores']}), at the cut {res['zero_score_at_cut_rows']}")
        if max(res["idx_q_max_rel_err"], res["idx_k_max_rel_err"], res["idx_weights_max_rel_err"]) > 1e-12:
            raise SystemExit(f"{fx.name} L{layer}: indexer projections self-check failed ({res})")
        if res["idx_scores_max_rel_err"] > 1e-5 or res["topk_set_mismatches"]:
            raise SystemExit(f"{fx.name} L{layer}: indexer scores/top-k self-check failed ({res})")
        if res["min_rel_gap_at_cut"] < IDX_MIN_REL_GAP or res["zero_score_at_cut_rows"]:
            raise SystemExit(f"{fx.name} L{layer}: near tie at the indexer top-k cut "
                             f"({res['min_rel_gap_at_cut']:.2e}, zero at cut {res['zero_score_at_cut_rows']}); "
                             f"change the seed or the indexer gain")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def make_one(fx: Fixture, args, report: dict) -> None:
    import torch
    import transformers
    import st_io
    from gguf_tools import load_f32_tensors, quantize, read_kv, tensor_types
    import hf_hooks
    import mla_check

    t0 = time.time()
    seed = args.seed + fx.seed_offset
    models_dir = args.out / "models"
    tmp = args.tmp
    models_dir.mkdir(parents=True, exist_ok=True)
    rep: dict = {"dims": fx.dims(), "inter": fx.inter, "yarn": fx.yarn, "seed": seed, "moe": fx.moe,
                 "attn_gain": fx.attn_gain, "files": {}}
    report[fx.name] = rep
    print(f"\n=== {fx.name}  (seed {seed}) " + "=" * 40)

    # 1. HF model -> checkpoint
    model = build_model(fx, seed)
    hf_dir = tmp / "hf" / fx.name
    model.save_pretrained(hf_dir)

    # 2. official converter -> F32
    f32_dir = models_dir if fx.commit_f32 else tmp / "models"
    f32_dir.mkdir(parents=True, exist_ok=True)
    f32 = f32_dir / f"{fx.name}-f32.gguf"
    if fx.legacy_kvb:
        split = tmp / "models" / f"{fx.name}-split-f32.gguf"
        split.parent.mkdir(parents=True, exist_ok=True)
        run_converter(hf_dir, split, fx.name, args.llama_cpp_dir, tmp / "logs" / f"convert-{fx.name}.log")
        make_legacy_kvb(split, f32, fx)
    else:
        run_converter(hf_dir, f32, fx.name, args.llama_cpp_dir, tmp / "logs" / f"convert-{fx.name}.log")
    n = check_gguf_matches_hf(f32, model, fx)
    print(f"{rel(f32)}: {n} tensors, all bit-identical to the HF weights")
    rep["gguf_tensors_checked"] = n
    rep["f32_keys"] = {k: v for k, v in read_kv(f32).items() if k.startswith(fx.arch + ".")}
    if fx.bf16:
        make_bf16_files(fx, hf_dir, model, models_dir, args, rep)

    # 3. quantize
    quant_src = f32
    for ft, committed in [(q, True) for q in fx.quants] + [(q, False) for q in fx.tmp_quants]:
        dst = (models_dir if committed else tmp / "models") / f"{fx.name}-{ft.lower()}.gguf"
        log = tmp / "logs" / f"quantize-{dst.stem}.log"
        rc = quantize(quant_src, dst, ft, log)
        if rc != 0 and fx.Lq is None and quant_src == f32:
            # llama.cpp reads q_lora_rank unconditionally unless the layer count looks like a
            # known "lite" model; the converter omits the key when q_lora_rank is null.
            refused = log.with_name(log.stem + "-refused.log")
            log.replace(refused)
            print(f"llama.cpp's quantizer refused {f32.name} (rc {rc}, see {refused}); "
                  f"retrying from a copy with q_lora_rank = 0")
            rep["quantizer_refused_absent_q_lora_rank"] = True
            quant_src = tmp / "models" / f"{fx.name}-f32-qlora0.gguf"
            add_q_lora_rank_zero(f32, quant_src)
            rc = quantize(quant_src, dst, ft, log)
        if rc != 0:
            raise SystemExit(f"quantizing {fx.name} to {ft} failed (rc {rc}), see {log}")
        types = tensor_types(dst)
        rep["files"][dst.name] = {"path": rel(dst), "committed": committed,
                                  "types": {n: t for n, t, _ in types}}
        counts: dict[str, int] = {}
        for _, t, _ in types:
            counts[t] = counts.get(t, 0) + 1
        print(f"{rel(dst)}: " + ", ".join(f"{t} x{c}" for t, c in sorted(counts.items())))
    if fx.Lq is None and quant_src == f32 and fx.quants:
        rep["quantizer_refused_absent_q_lora_rank"] = False

    # 4. golden (captured for every fixture, for the logit-std measurement; saved if fx.golden)
    ids = token_ids(fx, seed)
    # the plain HF f32 run, only to report how far it is from the f64 golden
    with torch.no_grad():
        logits32 = model(input_ids=ids[None]).logits[0].double().numpy()
    model64 = model.to(torch.float64)
    cap = hf_hooks.capture(model64, ids)
    t = cap.tensors
    rep["hf_f32_vs_f64_logits_max_abs"] = float(np.abs(logits32 - t["logits"]).max())
    rep["inv_freq_rel_err_vs_hf_f32"] = cap.extras["inv_freq_rel_err_vs_hf_f32"]

    scale = mla_check.softmax_scale(fx.P, fx.R, fx.yarn)
    rep["softmax_scale"] = scale
    rep["logit_stats"] = cap.extras["logit_stats"]
    rep["checks"] = {}
    for layer in range(fx.layers):
        hf_scale = cap.extras["hf_scaling"][layer]
        if not math.isclose(hf_scale, scale, rel_tol=1e-14):
            raise SystemExit(f"HF softmax scale {hf_scale} != docs/mla.md scale {scale}")
        allowed = None
        if f"L{layer}.idx_topk" in t:       # DSA: attention restricted to the selected keys
            allowed = mla_check.topk_mask(t[f"L{layer}.idx_topk"], fx.tokens)
        res = mla_check.check_layer(t, layer, fx.dims(), scale, cap.extras["cos"], cap.extras["sin"],
                                    rope=FAMILIES[fx.family]["rope"], allowed=allowed)
        if allowed is not None:
            # control: plain causal attention (no top-k) must NOT reproduce the sparse golden
            dense = mla_check.check_layer(t, layer, fx.dims(), scale, cap.extras["cos"], cap.extras["sin"],
                                          rope=FAMILIES[fx.family]["rope"])
            res["dense_causal_attn_out_max_diff"] = dense["attn_out_max_err"]
            if dense["attn_out_max_err"] < 1e-3:
                raise SystemExit(f"{fx.name} L{layer}: the indexer's top-k changes nothing")
        rep["checks"][layer] = res
        st = cap.extras["logit_stats"][layer]
        print(f"L{layer}: logit std {st['std']:.3f} (absmax {st['absmax']:.2f})  "
              f"rope q/k err {res['rope_q_max_err']:.1e}/{res['rope_k_max_err']:.1e} "
              f"(the other rope order would differ by {res['rope_k_other_order_max_diff']:.2f})  "
              f"attn_out err {res['attn_out_max_err']:.1e} (absorbed {res['absorbed_attn_out_max_err']:.1e})  "
              f"lse err {res['lse_max_err']:.1e} (absorbed {res['absorbed_lse_max_err']:.1e})  "
              f"kv_b split err {max(res['kv_b_k_nope_max_err'], res['kv_b_v_max_err']):.1e}"
              + (f"  (dense causal instead of top-k: attn_out differs by {res['dense_causal_attn_out_max_diff']:.2f})"
                 if "dense_causal_attn_out_max_diff" in res else ""))
        lo, hi = LOGIT_STD_RANGE
        if not lo <= st["std"] <= hi:
            raise SystemExit(f"{fx.name} L{layer}: logit std {st['std']:.3f} outside [{lo}, {hi}]; "
                             f"adjust attn_gain")
        worst = max(res["rope_q_max_err"], res["rope_k_max_err"], res["attn_out_max_err"],
                    res["lse_max_err"], res["absorbed_attn_out_max_err"], res["absorbed_lse_max_err"],
                    res["kv_b_k_nope_max_err"], res["kv_b_v_max_err"])
        if worst > 1e-9:
            raise SystemExit(f"{fx.name} L{layer}: golden self-check failed (max err {worst:.2e})")
    if fx.moe is not None:
        check_moe(fx, f32, t, rep)
    if fx.indexer is not None:
        check_indexer(fx, f32, t, cap.extras, rep)
    if fx.minicpm is not None:
        w = load_f32_tensors(f32)
        res = mla_check.check_minicpm3(t, w, fx.layers, fx.minicpm, COMMON["rms_norm_eps"])
        rep["minicpm3_checks"] = res
        print(f"MiniCPM3 scalings: embedding x{fx.minicpm['scale_emb']} err {res['embed_max_err']:.1e}  "
              f"hidden_out (residual x{fx.minicpm['scale_depth']}/sqrt({fx.layers})) err "
              f"{res['hidden_out_max_err']:.1e}  logits (/(H/{fx.minicpm['dim_model_base']})) err "
              f"{res['logits_max_err']:.1e}")
        if max(res["embed_max_err"], res["hidden_out_max_err"], res["logits_max_err"]) > 1e-9:
            raise SystemExit(f"{fx.name}: MiniCPM3 self-check failed ({res})")
    print(f"HF plain f32 vs f64 golden logits: max |diff| {rep['hf_f32_vs_f64_logits_max_abs']:.2e}; "
          f"f64 vs HF f32 inv_freq rel err {rep['inv_freq_rel_err_vs_hf_f32']:.1e}")

    if not fx.golden:
        golden = tmp / "hf" / f"{fx.name}.safetensors"        # scratch copy only
    else:
        golden = args.out / "hf" / f"{fx.name}.safetensors"
    golden.parent.mkdir(parents=True, exist_ok=True)
    # The w.* sites are the GGUF's F32 weights upcast, bit for bit (check_gguf_matches_hf
    # proves it above), so they are not stored: that keeps golden/ inside its size budget.
    names = [k for k in hf_hooks.ordered_names(t) if ".w." not in k]
    tensors = {k: np.ascontiguousarray(t[k]) for k in names}
    meta = {
        "fixture": fx.name,
        "gguf": rel(f32),
        "source": f"transformers {transformers.__version__} {FAMILIES[fx.family]['hf_class']} float64 eager",
        "rope_order": FAMILIES[fx.family]["rope"],
        "tokens": str(fx.tokens),
        "seed": str(seed),
        "softmax_scale": repr(scale),
        "f64_patches": "RMSNorm, rotary table and eager softmax kept in float64 (HF forces f32 there)"
                       + (", MoE router logits in float64" if fx.moe is not None else ""),
        "torch": torch.__version__,
    }
    if fx.indexer is not None:
        meta["idx_rope_order"] = FAMILIES[fx.family]["idx_rope"]
        meta["idx_scores_precision"] = ("float32: HF casts the indexer q and k to float32 (q.float()) "
                                        "even in a float64 model; stored as float64")
        meta["idx_topk_layout"] = "per row sorted ascending; keys past the query are -1, at the end"
        if fx.indexer.get("types"):
            meta["indexer_types"] = ",".join(fx.indexer["types"])
    if fx.minicpm is not None:
        meta["scalings"] = (f"scale_emb={fx.minicpm['scale_emb']} (L0.hidden_in is after it), "
                            f"residual scale_depth/sqrt(layers)={fx.minicpm['scale_depth']}/sqrt({fx.layers}), "
                            f"logits divided by hidden/dim_model_base={fx.H}/{fx.minicpm['dim_model_base']}")
    st_io.save(tensors, golden, metadata=meta)
    rep["golden"] = {"path": rel(golden), "bytes": golden.stat().st_size, "tensors": len(tensors),
                     "committed": fx.golden}
    print(f"{rel(golden)}: {len(tensors)} tensors, {golden.stat().st_size} bytes")

    # 5. end-to-end cross-check: llama.cpp on the GGUF vs the HF float64 golden logits
    if not args.no_llama_check:
        rep["llama_cpp_vs_golden"] = {}
        candidates = [f32] + ([quant_src] if quant_src != f32 else [])
        candidates += [models_dir / f"{fx.name}-{q.lower()}.gguf" for q in fx.quants]
        if fx.bf16:     # bf16 weights: llama.cpp rounds the activations to bf16 too (reported only)
            candidates += [models_dir / f"{fx.name}-bf16.gguf", models_dir / f"{fx.name}-split.gguf"]
        for path in candidates:
            proc = subprocess.run([sys.executable, str(HERE / "llama_logits.py"), str(path), str(golden)],
                                  capture_output=True, text=True)
            lines = proc.stdout.strip().splitlines()
            try:
                res = json.loads(lines[-1]) if lines else {"error": proc.stderr[-300:]}
            except json.JSONDecodeError:        # llama.cpp aborted (GGML_ASSERT) and printed a backtrace
                asserts = [x for x in (proc.stdout + proc.stderr).splitlines() if "GGML_ASSERT" in x]
                res = {"error": f"rc {proc.returncode}: " + (asserts[0] if asserts else proc.stderr[-300:])}
            rep["llama_cpp_vs_golden"][path.name] = res
            if "error" in res:
                print(f"llama.cpp vs golden logits, {path.name}: does not load ({res['error'][:80]})")
            else:
                print(f"llama.cpp vs golden logits, {path.name}: max |diff| {res['max_abs']:.2e}, "
                      f"rel_l2 {res['rel_l2']:.2e}")
                if path in (f32, quant_src) and res["max_abs"] > 1e-4:
                    raise SystemExit(f"llama.cpp disagrees with the golden on {path.name}")

    for p in sorted(models_dir.glob(f"{fx.name}-*.gguf")):
        rep["files"].setdefault(p.name, {"path": rel(p), "committed": True})
        rep["files"][p.name].update(bytes=p.stat().st_size, sha256=sha256(p))
    if not fx.commit_f32:
        rep["files"][f32.name] = {"path": str(f32), "committed": False, "bytes": f32.stat().st_size}
    print(f"({time.time() - t0:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=20250, help="base seed (fixture seed = base + offset)")
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=[f.name for f in FIXTURES],
                    help="make only these fixtures (default: all)")
    ap.add_argument("--out", type=Path, default=REPO / "golden", help="golden folder (default: repo/golden)")
    ap.add_argument("--tmp", type=Path, default=DEFAULT_TMP,
                    help=f"scratch folder outside the repo (default {DEFAULT_TMP})")
    ap.add_argument("--llama-cpp-dir", type=Path, default=None,
                    help=f"vendor/llama.cpp of the unpacked llama-cpp-python sdist "
                         f"(default: TMP/{SDIST}/vendor/llama.cpp)")
    ap.add_argument("--no-llama-check", action="store_true",
                    help="skip the llama.cpp-vs-golden logits cross-check")
    ap.add_argument("--list", action="store_true", help="print the fixture table and exit")
    args = ap.parse_args()

    if args.list:
        for f in FIXTURES:
            print(f)
        return
    args.tmp.mkdir(parents=True, exist_ok=True)
    if args.llama_cpp_dir is None:
        args.llama_cpp_dir = args.tmp / SDIST / "vendor" / "llama.cpp"
    if not (args.llama_cpp_dir / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"converter not found under {args.llama_cpp_dir}; unpack the {SDIST} sdist "
                         f"there (see golden/README.md) or pass --llama-cpp-dir")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    report_path = args.tmp / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    for fx in FIXTURES:
        if args.only and fx.name not in args.only:
            continue
        make_one(fx, args, report)
    report_path.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nreport: {report_path}")


if __name__ == "__main__":
    main()
