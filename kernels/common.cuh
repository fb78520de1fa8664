// Shared prelude of every mla-diff kernel module (prepended to each .cu source at run time).
//
// Conventions (docs/mla.md dim names): T tokens, N heads (nh per TP rank), H hidden, Lq q_lora_rank,
// L kv_lora_rank, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim. Every buffer is a
// row-major float32 tensor unless its type says otherwise; sizes and offsets are element counts
// passed as long long. Output buffers arrive holding the NaN canary (bits 0x7FA5A5A5).
#include <cuda_bf16.h>

#define MLA_CANARY_BITS 0x7FA5A5A5u
#define MLA_QUIET_BIT 0x00400000u

typedef long long i64;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// x as a kernel reading bf16 inputs sees it (round-to-nearest-even), or x itself.
__device__ __forceinline__ float mla_in(float x, int bf16) {
    return bf16 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

// A NaN with its payload kept and the quiet bit set: what IEEE-754 arithmetic on a CPU returns
// for a NaN operand. GPU arithmetic returns a canonical NaN instead, so kernels that may consume
// an unwritten (canary) value propagate it explicitly with this.
__device__ __forceinline__ float mla_quiet(float x) {
    return __uint_as_float(__float_as_uint(x) | MLA_QUIET_BIT);
}

__device__ __forceinline__ float mla_warp_sum(float v) {
    // Fixed butterfly order: the same bits on every run.
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
