// Fast MQA decode, split-KV stage 1 on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate)
// over the paged latent cache. Compiled per shape with -DMLA_W=<L+R> -DMLA_DV=<L> (W a multiple
// of 16, DV a multiple of 32).
//
// decode_split_mma(q, cache, tables, ctx, parts, lses, n, nh, block_size, max_blocks, splits,
//                  scale, empty_lse)
//   q      [n, nh, W] bf16        query rows [ql_nope | q_pe_roped] of n decode tokens
//   cache  [num_blocks·block_size, W] bf16   rows [kv_c_normed | k_pe_roped]; value = first DV
//   tables [n, max_blocks] i64 block ids      ctx [n] i64 context length of each token
//   parts  [splits, n, nh, DV] f32            lses [splits, n, nh] f32 (natural log)
//   grid (n · ⌈nh/16⌉, splits), 128 threads: one block takes 16 heads of one token (the M = 16
//   rows of the MMA; heads past nh are zero rows) and the positions of one split,
//   [s·⌈ctx/splits⌉, …) ∩ [0, ctx). An empty split writes no output and lse = empty_lse.
// Per tile of 32 cache rows (double-buffered with cp.async): each warp computes S for 8 keys
// (Q·Kᵀ over W), the block applies the online softmax, and each warp
// accumulates O for its quarter of the DV value columns (P·V, V fragments via ldmatrix.trans).
// The softmax runs one warp per four head rows, one lane per key, with shuffles for max and sum.

#ifndef MLA_W
#define MLA_W 576
#endif
#ifndef MLA_DV
#define MLA_DV 512
#endif

#define FD_BK 32
#define FD_LD (MLA_W + 8)          // bf16 row stride of Q and cache tiles
#define FD_KSTEPS (MLA_W / 16)
#define FD_WDV (MLA_DV / 4)        // value columns per warp
#define FD_NT (FD_WDV / 8)
#define FD_LDP (FD_BK + 8)         // bf16 row stride of P

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ void fd_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned fd_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void fd_cp16(void* dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fd_smem_addr(dst)), "l"(src), "r"(n));
}

