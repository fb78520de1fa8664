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

// Step one of every merge of partial attention states (merge_states, the fast decode's merges;
// docs/mla.md "Attention state merge"): over the k LSEs lse_at(0), …, lse_at(k − 1), a NaN (a
// partial never written) poisons the merge: MLA_MERGE_NAN, *q the first NaN quieted; every LSE
// −inf leaves nothing to merge: MLA_MERGE_EMPTY (output 0, LSE −inf); else MLA_MERGE_OK with *m
// the largest LSE. Each kernel then weights the finite LSEs exp(lse − *m) in split order.
#define MLA_MERGE_OK 0
#define MLA_MERGE_NAN 1
#define MLA_MERGE_EMPTY 2
template <typename LseAt>
__device__ __forceinline__ int mla_merge_scan(LseAt lse_at, i64 k, float* m, float* q) {
    float mx = -INFINITY;
    bool has_nan = false;
    float nan_val = 0.0f;
    for (i64 s = 0; s < k; ++s) {
        const float x = lse_at(s);
        if (isnan(x)) {
            if (!has_nan) nan_val = x;
            has_nan = true;
        } else {
            mx = fmaxf(mx, x);
        }
    }
    if (has_nan) {
        *q = mla_quiet(nan_val);
        return MLA_MERGE_NAN;
    }
    if (mx == -INFINITY) return MLA_MERGE_EMPTY;
    *m = mx;
    return MLA_MERGE_OK;
}

__device__ __forceinline__ float mla_warp_sum(float v) {
    // Fixed butterfly order: the same bits on every run.
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
