"""Block-FP8 compute for vLLM on a CPU: torch stand-ins for the GPU kernels of a DeepSeek-V3 fp8
checkpoint (`weight_block_size` [128, 128]), and the patches that register them.

Why this exists: vLLM 0.26 loads a block-FP8 checkpoint on the CPU with its own code
(`Fp8LinearMethod`, `Fp8MoEMethod`: parameters, weight loaders, `weight_scale_inv`,
`process_weights_after_loading`), but its only CPU block-FP8 GEMM, `CPUFp8BlockScaledMMKernel`,
needs AMX tiles and vLLM's CPU build (`init_fp8_linear_kernel` raises "Failed to find a kernel
that can implement the ScaledMM linear layer" elsewhere), and `select_fp8_moe_backend` finds no
fp8 MoE backend on a CPU (`Fp8MoeBackend.NONE`, which `Fp8MoEMethod._setup_kernel` refuses:
"Unsupported FP8 MoE backend: NONE" from `convert_to_fp8_moe_kernel_format`). The
CPU harness (`mla_diff_hooks.vllm_cpu run --model DIR`) registers the stand-ins below in their
place and records each in the dump. They compute what vLLM's GPU path computes for such a
checkpoint, in plain torch:

- `w8a8-block` (default): every GEMM input is quantized per token in groups of 128 columns as
  vLLM's `per_token_group_quant_fp8` does on a GPU (`torch.ops._C.per_token_group_fp8_quant`,
  csrc/quantization/w8a8/fp8/per_token_group_quant.cu): `s = max(amax, 1e-10) / 448` in f32
  (an IEEE division: the 0.26 wheel's sm_90 code calls `__cuda_sm3x_div_rn_noftz_f32`), then
  `q = e4m3(clamp(x / s, -448, 448))`, round to nearest even. The GEMM multiplies the dequantized
  operands `q·s` and `weight·weight_scale_inv[r // 128, c // 128]` (one f32 product per element)
  and accumulates in f32, as CUTLASS's and Triton's block kernels accumulate each block's
  partial product in f32 (they scale per 128-wide K block; here the operands are scaled first:
  the same sum in exact arithmetic, rounded in another order). Output in the activation dtype.
- `weight-only`: the weights dequantized the same way, the activations not quantized, the GEMM
  in the activation dtype: the arithmetic of a W8A16 kernel (Marlin, vLLM's CPU AMX kernel).

vLLM's own fallbacks round differently: its Triton `_per_token_group_quant_fp8` multiplies amax
by the f32 constant 1/448 (one ulp away from the division for about half of all amax values),
and `QuantFP8.forward_native` floors the scale at 1/(448·512) instead of amax at 1e-10; neither
runs on a GPU for this checkpoint. Reference: docs/engines.md, "Block-FP8 checkpoints (`--model DIR`)".
"""

from __future__ import annotations

FP8_MAX = 448.0
# vLLM's per_token_group_quant_fp8 default `eps`: the floor under a group's largest magnitude
AMAX_FLOOR = 1e-10
GROUP = 128
MODES = ("w8a8-block", "weight-only")

# (name, reason) of the patches `install` applies, for the dump's `patches`
FP8_F32_ACTIVATIONS = (
    "fp8-f32-activations",
    "Fp8Config.get_supported_act_dtypes is [bfloat16, float16]; float32 added, since the harness "
    "runs float32 throughout (the Triton interpreter's numpy has no bfloat16)",
)


def _linear_reason(mode: str) -> str:
    act = (
        "activations quantized per token in groups of 128 to e4m3 (s = max(amax, 1e-10)/448 in f32, "
        "round to nearest even, vLLM's per_token_group_quant_fp8 on a GPU)"
        if mode == "w8a8-block"
        else "activations not quantized (W8A16)"
    )
    return (
        f"{mode}: vLLM's CPU block-FP8 kernel needs AMX (CPUFp8BlockScaledMMKernel); "
        f"TorchBlockFp8Kernel, a Fp8BlockScaledMMLinearKernel registered first for the CPU platform "
        f"(vLLM's process_weights_after_loading kept: the checkpoint layout), computes the GEMM of "
        f"the dequantized operands in f32: weight x weight_scale_inv[r // 128, c // 128], {act}"
    )


