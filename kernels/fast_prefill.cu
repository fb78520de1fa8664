// Fast MHA prefill: FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, bf16 in,
// f32 accumulate), compiled per shape with -DMLA_DQK=<P+R> -DMLA_DV=<V> (multiples of 16).
//
// flash_prefill_mma(q, k, v, out, lse, segs, tiles, nh, scale, empty)
//   q    [Tq, nh, DQK] bf16        k [Tk, nh, DQK] bf16        v [Tk, nh, DV] bf16
//   out  [Tq, nh, DV] f32, written in place        lse [Tq, nh] f32 (natural log)
//   segs [nseg, 5] i64: q_off, q_len, k_off, k_len, causal (query i sees key j iff
//        j <= i + k_len - q_len when causal)
//   tiles [n_tiles, 2] i64: (segment, first query row); grid (n_tiles, nh); 128 threads
//   empty: a row with no visible key gets 0 = out 0, lse -inf; 1 = out 0, lse +inf; 2 = nothing
// Block: 64 query rows, 16 per warp; K/V tiles of 64 keys, double-buffered with cp.async.
// S = Q·Kᵀ and O += P·V run on mma.sync; the online softmax stays in registers (P is reused
// as the A operand of P·V without leaving registers); V fragments come from ldmatrix.trans.

#ifndef MLA_DQK
#define MLA_DQK 192
#endif
#ifndef MLA_DV
#define MLA_DV 128
#endif

#define FP_BQ 64
#define FP_BK 64
#define FP_LDK (MLA_DQK + 8)   // bf16 row stride of Q and K tiles (pad: no bank conflicts)
#define FP_LDV (MLA_DV + 8)    // bf16 row stride of V tiles
#define FP_KSTEPS (MLA_DQK / 16)
#define FP_NT (MLA_DV / 8)

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ void fp_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned fp_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

__device__ __forceinline__ unsigned fp_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16-byte async copy global -> shared; zero-fills when `valid` is false.
__device__ __forceinline__ void fp_cp16(void* dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fp_smem_addr(dst)), "l"(src), "r"(n));
}

__device__ __forceinline__ void fp_ldmatrix_x2_trans(unsigned& r0, unsigned& r1, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(fp_smem_addr(p)));
}

