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

use super::GgmlType;

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

/// Decodes one run of whole blocks.
fn decode_run(ty: GgmlType, b: &[u8], out: &mut [f32]) -> Result<(), String> {
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