def _moe_reason(mode: str) -> str:
    inputs = "quantized per token and group of 128" if mode == "w8a8-block" else "unquantized"
    return (
        f"{mode}: select_fp8_moe_backend finds no fp8 MoE backend on a CPU (Fp8MoeBackend.NONE); "
        "Fp8MoEMethod keeps the loaded w13/w2 weights and their weight_scale_inv in the checkpoint "
        "layout (no kernel set up) and its apply runs each token's top-k experts in torch: the "
        "w13 GEMM, silu(gate)·up, the w2 GEMM, each with the linear stand-in's arithmetic (the "
        f"GEMM inputs {inputs}), then the experts' outputs weighted by topk_weights and summed in f32"
    )


def patch_entries(mode: str) -> list[tuple[str, str]]:
    """The (name, reason) patches `install(mode)` applies, in order."""
    if mode not in MODES:
        raise ValueError(f"unknown fp8 compute {mode!r} (known: {', '.join(MODES)})")
    return [
        FP8_F32_ACTIVATIONS,
        ("fp8-block-linear", _linear_reason(mode)),
        ("fp8-block-moe", _moe_reason(mode)),
    ]


# ---- arithmetic (torch only) -----------------------------------------------------------------


def quant_per_token_group(x, group: int = GROUP, eps: float = AMAX_FLOOR):
    """`x` [..., K] (K a multiple of `group`) quantized as vLLM's per_token_group_quant_fp8 on a
    GPU: per row and group of `group` columns, `s = max(amax, eps) / 448` in float32 and
    `q = float8_e4m3fn(clamp(x / s, -448, 448))` (x in float32, an IEEE division, round to
    nearest even). Returns (q float8_e4m3fn [..., K], s float32 [..., K / group]). Errors:
    ValueError when K is not a multiple of `group`."""
    import torch

    k = x.shape[-1]
    if k % group:
        raise ValueError(f"the last dim {k} is not a multiple of the group {group}")
    xg = x.to(torch.float32).reshape(*x.shape[:-1], k // group, group)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    floor, fp8_max = torch.tensor(eps, dtype=torch.float32), torch.tensor(FP8_MAX, dtype=torch.float32)
    s = torch.clamp(amax, min=floor) / fp8_max
    q = torch.clamp(xg / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), s.squeeze(-1)


def dequant_groups(q, s, group: int = GROUP):
    """`q` [..., K] times its per-group scale `s` [..., K / group], one float32 product each."""
    import torch

    return (q.to(torch.float32) * s.to(torch.float32).repeat_interleave(group, dim=-1)).to(torch.float32)


def dequant_blocks(weight, scale, block: tuple[int, int] = (GROUP, GROUP)):
    """A block-quantized weight [N, K] (float8) as float32: element (r, c) =
    weight[r, c] · scale[r // bn, c // bk], one float32 product (the last block row and column
    cut short where N or K is not a multiple). Errors: ValueError when `scale` is not the
    [ceil(N/bn), ceil(K/bk)] grid."""
    import torch

    bn, bk = int(block[0]), int(block[1])
    n, k = weight.shape[-2:]
    grid = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape[-2:]) != grid:
        raise ValueError(
            f"weight {[n, k]} in {bn}x{bk} blocks has a {list(grid)} grid, the scale is {list(scale.shape)}"
        )
    full = scale.to(torch.float32).repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return weight.to(torch.float32) * full[..., :n, :k]


def block_fp8_linear(x, weight, scale, block: tuple[int, int], mode: str):
    """`x` [..., K] times a block-FP8 weight [N, K]ᵀ (`scale` its weight_scale_inv grid), with
    `mode`'s arithmetic (module docstring). Returns [..., N] in x's dtype."""
    import torch

    x2 = x.reshape(-1, x.shape[-1])
    w = dequant_blocks(weight, scale, block)
    if mode == "w8a8-block":
        q, s = quant_per_token_group(x2, int(block[1]))
        out = torch.matmul(dequant_groups(q, s, int(block[1])), w.t())
    elif mode == "weight-only":
        out = torch.matmul(x2, w.t().to(x.dtype))
    else:
        raise ValueError(f"unknown fp8 compute {mode!r} (known: {', '.join(MODES)})")
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def block_fp8_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, block, mode: str, expert_map=None):
    """The routed experts of a block-FP8 MoE layer: for each token t and each of its top-k
    experts e (`topk_ids` [T, k], global ids; `expert_map` maps them to local ones, -1 for an
    expert another rank holds), `down_e(silu(gate_e(x_t)) · up_e(x_t))` with w13 [E, 2I, H]
    (gate rows, then up rows) and w2 [E, H, I], each GEMM through block_fp8_linear's `mode`;
    the results weighted by `topk_weights` and summed in float32. Returns [T, H] in x's dtype."""
    import torch

    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    ids = topk_ids.to(torch.long)
    if expert_map is not None:
        ids = expert_map.to(torch.long)[ids]
    for e in sorted(set(ids.flatten().tolist()) - {-1}):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        h = block_fp8_linear(x[rows], w13[e], w13_scale[e], block, mode)
        gate, up = h.chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate.to(torch.float32)) * up.to(torch.float32)).to(x.dtype)
        y = block_fp8_linear(act, w2[e], w2_scale[e], block, mode)
        out.index_add_(0, rows, y.to(torch.float32) * topk_weights[rows, slot].to(torch.float32)[:, None])
    return out.to(x.dtype)


