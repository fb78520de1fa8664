// Fast MQA decode, split-KV stage 1 on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate)
// over the paged latent cache. Compiled per shape with -DMLA_W=<L+R> -DMLA_DV=<L> (W a multiple
// of 16, DV a multiple of 32) and per launch configuration with
//   FD_HM      heads per block (the MMA's M: a multiple of 16; heads past nh are zero rows)
//   FD_WARPS   warps per block
//   FD_P       parts the W (k) dimension of Q·Kᵀ is cut into (partial scores summed in shared
//              memory by the softmax)
//   FD_QREG    1: each warp keeps its Q fragments in registers for the whole kernel; 0: read with
//              ldmatrix from shared memory at every tile
//   FD_STAGES  cache tiles in the cp.async pipeline (2..6)
//   FD_MINB    blocks per SM the registers must allow (__launch_bounds__)
//   FD_TMA     p ≥ 1: p extra producer warps stream the cache with bulk copies (cp.async.bulk,
//              one per row, the TMA engine; producer warp w copies rows [w·32/p, (w+1)·32/p) of
//              every tile) into FD_STAGES stages tracked by mbarriers (full: bytes landed; empty:
//              the FD_WARPS warps of the consuming team done with the stage), so the consumer
//              warps issue no copies, never wait on copies they issued, and need only the score
//              and softmax barriers (named, consumers only) per tile; 0: cp.async by all warps.
//              p divides 32.
//   FD_TEAMS   consumer teams of FD_WARPS warps each (needs FD_TMA, the unfused softmax, and
//              FD_TEAMS dividing 2·FD_STAGES with FD_STAGES ≥ FD_TEAMS). Team k takes tiles k,
//              k + TEAMS, … from the one stage ring, with its own running max, sum and O and its
//              own score, P and α buffers; a team barrier (below) replaces the block's two
//              per-tile barriers. Every team runs ⌈tiles/TEAMS⌉ iterations (one without a tile
//              passes its barriers only), so all teams execute the same barrier sequence. After
//              the loop the teams' states are combined in shared memory (max, weights
//              exp2(m_k − max), sum, Σ weight·O) into the block's partial, which then goes on as
//              with one team (parts/LSEs and the fused merge, or the cluster merge). With one
//              block per SM this keeps one Q copy and a deep ring while 2·FD_WARPS warps compute:
//              the layout that reached 82 % of copy on the memory-bound bench (BENCHMARKS.md,
//              with 4 stages). FD_TEAMS is 1 or 2 (more compile, but never ran).
//              The team barrier is a named barrier (bar.sync 2 + team, 32·FD_WARPS threads). One
//              mbarrier per team instead (lane 0 of each warp arriving after __syncwarp) was
//              1–4 % slower and drew racecheck hazards, so it was removed.
//   FD_FUSED   1: every warp reads the whole score tile in the MMA accumulator layout and runs
//              the online softmax itself, in registers (same inputs, same order: every warp
//              holds the same running max and sum), building P's A fragments directly — no P,
//              α or sum in shared memory and no third barrier per tile; 0: one warp per head
//              row, P and α through shared memory
//   FD_CLUSTER 0: the merge as below (global partials, atomic counter, last block merges);
//              c in 2..8 with DV a multiple of 4c (needs FD_TMA, sm_90+, splits == c and out
//              not null; the host picks c = splits when these hold, else 0): the `splits`
//              blocks of one (token, head group) form one thread-block cluster
//              (__cluster_dims__(1, c, 1): grid.y = splits = c, so cluster rank = split index).
//              Each block leaves its partial O [HM, DV] f32 (row stride FD_LDO) at the start of
//              its own dynamic shared memory (Q, cache stages, scores and P are free by then) and
//              its LSE per head in fd_lse [HM]; a cluster barrier (arrive.release/wait.acquire);
//              then the block of rank r merges value columns [r·DV/c, (r+1)·DV/c) of all HM
//              heads, reading the c blocks' LSEs and partials through distributed shared memory
//              (mapa + ld.shared::cluster.v4), in split order with fd_merge_fast's arithmetic
//              (bit-identical output), writes out and (rank 0) out_lse; a second cluster barrier
//              keeps every block's shared memory alive until all reads are done. No parts, lses,
//              counters or atomics are touched (they may be null). An empty split's block
//              stores LSE empty_lse and a zero partial.
//   FD_WG      1: the same launch on Hopper's warpgroup MMA instead (wgmma.mma_async, sm_90a;
//              FD_HM 64, FD_WARPS 8, FD_STAGES 2, no TMA, cluster, fused softmax or QREG): the
//              kernel after fd_merge_tail, described there. 0: mma.sync, below.
// FD_WARPS must equal (FD_HM/16) · FD_P · NG with NG dividing FD_BK/8 (the key n-tiles): warp w
// computes scores for m-tile w % MT, k-part (w / MT) % P (k-steps [part·KPP, (part+1)·KPP)) and
// key n-tiles of group w / (MT·P).
//
// decode_split_mma(q, cache, tables, ctx, parts, lses, n, nh, block_size, max_blocks, splits,
//                  scale, empty_lse, out, out_lse, counters, spin)
//   q      [n, nh, W] bf16        query rows [ql_nope | q_pe_roped] of n decode tokens
//   cache  [num_blocks·block_size, W] bf16   rows [kv_c_normed | k_pe_roped]; value = first DV
//   tables [n, max_blocks] i64 block ids      ctx [n] i64 context length of each token
//   parts  [splits, n, nh, DV] f32            lses [splits, n, nh] f32 (natural log)
//   grid (n · ⌈nh/HM⌉, splits), 32·(FD_WARPS·FD_TEAMS + FD_TMA) threads: one block takes HM heads of one token and
//   the positions of one split, [s·⌈ctx/splits⌉, …) ∩ [0, ctx). An empty split writes no output
//   and lse = empty_lse.
//   out    [n, nh, DV] f32, out_lse [n, nh] f32, counters [n · ⌈nh/HM⌉] i32 (zero before the launch,
//          zero again after it): when out is not null, the last block of each (token, head
//          group) to finish — counted with an atomic after its parts and LSEs are fenced —
//          merges the splits' partials exactly as attention.cu's merge_states does (same order,
//          IEEE exp, log and division), so no merge launch is needed. null: parts and lses only.
//   spin   1: instead, every block waits for its token's other splits and merges its share of
//          the value columns (see fd_merge_tail; the host sets it only when every block of the
//          launch is resident at once); 0: the last block merges everything.
// Per tile of 32 cache rows (FD_STAGES-deep cp.async pipeline; a tile's row slots are computed
// one tile ahead from a block-table entry prefetched into a register one more tile ahead):
//   sync A (tile landed, previous tile fully consumed) → issue the copy of tile it+STAGES-1 →
//   partial S = Q·Kᵀ per warp → sync B → online softmax (one warp per HM/WARPS head rows, one
//   lane per key; running max and sum in registers) → sync C → O = O·α + P·V, each warp taking
//   the value n-tiles w, w + WARPS, … for all HM rows (V fragments via ldmatrix.trans, reused
//   across the m-tiles).

#ifndef MLA_W
#define MLA_W 576
#endif
#ifndef MLA_DV
#define MLA_DV 512
#endif
#ifndef FD_HM
#define FD_HM 16
#endif
#ifndef FD_WARPS
#define FD_WARPS 8
#endif
#ifndef FD_P
#define FD_P 2
#endif
#ifndef FD_QREG
#define FD_QREG 0
#endif
#ifndef FD_STAGES
#define FD_STAGES 2
#endif
#ifndef FD_FUSED
#define FD_FUSED 0                 // softmax in registers by every warp (no P in shared memory)
#endif
#ifndef FD_TMA
#define FD_TMA 0                   // producer warp + bulk copies + mbarrier pipeline
#endif
#ifndef FD_MINB
#define FD_MINB 2                  // blocks per SM the register allocation must allow
#endif
#ifndef FD_WG
#define FD_WG 0                    // 1: the wgmma (sm_90a) kernel at the end of this file
#endif
#ifndef FD_CLUSTER
#define FD_CLUSTER 0               // blocks per cluster merging through distributed shared memory
#endif
#ifndef FD_TEAMS
#define FD_TEAMS 1                 // consumer teams taking alternate tiles of one stage ring
#endif

#define FD_BK 32                   // cache rows per tile (= lanes: one key per lane in softmax)
#define FD_LD (MLA_W + 8)          // bf16 row stride of Q and cache tiles
#define FD_KSTEPS (MLA_W / 16)
#define FD_MT (FD_HM / 16)         // m-tiles
#define FD_NG (FD_WARPS / (FD_MT * FD_P))  // key n-tile groups
#define FD_NTW ((FD_BK / 8) / FD_NG)       // key n-tiles per warp
#define FD_KPP ((FD_KSTEPS + FD_P - 1) / FD_P)  // k-steps per part
#define FD_NTV (MLA_DV / 8)        // value n-tiles
#define FD_NVW ((FD_NTV + FD_WARPS - 1) / FD_WARPS)  // value n-tiles per warp
#define FD_RPW (FD_HM / FD_WARPS)  // softmax rows per warp (0: fewer rows than warps)
#define FD_LDP (FD_BK + 8)         // bf16 row stride of P
#define FD_LDS (FD_BK + 8)         // f32 row stride of S (conflict-free float2 stores)
#define FD_CH (FD_NTW >= 2 ? 1 : 2)  // independent accumulator chains in Q·Kᵀ
#define FD_TT (32 * FD_WARPS)       // threads of one consumer team
#define FD_THREADS (FD_TT * FD_TEAMS)  // consumer threads (every thread without FD_TMA)
#define FD_BLOCK (FD_THREADS + 32 * FD_TMA)  // threads per block (+ the producer warps)
#define FD_LDO (MLA_DV + 8)        // f32 row stride of a partial O in shared memory
// Bytes of one team's score buffers, P and α; the block's dynamic shared memory is Q, the stages,
// FD_TEAMS of these, then the final sums [TEAMS][HM] (and with teams the final maxima [TEAMS][HM]).
#define FD_TEAM_BYTES (FD_SBUF * FD_P * FD_HM * FD_LDS * 4 + FD_HM * FD_LDP * 2 + FD_HM * 4)
#define FD_SUMS_AT (FD_HM * FD_LD * 2 + FD_STAGES * FD_BK * FD_LD * 2 + FD_TEAMS * FD_TEAM_BYTES)
#define FD_SBUF (FD_TMA ? 2 : 1)   // score buffers (TMA: by tile parity; the fused path has no
                                   // barrier between one tile's softmax reads and the next's
                                   // score writes)

