// GGUF dequantization on the GPU, straight from the file's raw bytes.
//
// dequant_<type>(b [nblocks · block_bytes] u8, y [nblocks · block_elems] f32, nblocks)
//   One thread per output element. Block layouts are ggml's (ggml-common.h). The arithmetic
//   mirrors the CPU decoder operation for operation, and this module is compiled with
//   --fmad=false, so every value is bit-identical to the CPU's (checked by `mla-diff selftest
//   --backend cuda` and the device tests).
//   F32 [1 el / 4 B], F16 [1/2], BF16 [1/2], Q8_0 [32/34], Q4_0 [32/18], Q4_1 [32/20],
//   Q5_0 [32/22], Q5_1 [32/24], Q4_K [256/144], Q5_K [256/176], Q6_K [256/210].

typedef unsigned char u8;

__device__ __forceinline__ float f16le(const u8* p) {
    unsigned short h = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ unsigned u32le(const u8* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24);
}

#define ELEM_INDEX(block_elems)                               \
    i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;        \
    if (e >= nblocks * (block_elems)) return;                   \
    i64 blk = e / (block_elems);                                \
    int j = (int)(e % (block_elems));

extern "C" __global__ void dequant_f32(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(1)
    y[e] = __uint_as_float(u32le(b + 4 * blk));
    (void)j;
}

extern "C" __global__ void dequant_f16(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(1)
    y[e] = f16le(b + 2 * blk);
    (void)j;
}

extern "C" __global__ void dequant_bf16(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(1)
    unsigned bits = ((unsigned)b[2 * blk] | ((unsigned)b[2 * blk + 1] << 8)) << 16;
    y[e] = __uint_as_float(bits);
    (void)j;
}

extern "C" __global__ void dequant_q8_0(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(32)
    const u8* p = b + 34 * blk;
    y[e] = f16le(p) * (float)(signed char)p[2 + j];
}

// The 4-bit quant of element j (0..32) of a 32-element block whose 16 quant bytes start at `qs`:
// elements 0..16 are the low nibbles, 16..32 the high ones.
__device__ __forceinline__ int q4_nibble(const u8* qs, int j) {
    return j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
}

extern "C" __global__ void dequant_q4_0(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(32)
    const u8* p = b + 18 * blk;
    y[e] = f16le(p) * (float)(q4_nibble(p + 2, j) - 8);
}

extern "C" __global__ void dequant_q4_1(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(32)
    const u8* p = b + 20 * blk;
    y[e] = f16le(p) * (float)q4_nibble(p + 4, j) + f16le(p + 2);
}

// The 5-bit quant of element j (0..32) of a Q5_0/Q5_1 block: its low four bits the nibble of
// q4_nibble at `qs`, its fifth bit j of the little-endian word at `qh`.
__device__ __forceinline__ int q5_quant(const u8* qh, const u8* qs, int j) {
    return q4_nibble(qs, j) | (((u32le(qh) >> j) & 1) << 4);
}

extern "C" __global__ void dequant_q5_0(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(32)
    const u8* p = b + 22 * blk;
    y[e] = f16le(p) * (float)(q5_quant(p + 2, p + 6, j) - 16);
}

extern "C" __global__ void dequant_q5_1(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(32)
    const u8* p = b + 24 * blk;
    y[e] = f16le(p) * (float)q5_quant(p + 4, p + 8, j) + f16le(p + 2);
}

// 6-bit scale and min of sub-block `is` (0..8) from the 12-byte K-quant scales field.
__device__ __forceinline__ void scale_min_k4(int is, const u8* q, int* sc, int* m) {
    if (is < 4) {
        *sc = q[is] & 63;
        *m = q[is + 4] & 63;
    } else {
        *sc = (q[is + 4] & 0x0F) | ((q[is - 4] >> 6) << 4);
        *m = (q[is + 4] >> 4) | ((q[is] >> 6) << 4);
    }
}

// Element j (0..256) of a Q4_K or Q5_K block at p (f16 d, f16 dmin, 12 bytes of 6-bit scales and
// mins, …, the 4-bit quants at qs): its sub-block's scale d·sc and min dmin·m, and its low four
// bits. Each 64 elements share 32 quant bytes: the first 32 their low nibbles, the next 32 the
// high ones.
struct KQuantElem {
    float scale, min;
    int low;
};
__device__ __forceinline__ KQuantElem k_quant_elem(const u8* p, const u8* qs, int j) {
    const int chunk = j / 64, within = j % 64;
    int sc, m;
    scale_min_k4(2 * chunk + (within >= 32 ? 1 : 0), p + 4, &sc, &m);
    const u8 byte = qs[32 * chunk + within % 32];
    return {f16le(p) * (float)sc, f16le(p + 2) * (float)m, within < 32 ? (byte & 0x0F) : (byte >> 4)};
}

extern "C" __global__ void dequant_q4_k(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(256)
    const u8* p = b + 144 * blk;
    const KQuantElem k = k_quant_elem(p, p + 16, j);
    y[e] = k.scale * (float)k.low - k.min;
}

extern "C" __global__ void dequant_q5_k(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(256)
    const u8* p = b + 176 * blk;
    const KQuantElem k = k_quant_elem(p, p + 48, j);
    const int chunk = j / 64, within = j % 64;
    const unsigned bit = (within < 32 ? 1u : 2u) << (2 * chunk);  // the fifth bit, in qh at p + 16
    const int hi = (p[16 + within % 32] & bit) ? 16 : 0;
    y[e] = k.scale * (float)(k.low + hi) - k.min;
}

extern "C" __global__ void dequant_q6_k(const u8* b, float* y, i64 nblocks) {
    ELEM_INDEX(256)
    const u8* p = b + 210 * blk;
    const u8* ql = p;
    const u8* qh = p + 128;
    const signed char* sc = (const signed char*)(p + 192);
    const float d = f16le(p + 208);
    int half = j / 128, r = j % 128;
    int quarter = r / 32, l = r % 32;  // quarter 0..3 → q1..q4
    int is = l / 16;
    const u8* qlh = ql + 64 * half;
    u8 qhb = qh[32 * half + l];
    int q;
    switch (quarter) {
        case 0: q = (qlh[l] & 0x0F) | ((qhb & 3) << 4); break;
        case 1: q = (qlh[l + 32] & 0x0F) | (((qhb >> 2) & 3) << 4); break;
        case 2: q = (qlh[l] >> 4) | (((qhb >> 4) & 3) << 4); break;
        default: q = (qlh[l + 32] >> 4) | (((qhb >> 6) & 3) << 4); break;
    }
    y[e] = d * (float)sc[8 * half + is + 2 * quarter] * (float)(q - 32);
}
