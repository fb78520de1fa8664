//! Dequantization of GGUF tensor bytes to f32, bit-exact with ggml.
//!
//! Both sides of every comparison use the same dequantized weights, so dequantization is not what
//! mla-diff judges, but it must be exactly ggml's: a weight that is off by one ulp would make the
//! reference disagree with an engine that reads the same file. Block decoding of the quantized
//! types is delegated to the `rlx-gguf` crate (checked bit for bit against gguf-py, see
//! `tests/dequant_vectors.rs`), except MXFP4, whose nibble order rlx-gguf gets wrong and which is
//! decoded here. The plain types (F32, F16, BF16, F64, integers) are decoded here too, from
//! little-endian bytes, so an unaligned slice (an embedded file, a hostile offset) never reaches a
//! cast that would panic.
//!
//! Work is split into fixed runs of whole blocks decoded in parallel with rayon; each output
//! element depends on its own block only, so the result is identical for any thread count.

use rayon::prelude::*;

use crate::model::gguf::GgmlType;

/// Blocks per parallel work item. Fixed, so results never depend on the thread count.
const BLOCKS_PER_TASK: usize = 1024;

/// Dequantizes `bytes`, which must hold exactly `n` elements of type `ty` (whole blocks), to f32.
///
/// `bytes` may be any block-aligned slice of a tensor (a TP shard's rows, one embedding row).
/// Output: `n` f32 values in ggml element order (`ne[0]` fastest).
/// Errors: a message when `n` is not a whole number of blocks, when `bytes.len()` disagrees with
/// `n`, or when the type has no decoder (Q8_1, Q8_K and the I64 type are never stored as weights).
/// Source of the block layouts: ggml `ggml-common.h` / `ggml-quants.c`, via gguf-py `quants.py`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let expected = ty
        .bytes_for(n as u64)
        .ok_or_else(|| format!("{n} elements is not a whole number of {ty} blocks"))?;
    if bytes.len() as u64 != expected {
        return Err(format!(
            "{} bytes given for {n} {ty} elements, which need {expected}",
            bytes.len()
        ));
    }
    let mut out = vec![0f32; n];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Like [`dequantize`], writing into `out` (whose length is the element count).
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let n = out.len();
    let bs = ty.block_size() as usize;
    let ts = ty.type_size() as usize;
    if !n.is_multiple_of(bs) || bytes.len() != n / bs * ts {
        return Err(format!("{} bytes do not hold exactly {n} {ty} elements", bytes.len()));
    }
    let elems_per_task = bs * BLOCKS_PER_TASK;
    let bytes_per_task = ts * BLOCKS_PER_TASK;
    out.par_chunks_mut(elems_per_task)
        .zip(bytes.par_chunks(bytes_per_task))
        .try_for_each(|(o, b)| decode_run(ty, b, o))
}

/// Decodes one run of whole blocks, with AVX2 code generation where the CPU has it.
fn decode_run(ty: GgmlType, b: &[u8], out: &mut [f32]) -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of
        // `decode_run_avx2`'s `target_feature`.
        return unsafe { decode_run_avx2(ty, b, out) };
    }
    decode_run_generic(ty, b, out)
}

/// [`decode_run_generic`] compiled for AVX2: the local block decoders are inlined into it and
/// vectorized 8 lanes wide (the baseline x86-64 target has only SSE2, where LLVM leaves the Q8_0
/// loop scalar). The arithmetic is the same IEEE operations in the same order, so the bits are
/// the same as the generic build's (tested below).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn decode_run_avx2(ty: GgmlType, b: &[u8], out: &mut [f32]) -> Result<(), String> {
    decode_run_generic(ty, b, out)
}

/// Decodes one run of whole blocks (any CPU).
#[inline(always)]
fn decode_run_generic(ty: GgmlType, b: &[u8], out: &mut [f32]) -> Result<(), String> {
    let le2 = |c: &[u8]| [c[0], c[1]];
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::f16::from_le_bytes(le2(c)).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes(le2(c)).to_f32();
            }
        }
        GgmlType::F64 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(8)) {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                *o = f64::from_le_bytes(a) as f32;
            }
        }
        GgmlType::I8 => {
            for (o, &c) in out.iter_mut().zip(b) {
                *o = c as i8 as f32;
            }
        }
        GgmlType::I16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = i16::from_le_bytes(le2(c)) as f32;
            }
        }
        GgmlType::I32 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        GgmlType::MXFP4 => decode_mxfp4(b, out),
        GgmlType::Q8_0 => decode_q8_0(b, out),
        GgmlType::Q4_K => decode_q4_k(b, out),
        GgmlType::Q6_K => decode_q6_k(b, out),
        GgmlType::IQ4_NL => decode_iq4_nl(b, out),
        GgmlType::Q8_1 | GgmlType::Q8_K | GgmlType::I64 => {
            return Err(format!("no decoder for {ty}: it is not a weight storage type"));
        }
        _ => {
            let rt = rlx_type(ty).ok_or_else(|| format!("no decoder for {ty}"))?;
            let v = rlx_gguf::dequant_typed(rt, b, out.len(), ty.name()).map_err(|e| format!("{e}"))?;
            if v.len() != out.len() {
                return Err(format!(
                    "decoder returned {} values for {} {ty} elements",
                    v.len(),
                    out.len()
                ));
            }
            out.copy_from_slice(&v);
        }
    }
    Ok(())
}