#if FD_MT * FD_P * FD_NG != FD_WARPS || (FD_BK / 8) % FD_NG != 0 || FD_HM % 16 != 0
#error "fast_decode.cu: FD_WARPS must be (FD_HM/16) * FD_P * NG with NG dividing 4"
#endif
#if FD_HM >= FD_WARPS && FD_HM % FD_WARPS != 0
#error "fast_decode.cu: FD_HM must be a multiple of FD_WARPS, or at most FD_WARPS"
#endif
#if FD_STAGES < 2 || FD_STAGES > 6
#error "fast_decode.cu: FD_STAGES must be 2..6"
#endif
#if FD_TMA < 0 || FD_TMA > 32 || (FD_TMA > 0 && 32 % FD_TMA != 0)
#error "fast_decode.cu: FD_TMA (producer warps) must be 0 or divide 32"
#endif
#if FD_TEAMS < 1 || FD_TEAMS > 2
#error "fast_decode.cu: FD_TEAMS must be 1 or 2 (3 and 4 compile with the rules below but never ran on a GPU)"
#endif
#if FD_TEAMS > 1 && (!FD_TMA || FD_FUSED || FD_WG)
#error "fast_decode.cu: FD_TEAMS > 1 needs FD_TMA and the unfused mma.sync softmax"
#endif
// A team waiting for tile it polls the stage's full barrier with round it/STAGES's parity, which
// is exact only when the stage's previous round (tile it − STAGES) has landed. With TEAMS dividing
// STAGES that tile is the team's own; otherwise the team first waits for that tile's release,
// which is exact when tile it − 2·STAGES is its own (TEAMS divides 2·STAGES) and the team's warps
// have all released it (a team barrier of a later own tile: STAGES ≥ TEAMS).
#if FD_TEAMS > 1 && ((2 * FD_STAGES) % FD_TEAMS != 0 || FD_STAGES < FD_TEAMS)
#error "fast_decode.cu: FD_TEAMS must divide 2 * FD_STAGES, with FD_STAGES >= FD_TEAMS"
#endif
#if FD_CLUSTER != 0
#if FD_CLUSTER < 2 || FD_CLUSTER > 8 || MLA_DV % (4 * FD_CLUSTER) != 0
#error "fast_decode.cu: FD_CLUSTER must be 0, or 2..8 with MLA_DV a multiple of 4 * FD_CLUSTER"
#endif
#if !FD_TMA
#error "fast_decode.cu: FD_CLUSTER needs FD_TMA (sm_90+)"
#endif
#define FD_CW (MLA_DV / FD_CLUSTER)  // value columns merged by each block of the cluster
#define FD_CU (8 / FD_CLUSTER)     // float4 chunks per thread and pass of the cluster merge (the
                                   // loads of all splits' chunks are in flight together)
#endif
// Where the teams' weighted partial O go for the combine (floats from the start of the dynamic
// shared memory): after the cluster merge's partial O and per-head state, else at the start.
#if FD_CLUSTER
#define FD_XOFF (((FD_HM * FD_LDO + (2 * FD_CLUSTER + 3) * FD_HM) + 3) / 4 * 4)
#else
#define FD_XOFF 0
#endif
// The partial O, the merge's per-head state and the teams' partials [TEAMS−1][HM][LDO] must fit
// below the final sums (the last dynamic arrays).
#if (FD_CLUSTER || FD_TEAMS > 1) && \
    (FD_XOFF + (FD_TEAMS - 1) * FD_HM * FD_LDO) * 4 > FD_SUMS_AT
#error "fast_decode.cu: the partial O [FD_HM, MLA_DV] f32 of the cluster merge or the team combine does not fit in the block's shared memory"
#endif

typedef __nv_bfloat16 bf16;

// mbarrier and bulk-copy helpers (sm_90).
__device__ __forceinline__ void fd_bar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mla_smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fd_bar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(mla_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void fd_bar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(mla_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void fd_bar_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(mla_smem_addr(bar)), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ __forceinline__ void fd_bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     mla_smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(mla_smem_addr(bar))
                 : "memory");
}
// Barrier of the FD_THREADS consumer threads (all threads without FD_TMA).
__device__ __forceinline__ void fd_sync() {
#if FD_TMA
    asm volatile("bar.sync 1, %0;\n" ::"n"(FD_THREADS) : "memory");
#else
    __syncthreads();
#endif
}

// libdevice's IEEE exp and log: this module is compiled with --use_fast_math, which maps expf and
// logf to the hardware approximations; the merge must match merge_states (compiled without it).
extern "C" __device__ float __nv_expf(float);
extern "C" __device__ float __nv_logf(float);

// The merge of merge_states for heads [h0, h0 + HM) ∩ [0, nh) of token i, by `nt` threads, one
// element at a time (each thread's loads in sequence: slow; the fallback of fd_merge_fast when
// the splits' weights do not fit in shared memory). Partials written by other blocks are read
// through L2 (ld.global.cg).
__device__ __forceinline__ void fd_merge(const float* parts, const float* lses, float* out, float* out_lse, i64 n,
                                         i64 nh, i64 splits, i64 i, i64 h0, int tid, int nt, int d_lo, int d_hi,
                                         bool write_lse) {
    const i64 stride = n * nh;
    const int dw = d_hi - d_lo;
    for (int e = tid; e < FD_HM * dw; e += nt) {
        const int r = e / dw, d = d_lo + e % dw;
        if (h0 + r >= nh) continue;
        const i64 rh = i * nh + h0 + r;
        float m = -INFINITY, qn = 0.0f;
        const int state = mla_merge_scan([&](i64 s) { return __ldcg(lses + s * stride + rh); }, splits, &m, &qn);
        if (state == MLA_MERGE_NAN) {
            out[rh * MLA_DV + d] = qn;
            if (write_lse && d == d_lo) out_lse[rh] = qn;
            continue;
        }
        if (state == MLA_MERGE_EMPTY) {
            out[rh * MLA_DV + d] = 0.0f;
            if (write_lse && d == d_lo) out_lse[rh] = -INFINITY;
            continue;
        }
        float denom = 0.0f, acc = 0.0f;
        for (i64 s = 0; s < splits; ++s) {
            const float x = __ldcg(lses + s * stride + rh);
            if (x == -INFINITY) continue;
            const float w = __nv_expf(x - m);
            denom += w;
            acc = __fmaf_rn(w, __ldcg(parts + (s * stride + rh) * MLA_DV + d), acc);
        }
        out[rh * MLA_DV + d] = __fdiv_rn(acc, denom);
        if (write_lse && d == d_lo) out_lse[rh] = m + __nv_logf(denom);
    }
}

#ifndef FD_MU
#define FD_MU 2  // float4 chunks of the merge per thread and pass
#endif
#ifndef FD_MS
#define FD_MS 4  // splits of the merge whose loads (FD_MU chunks each) are in flight together
#endif

// The per-head state of the merge, in merge_states' order, for head row r of `splits` LSEs
// X [splits][HM]: St[r] = 1 (a NaN LSE: Z[r] its quieted payload), 2 (every LSE −inf) or 0 (then
// W[sp][r] = exp(lse − max), −1 for a −inf LSE, skipped, and D[r] their sum). Returns the
// merged LSE (Z[r], −inf, or max + log D[r]).
__device__ __forceinline__ float fd_head_state(const float* X, float* W, float* D, float* Z, int* St, int splits,
                                               int r) {
    float m = -INFINITY, q = 0.0f;
    const int state = mla_merge_scan([&](i64 sp) { return X[sp * FD_HM + r]; }, splits, &m, &q);
    if (state == MLA_MERGE_NAN) {
        St[r] = 1;
        Z[r] = q;
        return q;
    }
    if (state == MLA_MERGE_EMPTY) {
        St[r] = 2;
        return -INFINITY;
    }
    float denom = 0.0f;
    for (int sp = 0; sp < splits; ++sp) {
        const float x = X[sp * FD_HM + r];
        if (x == -INFINITY) {
            W[sp * FD_HM + r] = -1.0f;
            continue;
        }
        const float w = __nv_expf(x - m);
        W[sp * FD_HM + r] = w;
        denom += w;
    }
    St[r] = 0;
    D[r] = denom;
    return m + __nv_logf(denom);
}

// A merged float4 of head r from its weighted sum `acc` and the state of fd_head_state: the
// quieted NaN, zeros (every split empty), or acc / D[r] (IEEE division, as merge_states).
__device__ __forceinline__ float4 fd_merged4(const int* St, const float* Z, const float* D, int r, float4 acc) {
    if (St[r] == 1) return make_float4(Z[r], Z[r], Z[r], Z[r]);
    if (St[r] == 2) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float d = D[r];
    return make_float4(__fdiv_rn(acc.x, d), __fdiv_rn(acc.y, d), __fdiv_rn(acc.z, d), __fdiv_rn(acc.w, d));
}

// acc + w·p per component, each a fused multiply-add rounded to nearest: the one weighted step of
// every merge, in split order.
__device__ __forceinline__ float4 fd_fma4(float w, float4 p, float4 acc) {
    return make_float4(__fmaf_rn(w, p.x, acc.x), __fmaf_rn(w, p.y, acc.y), __fmaf_rn(w, p.z, acc.z),
                       __fmaf_rn(w, p.w, acc.w));
}

// The per-head tables of a merge in shared memory: weights W [splits][HM] (−1: a −inf LSE,
// skipped), sums D [HM], NaN payloads Z [HM] and states St [HM] (0: merge, 1: NaN, 2: every LSE
// −inf), as fd_head_state leaves them.
struct FdMergeHeads {
    const float* W;
    const float* D;
    const float* Z;
    const int* St;
};

