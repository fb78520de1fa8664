// MLA attention kernels: expanded prefill (flash attention with LSE), split-KV absorbed decode
// over the paged latent cache, and the LSE merge shared by decode splits and chunked prefill.
//
// flash_prefill_{f32,bf16}(q, k, v, out, lse, segs, tiles, krows, indirect, nh, dqk, dv, scale, empty)
//   q    [Tq, nh, dqk]  (dqk = P+R; f32 or bf16)      k [Tk, nh, dqk]   v [Tk, nh, dv] (dv = V)
//   out  [Tq, nh, dv] f32, written in place          lse [Tq, nh] f32 (natural log)
//   segs [nseg, 5] i64: q_off, q_len, k_off, k_len, causal (query i sees key j iff
//        j <= i + k_len - q_len when causal: bottom-right alignment)
//   krows i64, indirect: when indirect != 0, key j of a segment is row krows[k_off + j] of k and
//        v (the DSA selection read by index); otherwise row k_off + j and krows is not read
//   tiles [n_tiles, 2] i64: (segment, first query row of the tile); grid (n_tiles, nh)
//   empty: what a row with no visible key gets: 0 = out 0, lse -inf; 1 = out 0, lse +inf;
//          2 = nothing written (the caller's canary stays)
//   One warp per query row (4 rows per block); K/V tiles of FLASH_BK keys staged in shared
//   memory; f32 accumulation with the running max / running sum of FlashAttention-2.
//
// decode_split_{f32,bf16}(q, cache, tables, ctx, parts, lses, n, nh, width, dv, block_size,
//                         max_blocks, splits, scale, empty_lse)
//   q      [n, nh, width]  query rows [ql_nope | q_pe_roped], width = L+R
//   cache  [num_blocks·block_size, width]  rows [kv_c_normed | k_pe_roped]; value = first dv = L
//   tables [n, max_blocks] i64 block ids   ctx [n] i64 context length of each query row
//   parts  [splits, n, nh, dv] f32         lses [splits, n, nh] f32
//   grid (n·nh, splits), one warp each: split s covers positions [s·⌈ctx/splits⌉, …) ∩ [0, ctx);
//   an empty split writes no output and lse = empty_lse (Triton MLA decode stage 1).
//
// merge_states(parts [k, rows, nh, dv], lses [k, rows, nh], out [rows, nh, dv], lse [rows, nh])
//   m = max lse_i; out = Σ o_i e^(lse_i−m) / Σ e^(lse_i−m); lse = m + ln Σ e^(lse_i−m). A partial
//   with lse −inf contributes nothing and is not read. A NaN lse (an unwritten partial) is
//   propagated with its payload, as CPU arithmetic would.

#define FLASH_ROWS 4
#define FLASH_BK 16
#define MAX_PER_LANE 16  // dv and dqk up to 512 per lane-strided register array

template <typename T> __device__ __forceinline__ float ldf(const T* p, i64 i);
template <> __device__ __forceinline__ float ldf<float>(const float* p, i64 i) { return p[i]; }
template <> __device__ __forceinline__ float ldf<__nv_bfloat16>(const __nv_bfloat16* p, i64 i) {
    return __bfloat162float(p[i]);
}