/// Maps our type to rlx-gguf's for the quantized types it decodes bit-exactly.
fn rlx_type(ty: GgmlType) -> Option<rlx_gguf::GgmlType> {
    use rlx_gguf::GgmlType as R;
    Some(match ty {
        GgmlType::Q4_0 => R::Q4_0,
        GgmlType::Q4_1 => R::Q4_1,
        GgmlType::Q5_0 => R::Q5_0,
        GgmlType::Q5_1 => R::Q5_1,
        GgmlType::Q8_0 => R::Q8_0,
        GgmlType::Q2_K => R::Q2K,
        GgmlType::Q3_K => R::Q3K,
        GgmlType::Q4_K => R::Q4K,
        GgmlType::Q5_K => R::Q5K,
        GgmlType::Q6_K => R::Q6K,
        GgmlType::IQ2_XXS => R::IQ2XXS,
        GgmlType::IQ2_XS => R::IQ2XS,
        GgmlType::IQ3_XXS => R::IQ3XXS,
        GgmlType::IQ1_S => R::IQ1S,
        GgmlType::IQ4_NL => R::IQ4NL,
        GgmlType::IQ3_S => R::IQ3S,
        GgmlType::IQ2_S => R::IQ2S,
        GgmlType::IQ4_XS => R::IQ4XS,
        GgmlType::IQ1_M => R::IQ1M,
        GgmlType::TQ1_0 => R::TQ1_0,
        GgmlType::TQ2_0 => R::TQ2_0,
        _ => return None,
    })
}