// Lays the tables out in `ws` ((2·splits + 3)·HM floats: X [splits][HM] LSEs, then W, D, Z, St),
// reads X through `load_lse(sp, r)` (split sp, head row r; rows at or past nh − h0 read as 0),
// computes every head's state and, when `write_lse`, writes its merged LSE to
// out_lse[i·nh + h0 + r]. `nt` threads call it together; `sync`, their barrier, separates the
// loads from the states and the states from the callers' reads.
template <typename Sync, typename LoadLse>
__device__ __forceinline__ FdMergeHeads fd_merge_heads(float* ws, int splits, i64 nh, i64 i, i64 h0, int tid, int nt,
                                                       Sync sync, LoadLse load_lse, float* out_lse, bool write_lse) {
    float* X = ws;
    float* W = X + splits * FD_HM;
    float* D = W + splits * FD_HM;
    float* Z = D + FD_HM;
    int* St = reinterpret_cast<int*>(Z + FD_HM);
    for (int e = tid; e < splits * FD_HM; e += nt) {
        const int sp = e / FD_HM, r = e % FD_HM;
        X[e] = h0 + r < nh ? load_lse(sp, r) : 0.0f;
    }
    sync();
    if (tid < FD_HM && h0 + tid < nh) {
        const float lse = fd_head_state(X, W, D, Z, St, splits, tid);
        if (write_lse) out_lse[i * nh + h0 + tid] = lse;
    }
    sync();
    return {W, D, Z, St};
}

