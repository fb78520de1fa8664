// Fast MHA prefill: FlashAttention-2 forward on tensor cores (mma.sync m16n8k16, bf16 in,
// f32 accumulate), compiled per shape with -DMLA_DQK=<P+R> -DMLA_DV=<V> (multiples of 16) and per
// launch configuration with
//   FP_WARPS   warps per block
//   FP_MT      16-row m-tiles per warp (1 or 2): a block holds 16·FP_MT·FP_WARPS query rows, and
//              every K/V fragment read from shared memory feeds FP_MT MMAs
//   FP_BK      keys per K/V tile (32 or 64)
//   FP_STAGES  K/V tiles in the cp.async pipeline (2..4); one block barrier per tile
//   FP_QREG    1: each warp loads its Q fragments from global memory into registers once (no Q
//              tile in shared memory; FP_MT = 1 only); 0: Q stays in shared memory and its A
//              fragments are read with ldmatrix at every tile (fewer registers, more
//              shared-memory traffic)
//   FP_MINB    blocks per SM the register allocation must allow (__launch_bounds__)
//   FP_INDIRECT 1: the keys are read through krows (below)
//
// flash_prefill_mma(q, k, v, out, lse, segs, tiles, krows, nh, scale, empty)
//   q    [Tq, nh, DQK] bf16        k [Tk, nh, DQK] bf16        v [Tk, nh, DV] bf16
//   out  [Tq, nh, DV] f32, written in place        lse [Tq, nh] f32 (natural log)
//   segs [nseg, 5] i64: q_off, q_len, k_off, k_len, causal (query i sees key j iff
//        j <= i + k_len - q_len when causal)
//   tiles [n_tiles, 2] i64: (segment, first query row, a multiple of 16·FP_MT·FP_WARPS); grid
//        (n_tiles, nh); 32·FP_WARPS threads
//   krows i64: with FP_INDIRECT 1, key j of a segment is row krows[k_off + j] of k and v (the DSA
//        selection read by index: each K/V tile row is addressed on its own); with FP_INDIRECT 0
//        (a separate build, so the dense kernel keeps its registers) row k_off + j, krows unread
//   empty: a row with no visible key gets 0 = out 0, lse -inf; 1 = out 0, lse +inf; 2 = nothing
// Per K/V tile: wait for tile it (cp.async group), one __syncthreads (tile it landed for every
// warp, tile it-1's stage free), issue the copy of tile it+STAGES-1, S = Q·Kᵀ (K's B fragments
// by ldmatrix.x4, two key n-tiles per instruction), online softmax in registers (masks only on
// boundary tiles), O += P·V with P reused from the S accumulators as the A operand and V's B
// fragments by ldmatrix.x4.trans (two value n-tiles per instruction).

#ifndef MLA_DQK
#define MLA_DQK 192
#endif
#ifndef MLA_DV
#define MLA_DV 128
#endif
#ifndef FP_WARPS
#define FP_WARPS 4
#endif
#ifndef FP_MT
#define FP_MT 1
#endif
#ifndef FP_BK
#define FP_BK 64
#endif
#ifndef FP_STAGES
#define FP_STAGES 2
#endif
#ifndef FP_QREG
#define FP_QREG 0
#endif
#ifndef FP_MINB
#define FP_MINB 1
#endif
#ifndef FP_INDIRECT
#define FP_INDIRECT 0
#endif

#define FP_THREADS (32 * FP_WARPS)
#define FP_BQ (16 * FP_MT * FP_WARPS)
#define FP_LDK (MLA_DQK + 8)   // bf16 row stride of Q and K tiles (pad: no bank conflicts)
#define FP_LDV (MLA_DV + 8)    // bf16 row stride of V tiles
#define FP_KSTEPS (MLA_DQK / 16)
#define FP_NT (MLA_DV / 8)
#define FP_SNT (FP_BK / 8)     // key n-tiles of S per tile
#define FP_STAGE_ELEMS (FP_BK * (FP_LDK + FP_LDV))
#define FP_KCH (FP_BK * (MLA_DQK / 8))  // 16-byte chunks of one K tile
#define FP_VCH (FP_BK * (MLA_DV / 8))   // 16-byte chunks of one V tile