/// f16 little-endian bytes to f32 (exact).
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q8_0 (ggml `block_q8_0`: f16 `d`, then 32 signed bytes): `y = q·d`.
#[inline(always)]
fn decode_q8_0(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        for (y, &q) in o.iter_mut().zip(&blk[2..34]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

/// Q4_K scale and min of sub-block `j` (ggml `get_scale_min_k4`): 6-bit values packed in 12 bytes.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K (ggml `block_q4_K`, 144 bytes: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins,
/// 128 bytes of nibbles). Per 64 elements, the low nibbles of 32 bytes use sub-block scale
/// `2j`, the high nibbles `2j+1`: `y = (d·sc)·q − (dmin·m)`.
#[inline(always)]
fn decode_q4_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(144).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        let scales = &blk[4..16];
        for (j, (qs, y)) in blk[16..144].chunks_exact(32).zip(o.chunks_exact_mut(64)).enumerate() {
            let (sc1, m1) = scale_min_k4(2 * j, scales);
            let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let (lo, hi) = y.split_at_mut(32);
            for ((yl, yh), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
                *yl = d1 * (q & 0x0F) as f32 - m1;
                *yh = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

/// Q6_K (ggml `block_q6_K`, 210 bytes: 128 bytes of low nibbles `ql`, 64 bytes of high 2-bit
/// pairs `qh`, 16 signed 8-bit scales, f16 `d`): `y = (d·sc)·(q − 32)` for each 6-bit `q`.
#[inline(always)]
fn decode_q6_k(b: &[u8], out: &mut [f32]) {
    for (blk, o) in b.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(blk, 208);
        for h in 0..2 {
            let ql = &blk[h * 64..h * 64 + 64];
            let qh = &blk[128 + h * 32..128 + h * 32 + 32];
            let sc = &blk[192 + h * 8..192 + h * 8 + 8];
            let y = &mut o[h * 128..h * 128 + 128];
            for half in 0..2 {
                // Elements l in 16·half .. 16·half + 16 share the scales sc[half + 2i].
                let ds: [f32; 4] = std::array::from_fn(|i| d * (sc[half + 2 * i] as i8) as f32);
                for l in 16 * half..16 * half + 16 {
                    let (a, c, hb) = (ql[l], ql[l + 32], qh[l]);
                    let q1 = ((a & 0x0F) | ((hb & 3) << 4)) as i32 - 32;
                    let q2 = ((c & 0x0F) | (((hb >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((a >> 4) | (((hb >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((c >> 4) | (((hb >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = ds[0] * q1 as f32;
                    y[l + 32] = ds[1] * q2 as f32;
                    y[l + 64] = ds[2] * q3 as f32;
                    y[l + 96] = ds[3] * q4 as f32;
                }
            }
        }
    }
}

/// IQ4_NL (ggml `block_iq4_nl`: f16 `d`, 16 bytes of 4-bit indices into ggml's non-linear table
/// `kvalues_iq4nl`; low nibbles are elements 0..16, high nibbles 16..32): `y = d·kvalues[q]`.
#[inline(always)]
fn decode_iq4_nl(b: &[u8], out: &mut [f32]) {
    const KVALUES: [f32; 16] = [
        -127., -104., -83., -65., -49., -35., -22., -10., 1., 13., 25., 38., 53., 69., 89., 113.,
    ];
    for (blk, o) in b.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        let (lo, hi) = o.split_at_mut(16);
        for ((yl, yh), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&blk[2..18]) {
            *yl = d * KVALUES[(q & 0x0F) as usize];
            *yh = d * KVALUES[(q >> 4) as usize];
        }
    }
}

/// MXFP4 (ggml `block_mxfp4`: one E8M0 exponent byte, then 16 bytes of 4-bit E2M1 codes; the low
/// nibbles are elements 0..16, the high nibbles 16..32). Values are ggml's doubled E2M1 table
/// times half the E8M0 scale (`ggml_e8m0_to_fp32_half`).
fn decode_mxfp4(b: &[u8], out: &mut [f32]) {
    const KVALUES: [f32; 16] = [0., 1., 2., 3., 4., 6., 8., 12., 0., -1., -2., -3., -4., -6., -8., -12.];
    for (blk, o) in b.chunks_exact(17).zip(out.chunks_exact_mut(32)) {
        let e = blk[0] as u32;
        let bits = if e < 2 { 0x0020_0000u32 << e } else { (e - 1) << 23 };
        let d = f32::from_bits(bits);
        for j in 0..16 {
            let q = blk[1 + j];
            o[j] = d * KVALUES[(q & 0x0F) as usize];
            o[j + 16] = d * KVALUES[(q >> 4) as usize];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_types_decode_from_unaligned_bytes() {
        let vals = [1.5f32, -2.25, 3.0e-8];
        let mut bytes = vec![0u8];
        for v in vals {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        // Skip the first byte: the slice is deliberately misaligned for f32.
        assert_eq!(dequantize(GgmlType::F32, &bytes[1..], 3).unwrap(), vals);
        let h: Vec<u8> = [half::f16::from_f32(0.5), half::f16::from_f32(-3.0)]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(dequantize(GgmlType::F16, &h, 2).unwrap(), vec![0.5, -3.0]);
    }

    #[test]
    fn wrong_lengths_are_errors_not_panics() {
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], 32).is_err());
        assert!(dequantize(GgmlType::Q4_K, &[0u8; 144], 255).is_err());
        assert!(dequantize(GgmlType::Q8_K, &[0u8; 292], 256).is_err());
    }

    #[test]
    fn q8_0_block_by_hand() {
        // d = 0.5 (f16 0x3800), q = 0..31 as i8 with alternating signs.
        let mut b = vec![0x00, 0x38];
        for i in 0..32i8 {
            b.push((if i % 2 == 0 { i } else { -i }) as u8);
        }
        let v = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(v[0], 0.0);
        assert_eq!(v[1], -0.5);
        assert_eq!(v[30], 15.0);
    }

    #[test]
    fn local_decoders_match_rlx_gguf_bit_for_bit() {
        // Random bytes, so the f16 scales cover subnormals, infinities and NaNs too.
        let mut r = crate::core::batch::SplitMix64::new(7);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::IQ4_NL] {
            let blocks = 3000;
            let n = blocks * ty.block_size() as usize;
            let bytes: Vec<u8> = (0..blocks * ty.type_size() as usize)
                .map(|_| (r.next_u64() >> 56) as u8)
                .collect();
            let ours = dequantize(ty, &bytes, n).unwrap();
            let theirs = rlx_gguf::dequant_typed(rlx_type(ty).unwrap(), &bytes, n, ty.name()).unwrap();
            let differ = ours
                .iter()
                .zip(&theirs)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differ, 0, "{ty}: {differ} of {n} values differ in bits");
            // The baseline (non-AVX2) build of the same decoders, too.
            let mut generic = vec![0f32; n];
            decode_run_generic(ty, &bytes, &mut generic).unwrap();
            let differ = generic
                .iter()
                .zip(&theirs)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differ, 0, "{ty} (generic build): {differ} of {n} values differ in bits");
        }
    }

    #[test]
    fn mxfp4_nibble_order_low_first() {
        // e = 128 → d = 2^(127-127) = 1.0 (the "half" scale of E8M0 exponent 128).
        let mut b = vec![128u8];
        b.extend((0..16u8).map(|j| (j & 0x0F) | (((15 - j) & 0x0F) << 4)));
        let v = dequantize(GgmlType::MXFP4, &b, 32).unwrap();
        assert_eq!(v[1], 1.0); // low nibble of byte 1 → element 1
        assert_eq!(v[16], -12.0); // high nibble of byte 0 = 15 → element 16
        assert_eq!(v[7], 12.0);
    }
}