// The same merge, fast: the splits' LSEs are read once into shared memory `ws` (2·splits·HM + 3·HM
// floats), each head's max, weights exp(lse − max) (−1: a −inf LSE, skipped), sum and state are
// computed once per head (in merge_states' order), then every thread merges FD_MU float4 chunks
// of values per pass, the loads of all its chunks issued before their FMAs.
template <typename Sync>
__device__ __forceinline__ void fd_merge_fast(const float* parts, const float* lses, float* out, float* out_lse,
                                              i64 n, i64 nh, int splits, i64 i, i64 h0, int tid, int nt, float* ws,
                                              Sync sync, int c_lo, int c_hi, bool write_lse) {
    const i64 stride = n * nh;
    const FdMergeHeads hs = fd_merge_heads(
        ws, splits, nh, i, h0, tid, nt, sync, [&](int sp, int r) { return __ldcg(lses + sp * stride + i * nh + h0 + r); },
        out_lse, write_lse);
    const float *W = hs.W, *D = hs.D, *Z = hs.Z;
    const int* St = hs.St;
    const int CW = c_hi - c_lo;           // chunks per head merged here: [c_lo, c_hi)
    // Chunk c of this range is head c / CW, column c_lo + c % CW: shifts when CW is a power of two
    // (every split count that divides DV/4), else divisions.
    const bool pow2 = (CW & (CW - 1)) == 0;
    const int cw_log = __ffs(CW) - 1;
    auto head_of = [&](int c) { return pow2 ? c >> cw_log : c / CW; };
    auto col_of = [&](int c) { return c_lo + (pow2 ? c & (CW - 1) : c % CW); };
    if (splits == 1) {
        // One split: FD_MS·FD_MU chunks per thread and pass, all loads in flight together; the
        // same arithmetic as below (w = 1 and d = 1 unless the LSE was not finite).
        constexpr int U1 = FD_MS * FD_MU;
        for (int base = 0; base < FD_HM * CW; base += nt * U1) {
            float4 p[U1];
#pragma unroll
            for (int u = 0; u < U1; ++u) {
                const int c = base + u * nt + tid, r = head_of(c);
                if (c < FD_HM * CW && h0 + r < nh && St[r] == 0 && W[r] >= 0.0f)
                    p[u] = __ldcg(reinterpret_cast<const float4*>(parts + (i * nh + h0 + r) * MLA_DV) + col_of(c));
            }
#pragma unroll
            for (int u = 0; u < U1; ++u) {
                const int c = base + u * nt + tid, r = head_of(c);
                if (c < FD_HM * CW && h0 + r < nh) {
                    const float w = W[r];
                    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (St[r] == 0 && w >= 0.0f) a = fd_fma4(w, p[u], a);
                    reinterpret_cast<float4*>(out + (i * nh + h0 + r) * MLA_DV)[col_of(c)] = fd_merged4(St, Z, D, r, a);
                }
            }
        }
        return;
    }
    for (int base = 0; base < FD_HM * CW; base += nt * FD_MU) {
        float4 acc[FD_MU];
#pragma unroll
        for (int u = 0; u < FD_MU; ++u) acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        // FD_MS splits at a time: the loads of all their chunks in flight together, then the
        // FMAs in split order (so the sums are merge_states' to the bit).
        for (int s0 = 0; s0 < splits; s0 += FD_MS) {
            float4 p[FD_MS][FD_MU];
#pragma unroll
            for (int ss = 0; ss < FD_MS; ++ss) {
                const int sp = s0 + ss;
#pragma unroll
                for (int u = 0; u < FD_MU; ++u) {
                    const int c = base + u * nt + tid, r = head_of(c);
                    if (sp < splits && c < FD_HM * CW && h0 + r < nh && St[r] == 0 && W[sp * FD_HM + r] >= 0.0f)
                        p[ss][u] = __ldcg(
                            reinterpret_cast<const float4*>(parts + (sp * stride + i * nh + h0 + r) * MLA_DV) +
                            col_of(c));
                }
            }
#pragma unroll
            for (int ss = 0; ss < FD_MS; ++ss) {
                const int sp = s0 + ss;
#pragma unroll
                for (int u = 0; u < FD_MU; ++u) {
                    const int c = base + u * nt + tid, r = head_of(c);
                    if (sp < splits && c < FD_HM * CW && h0 + r < nh && St[r] == 0) {
                        const float w = W[sp * FD_HM + r];
                        if (w >= 0.0f) acc[u] = fd_fma4(w, p[ss][u], acc[u]);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < FD_MU; ++u) {
            const int c = base + u * nt + tid, r = head_of(c);
            if (c < FD_HM * CW && h0 + r < nh)
                reinterpret_cast<float4*>(out + (i * nh + h0 + r) * MLA_DV)[col_of(c)] = fd_merged4(St, Z, D, r, acc[u]);
        }
    }
}

// The counter word of one (token, head group): arrivals in the low byte, FD_ABANDON once a
// waiting block gave up (spin mode), and blocks done with the counter from bit 16 on.
#define FD_COUNT 0xff
#define FD_ABANDON 0x8000
#define FD_DONE 0x10000
#ifndef FD_SPIN_POLLS
#define FD_SPIN_POLLS (1 << 16)  // polls (≥ 64 ns apart) before a waiting block gives up (a few ms on an H200)
#endif

__device__ __forceinline__ int fd_ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// After this block's parts and LSEs: count it in, then merge, with `ws_floats` floats of shared
// memory at `ws` that no thread reads or writes any more. `nt` threads (all of the block's
// threads still running) call it together; `sync` is their barrier.
//   spin 0: the last of the token's splits to arrive merges every value column.
//   spin 1 (the host asks for it only when every block of the launch is resident at once, and
//        with at most 255 splits): every block waits until all of its token's splits have
//        arrived, then merges its share of the value columns (split s: float4 chunks
//        [s·⌈DV/4/splits⌉, …)), split 0 also the LSE; so the merge after the last split is
//        1/splits of the work and runs on all the token's blocks. A block that has waited
//        FD_SPIN_POLLS polls (a launch whose blocks are not all resident after all) marks the
//        word FD_ABANDON with a compare-and-swap that succeeds only while arrivals are missing,
//        and leaves; the other waiting blocks then leave too and the last to arrive merges
//        every column, as in spin 0, so the launch always finishes.
// Either way the counter is zero again when the last block leaves.
// Not inlined: its registers stay out of the main loop's allocation (inlined, ptxas spilled in
// the 96-register TMA configuration).
template <typename Sync>
__device__ __noinline__ void fd_merge_tail(const float* parts, const float* lses, float* out, float* out_lse,
                                              int* counters, i64 n, i64 nh, i64 splits, i64 i, i64 h0, int tid,
                                              int nt, float* ws, int ws_floats, Sync sync, int spin) {
    __shared__ int fd_mode;  // 0: no merge here, 1: every value column, 2: this split's share
    int* const cnt = counters + blockIdx.x;
    __threadfence();  // this thread's parts and LSEs, visible device-wide before the count
    sync();
    if (tid == 0) {
        const int old = atomicAdd(cnt, 1);
        const bool last = spin ? (old & FD_COUNT) == (int)(splits - 1) : old == (int)(splits - 1);
        int mode = 0;
        if (!spin || (old & FD_ABANDON)) {
            mode = last ? 1 : 0;
        } else if (last) {
            mode = 2;
        } else {
            for (unsigned polls = 0;; ++polls) {
                const int v = fd_ld_acquire(cnt);
                if (v & FD_ABANDON) break;  // the last to arrive merges everything
                if ((v & FD_COUNT) == (int)splits) {
                    mode = 2;
                    break;
                }
                if (polls >= FD_SPIN_POLLS && atomicCAS(cnt, v, v | FD_ABANDON) == v) break;
                __nanosleep(64);
            }
        }
        fd_mode = mode;
    }
    sync();
    const int mode = fd_mode;
    constexpr int C4 = MLA_DV / 4;  // float4 chunks per head
    if (mode != 0) {
        __threadfence();
        const int share = (C4 + (int)splits - 1) / (int)splits, s = (int)blockIdx.y;
        const int c_lo = mode == 1 ? 0 : min(s * share, C4), c_hi = mode == 1 ? C4 : min((s + 1) * share, C4);
        if (2 * splits * FD_HM + 3 * FD_HM <= ws_floats)
            fd_merge_fast(parts, lses, out, out_lse, n, nh, (int)splits, i, h0, tid, nt, ws, sync, c_lo, c_hi,
                          mode == 1 || s == 0);
        else
            fd_merge(parts, lses, out, out_lse, n, nh, splits, i, h0, tid, nt, c_lo * 4, c_hi * 4, mode == 1 || s == 0);
    }
    if (!spin) {
        if (mode == 1 && tid == 0) *cnt = 0;  // ready for the next launch
    } else if (tid == 0) {
        // Done with the word: the last block to be done zeroes it for the next launch.
        if ((atomicAdd(cnt, FD_DONE) >> 16) == (int)(splits - 1)) atomicExch(cnt, 0);
    }
}

#if FD_CLUSTER
// Cluster helpers (sm_90): barrier of all non-exited threads of the cluster, with release /
// acquire semantics at cluster scope (the .aligned form: every thread of a warp executes it);
// this block's rank; a shared::cluster address of `p` in the block of rank `rank`; loads from it.
__device__ __forceinline__ void fd_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned fd_cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned fd_map(const void* p, unsigned rank) {
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(mla_smem_addr(p)), "r"(rank));
    return a;
}
__device__ __forceinline__ float fd_ld_cluster(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float4 fd_ld_cluster4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// The merge of the FD_CLUSTER blocks (splits) of one cluster, by this block's FD_THREADS consumer
// threads (the producer warp has exited; `sync` is the consumers' barrier). On entry this block's
// partial O is in `Os` [HM][FD_LDO] (its rows past nh unused) and its LSEs (natural log) in `Lse`
// [HM]; `ws` holds (2·FD_CLUSTER + 3)·HM floats that no other block reads. Same order and
// arithmetic as fd_merge_fast (per head: max over the non-NaN LSEs, weights exp(lse − max) with
// −1 marking a −inf LSE, their sum in split order; per element: FMAs in split order, IEEE
// division), for value columns [rank·FD_CW, (rank+1)·FD_CW) of heads [h0, h0 + HM) ∩ [0, nh);
// rank 0 writes out_lse. Begins and ends with a cluster barrier: the first publishes every
// block's Os and Lse, the second keeps them alive until every block is done reading.
template <typename Sync>
__device__ __noinline__ void fd_cluster_merge(const float* Os, const float* Lse, float* ws, float* out,
                                              float* out_lse, i64 nh, i64 i, i64 h0, int tid, Sync sync) {
    constexpr int C = FD_CLUSTER, nt = FD_THREADS;
    fd_cluster_sync();
    const unsigned rank = fd_cluster_rank();
    const FdMergeHeads hs = fd_merge_heads(
        ws, C, nh, i, h0, tid, nt, sync, [&](int sp, int r) { return fd_ld_cluster(fd_map(Lse + r, sp)); }, out_lse,
        rank == 0);
    const float *W = hs.W, *D = hs.D, *Z = hs.Z;
    const int* St = hs.St;
    constexpr int C4 = FD_CW / 4;          // float4 chunks per head in this block's columns
    unsigned ob[C];                        // Os of every block of the cluster
#pragma unroll
    for (int sp = 0; sp < C; ++sp) ob[sp] = fd_map(Os, sp);
    for (int base = 0; base < FD_HM * C4; base += nt * FD_CU) {
        float4 p[C][FD_CU];
#pragma unroll
        for (int sp = 0; sp < C; ++sp)
#pragma unroll
            for (int u = 0; u < FD_CU; ++u) {
                const int c = base + u * nt + tid, r = c / C4;
                p[sp][u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (c < FD_HM * C4 && h0 + r < nh && St[r] == 0 && W[sp * FD_HM + r] >= 0.0f)
                    p[sp][u] = fd_ld_cluster4(ob[sp] + 4u * (unsigned)(r * FD_LDO + rank * FD_CW + (c % C4) * 4));
            }
#pragma unroll
        for (int u = 0; u < FD_CU; ++u) {
            const int c = base + u * nt + tid, r = c / C4;
            if (c >= FD_HM * C4 || h0 + r >= nh) continue;
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (St[r] == 0) {
#pragma unroll
                for (int sp = 0; sp < C; ++sp) {
                    const float w = W[sp * FD_HM + r];
                    if (w >= 0.0f) acc = fd_fma4(w, p[sp][u], acc);
                }
            }
            reinterpret_cast<float4*>(out + (i * nh + h0 + r) * MLA_DV + rank * FD_CW)[c % C4] = fd_merged4(St, Z, D, r, acc);
        }
    }
    fd_cluster_sync();  // no block exits while another may still read its shared memory
}
#endif

#if FD_WG
// ---------------------------------------------------------------------------------------------
// FD_WG 1: the same launch (grid, arguments, outputs, fused merge) on Hopper's warpgroup MMA
// (wgmma.mma_async, sm_90a only; the host compiles this variant for sm_90a), FlashMLA's layout:
// FD_HM = 64 heads per block (the wgmma M), 64 cache rows per tile, two warpgroups (8 warps).
//   Shared memory (1024-byte aligned): Q [64 heads][W] and two cache stages [64 rows][W], each in
//   the 128-byte-swizzled K-major layout wgmma reads through a matrix descriptor (W cut into
//   panels of 64 columns; panel p, row r, 16-byte chunk c at p·8192 + r·128 + ((c ^ r%8)·16)),
//   filled by cp.async from all 256 threads (a row's slot from its block-table entry, computed
//   one tile ahead into `slots`); P [64][64] bf16 in the same layout; α and the final sums.
//   Per tile (one barrier for the copies, one for P):
//     warpgroup 0: S = Q·Kᵀ (W/16 wgmma m64n64k16, A and B from shared memory), online softmax
//       in the accumulator registers (a head row's 4 lanes reduce by two shuffles; running max in
//       log2 units; each thread keeps its own partial sum, reduced at the end), P as A fragments
//       in registers, and to shared memory for warpgroup 1 with α;
//     both: O·α, then O[:, half] += P·V (wgmma m64n64k16 per 64 value columns, V read in place
//       from the cache tile as an MN-major B operand): warpgroup 0 value columns [0, DV/2) with P
//       from registers, warpgroup 1 columns [DV/2, DV) with P from shared memory.
//   Then parts/lses and fd_merge_tail exactly as the mma.sync kernel.
// Needs W a multiple of 16 (≤ 576 for the shared memory to fit) and DV a multiple of 128.
#if MLA_DV % 128 != 0
#error "fast_decode.cu: FD_WG needs MLA_DV a multiple of 128 (64 value columns per wgmma per warpgroup)"
#endif
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "fast_decode.cu: FD_WG (wgmma) needs --gpu-architecture=sm_90a"
#endif
#define WG_BK 64                                    // cache rows per tile (= heads per block)
#define WG_PANEL (WG_BK * 128)                      // bytes of one 64-column panel of a tile
#define WG_TILE (((MLA_W + 63) / 64) * WG_PANEL)    // bytes of a Q or cache tile
#define WG_NCH (MLA_DV / 128)                       // 64-column chunks of O per warpgroup

// Byte offset of 16-byte chunk c of row r in a swizzled [64][W] tile.
__device__ __forceinline__ unsigned wg_off(int r, int c) {
    return (unsigned)((c >> 3) * WG_PANEL + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
// A wgmma matrix descriptor: 128-byte swizzle, leading / stride byte offsets `lbo` / `sbo`.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Pins N accumulator registers at this point (no reads or writes move across it).
template <int N = 32>
__device__ __forceinline__ void wg_pin(float* d) {
#pragma unroll
    for (int e = 0; e < N; ++e) asm volatile("" : "+f"(d[e])::"memory");
}
#define WG_D32                                                                                            \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_OUT32(d)                                                                                      \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),     \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),        \
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),      \
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),      \
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#if FD_WG == 1
#if FD_HM != 64 || FD_WARPS != 8 || FD_TMA || FD_CLUSTER || FD_STAGES != 2 || FD_FUSED || FD_QREG
#error "fast_decode.cu: FD_WG 1 needs FD_HM=64, FD_WARPS=8, FD_STAGES=2 and no TMA, cluster, fused softmax or QREG"
#endif
// d[64×64] (+)= A·B, A [64][16] K-major and B [16][64] from shared memory; B K-major (`TB` 0:
// [64 n][16 k], the cache rows as keys) or MN-major (1: [16 k][64 n], the cache rows as values).
template <int TB>
__device__ __forceinline__ void wg_mma_ss(float* d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", %32, %33, p, 1, 1, 0, %35;\n}\n"
                 : WG_OUT32(d)
                 : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
// d[64×64] += A·B with A [64][16] as register fragments (mma.sync's A layout per warp) and B
// [16][64] MN-major from shared memory.
__device__ __forceinline__ void wg_mma_rs(float* d, const unsigned* a, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : WG_OUT32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

extern "C" __global__ void __launch_bounds__(256, 1)
    decode_split_mma(const bf16* q, const bf16* cache, const i64* tables, const i64* ctx, float* parts,
                     float* lses, i64 n, i64 nh, i64 block_size, i64 max_blocks, i64 splits, float scale,
                     float empty_lse, float* out, float* out_lse, int* counters, int spin) {
    extern __shared__ __align__(16) unsigned char fd_smem[];
    unsigned char* const base = fd_smem + ((1024u - (mla_smem_addr(fd_smem) & 1023u)) & 1023u);
    unsigned char* const Qs = base;                          // [64][W] swizzled
    unsigned char* const Cs = Qs + WG_TILE;                  // [2][64][W] swizzled
    unsigned char* const Ps = Cs + 2 * WG_TILE;              // [64][64] bf16 swizzled
    float* const As = reinterpret_cast<float*>(Ps + WG_PANEL);  // [64] rescale of this tile
    float* const Ls = As + WG_BK;                            // [64] final sums
    long long* const slots = reinterpret_cast<long long*>(Ls + WG_BK);  // [2][64] row slots

    const i64 groups = (nh + FD_HM - 1) / FD_HM;
    const i64 i = blockIdx.x / groups, h0 = (blockIdx.x % groups) * FD_HM;
    const i64 s = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // Warpgroup (read through a shuffle so that the compiler knows it is warp-uniform: wgmma in a
    // branch it cannot prove uniform is serialized) and warp in it (rows 16·wr …).
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), wr = warp % 4;
    const i64 c = ctx[i];
    const i64 sl = (c + splits - 1) / splits;
    const i64 k0 = min(s * sl, c), k1 = min((s + 1) * sl, c);
    if (k0 == k1) {
        for (int r = tid; r < FD_HM; r += 256)
            if (h0 + r < nh) lses[(s * n + i) * nh + h0 + r] = empty_lse;
        if (out != nullptr)
            fd_merge_tail(parts, lses, out, out_lse, counters, n, nh, splits, i, h0, tid, 256,
                          reinterpret_cast<float*>(Cs), 2 * WG_TILE / 4, [] { __syncthreads(); }, spin);
        return;
    }
    const i64* table = tables + i * max_blocks;
    const int n_tiles = (int)((k1 - k0 + WG_BK - 1) / WG_BK);
    auto slot_of = [&](int tile) -> long long {
        const i64 pos = k0 + (i64)tile * WG_BK + tid;
        if (tile >= n_tiles || pos >= k1) return -1;
        const i64 page = pos / block_size;
        return table[page] * block_size + (pos - page * block_size);
    };
    // Warp w copies rows w, w + 8, …: 512 contiguous bytes per warp instruction.
    auto load_tile = [&](int tile) {
        unsigned char* dst = Cs + (tile & 1) * WG_TILE;
        const long long* sl_ = slots + (tile & 1) * WG_BK;
#pragma unroll
        for (int j = 0; j < WG_BK / 8; ++j) {
            const int r = warp + 8 * j;
            const long long slot = sl_[r];
            const bf16* src = cache + (slot < 0 ? 0 : slot) * MLA_W;
#pragma unroll
            for (int cc = lane; cc < MLA_W / 8; cc += 32) mla_cp16(dst + wg_off(r, cc), src + cc * 8, slot >= 0);
        }
    };
    for (int e = tid; e < FD_HM * (MLA_W / 8); e += 256) {
        const int r = e / (MLA_W / 8), cc = e % (MLA_W / 8);
        const bool ok = h0 + r < nh;
        mla_cp16(Qs + wg_off(r, cc), q + (i * nh + (ok ? h0 + r : 0)) * MLA_W + cc * 8, ok);
    }
    __shared__ int wg_direct;  // 1 while every LSE of the block is finite (see the epilogue)
    if (tid == 0) wg_direct = 1;
    if (tid < WG_BK) slots[tid] = slot_of(0);
    __syncthreads();
    load_tile(0);
    asm volatile("cp.async.commit_group;\n" ::);
    if (tid < WG_BK) slots[WG_BK + tid] = slot_of(1);

    float o[WG_NCH][32];
#pragma unroll
    for (int j = 0; j < WG_NCH; ++j)
#pragma unroll
        for (int e = 0; e < 32; ++e) o[j][e] = 0.0f;
    // Warpgroup 0: running max (log2 units) and this thread's partial sum of rows 16·wr + g + 8·h.
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    const float sl2 = scale * 1.4426950408889634f;
    const unsigned q_addr = mla_smem_addr(Qs), p_addr = mla_smem_addr(Ps);

    for (int it = 0; it < n_tiles; ++it) {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // for wgmma's reads
        __syncthreads();  // tile `it` landed; tile it-1, P and α of it-1 consumed
        if (it + 1 < n_tiles) load_tile(it + 1);
        asm volatile("cp.async.commit_group;\n" ::);
        if (tid < WG_BK) slots[(it & 1) * WG_BK + tid] = slot_of(it + 2);
        const unsigned c_addr = mla_smem_addr(Cs + (it & 1) * WG_TILE);
        const i64 kt = k0 + (i64)it * WG_BK;
        unsigned pa[WG_BK / 16][4];
        if (wg == 0) {
            float sacc[32];
#pragma unroll
            for (int e = 0; e < 32; ++e) sacc[e] = 0.0f;
            wg_pin(sacc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < MLA_W / 16; ++kk) {
                const unsigned off = (kk >> 2) * WG_PANEL + (kk & 3) * 32;
                wg_mma_ss<0>(sacc, wg_desc(q_addr + off, 16, 1024), wg_desc(c_addr + off, 16, 1024), kk > 0);
            }
            wg_commit();
            wg_wait0();
            wg_pin(sacc);
            // Online softmax: this thread holds keys 8j + 2t + {0,1} of rows 16·wr + g + 8·h in
            // sacc[4j + 2h + {0,1}].
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const bool ok = kt + 8 * j + 2 * t + e < k1;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float& x = sacc[4 * j + 2 * h + e];
                        x = ok ? x * sl2 : -INFINITY;
                        mx[h] = fmaxf(mx[h], x);
                    }
                }
            float al[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                const float mn = fmaxf(m_run[h], mx[h]);
                al[h] = exp2f(m_run[h] - mn);
                m_run[h] = mn;
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& x = sacc[4 * j + 2 * h + e];
                        x = exp2f(x - mn);
                        sum += x;
                    }
                l_run[h] = l_run[h] * al[h] + sum;
            }
            // P as A fragments (keys 16·kk …) and, for warpgroup 1, to shared memory.
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    __nv_bfloat162 v = __floats2bfloat162_rn(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]);
                    const unsigned u = *reinterpret_cast<unsigned*>(&v);
                    pa[j / 2][(j & 1) * 2 + h] = u;
                    const int r = 16 * wr + g + 8 * h;
                    *reinterpret_cast<unsigned*>(Ps + r * 128 + ((j ^ (r & 7)) << 4) + 4 * t) = u;
                }
            if (t == 0) {
                As[16 * wr + g] = al[0];
                As[16 * wr + g + 8] = al[1];
            }
#pragma unroll
            for (int j = 0; j < WG_NCH; ++j)
#pragma unroll
                for (int e = 0; e < 32; ++e) o[j][e] *= al[(e >> 1) & 1];
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // P, for wgmma's reads
        }
        __syncthreads();  // P and α ready
        if (wg == 1) {
            const float a0 = As[16 * wr + g], a1 = As[16 * wr + g + 8];
#pragma unroll
            for (int j = 0; j < WG_NCH; ++j)
#pragma unroll
                for (int e = 0; e < 32; ++e) o[j][e] *= (e & 2) ? a1 : a0;
        }
#pragma unroll
        for (int j = 0; j < WG_NCH; ++j) wg_pin(o[j]);
        wg_fence();
        // V rows 16·kk … of value panel wg·NCH + j: MN-major, 8-row groups 1024 bytes apart
        // (stride), panels 8192 apart (leading; one panel per wgmma).
        auto v_desc = [&](int kk, int j) {
            return wg_desc(c_addr + (wg * WG_NCH + j) * WG_PANEL + kk * 16 * 128, WG_PANEL, 1024);
        };
        if (wg == 0) {
#pragma unroll
            for (int kk = 0; kk < WG_BK / 16; ++kk)
#pragma unroll
                for (int j = 0; j < WG_NCH; ++j) wg_mma_rs(o[j], pa[kk], v_desc(kk, j));
        } else {
#pragma unroll
            for (int kk = 0; kk < WG_BK / 16; ++kk)
#pragma unroll
                for (int j = 0; j < WG_NCH; ++j) wg_mma_ss<1>(o[j], wg_desc(p_addr + kk * 32, 16, 1024), v_desc(kk, j), 1);
        }
        wg_commit();
        wg_wait0();
#pragma unroll
        for (int j = 0; j < WG_NCH; ++j) wg_pin(o[j]);
    }
    // With one split the merge would return each head's partial unchanged when its LSE is
    // finite (weight exp(0) = 1, sum 1: fma(1, p, 0) / 1 = p + 0, LSE + log 1), so a block whose
    // LSEs are all finite writes `out` and `out_lse` directly (the same bits: `+ 0` as the
    // merge's FMA turns −0 into +0) and skips the merge; otherwise parts, LSEs and
    // fd_merge_tail as with more splits (the counter is untouched either way: one split's
    // merge leaves it zero).
    const float ln2 = 0.6931471805599453f;
    float lse[2] = {0.0f, 0.0f};
    if (wg == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int r = 16 * wr + g + 8 * h;
            lse[h] = m_run[h] * ln2 + logf(l);
            if (t == 0) {
                Ls[r] = l;
                if (h0 + r < nh && !isfinite(lse[h])) atomicExch(&wg_direct, 0);  // several may clear it
            }
        }
    }
    __syncthreads();
    const bool direct = splits == 1 && out != nullptr && wg_direct;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * wr + g + 8 * h;
        if (h0 + r >= nh) continue;
        if (wg == 0 && t == 0) {
            if (direct)
                out_lse[i * nh + h0 + r] = __fadd_rn(lse[h], 0.0f);
            else
                lses[(s * n + i) * nh + h0 + r] = lse[h];
        }
        const float l = Ls[r];
        float* const orow = (direct ? out + (i * nh + h0 + r) * MLA_DV
                                    : parts + ((s * n + i) * nh + h0 + r) * MLA_DV) +
                            wg * (MLA_DV / 2);