#if (MLA_DQK % 16) || (MLA_DV % 16) || (FP_BK != 32 && FP_BK != 64) || FP_STAGES < 2 || FP_STAGES > 4 || \
    (FP_MT != 1 && FP_MT != 2) || (FP_QREG && FP_MT != 1)
#error "fast_prefill.cu: unsupported configuration"
#endif

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ unsigned fp_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

__device__ __forceinline__ void fp_ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void fp_ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ unsigned fp_ld32(const bf16* p, bool ok) {
    return ok ? *reinterpret_cast<const unsigned*>(p) : 0u;
}

extern "C" __global__ void __launch_bounds__(FP_THREADS, FP_MINB)
    flash_prefill_mma(const bf16* q, const bf16* k, const bf16* v, float* out, float* lse, const i64* segs,
                      const i64* tiles, const i64* krows, i64 nh, float scale, int empty) {
    extern __shared__ __align__(16) unsigned char fp_smem[];
    bf16* St = reinterpret_cast<bf16*>(fp_smem);  // [STAGES][BK·LDK (K) + BK·LDV (V)]
#if !FP_QREG
    bf16* Qs = St + FP_STAGES * FP_STAGE_ELEMS;    // [BQ][LDK]
#endif

    const i64 tile = blockIdx.x, h = blockIdx.y;
    const i64 seg = tiles[2 * tile], q0 = tiles[2 * tile + 1];
    const i64 q_off = segs[5 * seg], q_len = segs[5 * seg + 1], k_off = segs[5 * seg + 2];
    const i64 k_len = segs[5 * seg + 3], causal = segs[5 * seg + 4];
    const i64 shift = k_len - q_len;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // Local query indices of this thread's rows: m-tile mt holds rows row0 + 16·mt (+8).
    const i64 row0 = q0 + warp * 16 * FP_MT + g;

#if FP_QREG
    // This warp's Q A-fragments straight from global memory (rows past q_len read as 0).
    unsigned qa[FP_KSTEPS][4];
    {
        const i64 row_lo = row0, row_hi = row0 + 8;
        const bool lo_ok = row_lo < q_len, hi_ok = row_hi < q_len;
        const bf16* qlo = q + ((q_off + (lo_ok ? row_lo : 0)) * nh + h) * MLA_DQK + 2 * t;
        const bf16* qhi = q + ((q_off + (hi_ok ? row_hi : 0)) * nh + h) * MLA_DQK + 2 * t;
#pragma unroll
        for (int kk = 0; kk < FP_KSTEPS; ++kk) {
            qa[kk][0] = fp_ld32(qlo + kk * 16, lo_ok);
            qa[kk][1] = fp_ld32(qhi + kk * 16, hi_ok);
            qa[kk][2] = fp_ld32(qlo + kk * 16 + 8, lo_ok);
            qa[kk][3] = fp_ld32(qhi + kk * 16 + 8, hi_ok);
        }
    }
#else
    // Q tile: rows q0..q0+BQ of this segment (zero beyond q_len); lands with K/V tile 0's group.
    for (int e = tid; e < FP_BQ * (MLA_DQK / 8); e += FP_THREADS) {
        int r = e / (MLA_DQK / 8), c = (e % (MLA_DQK / 8)) * 8;
        bool ok = q0 + r < q_len;
        const bf16* src = q + ((q_off + (ok ? q0 + r : 0)) * nh + h) * MLA_DQK + c;
        mla_cp16(Qs + r * FP_LDK + c, src, ok);
    }
    // ldmatrix.x4 address of this lane for A fragments (rows lane%16, columns (lane/16)·8).
    const unsigned qs_addr = mla_smem_addr(Qs + (warp * 16 * FP_MT + (lane & 15)) * FP_LDK + (lane >> 4) * 8);
#endif

    // Keys this block needs: with causal masking, none past its last query's horizon.
    i64 k_end = k_len;
    if (causal) {
        i64 last = q0 + FP_BQ - 1 + shift + 1;
        if (last < k_end) k_end = last > 0 ? last : 0;
    }
    const int n_tiles = (int)((k_end + FP_BK - 1) / FP_BK);

    // Row strides in elements (the host checks 64·nh·DQK and 64·nh·DV fit in 31 bits, so a
    // tile's offsets from its first row are 32-bit).
    const int row_stride_k = (int)nh * MLA_DQK, row_stride_v = (int)nh * MLA_DV;
    const bf16* kg = k + (k_off * nh + h) * MLA_DQK;
    const bf16* vg = v + (k_off * nh + h) * MLA_DV;
    auto load_kv = [&](int it) {
        bf16* kd = St + (it % FP_STAGES) * FP_STAGE_ELEMS;
        bf16* vd = kd + FP_BK * FP_LDK;
        const i64 kt = (i64)it * FP_BK;
        const bf16* kb = kg + kt * row_stride_k;
        const bf16* vb = vg + kt * row_stride_v;
        const int lim = (int)min((i64)FP_BK, k_len - kt);  // rows of this tile inside the sequence
#pragma unroll
        for (int i = 0; i < (FP_KCH + FP_THREADS - 1) / FP_THREADS; ++i) {
            const int e = tid + i * FP_THREADS;
            if (FP_KCH % FP_THREADS == 0 || e < FP_KCH) {
                const int r = e / (MLA_DQK / 8), c = (e % (MLA_DQK / 8)) * 8;
                const bool ok = r < lim;
#if FP_INDIRECT
                const bf16* src = ok ? k + (krows[k_off + kt + r] * nh + h) * MLA_DQK + c : kb;
#else
                const bf16* src = kb + (ok ? r * row_stride_k + c : 0);
#endif
                mla_cp16(kd + r * FP_LDK + c, src, ok);
            }
        }
#pragma unroll
        for (int i = 0; i < (FP_VCH + FP_THREADS - 1) / FP_THREADS; ++i) {
            const int e = tid + i * FP_THREADS;
            if (FP_VCH % FP_THREADS == 0 || e < FP_VCH) {
                const int r = e / (MLA_DV / 8), c = (e % (MLA_DV / 8)) * 8;
                const bool ok = r < lim;
#if FP_INDIRECT
                const bf16* src = ok ? v + (krows[k_off + kt + r] * nh + h) * MLA_DV + c : vb;
#else
                const bf16* src = vb + (ok ? r * row_stride_v + c : 0);
#endif
                mla_cp16(vd + r * FP_LDV + c, src, ok);
            }
        }
    };

    // Prologue: tiles 0 .. STAGES-2, one commit group each (empty groups past the last tile keep
    // the group count uniform; the Q tile rides with group 0).
#pragma unroll
    for (int s = 0; s < FP_STAGES - 1; ++s) {
        if (s < n_tiles) load_kv(s);
        asm volatile("cp.async.commit_group;\n" ::);
    }

    float o[FP_MT][FP_NT][4];
    float m_lo[FP_MT], m_hi[FP_MT], l_lo[FP_MT], l_hi[FP_MT];
#pragma unroll
    for (int mt = 0; mt < FP_MT; ++mt) {
#pragma unroll
        for (int n = 0; n < FP_NT; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
        m_lo[mt] = m_hi[mt] = -INFINITY;
        l_lo[mt] = l_hi[mt] = 0.0f;
    }
    const float sl2 = scale * 1.4426950408889634f;  // scale · log2(e)
    // ldmatrix lane offsets: K (non-transposed) rows (lane&7) + ((lane>>4)·8), columns
    // ((lane>>3)&1)·8 give b0, b1 of key n-tile n and b0, b1 of n-tile n+1; V (transposed) rows
    // (lane&7) + ((lane>>3)&1)·8, columns (lane>>4)·8 give b0, b1 of value n-tiles n and n+1.
    const int k_lane = ((lane & 7) + (lane >> 4) * 8) * FP_LDK + ((lane >> 3) & 1) * 8;
    const int v_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * FP_LDV + (lane >> 4) * 8;

    for (int it = 0; it < n_tiles; ++it) {
        const i64 kt = (i64)it * FP_BK;
        asm volatile("cp.async.wait_group %0;\n" ::"n"(FP_STAGES - 2));
        __syncthreads();
        if (it + FP_STAGES - 1 < n_tiles) load_kv(it + FP_STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);

        const bf16* Kt = St + (it % FP_STAGES) * FP_STAGE_ELEMS;
        const unsigned k_addr = mla_smem_addr(Kt + k_lane);
        const unsigned v_addr = mla_smem_addr(Kt + FP_BK * FP_LDK + v_lane);

        // S = Q · Kᵀ for this warp's rows and the tile's keys; k-steps outside, key n-tiles
        // inside: FP_MT·FP_SNT independent accumulators per k-step, each K fragment used FP_MT
        // times.
        float s[FP_MT][FP_SNT][4];
#pragma unroll
        for (int mt = 0; mt < FP_MT; ++mt)
#pragma unroll
            for (int n = 0; n < FP_SNT; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < FP_KSTEPS; ++kk) {
#if FP_QREG
            const unsigned* a0 = qa[kk];
#else
            unsigned a[FP_MT][4];
#pragma unroll
            for (int mt = 0; mt < FP_MT; ++mt) fp_ldmatrix_x4(a[mt], qs_addr + (mt * 16 * FP_LDK + kk * 16) * 2);
#endif
#pragma unroll
            for (int n = 0; n < FP_SNT; n += 2) {
                unsigned b[4];
                fp_ldmatrix_x4(b, k_addr + (n * 8 * FP_LDK + kk * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < FP_MT; ++mt) {
#if FP_QREG
                    const unsigned* am = a0;
#else
                    const unsigned* am = a[mt];
#endif
                    mla_mma_16816(s[mt][n], am, b[0], b[1]);
                    mla_mma_16816(s[mt][n + 1], am, b[2], b[3]);
                }
            }
        }
        const bool interior_kq = kt + FP_BK <= k_len && q0 + FP_BQ <= q_len;
#pragma unroll
        for (int mt = 0; mt < FP_MT; ++mt) {
            const i64 row_lo = row0 + 16 * mt, row_hi = row_lo + 8;
            // Mask (sequence end, causal horizon, rows past q_len) only on tiles that need it;
            // the maxima are taken on the raw scores (the scale is positive) and the scale to
            // log2 units is folded into the exponent's FMA below.
            float mx_lo = -INFINITY, mx_hi = -INFINITY;
            const bool interior = interior_kq && (!causal || kt + FP_BK - 1 <= row0 - g + 16 * mt + shift);
            if (interior) {
#pragma unroll
                for (int n = 0; n < FP_SNT; ++n) {
                    mx_lo = fmaxf(mx_lo, fmaxf(s[mt][n][0], s[mt][n][1]));
                    mx_hi = fmaxf(mx_hi, fmaxf(s[mt][n][2], s[mt][n][3]));
                }
            } else {
                const int klim = (int)(k_len - kt);             // keys valid below this
                const int lo_lim = (int)(row_lo + shift - kt);  // causal: key index <= this
                const int hi_lim = lo_lim + 8;
                const bool lo_ok = row_lo < q_len, hi_ok = row_hi < q_len;
#pragma unroll
                for (int n = 0; n < FP_SNT; ++n) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int key = n * 8 + 2 * t + j;
                        bool vlo = key < klim && lo_ok && (!causal || key <= lo_lim);
                        bool vhi = key < klim && hi_ok && (!causal || key <= hi_lim);
                        s[mt][n][j] = vlo ? s[mt][n][j] : -INFINITY;
                        s[mt][n][2 + j] = vhi ? s[mt][n][2 + j] : -INFINITY;
                        mx_lo = fmaxf(mx_lo, s[mt][n][j]);
                        mx_hi = fmaxf(mx_hi, s[mt][n][2 + j]);
                    }
                }
            }
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
            const float mn_lo = fmaxf(m_lo[mt], mx_lo * sl2), mn_hi = fmaxf(m_hi[mt], mx_hi * sl2);
            // Rows with nothing visible yet keep m = -inf: use 0 as the reference so exp2 gives 0.
            const float ref_lo = mn_lo == -INFINITY ? 0.0f : mn_lo, ref_hi = mn_hi == -INFINITY ? 0.0f : mn_hi;
            const float al_lo = exp2f(m_lo[mt] - ref_lo), al_hi = exp2f(m_hi[mt] - ref_hi);
            float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
            for (int n = 0; n < FP_SNT; ++n) {
                s[mt][n][0] = exp2f(fmaf(s[mt][n][0], sl2, -ref_lo));
                s[mt][n][1] = exp2f(fmaf(s[mt][n][1], sl2, -ref_lo));
                s[mt][n][2] = exp2f(fmaf(s[mt][n][2], sl2, -ref_hi));
                s[mt][n][3] = exp2f(fmaf(s[mt][n][3], sl2, -ref_hi));
                sum_lo += s[mt][n][0] + s[mt][n][1];
                sum_hi += s[mt][n][2] + s[mt][n][3];
            }
            sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 1);
            sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, 2);
            sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 1);
            sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, 2);
            l_lo[mt] = l_lo[mt] * al_lo + sum_lo;
            l_hi[mt] = l_hi[mt] * al_hi + sum_hi;
            m_lo[mt] = mn_lo;
            m_hi[mt] = mn_hi;
