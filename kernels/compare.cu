// The site comparison where the traces live (judge/metrics.rs's two passes, src/core/sums.rs's
// fields): a reference site in double against a candidate site in float, reduced per block. The
// host adds the few per-block partials in block order and builds the metrics from them, so a
// real-size trace never crosses PCIe to be judged. Sums are f64; their order differs from the
// CPU's chunked order only in the last bits of the metrics, never in a count.

#define CMP_THREADS 256

__device__ inline bool cmp_finite(double x) { return !isnan(x) && !isinf(x); }

// Warp then block reduction of a sum (every thread passes its part; thread 0 gets the total).
__device__ double cmp_sum_d(double v, double* part) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0)
        for (int w = 0; w < CMP_THREADS / 32; ++w) s += part[w];
    __syncthreads();
    return s;
}

__device__ unsigned long long cmp_sum_u(unsigned long long v, unsigned long long* part) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long s = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < CMP_THREADS / 32; ++w) s += part[w];
    __syncthreads();
    return s;
}

__device__ unsigned long long cmp_min_u(unsigned long long v, unsigned long long* part) {
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long x = __shfl_down_sync(0xffffffff, v, o);
        v = x < v ? x : v;
    }
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long s = ~0ull;
    if (threadIdx.x == 0)
        for (int w = 0; w < CMP_THREADS / 32; ++w) s = part[w] < s ? part[w] : s;
    __syncthreads();
    return s;
}

// Pass 1 over elements [0, n): per block, sums[b*4 + {0..3}] = Σr², Σc², Σ(c−r)², Σr·c over
// pairs finite on both sides, and counts[b*6 + {0..5}] = non-finite reference, non-finite
// candidate, mismatched non-finite, the first mismatch (~0 when none), canaries (a NaN whose
// bits under `canary_mask` equal `canary_bits`), zeros where the reference is not.
extern "C" __global__ void cmp_pass1(const double* __restrict__ r, const float* __restrict__ c, i64 n,
                                     unsigned int canary_bits, unsigned int canary_mask, double* __restrict__ sums,
                                     unsigned long long* __restrict__ counts) {
    __shared__ double pd[CMP_THREADS / 32];
    __shared__ unsigned long long pu[CMP_THREADS / 32];
    double rr = 0.0, cc = 0.0, dd = 0.0, rc = 0.0;
    unsigned long long nf_r = 0, nf_c = 0, nf_mis = 0, first = ~0ull, canary = 0, zeros = 0;
    for (i64 i = (i64)blockIdx.x * CMP_THREADS + threadIdx.x; i < n; i += (i64)gridDim.x * CMP_THREADS) {
        float cf = c[i];
        double rv = r[i], cv = (double)cf;
        if (isnan(cf) && (__float_as_uint(cf) & canary_mask) == canary_bits) ++canary;
        bool rfin = cmp_finite(rv), cfin = cmp_finite(cv);
        nf_r += !rfin;
        nf_c += !cfin;
        if (rfin != cfin) {
            ++nf_mis;
            if ((unsigned long long)i < first) first = (unsigned long long)i;
        }
        if (rfin && cfin) {
            double d = cv - rv;
            rr += rv * rv;
            cc += cv * cv;
            dd += d * d;
            rc += rv * cv;
            if (cv == 0.0 && rv != 0.0) ++zeros;
        }
    }
    double s0 = cmp_sum_d(rr, pd), s1 = cmp_sum_d(cc, pd), s2 = cmp_sum_d(dd, pd), s3 = cmp_sum_d(rc, pd);
    unsigned long long u0 = cmp_sum_u(nf_r, pu), u1 = cmp_sum_u(nf_c, pu), u2 = cmp_sum_u(nf_mis, pu);
    unsigned long long u3 = cmp_min_u(first, pu), u4 = cmp_sum_u(canary, pu), u5 = cmp_sum_u(zeros, pu);
    if (threadIdx.x == 0) {
        double* s = sums + (i64)blockIdx.x * 4;
        s[0] = s0; s[1] = s1; s[2] = s2; s[3] = s3;
        unsigned long long* u = counts + (i64)blockIdx.x * 6;
        u[0] = u0; u[1] = u1; u[2] = u2; u[3] = u3; u[4] = u4; u[5] = u5;
    }
}