#pragma unroll
        for (int j = 0; j < WG_NCH; ++j)
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                float2 v = make_float2(o[j][4 * jj + 2 * h] / l, o[j][4 * jj + 2 * h + 1] / l);
                if (direct) v = make_float2(__fadd_rn(v.x, 0.0f), __fadd_rn(v.y, 0.0f));
                *reinterpret_cast<float2*>(orow + j * 64 + jj * 8 + 2 * t) = v;
            }
    }
    if (out != nullptr && !direct)
        fd_merge_tail(parts, lses, out, out_lse, counters, n, nh, splits, i, h0, tid, 256,
                      reinterpret_cast<float*>(Cs), 2 * WG_TILE / 4, [] { __syncthreads(); }, spin);
}
#endif  // FD_WG == 1
#else
// A fragment (16 rows × 16 k) of a row-major bf16 tile with row stride FD_LD.
__device__ __forceinline__ void fd_load_a(unsigned* a, const bf16* base, int g, int t) {
    const bf16* p = base + g * FD_LD + 2 * t;
    a[0] = *reinterpret_cast<const unsigned*>(p);
    a[1] = *reinterpret_cast<const unsigned*>(p + 8 * FD_LD);
    a[2] = *reinterpret_cast<const unsigned*>(p + 8);
    a[3] = *reinterpret_cast<const unsigned*>(p + 8 * FD_LD + 8);
}

// One step of the unfused online softmax for head row `row`, lane j on key j of the tile: the
// row's score (its FD_P partial sums added in part order) scaled to log2 units by sl2, or −inf
// past the context (key_ok false); the new running max over the warp, P = exp2(score − max) to
// Ps as bf16, the running sum m_run / l_run updated, and the row's rescale α of O to As.
__device__ __forceinline__ void fd_softmax_row(const float* Sb, bf16* Ps, float* As, int row, int lane, bool key_ok,
                                               float sl2, float& m_run, float& l_run) {
    float x = Sb[row * FD_LDS + lane];
#pragma unroll
    for (int p = 1; p < FD_P; ++p) x += Sb[(p * FD_HM + row) * FD_LDS + lane];
    x = key_ok ? x * sl2 : -INFINITY;
    float mx = x;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float mn = fmaxf(m_run, mx);
    const float pv = exp2f(x - mn);
    float sum = pv;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    Ps[row * FD_LDP + lane] = __float2bfloat16_rn(pv);
    const float al = exp2f(m_run - mn);
    l_run = l_run * al + sum;
    m_run = mn;
    if (lane == 0) As[row] = al;
}