extern "C" __global__ void __launch_bounds__(128)
    flash_prefill_mma(const bf16* q, const bf16* k, const bf16* v, float* out, float* lse, const i64* segs,
                      const i64* tiles, i64 nh, float scale, int empty) {
    extern __shared__ __align__(16) unsigned char fp_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(fp_smem);  // [BQ][LDK]
    bf16* Ks = Qs + FP_BQ * FP_LDK;                // [2][BK][LDK]
    bf16* Vs = Ks + 2 * FP_BK * FP_LDK;            // [2][BK][LDV]

    const i64 tile = blockIdx.x, h = blockIdx.y;
    const i64 seg = tiles[2 * tile], q0 = tiles[2 * tile + 1];
    const i64 q_off = segs[5 * seg], q_len = segs[5 * seg + 1], k_off = segs[5 * seg + 2];
    const i64 k_len = segs[5 * seg + 3], causal = segs[5 * seg + 4];
    const i64 shift = k_len - q_len;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

    // Q tile: rows q0..q0+BQ of this segment (zero beyond q_len).
    for (int e = tid; e < FP_BQ * (MLA_DQK / 8); e += 128) {
        int r = e / (MLA_DQK / 8), c = (e % (MLA_DQK / 8)) * 8;
        bool ok = q0 + r < q_len;
        const bf16* src = q + ((q_off + (ok ? q0 + r : 0)) * nh + h) * MLA_DQK + c;
        fp_cp16(Qs + r * FP_LDK + c, src, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::);

    // Keys this block needs: with causal masking, none past its last query's horizon.
    i64 k_end = k_len;
    if (causal) {
        i64 last = q0 + FP_BQ - 1 + shift + 1;
        if (last < k_end) k_end = last > 0 ? last : 0;
    }
    const int n_tiles = (int)((k_end + FP_BK - 1) / FP_BK);

    auto load_kv = [&](int stage, i64 kt) {
        bf16* kd = Ks + stage * FP_BK * FP_LDK;
        bf16* vd = Vs + stage * FP_BK * FP_LDV;
        for (int e = tid; e < FP_BK * (MLA_DQK / 8); e += 128) {
            int r = e / (MLA_DQK / 8), c = (e % (MLA_DQK / 8)) * 8;
            bool ok = kt + r < k_len;
            fp_cp16(kd + r * FP_LDK + c, k + ((k_off + (ok ? kt + r : 0)) * nh + h) * MLA_DQK + c, ok);
        }
        for (int e = tid; e < FP_BK * (MLA_DV / 8); e += 128) {
            int r = e / (MLA_DV / 8), c = (e % (MLA_DV / 8)) * 8;
            bool ok = kt + r < k_len;
            fp_cp16(vd + r * FP_LDV + c, v + ((k_off + (ok ? kt + r : 0)) * nh + h) * MLA_DV + c, ok);
        }
    };

    if (n_tiles > 0) load_kv(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);

    float o[FP_NT][4];
#pragma unroll
    for (int n = 0; n < FP_NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
    const i64 row_lo = q0 + warp * 16 + g, row_hi = row_lo + 8;  // local query indices
    const float sl2 = scale * 1.4426950408889634f;             // scale · log2(e)
    unsigned qa[FP_KSTEPS][4];
    bool q_loaded = false;

    for (int it = 0; it < n_tiles; ++it) {
        const i64 kt = (i64)it * FP_BK;
        if (it + 1 < n_tiles) {
            load_kv((it + 1) & 1, kt + FP_BK);
            asm volatile("cp.async.commit_group;\n" ::);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        if (!q_loaded) {
#pragma unroll
            for (int kk = 0; kk < FP_KSTEPS; ++kk) {
                const bf16* base = Qs + (warp * 16 + g) * FP_LDK + kk * 16 + 2 * t;
                qa[kk][0] = *reinterpret_cast<const unsigned*>(base);
                qa[kk][1] = *reinterpret_cast<const unsigned*>(base + 8 * FP_LDK);
                qa[kk][2] = *reinterpret_cast<const unsigned*>(base + 8);
                qa[kk][3] = *reinterpret_cast<const unsigned*>(base + 8 * FP_LDK + 8);
            }
            q_loaded = true;
        }
        const bf16* Kt = Ks + (it & 1) * FP_BK * FP_LDK;
        const bf16* Vt = Vs + (it & 1) * FP_BK * FP_LDV;

        // S = Q · Kᵀ for this warp's 16 rows and the tile's 64 keys.
        float s[FP_BK / 8][4];
#pragma unroll
        for (int n = 0; n < FP_BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        // k-steps outside, key tiles inside: eight independent accumulators per k-step.
#pragma unroll
        for (int kk = 0; kk < FP_KSTEPS; ++kk) {
#pragma unroll
            for (int n = 0; n < FP_BK / 8; ++n) {
                const bf16* kb = Kt + (n * 8 + g) * FP_LDK + 2 * t + kk * 16;
                unsigned b0 = *reinterpret_cast<const unsigned*>(kb);
                unsigned b1 = *reinterpret_cast<const unsigned*>(kb + 8);
                fp_mma(s[n], qa[kk], b0, b1);
            }
        }
        // Mask (sequence end, causal horizon, rows past q_len) only on tiles that need it, and
        // scale to log2 units.
        float mx_lo = -INFINITY, mx_hi = -INFINITY;
        const bool interior = kt + FP_BK <= k_len && q0 + FP_BQ <= q_len &&
                              (!causal || kt + FP_BK - 1 <= q0 + shift);
        if (interior) {
#pragma unroll
            for (int n = 0; n < FP_BK / 8; ++n) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    s[n][j] *= sl2;
                    s[n][2 + j] *= sl2;
                    mx_lo = fmaxf(mx_lo, s[n][j]);
                    mx_hi = fmaxf(mx_hi, s[n][2 + j]);
                }
            }
        } else {
            const int klim = (int)(k_len - kt);                       // keys valid below this
            const int lo_lim = (int)(row_lo + shift - kt);            // causal: key index <= this
            const int hi_lim = lo_lim + 8;
            const bool lo_ok = row_lo < q_len, hi_ok = row_hi < q_len;
#pragma unroll
            for (int n = 0; n < FP_BK / 8; ++n) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int key = n * 8 + 2 * t + j;
                    bool vlo = key < klim && lo_ok && (!causal || key <= lo_lim);
                    bool vhi = key < klim && hi_ok && (!causal || key <= hi_lim);
                    s[n][j] = vlo ? s[n][j] * sl2 : -INFINITY;
                    s[n][2 + j] = vhi ? s[n][2 + j] * sl2 : -INFINITY;
                    mx_lo = fmaxf(mx_lo, s[n][j]);
                    mx_hi = fmaxf(mx_hi, s[n][2 + j]);
                }
            }
        }
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        // Rows with nothing visible yet keep m = -inf: use 0 as the reference so exp2 gives 0.
        const float ref_lo = mn_lo == -INFINITY ? 0.0f : mn_lo, ref_hi = mn_hi == -INFINITY ? 0.0f : mn_hi;
        const float al_lo = exp2f(m_lo - ref_lo), al_hi = exp2f(m_hi - ref_hi);
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int n = 0; n < FP_BK / 8; ++n) {
            s[n][0] = exp2f(s[n][0] - ref_lo);
            s[n][1] = exp2f(s[n][1] - ref_lo);
            s[n][2] = exp2f(s[n][2] - ref_hi);
            s[n][3] = exp2f(s[n][3] - ref_hi);
            sum_lo += s[n][0] + s[n][1];
            sum_hi += s[n][2] + s[n][3];
        }
        sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 1);
        sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 2);
        sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 1);
        sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 2);
        l_lo = l_lo * al_lo + sum_lo;
        l_hi = l_hi * al_hi + sum_hi;
        m_lo = mn_lo;
        m_hi = mn_hi;
