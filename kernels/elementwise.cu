// Elementwise and data-movement kernels of the engine paths.
//
// Pointer arguments (shapes in docs/mla.md dims; every size an element count):
//   fill_bits(x [n])                                      x[i] = bits
//   add(a [n], b [n], out [n])                            out = a + b
//   silu_mul(g [n], u [n], out [n])                       out = silu(g)·u (SwiGLU)
//   cast_bf16(x [n], y [n] bf16)                          y = bf16(x), round to nearest even
//   copy2d(src, dst, rows, width, src_off, src_stride, src_row_div, dst_off, dst_stride)
//        dst[dst_off + r·dst_stride + c] = src[src_off + (r / src_row_div)·src_stride + c]
//   transpose(src [batch, rows, cols], dst [batch, cols, rows])
//   gather_rows(src [*, row_len], idx [n] i64, dst [n, row_len])
//   scatter_rows(dst [*, row_len], src [n, row_len], idx [n] i64)
//   cache_write(cache [slots, L+R], kv_c [n, L], k_pe [n, R], slots [n] i64)
//        concat_and_cache_mla: cache row slots[i] = [kv_c[i] | k_pe[i]]
//   bmm_heads(x [T, nh, A], w [nh, A, B], out [T, nh, B])  out[t,h] = x[t,h] · w[h]

extern "C" __global__ void fill_bits(float* x, i64 n, unsigned bits) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __uint_as_float(bits);
}

extern "C" __global__ void add(const float* a, const float* b, float* out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = g[i];
        out[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

extern "C" __global__ void cast_bf16(const float* x, __nv_bfloat16* y, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

extern "C" __global__ void copy2d(const float* src, float* dst, i64 rows, i64 width, i64 src_off,
                                  i64 src_stride, i64 src_row_div, i64 dst_off, i64 dst_stride) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * width) return;
    i64 r = i / width, c = i % width;
    dst[dst_off + r * dst_stride + c] = src[src_off + (r / src_row_div) * src_stride + c];
}

extern "C" __global__ void transpose(const float* src, float* dst, i64 batch, i64 rows, i64 cols) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * rows * cols) return;
    i64 b = i / (rows * cols), rc = i % (rows * cols), r = rc / cols, c = rc % cols;
    dst[b * rows * cols + c * rows + r] = src[i];
}

extern "C" __global__ void gather_rows(const float* src, const i64* idx, float* dst, i64 n, i64 row_len) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * row_len) return;
    i64 k = i / row_len, c = i % row_len;
    dst[i] = src[idx[k] * row_len + c];
}

extern "C" __global__ void scatter_rows(float* dst, const float* src, const i64* idx, i64 n, i64 row_len) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * row_len) return;
    i64 k = i / row_len, c = i % row_len;
    dst[idx[k] * row_len + c] = src[i];
}

extern "C" __global__ void cache_write(float* cache, const float* kv_c, const float* k_pe, const i64* slots,
                                       i64 n, i64 l, i64 r) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 w = l + r;
    if (i >= n * w) return;
    i64 k = i / w, c = i % w;
    cache[slots[k] * w + c] = c < l ? kv_c[k * l + c] : k_pe[k * r + (c - l)];
}

extern "C" __global__ void bmm_heads(const float* x, const float* w, float* out, i64 t, i64 nh, i64 a, i64 b,
                                     int bf16) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= t * nh * b) return;
    i64 ti = i / (nh * b), h = (i / b) % nh, bi = i % b;
    const float* xr = x + (ti * nh + h) * a;
    const float* wh = w + h * a * b;
    float acc = 0.0f;
    for (i64 k = 0; k < a; ++k) acc += mla_in(xr[k], bf16) * mla_in(wh[k * b + bi], bf16);
    out[i] = acc;
}

// round_bf16(x [n], y [n]): y = float(bf16(x)), round to nearest even (bf16 GEMM emulation).
extern "C" __global__ void round_bf16(const float* x, float* y, i64 n) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
}