// O·α for m-tile m: this thread's accumulators 0, 1 (head row m·16 + g) scale by al_lo, 2, 3
// (row m·16 + g + 8) by al_hi, in every value n-tile of the warp.
__device__ __forceinline__ void fd_rescale_o(float (&o)[FD_MT][FD_NVW][4], int m, float al_lo, float al_hi) {
#pragma unroll
    for (int v = 0; v < FD_NVW; ++v) {
        o[m][v][0] *= al_lo;
        o[m][v][1] *= al_lo;
        o[m][v][2] *= al_hi;
        o[m][v][3] *= al_hi;
    }
}

// O += P·V for one 16-key step of the tile, the same for both softmax variants: a holds P's A
// fragments of the FD_MT m-tiles for these 16 keys, vrow is this lane's row of V for ldmatrix
// (cache tile row kk·16 + lane % 16); warp wt takes the value n-tiles wt + FD_WARPS·v. Per n-tile
// one transposed ldmatrix of V, then one mma per m-tile, m ascending.
__device__ __forceinline__ void fd_pv_step(float (&o)[FD_MT][FD_NVW][4], const unsigned (&a)[FD_MT][4],
                                           const bf16* vrow, int wt) {
#pragma unroll
    for (int v = 0; v < FD_NVW; ++v) {
        const int nt = wt + FD_WARPS * v;
        if (FD_NTV % FD_WARPS == 0 || nt < FD_NTV) {
            unsigned b0, b1;
            asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                         : "=r"(b0), "=r"(b1)
                         : "r"(mla_smem_addr(vrow + nt * 8)));
#pragma unroll
            for (int m = 0; m < FD_MT; ++m) mla_mma_16816(o[m][v], a[m], b0, b1);
        }
    }
}

// One head row of this warp's output, O / l, to its partial row `orow`: `o` holds the row's
// accumulator fragments of one m-tile (half 0: fragment elements 0–1, half 1: 2–3), the warp owns
// value n-tiles wt + FD_WARPS·v, lane t columns 2t and 2t + 1 of each; IEEE division by the
// softmax sum l.
__device__ __forceinline__ void fd_store_o_row(float* orow, const float (&o)[FD_NVW][4], int half, float l, int wt,
                                               int t) {
#pragma unroll
    for (int v = 0; v < FD_NVW; ++v) {
        const int nt = wt + FD_WARPS * v;
        if (FD_NTV % FD_WARPS == 0 || nt < FD_NTV)
            *reinterpret_cast<float2*>(orow + nt * 8 + 2 * t) =
                make_float2(o[v][2 * half] / l, o[v][2 * half + 1] / l);
    }
}

