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

// Tensor-core and async-copy primitives of the fast decode and fast prefill kernels (sm_80+; a
// module that does not call them compiles none of them).
// C[16×8] += A[16×16]·B[16×8] on bf16 inputs with f32 accumulation (mma.sync m16n8k16, A row-
// major, B column-major): `c` the thread's 4 accumulator values, `a` its 4 A registers, b0 and b1
// its 2 B registers, in the PTX fragment layout.
__device__ __forceinline__ void mla_mma_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 32-bit shared-state-space address of a pointer into shared memory.
__device__ __forceinline__ unsigned mla_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16-byte async copy global -> shared (cp.async.cg); zero-fills the 16 bytes when `valid` is false.
__device__ __forceinline__ void mla_cp16(void* dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(mla_smem_addr(dst)), "l"(src), "r"(n));
}