extern "C" __global__ void __launch_bounds__(128)
    decode_split_mma(const bf16* q, const bf16* cache, const i64* tables, const i64* ctx, float* parts,
                     float* lses, i64 n, i64 nh, i64 block_size, i64 max_blocks, i64 splits, float scale,
                     float empty_lse) {
    extern __shared__ __align__(16) unsigned char fd_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(fd_smem);           // [16][LD]
    bf16* Cs = Qs + 16 * FD_LD;                              // [2][BK][LD]
    float* Ss = reinterpret_cast<float*>(Cs + 2 * FD_BK * FD_LD);  // [16][BK]
    bf16* Ps = reinterpret_cast<bf16*>(Ss + 16 * FD_BK);    // [16][LDP]
    float* Ms = reinterpret_cast<float*>(Ps + 16 * FD_LDP);  // [16] running max (log2 units)
    float* Ls = Ms + 16;                                      // [16] running sum
    float* As = Ls + 16;                                      // [16] rescale factor of this tile

    const i64 groups = (nh + 15) / 16;
    const i64 i = blockIdx.x / groups, h0 = (blockIdx.x % groups) * 16;
    const i64 s = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const i64 c = ctx[i];
    const i64 sl = (c + splits - 1) / splits;
    const i64 k0 = min(s * sl, c), k1 = min((s + 1) * sl, c);
    if (k0 == k1) {
        if (tid < 16 && h0 + tid < nh) lses[(s * n + i) * nh + h0 + tid] = empty_lse;
        return;
    }
    for (int e = tid; e < 16 * (MLA_W / 8); e += 128) {
        int r = e / (MLA_W / 8), col = (e % (MLA_W / 8)) * 8;
        bool ok = h0 + r < nh;
        fd_cp16(Qs + r * FD_LD + col, q + ((i * nh + (ok ? h0 + r : 0)) * MLA_W) + col, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    const i64* table = tables + i * max_blocks;
    __shared__ long long fd_slots[2][FD_BK];
    // Slots of a tile's rows are computed once per row (one division each), then every thread
    // issues its 16-byte copies.
    auto slots_of = [&](int stage, i64 kt) {
        if (tid < FD_BK) {
            const i64 pos = kt + tid;
            fd_slots[stage][tid] = pos < k1 ? table[pos / block_size] * block_size + pos % block_size : -1;
        }
    };
    auto load_tile = [&](int stage) {
        bf16* dst = Cs + stage * FD_BK * FD_LD;
        for (int e = tid; e < FD_BK * (MLA_W / 8); e += 128) {
            const int r = e / (MLA_W / 8), col = (e % (MLA_W / 8)) * 8;
            const i64 slot = fd_slots[stage][r];
            fd_cp16(dst + r * FD_LD + col, cache + (slot < 0 ? 0 : slot) * MLA_W + col, slot >= 0);
        }
    };
    const int n_tiles = (int)((k1 - k0 + FD_BK - 1) / FD_BK);
    slots_of(0, k0);
    __syncthreads();
    load_tile(0);
    asm volatile("cp.async.commit_group;\n" ::);
    if (tid < 16) {
        Ms[tid] = -INFINITY;
        Ls[tid] = 0.0f;
    }
    float o[FD_NT][4];
#pragma unroll
    for (int nn = 0; nn < FD_NT; ++nn) o[nn][0] = o[nn][1] = o[nn][2] = o[nn][3] = 0.0f;
    const float sl2 = scale * 1.4426950408889634f;

    for (int it = 0; it < n_tiles; ++it) {
        const i64 kt = k0 + (i64)it * FD_BK;
        if (it + 1 < n_tiles) {
            slots_of((it + 1) & 1, kt + FD_BK);
            __syncthreads();
            load_tile((it + 1) & 1);
            asm volatile("cp.async.commit_group;\n" ::);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const bf16* Ct = Cs + (it & 1) * FD_BK * FD_LD;
        // S for keys [8·warp, 8·warp + 8) of the tile: 16 heads × 8 keys.
        {
            // Four independent accumulator chains (k-steps mod 4) keep the tensor cores busy.
            float acc4[4][4] = {};
            const bf16* kb = Ct + (warp * 8 + g) * FD_LD + 2 * t;
            const bf16* qb = Qs + g * FD_LD + 2 * t;
#pragma unroll 4
            for (int kk = 0; kk < FD_KSTEPS; ++kk) {
                unsigned a[4];
                a[0] = *reinterpret_cast<const unsigned*>(qb + kk * 16);
                a[1] = *reinterpret_cast<const unsigned*>(qb + 8 * FD_LD + kk * 16);
                a[2] = *reinterpret_cast<const unsigned*>(qb + kk * 16 + 8);
                a[3] = *reinterpret_cast<const unsigned*>(qb + 8 * FD_LD + kk * 16 + 8);
                unsigned b0 = *reinterpret_cast<const unsigned*>(kb + kk * 16);
                unsigned b1 = *reinterpret_cast<const unsigned*>(kb + kk * 16 + 8);
                fd_mma(acc4[kk & 3], a, b0, b1);
            }
            float sacc[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) sacc[j] = (acc4[0][j] + acc4[1][j]) + (acc4[2][j] + acc4[3][j]);
            const int key = warp * 8 + 2 * t;
            Ss[g * FD_BK + key] = sacc[0];
            Ss[g * FD_BK + key + 1] = sacc[1];
            Ss[(g + 8) * FD_BK + key] = sacc[2];
            Ss[(g + 8) * FD_BK + key + 1] = sacc[3];
        }
        __syncthreads();
        // Online softmax: warp w takes head rows 4w..4w+3, lane j takes key j of the tile.
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const int row = warp * 4 + rr;
            const float x = kt + lane < k1 ? Ss[row * FD_BK + lane] * sl2 : -INFINITY;
            float mx = x;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_old = Ms[row];
            const float mn = fmaxf(m_old, mx);
            const float p = exp2f(x - mn);
            float sum = p;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            Ps[row * FD_LDP + lane] = __float2bfloat16_rn(p);
            __syncwarp();
            if (lane == 0) {
                const float al = exp2f(m_old - mn);
                Ls[row] = Ls[row] * al + sum;
                Ms[row] = mn;
                As[row] = al;
            }
        }
        __syncthreads();
        // O[:, warp quarter] = O·alpha + P · V.
        const float al_lo = As[g], al_hi = As[g + 8];
#pragma unroll
        for (int nn = 0; nn < FD_NT; ++nn) {
            o[nn][0] *= al_lo;
            o[nn][1] *= al_lo;
            o[nn][2] *= al_hi;
            o[nn][3] *= al_hi;
        }
#pragma unroll
        for (int kk = 0; kk < FD_BK / 16; ++kk) {
            unsigned a[4];
            const bf16* pb = Ps + g * FD_LDP + kk * 16 + 2 * t;
            a[0] = *reinterpret_cast<const unsigned*>(pb);
            a[1] = *reinterpret_cast<const unsigned*>(pb + 8 * FD_LDP);
            a[2] = *reinterpret_cast<const unsigned*>(pb + 8);
            a[3] = *reinterpret_cast<const unsigned*>(pb + 8 * FD_LDP + 8);
            const bf16* vrow = Ct + (kk * 16 + (lane & 15)) * FD_LD + warp * FD_WDV;
#pragma unroll
            for (int nn = 0; nn < FD_NT; ++nn) {
                unsigned b0, b1;
                asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                             : "=r"(b0), "=r"(b1)
                             : "r"(fd_smem_addr(vrow + nn * 8)));
                fd_mma(o[nn], a, b0, b1);
            }
        }
        __syncthreads();
    }
    // Partial output and its natural-log LSE.
    const float ln2 = 0.6931471805599453f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        if (h0 + r >= nh) continue;
        const float l = Ls[r];
        const i64 base = ((s * n + i) * nh + h0 + r) * MLA_DV + warp * FD_WDV;
#pragma unroll
        for (int nn = 0; nn < FD_NT; ++nn) {
            parts[base + nn * 8 + 2 * t] = o[nn][2 * half] / l;
            parts[base + nn * 8 + 2 * t + 1] = o[nn][2 * half + 1] / l;
        }
        if (warp == 0 && t == 0) lses[(s * n + i) * nh + h0 + r] = Ms[r] * ln2 + logf(l);
    }
}