// With one producer warp a block has 9 warps. Registers are allocated per SM sub-partition (4 of
// them, 16384 registers each) and a block's warps are spread over all four, so two such blocks per
// SM need at most 96 registers per thread (5 warps of 3072 per sub-partition), which is what
// ptxas's cap for __launch_bounds__(288, 2) is; a higher cap (112 was tried) leaves one block per SM.
// The teams block (2 teams of 4 warps and 4 producer warps, one block per SM) is capped at 168
// (65536 / 384, rounded down to 8); ptxas uses 150.
#if FD_CLUSTER
#define FD_CLUSTER_DIMS __cluster_dims__(1, FD_CLUSTER, 1)
#else
#define FD_CLUSTER_DIMS
#endif
extern "C" __global__ void __launch_bounds__(FD_BLOCK, FD_MINB) FD_CLUSTER_DIMS
    decode_split_mma(const bf16* q, const bf16* cache, const i64* tables, const i64* ctx, float* parts,
                     float* lses, i64 n, i64 nh, i64 block_size, i64 max_blocks, i64 splits, float scale,
                     float empty_lse, float* out, float* out_lse, int* counters, int spin) {
    extern __shared__ __align__(16) unsigned char fd_smem[];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // This thread's consumer team and its warp within the team (producer warps: the last team's
    // buffers, unused).
    const int team = FD_TEAMS > 1 ? min(warp / FD_WARPS, FD_TEAMS - 1) : 0;
    const int wt = warp - team * FD_WARPS;
    bf16* Qs = reinterpret_cast<bf16*>(fd_smem);                     // [HM][LD]
    bf16* Cs = Qs + FD_HM * FD_LD;                                     // [STAGES][BK][LD]
    unsigned char* const Tb = reinterpret_cast<unsigned char*>(Cs + FD_STAGES * FD_BK * FD_LD) + team * FD_TEAM_BYTES;
    float* Ss = reinterpret_cast<float*>(Tb);                          // [SBUF][P][HM][LDS] this team's
    bf16* Ps = reinterpret_cast<bf16*>(Ss + FD_SBUF * FD_P * FD_HM * FD_LDS);  // [HM][LDP]
    float* As = reinterpret_cast<float*>(Ps + FD_HM * FD_LDP);        // [HM] rescale of this tile
    float* const Lall = reinterpret_cast<float*>(fd_smem + FD_SUMS_AT);  // [TEAMS][HM] final sums
    float* Ls = Lall + team * FD_HM;                                    // this team's
#if FD_TEAMS > 1
    float* const Mall = Lall + FD_TEAMS * FD_HM;                        // [TEAMS][HM] final maxima
#endif
#if FD_TMA
    __shared__ __align__(8) unsigned long long fd_full[FD_STAGES], fd_empty[FD_STAGES];
#else
    __shared__ long long fd_slots[2][FD_BK];
#endif
#if FD_CLUSTER
    __shared__ float fd_lse[FD_HM];  // this block's LSE per head, read by the whole cluster
    float* const Os = reinterpret_cast<float*>(fd_smem);  // [HM][LDO] partial O, after the tiles
    float* const Ws = Os + FD_HM * FD_LDO;                  // the cluster merge's per-head state
#endif

    const i64 groups = (nh + FD_HM - 1) / FD_HM;
    const i64 i = blockIdx.x / groups, h0 = (blockIdx.x % groups) * FD_HM;
    const i64 s = blockIdx.y;
    const i64 c = ctx[i];
    const i64 sl = (c + splits - 1) / splits;
    const i64 k0 = min(s * sl, c), k1 = min((s + 1) * sl, c);
    if (k0 == k1) {
#if FD_CLUSTER
        // LSE empty_lse and a zero partial (read only with a finite empty_lse); the producer
        // warp exits (cluster barriers wait for non-exited threads only).
        if (tid >= FD_THREADS) return;
        for (int r = tid; r < FD_HM; r += FD_THREADS) fd_lse[r] = empty_lse;
        for (int e = tid; e < FD_HM * (MLA_DV / 4); e += FD_THREADS)
            reinterpret_cast<float4*>(Os + (e / (MLA_DV / 4)) * FD_LDO)[e % (MLA_DV / 4)] =
                make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        fd_cluster_merge(Os, fd_lse, Ws, out, out_lse, nh, i, h0, tid, [] { fd_sync(); });
        return;
#endif
        for (int r = tid; r < FD_HM; r += FD_BLOCK)
            if (h0 + r < nh) lses[(s * n + i) * nh + h0 + r] = empty_lse;
        if (out != nullptr)
            fd_merge_tail(parts, lses, out, out_lse, counters, n, nh, splits, i, h0, tid, FD_BLOCK,
                          reinterpret_cast<float*>(Cs), FD_STAGES * FD_BK * FD_LD / 2, [] { __syncthreads(); }, spin);
        return;
    }
    for (int e = tid; e < FD_HM * (MLA_W / 8); e += FD_BLOCK) {
        int r = e / (MLA_W / 8), col = (e % (MLA_W / 8)) * 8;
        bool ok = h0 + r < nh;
        mla_cp16(Qs + r * FD_LD + col, q + ((i * nh + (ok ? h0 + r : 0)) * MLA_W) + col, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    const i64* table = tables + i * max_blocks;
    const int n_tiles = (int)((k1 - k0 + FD_BK - 1) / FD_BK);
#if FD_TMA
    if (tid == 0) {
#pragma unroll
        for (int st = 0; st < FD_STAGES; ++st) {
            fd_bar_init(&fd_full[st], 32);         // one producer lane per row
            fd_bar_init(&fd_empty[st], FD_WARPS);  // one lane per warp of the consuming team
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // Q landed, barriers initialized
    if (warp >= FD_WARPS * FD_TEAMS) {
        // Producer warp pw of FD_TMA: lane r < RPP streams row pw·RPP + r of every tile (one
        // arrival per row on the full barrier). Page and offset in 32-bit arithmetic when
        // positions and the page size fit (the usual case), else 64-bit.
        constexpr int RPP = FD_BK / FD_TMA;  // rows per producer warp
        const int row = (warp - FD_WARPS * FD_TEAMS) * RPP + lane;
        const bool mine = FD_TMA == 1 || lane < RPP;
        const bool narrow = k1 < 0x7fffffffLL && block_size < 0x7fffffffLL;
        for (int j = 0; j < n_tiles; ++j) {
            const int st = j % FD_STAGES;
            const i64 pos = k0 + (i64)j * FD_BK + row;
            const bool ok = mine && pos < k1;
            long long slot = 0;
            if (ok) {
                i64 page, off;
                if (narrow) {
                    const unsigned p32 = (unsigned)pos, b32 = (unsigned)block_size;
                    page = p32 / b32;
                    off = p32 - (unsigned)page * b32;
                } else {
                    page = pos / block_size;
                    off = pos - page * block_size;
                }
                slot = table[page] * block_size + off;
            }
            const unsigned valid = __popc(__ballot_sync(0xffffffffu, ok));
            if (j >= FD_STAGES) fd_bar_wait(&fd_empty[st], ((j / FD_STAGES) - 1) & 1);
            if (lane == 0) fd_bar_expect(&fd_full[st], valid * (MLA_W * 2));
            __syncwarp();
            if (mine) {
                bf16* dst = Cs + (st * FD_BK + row) * FD_LD;
                if (ok) {
                    fd_bulk_copy(dst, cache + slot * MLA_W, MLA_W * 2, &fd_full[st]);
                } else {
                    // Rows past the split's end read as zeros (as cp.async's zero fill): P is 0
                    // there, and 0 · garbage could be NaN.
                    uint4* d4 = reinterpret_cast<uint4*>(dst);
                    for (int c = 0; c < MLA_W / 8; ++c) d4[c] = make_uint4(0u, 0u, 0u, 0u);
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                }
                fd_bar_arrive(&fd_full[st]);
            }
        }
        return;
    }
#else
    // Lane `tid` (< BK) of warp 0 owns row tid of every tile's slot list.
    auto table_entry = [&](int tile) -> i64 {
        const i64 pos = k0 + (i64)tile * FD_BK + tid;
        return tile < n_tiles && pos < k1 ? table[pos / block_size] : -1;
    };
    auto slot_of = [&](int tile, i64 entry) -> long long {
        const i64 pos = k0 + (i64)tile * FD_BK + tid;
        return entry < 0 ? -1 : entry * block_size + pos % block_size;
    };
    // Warp w copies rows w, w + WARPS, …: one slot read and one base address per row, then
    // 16-byte copies at lane·16 + 512·j (each warp instruction moves 512 contiguous bytes).
    auto load_tile = [&](int tile) {
        bf16* dst = Cs + (tile % FD_STAGES) * FD_BK * FD_LD;
        const long long* sl_ = fd_slots[tile & 1];
#pragma unroll
        for (int r = warp; r < FD_BK; r += FD_WARPS) {
            const long long slot = sl_[r];
            const bf16* src = cache + (slot < 0 ? 0 : slot) * MLA_W + lane * 8;
            bf16* d = dst + r * FD_LD + lane * 8;
#pragma unroll
            for (int c = 0; c < MLA_W; c += 256)
                if (c + lane * 8 < MLA_W) mla_cp16(d + c, src + c, slot >= 0);
        }
    };
    // Prologue: tiles 0 .. STAGES-2 in flight, slots of tile STAGES-1 ready, table entry of tile
    // STAGES prefetched.
    i64 entry_next = -1;
#pragma unroll
    for (int j = 0; j < FD_STAGES - 1; ++j) {
        if (tid < FD_BK) fd_slots[j & 1][tid] = slot_of(j, table_entry(j));
        __syncthreads();
        if (j < n_tiles) load_tile(j);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    if (tid < FD_BK) {
        fd_slots[(FD_STAGES - 1) & 1][tid] = slot_of(FD_STAGES - 1, table_entry(FD_STAGES - 1));
        entry_next = table_entry(FD_STAGES);
    }
#endif

    // Score mapping of this warp.
    const int mt_s = wt % FD_MT, part = (wt / FD_MT) % FD_P, ng = wt / (FD_MT * FD_P);
#if FD_QREG
    unsigned qa[FD_KPP][4];
#if !FD_TMA
    asm volatile("cp.async.wait_group %0;\n" ::"n"(FD_STAGES - 1));
    __syncthreads();
#endif
#pragma unroll
    for (int j = 0; j < FD_KPP; ++j) {
        const int kk = part * FD_KPP + j;
        if (kk < FD_KSTEPS) fd_load_a(qa[j], Qs + mt_s * 16 * FD_LD + kk * 16, g, t);
    }
#endif

    float o[FD_MT][FD_NVW][4];
#pragma unroll
    for (int m = 0; m < FD_MT; ++m)
#pragma unroll
        for (int v = 0; v < FD_NVW; ++v) o[m][v][0] = o[m][v][1] = o[m][v][2] = o[m][v][3] = 0.0f;
#if FD_FUSED
    // Running max (log2 units) and sum of rows m·16 + g + 8·half, in registers of every warp.
    float m_run[FD_MT][2], l_run[FD_MT][2];
#pragma unroll
    for (int m = 0; m < FD_MT; ++m) m_run[m][0] = m_run[m][1] = -INFINITY, l_run[m][0] = l_run[m][1] = 0.0f;
#else
    // Running max (log2 units) and sum of this warp's softmax rows, in registers.
    float m_run[FD_RPW > 0 ? FD_RPW : 1], l_run[FD_RPW > 0 ? FD_RPW : 1];
#pragma unroll
    for (int rr = 0; rr < (FD_RPW > 0 ? FD_RPW : 1); ++rr) {
        m_run[rr] = -INFINITY;
        l_run[rr] = 0.0f;
    }
#endif
    const float sl2 = scale * 1.4426950408889634f;
    // The per-tile barrier of this thread's team (all consumers with one team).
    auto team_sync = [&]() {
#if FD_TEAMS > 1
        asm volatile("bar.sync %0, %1;\n" ::"r"(2 + team), "n"(FD_TT) : "memory");
#else
        fd_sync();
#endif
    };

#if FD_TMA
    // Iteration jt of team k is tile jt·TEAMS + k; a team whose last iteration has no tile
    // (`live` false) passes its barriers only.
    const int n_iter = (n_tiles + FD_TEAMS - 1) / FD_TEAMS;
    for (int jt = 0; jt < n_iter; ++jt) {
        const int it = jt * FD_TEAMS + team;
        const bool live = FD_TEAMS == 1 || it < n_tiles;
        const i64 kt = k0 + (i64)it * FD_BK;
        if (live) {
#if FD_TEAMS > 1
            // The stage's previous tile is another team's: wait for its release first, so the
            // parity wait below is for this round (see the FD_TEAMS check at the top).
            if (FD_STAGES % FD_TEAMS != 0 && it >= FD_STAGES)
                fd_bar_wait(&fd_empty[it % FD_STAGES], ((it / FD_STAGES) - 1) & 1);
#endif
            fd_bar_wait(&fd_full[it % FD_STAGES], (it / FD_STAGES) & 1);  // tile landed
        }
        float* const Sb = Ss + (jt & 1) * (FD_P * FD_HM * FD_LDS);
#else
    for (int it = 0; it < n_tiles; ++it) {
        constexpr bool live = true;
        const i64 kt = k0 + (i64)it * FD_BK;
        asm volatile("cp.async.wait_group %0;\n" ::"n"(FD_STAGES - 2));
        __syncthreads();  // A
        if (it + FD_STAGES - 1 < n_tiles) load_tile(it + FD_STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        if (tid < FD_BK) {
            fd_slots[(it + FD_STAGES) & 1][tid] = slot_of(it + FD_STAGES, entry_next);
            entry_next = table_entry(it + FD_STAGES + 1);
        }
        float* const Sb = Ss;
#endif
        const bf16* Ct = Cs + (it % FD_STAGES) * FD_BK * FD_LD;
        // Partial S: m-tile mt_s, k-steps [part·KPP, (part+1)·KPP), key n-tiles ng·NTW + u.
        if (live) {
            float acc[FD_CH][FD_NTW][4];
#pragma unroll
            for (int ch = 0; ch < FD_CH; ++ch)
#pragma unroll
                for (int u = 0; u < FD_NTW; ++u) acc[ch][u][0] = acc[ch][u][1] = acc[ch][u][2] = acc[ch][u][3] = 0.0f;
            // k-steps in pairs: one ldmatrix.x4 gives the B fragments of two k-steps.
#pragma unroll
            for (int j = 0; j < FD_KPP; j += 2) {
                const int kk = part * FD_KPP + j;
                if (kk < FD_KSTEPS) {
                    const bool two = j + 1 < FD_KPP && kk + 1 < FD_KSTEPS;
                    unsigned a0[4], a1[4];
#if FD_QREG
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        a0[e] = qa[j][e];
                        a1[e] = qa[j + 1 < FD_KPP ? j + 1 : j][e];
                    }
#else
                    {
                        const bf16* p = Qs + (mt_s * 16 + (lane & 15)) * FD_LD + kk * 16 + (lane >> 4) * 8;
                        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                     : "=r"(a0[0]), "=r"(a0[1]), "=r"(a0[2]), "=r"(a0[3])
                                     : "r"(mla_smem_addr(p)));
                        if (two)
                            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                         : "=r"(a1[0]), "=r"(a1[1]), "=r"(a1[2]), "=r"(a1[3])
                                         : "r"(mla_smem_addr(p + 16)));
                    }
#endif
#pragma unroll
                    for (int u = 0; u < FD_NTW; ++u) {
                        const bf16* kb = Ct + (ng * FD_NTW + u) * 8 * FD_LD;
                        if (two) {
                            unsigned b0, b1, b2, b3;
                            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                                         : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                                         : "r"(mla_smem_addr(kb + (lane & 7) * FD_LD + kk * 16 + (lane >> 3) * 8)));
                            mla_mma_16816(acc[j % FD_CH][u], a0, b0, b1);
                            mla_mma_16816(acc[(j + 1) % FD_CH][u], a1, b2, b3);
                        } else {
                            const bf16* kr = kb + g * FD_LD + kk * 16 + 2 * t;
                            mla_mma_16816(acc[j % FD_CH][u], a0, *reinterpret_cast<const unsigned*>(kr),
                                   *reinterpret_cast<const unsigned*>(kr + 8));
                        }
                    }
                }
            }
            float* Sp = Sb + part * FD_HM * FD_LDS;
#pragma unroll
            for (int u = 0; u < FD_NTW; ++u) {
                float sv[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    sv[e] = acc[0][u][e];
#pragma unroll
                    for (int ch = 1; ch < FD_CH; ++ch) sv[e] += acc[ch][u][e];
                }
                const int key = (ng * FD_NTW + u) * 8 + 2 * t, row = mt_s * 16 + g;
                *reinterpret_cast<float2*>(Sp + row * FD_LDS + key) = make_float2(sv[0], sv[1]);
                *reinterpret_cast<float2*>(Sp + (row + 8) * FD_LDS + key) = make_float2(sv[2], sv[3]);
            }
        }
        team_sync();  // B
#if FD_FUSED
        // Online softmax in the accumulator layout: this thread holds keys kk·16 + 8·e2 + 2t + {0,1}
        // of rows m·16 + g + 8·half; max and sum over the row's 4 lanes by two shuffles.
        unsigned pa[FD_BK / 16][FD_MT][4];  // P's A fragments per 16-key step (fd_pv_step's a)
        float alpha[FD_MT][2];
#pragma unroll
        for (int m = 0; m < FD_MT; ++m) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = m * 16 + g + 8 * half;
                float x[FD_BK / 16][4];
                float mx = -INFINITY;
#pragma unroll
                for (int kk = 0; kk < FD_BK / 16; ++kk) {
#pragma unroll
                    for (int e2 = 0; e2 < 2; ++e2) {
                        const int key = kk * 16 + 8 * e2 + 2 * t;
                        float2 v = *reinterpret_cast<const float2*>(Sb + row * FD_LDS + key);
#pragma unroll
                        for (int p = 1; p < FD_P; ++p) {
                            const float2 w2 = *reinterpret_cast<const float2*>(Sb + (p * FD_HM + row) * FD_LDS + key);
                            v.x += w2.x;
                            v.y += w2.y;
                        }
                        x[kk][2 * e2] = kt + key < k1 ? v.x * sl2 : -INFINITY;
                        x[kk][2 * e2 + 1] = kt + key + 1 < k1 ? v.y * sl2 : -INFINITY;
                        mx = fmaxf(mx, fmaxf(x[kk][2 * e2], x[kk][2 * e2 + 1]));
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mn = fmaxf(m_run[m][half], mx);
                float sum = 0.0f;
#pragma unroll
                for (int kk = 0; kk < FD_BK / 16; ++kk)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        x[kk][e] = exp2f(x[kk][e] - mn);
                        sum += x[kk][e];
                    }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                const float al = exp2f(m_run[m][half] - mn);
                l_run[m][half] = l_run[m][half] * al + sum;
                m_run[m][half] = mn;
                alpha[m][half] = al;
#pragma unroll
                for (int kk = 0; kk < FD_BK / 16; ++kk) {
                    __nv_bfloat162 lo = __floats2bfloat162_rn(x[kk][0], x[kk][1]);
                    __nv_bfloat162 hi = __floats2bfloat162_rn(x[kk][2], x[kk][3]);
                    pa[kk][m][half] = *reinterpret_cast<unsigned*>(&lo);
                    pa[kk][m][2 + half] = *reinterpret_cast<unsigned*>(&hi);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < FD_MT; ++m) fd_rescale_o(o, m, alpha[m][0], alpha[m][1]);
#pragma unroll
        for (int kk = 0; kk < FD_BK / 16; ++kk) fd_pv_step(o, pa[kk], Ct + (kk * 16 + (lane & 15)) * FD_LD, wt);
#else
        // Online softmax: (team) warp w takes head rows w·RPW …, lane j takes key j of the tile.
        const bool key_ok = kt + lane < k1;
#pragma unroll
        for (int rr = 0; rr < FD_RPW; ++rr) {
            if (!live) break;
            fd_softmax_row(Sb, Ps, As, wt * FD_RPW + rr, lane, key_ok, sl2, m_run[rr], l_run[rr]);
        }
#if FD_RPW == 0
        if (live && wt < FD_HM) fd_softmax_row(Sb, Ps, As, wt, lane, key_ok, sl2, m_run[0], l_run[0]);
#endif
        team_sync();  // C
        // O[:, value n-tiles of this warp] = O·α + P · V.
        if (live) {
#pragma unroll
        for (int m = 0; m < FD_MT; ++m) fd_rescale_o(o, m, As[m * 16 + g], As[m * 16 + g + 8]);
#pragma unroll
        for (int kk = 0; kk < FD_BK / 16; ++kk) {
            unsigned a[FD_MT][4];
#pragma unroll
            for (int m = 0; m < FD_MT; ++m) {
                const bf16* pb = Ps + (m * 16 + g) * FD_LDP + kk * 16 + 2 * t;
                a[m][0] = *reinterpret_cast<const unsigned*>(pb);
                a[m][1] = *reinterpret_cast<const unsigned*>(pb + 8 * FD_LDP);
                a[m][2] = *reinterpret_cast<const unsigned*>(pb + 8);
                a[m][3] = *reinterpret_cast<const unsigned*>(pb + 8 * FD_LDP + 8);
            }
            fd_pv_step(o, a, Ct + (kk * 16 + (lane & 15)) * FD_LD, wt);
        }
        }  // live
#endif
#if FD_TMA
        __syncwarp();
        if (live && lane == 0) fd_bar_arrive(&fd_empty[it % FD_STAGES]);  // this warp is done with the stage
#endif
    }
    const float ln2 = 0.6931471805599453f;
    // Head row r of this block's partial output and its LSE (natural log): in shared memory for
    // the cluster merge, else in parts / lses.
    auto part_row = [&](int r) -> float* {
#if FD_CLUSTER
        return Os + r * FD_LDO;
#else
        return parts + ((s * n + i) * nh + h0 + r) * MLA_DV;
#endif
    };
    auto store_lse = [&](int r, float lse) {
#if FD_CLUSTER
        fd_lse[r] = lse;
#else
        lses[(s * n + i) * nh + h0 + r] = lse;
#endif
    };
#if FD_FUSED
    // Every warp holds the sums of its rows; warp 0 writes the LSE (natural log).
#if FD_CLUSTER
    fd_sync();  // every warp done with the last tile: Os overwrites Q, the stages and the scores
#endif
#pragma unroll
    for (int m = 0; m < FD_MT; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = m * 16 + g + 8 * half;
            if (h0 + r >= nh) continue;
            const float l = l_run[m][half];
            if (wt == 0 && t == 0) store_lse(r, m_run[m][half] * ln2 + logf(l));
            fd_store_o_row(part_row(r), o[m], half, l, wt, t);
        }
    }
#elif FD_TEAMS > 1
    // Teams: each team's final max and sum to shared memory; then each team k > 0 leaves its
    // O·exp2(m_k − max) in X [k−1][HM][LDO], and team 0 combines: max over the teams, weights
    // a_k = exp2(m_k − max) (0 for a team without a tile: m −inf, sum 0, O 0), sum Σ a_k·l_k,
    // O = (a_0·O_0 + Σ X_k) / sum, LSE = max·ln2 + log(sum).
#pragma unroll
    for (int rr = 0; rr < (FD_RPW > 0 ? FD_RPW : 1); ++rr) {
        const int row = FD_RPW > 0 ? wt * FD_RPW + rr : wt;
        if ((FD_RPW > 0 || wt < FD_HM) && lane == 0) {
            Ls[row] = l_run[rr];
            Mall[team * FD_HM + row] = m_run[rr];
        }
    }
    fd_sync();  // every team done with its last tile (X overwrites Q and the stages)
    float* const X = reinterpret_cast<float*>(fd_smem) + FD_XOFF;
    auto team_max = [&](int r) {
        float mx = Mall[r];
#pragma unroll
        for (int k = 1; k < FD_TEAMS; ++k) mx = fmaxf(mx, Mall[k * FD_HM + r]);
        return mx;
    };
    if (team > 0) {
#pragma unroll
        for (int m = 0; m < FD_MT; ++m) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = m * 16 + g + 8 * half;
                if (h0 + r >= nh) continue;
                const float a = exp2f(Mall[team * FD_HM + r] - team_max(r));
                float* const xrow = X + ((team - 1) * FD_HM + r) * FD_LDO;
#pragma unroll
                for (int v = 0; v < FD_NVW; ++v) {
                    const int nt = wt + FD_WARPS * v;
                    if (FD_NTV % FD_WARPS == 0 || nt < FD_NTV)
                        *reinterpret_cast<float2*>(xrow + nt * 8 + 2 * t) =
                            make_float2(o[m][v][2 * half] * a, o[m][v][2 * half + 1] * a);
                }
            }
        }
    }
    fd_sync();  // X written
    if (team == 0) {
#pragma unroll
        for (int m = 0; m < FD_MT; ++m) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = m * 16 + g + 8 * half;
                if (h0 + r >= nh) continue;
                const float mx = team_max(r);
                const float a0 = exp2f(Mall[r] - mx);
                float l = a0 * Lall[r];
#pragma unroll
                for (int k = 1; k < FD_TEAMS; ++k) l += exp2f(Mall[k * FD_HM + r] - mx) * Lall[k * FD_HM + r];
                if (wt == 0 && t == 0) store_lse(r, mx * ln2 + logf(l));
                float* const orow = part_row(r);
#pragma unroll
                for (int v = 0; v < FD_NVW; ++v) {
                    const int nt = wt + FD_WARPS * v;
                    if (FD_NTV % FD_WARPS == 0 || nt < FD_NTV) {
                        float2 acc = make_float2(o[m][v][2 * half] * a0, o[m][v][2 * half + 1] * a0);
#pragma unroll
                        for (int k = 1; k < FD_TEAMS; ++k) {
                            const float2 x =
                                *reinterpret_cast<const float2*>(X + ((k - 1) * FD_HM + r) * FD_LDO + nt * 8 + 2 * t);
                            acc.x += x.x;
                            acc.y += x.y;
                        }
                        *reinterpret_cast<float2*>(orow + nt * 8 + 2 * t) = make_float2(acc.x / l, acc.y / l);
                    }
                }
            }
        }
    }