# ---- registration in vLLM (inside the harness's process) -------------------------------------


class _TorchExperts:
    """What Fp8MoEMethod.experts_cls is on a CPU with the stand-in: a modular (non-monolithic)
    expert implementation, so vLLM's runner routes first and calls Fp8MoEMethod.apply."""

    @staticmethod
    def is_monolithic() -> bool:
        return False


def install(mode: str) -> list[tuple[str, str]]:
    """Register the stand-ins for `mode` in this process (before the model is built) and return
    their patch entries (patch_entries). Needs vLLM 0.26's module layout."""
    entries = patch_entries(mode)
    import torch
    from vllm.model_executor.kernels import linear as kernels
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.layers.quantization import fp8
    from vllm.platforms import PlatformEnum, current_platform

    # fp8-f32-activations
    supported = fp8.Fp8Config.get_supported_act_dtypes.__func__

    def get_supported_act_dtypes(cls):
        return [*supported(cls), torch.float32]

    fp8.Fp8Config.get_supported_act_dtypes = classmethod(get_supported_act_dtypes)

    # fp8-block-linear
    class TorchBlockFp8Kernel(Fp8BlockScaledMMLinearKernel):
        """Block-FP8 GEMM in torch (fp8_cpu.block_fp8_linear), for the CPU platform."""

        compute = mode

        @classmethod
        def is_supported(cls, compute_capability=None):
            if not current_platform.is_cpu():
                return False, "a CPU stand-in"
            return True, None

        @classmethod
        def can_implement(cls, config):
            ok, why = super().can_implement(config)
            if not ok:
                return ok, why
            gs = config.weight_quant_key.scale.group_shape
            if (gs.row, gs.col) != (GROUP, GROUP):
                return False, f"blocks of {GROUP}x{GROUP} only, not {gs.row}x{gs.col}"
            return True, None

        def apply_weights(self, layer, x, bias=None, **kwargs):
            params = self._get_layer_params(layer)
            scale = params.weight_scale if params.weight_scale_inv is None else params.weight_scale_inv
            out = block_fp8_linear(x, params.weight, scale, tuple(self.weight_group_shape), mode)
            return out if bias is None else out + bias

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise NotImplementedError("TorchBlockFp8Kernel overrides apply_weights")

    TorchBlockFp8Kernel.__module__ = __name__
    globals()["TorchBlockFp8Kernel"] = TorchBlockFp8Kernel
    kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU].insert(0, TorchBlockFp8Kernel)

    # fp8-block-moe
    select = fp8.select_fp8_moe_backend

    def select_fp8_moe_backend(*args, **kwargs):
        backend, experts_cls = select(*args, **kwargs)
        if experts_cls is None and current_platform.is_cpu():
            return backend, _TorchExperts
        return backend, experts_cls

    fp8.select_fp8_moe_backend = select_fp8_moe_backend
    setup, apply = fp8.Fp8MoEMethod._setup_kernel, fp8.Fp8MoEMethod.apply

    def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale):
        if self.experts_cls is not _TorchExperts:
            return setup(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale)
        self.moe_kernel = None  # the parameters stay as loaded

    def moe_apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if self.experts_cls is not _TorchExperts:
            return apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return block_fp8_moe(
            x,
            layer.w13_weight,
            getattr(layer, f"w13_{self.weight_scale_name}"),
            layer.w2_weight,
            getattr(layer, f"w2_{self.weight_scale_name}"),
            topk_weights,
            topk_ids,
            tuple(self.weight_block_size),
            mode,
            expert_map=getattr(layer, "expert_map", None),
        )

    fp8.Fp8MoEMethod._setup_kernel = _setup_kernel
    fp8.Fp8MoEMethod.apply = moe_apply
    return entries