// (difference, index) with the larger difference first and the lower index on ties.
__device__ inline bool cmp_worse(double d, unsigned long long i, double bd, unsigned long long bi) {
    return d > bd || (d == bd && i < bi);
}

// Pass 2 over elements [0, n) given atol = atol_rms·rms, rtol and floor = 1e-3·rms: per block,
// worst[b*2 + {0,1}] = the largest |c − r| (+∞ for a mismatched non-finite pair) and the
// largest |c − r|/|r| with |r| > floor; idx[b*2 + {0,1}] = the index of the former (the lowest on
// ties; 0 when every difference is 0) and the elements within atol + rtol·|r| (plus pairs
// non-finite in the same way).
extern "C" __global__ void cmp_pass2(const double* __restrict__ r, const float* __restrict__ c, i64 n, double atol,
                                     double rtol, double floor, double* __restrict__ worst,
                                     unsigned long long* __restrict__ idx) {
    __shared__ double pd[CMP_THREADS];
    __shared__ unsigned long long pi[CMP_THREADS];
    double max_abs = 0.0, max_rel = 0.0;
    unsigned long long max_i = 0, passed = 0;
    for (i64 i = (i64)blockIdx.x * CMP_THREADS + threadIdx.x; i < n; i += (i64)gridDim.x * CMP_THREADS) {
        double rv = r[i], cv = (double)c[i];
        bool rfin = cmp_finite(rv), cfin = cmp_finite(cv);
        if (rfin && cfin) {
            double d = fabs(cv - rv);
            // Strictly greater: a thread visits its elements in ascending order.
            if (d > max_abs) { max_abs = d; max_i = (unsigned long long)i; }
            if (fabs(rv) > floor) max_rel = fmax(max_rel, d / fabs(rv));
            if (d <= atol + rtol * fabs(rv)) ++passed;
        } else if (rfin == cfin && (isnan(rv) == isnan(cv)) && (isnan(rv) || rv == cv)) {
            ++passed;
        } else if (max_abs != (double)INFINITY) {
            max_abs = (double)INFINITY;
            max_i = (unsigned long long)i;
        }
    }
    // The worst (difference, index) of the block: an element with difference 0 never
    // competes (index 0 stands for "none"), as in the host pass.
    pd[threadIdx.x] = max_abs;
    pi[threadIdx.x] = max_abs > 0.0 ? max_i : ~0ull;
    __syncthreads();
    for (int k = CMP_THREADS / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k && cmp_worse(pd[threadIdx.x + k], pi[threadIdx.x + k], pd[threadIdx.x], pi[threadIdx.x])) {
            pd[threadIdx.x] = pd[threadIdx.x + k];
            pi[threadIdx.x] = pi[threadIdx.x + k];
        }
        __syncthreads();
    }
    double bd = pd[0];
    unsigned long long bi = pi[0];
    __syncthreads();
    double rel = 0.0;
    pd[threadIdx.x] = max_rel;
    __syncthreads();
    for (int k = CMP_THREADS / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) pd[threadIdx.x] = fmax(pd[threadIdx.x], pd[threadIdx.x + k]);
        __syncthreads();
    }
    rel = pd[0];
    __syncthreads();
    pi[threadIdx.x] = passed;
    __syncthreads();
    for (int k = CMP_THREADS / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) pi[threadIdx.x] += pi[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        worst[(i64)blockIdx.x * 2] = bd;
        worst[(i64)blockIdx.x * 2 + 1] = rel;
        idx[(i64)blockIdx.x * 2] = bd > 0.0 ? bi : 0;
        idx[(i64)blockIdx.x * 2 + 1] = pi[0];
    }
}

// dst[k*row_len + c] = src[idx[k]*row_len + c] for k < n, c < row_len: a step's rows (and a
// head subset's heads) of a reference site that stays on the device, gathered where it lives so
// that the step is judged there (compare's device judging). Grid-stride over n·row_len.
extern "C" __global__ void gather_rows_f64(const double* __restrict__ src, const i64* __restrict__ idx,
                                           double* __restrict__ dst, i64 n, i64 row_len) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n * row_len; i += (i64)gridDim.x * blockDim.x) {
        i64 k = i / row_len, c = i % row_len;
        dst[i] = src[idx[k] * row_len + c];
    }
}