#else
    // Final sums to shared memory for the value warps; LSE (natural log) by the softmax owners.
#pragma unroll
    for (int rr = 0; rr < (FD_RPW > 0 ? FD_RPW : 1); ++rr) {
        const int row = FD_RPW > 0 ? wt * FD_RPW + rr : wt;
        if ((FD_RPW > 0 || wt < FD_HM) && lane == 0) {
            Ls[row] = l_run[rr];
            if (h0 + row < nh) store_lse(row, m_run[rr] * ln2 + logf(l_run[rr]));
        }
    }
    fd_sync();  // also: every warp done with the last tile (Os overwrites Q, the stages, scores, P)
#pragma unroll
    for (int m = 0; m < FD_MT; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = m * 16 + g + 8 * half;
            if (h0 + r >= nh) continue;
            fd_store_o_row(part_row(r), o[m], half, Ls[r], wt, t);
        }
    }
#endif
#if FD_CLUSTER
    fd_cluster_merge(Os, fd_lse, Ws, out, out_lse, nh, i, h0, tid, [] { fd_sync(); });
#else
    if (out != nullptr)
        fd_merge_tail(parts, lses, out, out_lse, counters, n, nh, splits, i, h0, tid, FD_THREADS,
                      reinterpret_cast<float*>(Cs), FD_STAGES * FD_BK * FD_LD / 2, [] { fd_sync(); }, spin);
#endif
}
#endif  // FD_WG
