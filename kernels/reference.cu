// The f64 reference's own kernels (docs/mla.md, "The reference"): the plain maths of one MLA
// layer in double precision, between cuBLAS DGEMMs. They judge the engine kernels, so they share
// nothing with them: no f32 or bf16 arithmetic, no tensor cores, no fast math, one thread or one
// block per independent output. Buffers here are row-major double unless a parameter says float
// (the dequantized f32 weights, widened once).

#define REF_THREADS 256

// dst[i] = (double)src[i]: the exact widening of dequantized f32 values.
extern "C" __global__ void ref_widen(const float* __restrict__ src, double* __restrict__ dst, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = (double)src[i];
}

// dst[r, j] = src[off + r·stride + j] for r < rows, j < width: the column block of a strided
// tensor (k_pe out of kv_a, q_pe out of q, k_nope and v out of the expanded kv).
extern "C" __global__ void ref_copy_cols(const double* __restrict__ src, i64 rows, i64 stride, i64 off, i64 width,
                                         double* __restrict__ dst) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * width) return;
    i64 r = i / width, j = i % width;
    dst[i] = src[off + r * stride + j];
}

// Sum over a block of REF_THREADS threads (every thread gets the total).
__device__ double ref_block_sum(double v, double* part) {
    part[threadIdx.x] = v;
    __syncthreads();
    for (int k = REF_THREADS / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
        __syncthreads();
    }
    double s = part[0];
    __syncthreads();
    return s;
}

// Max over a block of REF_THREADS threads (every thread gets the maximum).
__device__ double ref_block_max(double v, double* part) {
    part[threadIdx.x] = v;
    __syncthreads();
    for (int k = REF_THREADS / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part[threadIdx.x] = fmax(part[threadIdx.x], part[threadIdx.x + k]);
        __syncthreads();
    }
    double s = part[0];
    __syncthreads();
    return s;
}

// RMSNorm of row r (one block per row) read at src[off + r·stride ..][..width]:
// out[r, j] = x_j / sqrt(mean(x²) + eps) · g_j.
extern "C" __global__ void ref_rms_norm(const double* __restrict__ src, i64 rows, i64 off, i64 stride, i64 width,
                                        const double* __restrict__ g, double eps, double* __restrict__ out) {
    __shared__ double part[REF_THREADS];
    i64 r = blockIdx.x;
    if (r >= rows) return;
    const double* x = src + off + r * stride;
    double s = 0.0;
    for (i64 j = threadIdx.x; j < width; j += REF_THREADS) s += x[j] * x[j];
    double inv = 1.0 / sqrt(ref_block_sum(s, part) / (double)width + eps);
    for (i64 j = threadIdx.x; j < width; j += REF_THREADS) out[r * width + j] = x[j] * inv * g[j];
}

// RoPE in place on `rows` rows of r values (row = token·heads + head), token t at pos[t], angle
// pos·inv_freq[k] for pair k: adjacent pairs (2k, 2k+1), or NeoX halves (k, k + r/2) when neox.
extern "C" __global__ void ref_rope(double* __restrict__ x, i64 rows, i64 heads, i64 r, const i64* __restrict__ pos,
                                    const double* __restrict__ inv_freq, int neox) {
    i64 half = r / 2;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * half) return;
    i64 row = i / half, k = i % half;
    i64 a = neox ? k : 2 * k, b = neox ? k + half : 2 * k + 1;
    double s, c;
    sincos((double)pos[row / heads] * inv_freq[k], &s, &c);
    double x0 = x[row * r + a], x1 = x[row * r + b];
    x[row * r + a] = x0 * c - x1 * s;
    x[row * r + b] = x0 * s + x1 * c;
}

// Causal softmax of one sequence's raw logits, in place: s [heads, len, len] row-major (row i of
// head hh holds q_i·k_j for every j), one block per (head, row). Row i keeps keys j ≤ i:
// p_j = exp(scale·s_j − m) / Σ, the rest 0; lse[i·lse_stride + hh] = m + ln Σ (natural log).
extern "C" __global__ void ref_softmax_causal(double* __restrict__ s, i64 len, i64 heads, double scale,
                                              double* __restrict__ lse, i64 lse_stride) {
    __shared__ double part[REF_THREADS];
    i64 hh = blockIdx.x / len, i = blockIdx.x % len;
    if (hh >= heads) return;
    double* row = s + (hh * len + i) * len;
    i64 visible = i + 1;
    double m = -INFINITY;
    for (i64 j = threadIdx.x; j < visible; j += REF_THREADS) m = fmax(m, row[j] * scale);
    m = ref_block_max(m, part);
    double sum = 0.0;
    for (i64 j = threadIdx.x; j < len; j += REF_THREADS) {
        double e = j < visible ? exp(row[j] * scale - m) : 0.0;
        row[j] = e;
        sum += e;
    }
    sum = ref_block_sum(sum, part);
    for (i64 j = threadIdx.x; j < visible; j += REF_THREADS) row[j] = row[j] / sum;
    if (threadIdx.x == 0) lse[i * lse_stride + hh] = m + log(sum);
}

// SwiGLU: out = g / (1 + exp(−g)) · u.
extern "C" __global__ void ref_swiglu(const double* __restrict__ g, const double* __restrict__ u,
                                      double* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
}

// out = a + b·scale (the residual adds, with MiniCPM3's residual scale).
extern "C" __global__ void ref_add_scaled(const double* __restrict__ a, const double* __restrict__ b, double scale,
                                          double* __restrict__ out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i] * scale;
}