#pragma unroll
            for (int n = 0; n < FP_NT; ++n) {
                o[mt][n][0] *= al_lo;
                o[mt][n][1] *= al_lo;
                o[mt][n][2] *= al_hi;
                o[mt][n][3] *= al_hi;
            }
        }
        // O += P · V: P comes straight from the S accumulators (FlashAttention-2 layout trick);
        // each V fragment feeds FP_MT MMAs.
#pragma unroll
        for (int kk = 0; kk < FP_BK / 16; ++kk) {
            unsigned a[FP_MT][4];
#pragma unroll
            for (int mt = 0; mt < FP_MT; ++mt) {
                a[mt][0] = fp_pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = fp_pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = fp_pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = fp_pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int n = 0; n < FP_NT; n += 2) {
                unsigned b[4];
                fp_ldmatrix_x4_trans(b, v_addr + (kk * 16 * FP_LDV + n * 8) * 2);
#pragma unroll
                for (int mt = 0; mt < FP_MT; ++mt) {
                    mla_mma_16816(o[mt][n], a[mt], b[0], b[1]);
                    mla_mma_16816(o[mt][n + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);

    // Write rows g and g+8 of each m-tile: natural-log LSE = m·ln2 + ln l.
    const float ln2 = 0.6931471805599453f;
#pragma unroll
    for (int mt = 0; mt < FP_MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const i64 row = row0 + 16 * mt + 8 * half;
            if (row >= q_len) continue;
            const float l = half ? l_hi[mt] : l_lo[mt], m = half ? m_hi[mt] : m_lo[mt];
            float* orow = out + ((q_off + row) * nh + h) * MLA_DV + 2 * t;
            if (l > 0.0f) {
                const float inv = 1.0f / l;
#pragma unroll
                for (int n = 0; n < FP_NT; ++n)
                    *reinterpret_cast<float2*>(orow + n * 8) =
                        make_float2(o[mt][n][2 * half] * inv, o[mt][n][2 * half + 1] * inv);
                if (t == 0) lse[(q_off + row) * nh + h] = m * ln2 + logf(l);
            } else if (empty != 2) {
#pragma unroll
                for (int n = 0; n < FP_NT; ++n) *reinterpret_cast<float2*>(orow + n * 8) = make_float2(0.0f, 0.0f);
                if (t == 0) lse[(q_off + row) * nh + h] = empty == 1 ? INFINITY : -INFINITY;
            }
        }
    }
}