#pragma unroll
        for (int n = 0; n < FP_NT; ++n) {
            o[n][0] *= al_lo;
            o[n][1] *= al_lo;
            o[n][2] *= al_hi;
            o[n][3] *= al_hi;
        }
        // O += P · V: P comes straight from the S accumulators (FlashAttention-2 layout trick).
#pragma unroll
        for (int kk = 0; kk < FP_BK / 16; ++kk) {
            unsigned a[4];
            a[0] = fp_pack(s[2 * kk][0], s[2 * kk][1]);
            a[1] = fp_pack(s[2 * kk][2], s[2 * kk][3]);
            a[2] = fp_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = fp_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const bf16* vrow = Vt + (kk * 16 + (lane & 15)) * FP_LDV;
#pragma unroll
            for (int n = 0; n < FP_NT; ++n) {
                unsigned b0, b1;
                fp_ldmatrix_x2_trans(b0, b1, vrow + n * 8);
                fp_mma(o[n], a, b0, b1);
            }
        }
        __syncthreads();
    }
    asm volatile("cp.async.wait_group 0;\n" ::);

    // Write rows g and g+8 of this warp: natural-log LSE = m·ln2 + ln l.
    const float ln2 = 0.6931471805599453f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 row = half ? row_hi : row_lo;
        if (row >= q_len) continue;
        const float l = half ? l_hi : l_lo, m = half ? m_hi : m_lo;
        const i64 base = (q_off + row) * nh + h;
        if (l > 0.0f) {
            const float inv = 1.0f / l;
#pragma unroll
            for (int n = 0; n < FP_NT; ++n) {
                out[base * MLA_DV + n * 8 + 2 * t] = o[n][2 * half] * inv;
                out[base * MLA_DV + n * 8 + 2 * t + 1] = o[n][2 * half + 1] * inv;
            }
            if (t == 0) lse[base] = m * ln2 + logf(l);
        } else if (empty != 2) {
#pragma unroll
            for (int n = 0; n < FP_NT; ++n) {
                out[base * MLA_DV + n * 8 + 2 * t] = 0.0f;
                out[base * MLA_DV + n * 8 + 2 * t + 1] = 0.0f;
            }
            if (t == 0) lse[base] = empty == 1 ? INFINITY : -INFINITY;
        }
    }
}