template <typename T>
__device__ void flash_prefill(const T* q, const T* k, const T* v, float* out, float* lse, const i64* segs,
                              const i64* tiles, const i64* krows, int indirect, i64 nh, i64 dqk, i64 dv,
                              float scale, int empty) {
    extern __shared__ float smem[];
    float* ks = smem;                              // [FLASH_BK, dqk]
    float* vs = ks + FLASH_BK * dqk;               // [FLASH_BK, dv]
    float* qs = vs + FLASH_BK * dv;                // [FLASH_ROWS, dqk]
    const i64 tile = blockIdx.x, h = blockIdx.y;
    const i64 seg = tiles[2 * tile], q0 = tiles[2 * tile + 1];
    const i64 q_off = segs[5 * seg], q_len = segs[5 * seg + 1], k_off = segs[5 * seg + 2];
    const i64 k_len = segs[5 * seg + 3], causal = segs[5 * seg + 4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 i = q0 + warp;  // local query index
    const bool active = i < q_len;
    const i64 shift = k_len - q_len;
    if (active)
        for (i64 d = lane; d < dqk; d += 32) qs[warp * dqk + d] = ldf(q, ((q_off + i) * nh + h) * dqk + d);
    float m = -INFINITY, l = 0.0f, acc[MAX_PER_LANE];
    for (int a = 0; a < MAX_PER_LANE; ++a) acc[a] = 0.0f;
    for (i64 kt = 0; kt < k_len; kt += FLASH_BK) {
        const i64 cols = min((i64)FLASH_BK, k_len - kt);
        __syncthreads();
        for (i64 e = threadIdx.x; e < cols * dqk; e += blockDim.x) {
            i64 c = e / dqk, d = e % dqk;
            const i64 kr = indirect ? krows[k_off + kt + c] : k_off + kt + c;
            ks[c * dqk + d] = ldf(k, (kr * nh + h) * dqk + d);
        }
        for (i64 e = threadIdx.x; e < cols * dv; e += blockDim.x) {
            i64 c = e / dv, d = e % dv;
            const i64 kr = indirect ? krows[k_off + kt + c] : k_off + kt + c;
            vs[c * dv + d] = ldf(v, (kr * nh + h) * dv + d);
        }
        __syncthreads();
        if (!active) continue;
        for (i64 c = 0; c < cols; ++c) {
            const i64 j = kt + c;
            if (causal && j > i + shift) break;
            float dot = 0.0f;
            for (i64 d = lane; d < dqk; d += 32) dot += qs[warp * dqk + d] * ks[c * dqk + d];
            const float s = mla_warp_sum(dot) * scale;
            const float m_new = fmaxf(m, s);
            const float alpha = expf(m - m_new);
            const float p = expf(s - m_new);
            int a = 0;
            for (i64 d = lane; d < dv; d += 32, ++a) acc[a] = acc[a] * alpha + p * vs[c * dv + d];
            l = l * alpha + p;
            m = m_new;
        }
    }
    if (!active) return;
    const i64 row = (q_off + i) * nh + h;
    if (l > 0.0f) {
        int a = 0;
        for (i64 d = lane; d < dv; d += 32, ++a) out[row * dv + d] = acc[a] / l;
        if (lane == 0) lse[row] = m + logf(l);
    } else if (empty != 2) {
        for (i64 d = lane; d < dv; d += 32) out[row * dv + d] = 0.0f;
        if (lane == 0) lse[row] = empty == 1 ? INFINITY : -INFINITY;
    }
}

extern "C" __global__ void flash_prefill_f32(const float* q, const float* k, const float* v, float* out, float* lse,
                                             const i64* segs, const i64* tiles, const i64* krows, int indirect,
                                             i64 nh, i64 dqk, i64 dv, float scale, int empty) {
    flash_prefill<float>(q, k, v, out, lse, segs, tiles, krows, indirect, nh, dqk, dv, scale, empty);
}

extern "C" __global__ void flash_prefill_bf16(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                              const __nv_bfloat16* v, float* out, float* lse, const i64* segs,
                                              const i64* tiles, const i64* krows, int indirect, i64 nh, i64 dqk,
                                              i64 dv, float scale, int empty) {
    flash_prefill<__nv_bfloat16>(q, k, v, out, lse, segs, tiles, krows, indirect, nh, dqk, dv, scale, empty);
}

template <typename T>
__device__ void decode_split(const T* q, const T* cache, const i64* tables, const i64* ctx, float* parts,
                             float* lses, i64 n, i64 nh, i64 width, i64 dv, i64 block_size, i64 max_blocks,
                             i64 splits, float scale, float empty_lse) {
    extern __shared__ float qsh[];  // [width]
    const i64 rh = blockIdx.x, s = blockIdx.y;
    const i64 i = rh / nh, h = rh % nh;
    const int lane = threadIdx.x;
    const i64 c = ctx[i];
    const i64 sl = (c + splits - 1) / splits;
    const i64 k0 = min(s * sl, c), k1 = min((s + 1) * sl, c);
    if (k0 == k1) {
        if (lane == 0) lses[(s * n + i) * nh + h] = empty_lse;
        return;
    }
    for (i64 d = lane; d < width; d += 32) qsh[d] = ldf(q, (i * nh + h) * width + d);
    __syncwarp();
    float m = -INFINITY, l = 0.0f, acc[MAX_PER_LANE];
    for (int a = 0; a < MAX_PER_LANE; ++a) acc[a] = 0.0f;
    for (i64 pos = k0; pos < k1; ++pos) {
        const i64 slot = tables[i * max_blocks + pos / block_size] * block_size + pos % block_size;
        const T* row = cache + slot * width;
        float dot = 0.0f;
        for (i64 d = lane; d < width; d += 32) dot += qsh[d] * ldf(row, d);
        const float sc = mla_warp_sum(dot) * scale;
        const float m_new = fmaxf(m, sc);
        const float alpha = expf(m - m_new);
        const float p = expf(sc - m_new);
        int a = 0;
        for (i64 d = lane; d < dv; d += 32, ++a) acc[a] = acc[a] * alpha + p * ldf(row, d);
        l = l * alpha + p;
        m = m_new;
    }
    const i64 o = ((s * n + i) * nh + h) * dv;
    int a = 0;
    for (i64 d = lane; d < dv; d += 32, ++a) parts[o + d] = acc[a] / l;
    if (lane == 0) lses[(s * n + i) * nh + h] = m + logf(l);
}

extern "C" __global__ void decode_split_f32(const float* q, const float* cache, const i64* tables, const i64* ctx,
                                            float* parts, float* lses, i64 n, i64 nh, i64 width, i64 dv,
                                            i64 block_size, i64 max_blocks, i64 splits, float scale,
                                            float empty_lse) {
    decode_split<float>(q, cache, tables, ctx, parts, lses, n, nh, width, dv, block_size, max_blocks, splits, scale,
                        empty_lse);
}

extern "C" __global__ void decode_split_bf16(const __nv_bfloat16* q, const __nv_bfloat16* cache, const i64* tables,
                                             const i64* ctx, float* parts, float* lses, i64 n, i64 nh, i64 width,
                                             i64 dv, i64 block_size, i64 max_blocks, i64 splits, float scale,
                                             float empty_lse) {
    decode_split<__nv_bfloat16>(q, cache, tables, ctx, parts, lses, n, nh, width, dv, block_size, max_blocks,
                                splits, scale, empty_lse);
}

extern "C" __global__ void merge_states(const float* parts, const float* lses, float* out, float* lse, i64 k,
                                        i64 rows, i64 nh, i64 dv) {
    // One thread per output element (coalesced); each recomputes its row's max and weights from
    // the k LSEs (k is small: the splits or chunks of one query row).
    const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= rows * nh * dv) return;
    const i64 rh = e / dv, d = e % dv;
    const i64 stride = rows * nh;
    float m = -INFINITY, q = 0.0f;
    const int state = mla_merge_scan([&](i64 s) { return lses[s * stride + rh]; }, k, &m, &q);
    if (state == MLA_MERGE_NAN) {
        // An unwritten (canary) LSE poisons the merge; keep its payload visible.
        out[e] = q;
        if (d == 0) lse[rh] = q;
        return;
    }
    if (state == MLA_MERGE_EMPTY) {
        out[e] = 0.0f;
        if (d == 0) lse[rh] = -INFINITY;
        return;
    }
    float denom = 0.0f, acc = 0.0f;
    for (i64 s = 0; s < k; ++s) {
        const float x = lses[s * stride + rh];
        if (x == -INFINITY) continue;
        const float w = expf(x - m);
        denom += w;
        acc += w * parts[(s * stride + rh) * dv + d];
    }
    out[e] = acc / denom;
    if (d == 0) lse[rh] = m + logf(denom);
}
