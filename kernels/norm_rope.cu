// RMSNorm over strided rows and rotary position embedding.
//
// Pointer arguments (docs/mla.md dims; element counts):
//   rms_norm(src [src_len], g [width], out [rows, width], rows, off, stride, width, src_len, eps)
//        out[r] = x / sqrt(mean(x²) + eps) · g with x = src[off + r·stride .. + width]; kv_c is
//        such a strided view of kv_a (width L, stride L+R). Reads past src_len give 0.
//        One block per row; the sum of squares uses a fixed-shape tree, so results are
//        deterministic.
//   rope(x [rows, R] in place, positions [rows] i64, cos [n, R/2], sin [n, R/2], rows, R, neox)
//        positions[r] is the row of the cos/sin tables for row r (the tables hold one row per
//        token, built on the host from the token's position and the YaRN frequencies).
//        neox = 0: DeepSeek/GPT-J interleaved pairs (x[2i], x[2i+1]); neox = 1: (x[i], x[i+R/2]).
//        cos/sin come from the host's YaRN frequency table.

#define RMS_THREADS 256

extern "C" __global__ void rms_norm(const float* src, const float* g, float* out, i64 rows, i64 off, i64 stride,
                                    i64 width, i64 src_len, float eps) {
    __shared__ float part[RMS_THREADS];
    i64 row = blockIdx.x;
    if (row >= rows) return;
    i64 base = off + row * stride;
    float s = 0.0f;
    for (i64 j = threadIdx.x; j < width; j += RMS_THREADS) {
        i64 k = base + j;
        float x = k < src_len ? src[k] : 0.0f;
        s += x * x;
    }
    part[threadIdx.x] = s;
    __syncthreads();
    for (int h = RMS_THREADS / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    float inv = 1.0f / sqrtf(part[0] / (float)width + eps);
    for (i64 j = threadIdx.x; j < width; j += RMS_THREADS) {
        i64 k = base + j;
        float x = k < src_len ? src[k] : 0.0f;
        out[row * width + j] = x * inv * g[j];
    }
}

extern "C" __global__ void rope(float* x, const i64* positions, const float* cos_t, const float* sin_t, i64 rows,
                                i64 r, int neox) {
    i64 half = r / 2;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * half) return;
    i64 row = i / half, k = i % half;
    i64 pos = positions[row];
    float c = cos_t[pos * half + k], s = sin_t[pos * half + k];
    i64 ia = neox ? k : 2 * k, ib = neox ? k + half : 2 * k + 1;
    float* v = x + row * r;
    float a = v[ia], b = v[ib];
    v[ia] = a * c - b * s;
    v[ib] = b * c + a * s;
}
