//! FP8 E4M3 quantization as engines apply it before a product: rounding, block scales, and the
//! query/key pair of a scoring product.
//!
//! Engines quantize some activations to 8-bit floats before multiplying them: vLLM's DSA
//! lightning indexer scores fp8 queries against fp8 keys (DeepGEMM's `fp8_mqa_logits`), and an
//! fp8 KV cache stores keys and values that way. Three mantissa bits move a score by a few
//! percent, which is enough to change which keys a top-k keeps, so a reference that is to judge
//! such an engine stage by stage has to apply the same roundings where the engine declares them.
//! This module holds that arithmetic, with nothing about where it is applied: E4M3 rounding
//! (the OCP "e4m3fn" format, finite only, ±448 at most; round to nearest, ties to even,
//! saturating, as CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` and Triton's
//! `.to(float8e4nv)` convert), the per-block scale (`max(amax, floor)/448`, as a power of two
//! for the `ue8m0` format), and the quantize-dequantize of a vector block by block.
//!
//! Sources: "FP8 Formats for Deep Learning" (arXiv:2209.05433), table 1; vLLM 0.26
//! `model_executor/layers/sparse_attn_indexer.py` (`_fused_indexer_q_rope_quant_kernel`: q's
//! scale `2^⌈log2(max(amax, 1e-10)/448)⌉` per token and head), `ops.indexer_k_quant_and_cache`
//! (k's scale `max(amax, 1e-4)/448`, to a power of two for `ue8m0`, per token and
//! `quant_block_size` block; its Triton twin in `v1/attention/ops/rocm_aiter_mla_sparse.py`),
//! `model_executor/layers/quantization/utils/fp8_utils.py` (`per_token_group_quant_fp8`). The
//! rounding itself is the `float8` crate's port of CUDA's `cuda_fp8.hpp`, tested here against
//! an independent nearest-value search over all 256 codes.

use float8::F8E4M3;
use serde::{Deserialize, Serialize};

/// The largest finite E4M3 magnitude: `1.75 · 2^8`.
pub const E4M3_MAX: f64 = 448.0;

/// `x` rounded to the nearest E4M3 value (ties to the even code), saturating: a finite `x`
/// beyond ±448 (and ±∞) gives ±448, never NaN; NaN stays NaN; the sign of zero is kept.
pub fn round_e4m3(x: f64) -> f64 {
    F8E4M3::from_f64(x).to_f64()
}

/// The E4M3 code (sign, 4 exponent bits with bias 7, 3 mantissa bits) [`round_e4m3`] gives `x`.
pub fn e4m3_code(x: f64) -> u8 {
    F8E4M3::from_f64(x).to_bits()
}

/// The value of E4M3 code `code` (exact in f64); NaN for `0x7F` and `0xFF`.
pub fn e4m3_value(code: u8) -> f64 {
    F8E4M3::from_bits(code).to_f64()
}

/// How a block's scale is derived from `a = max(amax, floor)`, the block's largest magnitude
/// floored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleFormat {
    /// `2^⌈log2(a/448)⌉`: the smallest power of two at least `a/448` (an exponent-only "ue8m0"
    /// scale; vLLM's `scale_fmt = "ue8m0"`, DeepSeek's fp8 recipes). Scaling by it is exact.
    Ue8m0,
    /// `a/448` in f32, the division the engine does; the scaled value `x/scale` is then formed
    /// in f32 too, before its E4M3 rounding.
    F32,
}

/// What a quantizer's input holds before it is scaled: the engine's activation dtype, which the
/// reference rounds its own f64 values to first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputDtype {
    /// bfloat16 (round to nearest even).
    Bf16,
    /// IEEE half (round to nearest even).
    F16,
    /// IEEE single (round to nearest even).
    F32,
}

impl InputDtype {
    /// `x` rounded to this dtype, back in f64.
    pub fn round(self, x: f64) -> f64 {
        match self {
            InputDtype::Bf16 => half::bf16::from_f64(x).to_f64(),
            InputDtype::F16 => half::f16::from_f64(x).to_f64(),
            InputDtype::F32 => f64::from(x as f32),
        }
    }
}

/// One tensor's blockwise E4M3 quantization: each run of `block` consecutive values shares one
/// scale computed from its largest magnitude; a value is stored as `e4m3(x / scale)` and read
/// back as that times `scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQuant {
    /// Values per scale (vLLM's `quant_block_size`; a DSA indexer's 128 = its head width, so
    /// one scale per token and head). At least 1.
    pub block: usize,
    /// How the scale is derived.
    pub scale: ScaleFormat,
    /// The floor under a block's largest magnitude (an all-zero block still gets a finite
    /// scale): vLLM's q quantizer 1e-10, its indexer k cache 1e-4.
    pub amax_floor: f64,
    /// The dtype the quantizer reads (the reference rounds to it first); `None`: the values as
    /// they are.
    pub input: Option<InputDtype>,
}

impl BlockQuant {
    /// The scale of a block whose largest magnitude is `amax` (≥ 0, finite), as [`ScaleFormat`]
    /// says. Always positive and finite for a positive finite floor.
    pub fn scale_of(&self, amax: f64) -> f64 {
        let a = amax.max(self.amax_floor);
        match self.scale {
            ScaleFormat::Ue8m0 => pow2_ceil(a / E4M3_MAX),
            ScaleFormat::F32 => f64::from(a as f32 / E4M3_MAX as f32),
        }
    }

    /// Quantizes `x` in place to what the engine's product reads back (`scale · e4m3(x/scale)`
    /// per block; values first rounded to [`BlockQuant::input`]), block after block from the
    /// first value (a last block shorter than `block` has its own scale). Returns the scales, one
    /// per block. Non-finite values are not expected (a NaN block gives NaN values).
    pub fn quantize(&self, x: &mut [f64]) -> Vec<f64> {
        let block = self.block.max(1);
        let mut scales = Vec::with_capacity(x.len().div_ceil(block));
        for chunk in x.chunks_mut(block) {
            if let Some(d) = self.input {
                chunk.iter_mut().for_each(|v| *v = d.round(*v));
            }
            let amax = chunk.iter().fold(0f64, |m, v| m.max(v.abs()));
            let s = self.scale_of(amax);
            for v in chunk.iter_mut() {
                let scaled = match self.scale {
                    ScaleFormat::Ue8m0 => *v / s,
                    ScaleFormat::F32 => f64::from(*v as f32 / s as f32),
                };
                *v = round_e4m3(scaled) * s;
            }
            scales.push(s);
        }
        scales
    }
}

/// Which values share one scale when an engine quantizes a GEMM's activation input to E4M3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ActGranularity {
    /// One scale per token (row) and run of this many columns, from the row's start: vLLM's
    /// `per_token_group_quant_fp8` before a block-scaled GEMM (128 for DeepSeek-V3's
    /// `weight_block_size` [128, 128]). At least 1.
    TokenGroup(usize),
    /// One dynamic scale over the whole input `[T, K]`: vLLM's `scaled_fp8_quant` without a
    /// scale, SGLang's per-tensor fp8 path. Rows outside the batch must not enter its amax.
    Tensor,
}

/// How an engine quantizes the activation input of an fp8 GEMM: `x̂ = s·e4m3(x/s)` with
/// `s = max(amax, amax_floor)/448` in f32 over each [`ActGranularity`] group, `x/s` an f32
/// division (vLLM 0.26's sm_90 `per_token_group_fp8_quant` and `dynamic_scaled_fp8_quant`), the
/// weight's own block scales applied in the GEMM. The reference and mla-diff's fp8 paths apply
/// this at the input of every projection whose weight the engine multiplies in fp8.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ActQuant {
    /// Which values share a scale.
    pub granularity: ActGranularity,
    /// The floor under a group's largest magnitude (vLLM's `eps`, 1e-10).
    pub amax_floor: f64,
    /// The dtype the quantizer reads (the reference rounds to it first); `None`: the values as
    /// they are.
    pub input: Option<InputDtype>,
}

impl ActQuant {
    /// vLLM's block-fp8 activation quantization: per token in groups of 128 columns, f32 scales,
    /// amax floor 1e-10, reading `input`.
    pub const fn token_group(group: usize, input: Option<InputDtype>) -> ActQuant {
        ActQuant {
            granularity: ActGranularity::TokenGroup(group),
            amax_floor: 1e-10,
            input,
        }
    }

    /// One dynamic per-tensor scale, amax floor 1e-10, reading `input`.
    pub const fn tensor(input: Option<InputDtype>) -> ActQuant {
        ActQuant {
            granularity: ActGranularity::Tensor,
            amax_floor: 1e-10,
            input,
        }
    }

    /// The [`BlockQuant`] of one group of `len` values.
    fn block(&self, len: usize) -> BlockQuant {
        BlockQuant {
            block: len.max(1),
            scale: ScaleFormat::F32,
            amax_floor: self.amax_floor,
            input: self.input,
        }
    }

    /// Quantizes the row-major input `x` [T, K] (`k` = K columns, ≥ 1) in place to what the
    /// GEMM reads back, with its columns cut into `parts` equal slices quantized on their own
    /// (a row-parallel projection under TP: each rank quantizes its own slice of the input;
    /// `parts` 1 otherwise). Returns the scales, row after row and slice after slice.
    ///
    /// A `parts` that does not divide `k` (or 0) is taken as 1.
    pub fn quantize(&self, x: &mut [f64], k: usize, parts: usize) -> Vec<f64> {
        let k = k.max(1);
        let parts = if parts >= 1 && k.is_multiple_of(parts) {
            parts
        } else {
            1
        };
        let width = k / parts;
        match self.granularity {
            ActGranularity::TokenGroup(g) => {
                let q = self.block(g);
                x.chunks_mut(width).flat_map(|slice| q.quantize(slice)).collect()
            }
            ActGranularity::Tensor => (0..parts)
                .map(|p| self.quantize_columns(x, k, p * width..(p + 1) * width, None))
                .collect(),
        }
    }

    /// [`ActGranularity::Tensor`] over columns `cols` of every row of `x` [T, K] with one scale,
    /// taken over those values and, when `extra_amax` is given, that magnitude too (rows the
    /// engine's buffer holds beyond the batch, which a correct engine leaves out). Returns the
    /// scale. Values are first rounded to [`ActQuant::input`].
    pub fn quantize_columns(
        &self,
        x: &mut [f64],
        k: usize,
        cols: std::ops::Range<usize>,
        extra_amax: Option<f64>,
    ) -> f64 {
        let k = k.max(1);
        let mut amax = extra_amax.unwrap_or(0f64);
        for row in x.chunks_mut(k) {
            for v in &mut row[cols.clone()] {
                if let Some(d) = self.input {
                    *v = d.round(*v);
                }
                amax = amax.max(v.abs());
            }
        }
        let q = self.block(1);
        let s = q.scale_of(amax);
        for row in x.chunks_mut(k) {
            for v in &mut row[cols.clone()] {
                *v = round_e4m3(f64::from(*v as f32 / s as f32)) * s;
            }
        }
        s
    }

    /// [`ActQuant::quantize`] of f32 values (an engine path's buffer), through f64: each value
    /// comes back as `f32(s·e4m3(x/s))`, the operand an f32 GEMM reads.
    pub fn quantize_f32(&self, x: &mut [f32], k: usize, parts: usize) -> Vec<f64> {
        let mut w: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let scales = self.quantize(&mut w, k, parts);
        x.iter_mut().zip(&w).for_each(|(d, &v)| *d = v as f32);
        scales
    }

    /// One line for reports: what is quantized and how.
    pub fn describe(&self) -> String {
        let gran = match self.granularity {
            ActGranularity::TokenGroup(g) => format!("per token in groups of {g} columns"),
            ActGranularity::Tensor => "one dynamic scale per tensor".to_string(),
        };
        let input = match self.input {
            Some(InputDtype::Bf16) => ", read from bf16",
            Some(InputDtype::F16) => ", read from f16",
            Some(InputDtype::F32) | None => "",
        };
        format!(
            "fp8_e4m3 GEMM inputs, {gran} (f32 scales max(amax, {:e})/448{input})",
            self.amax_floor
        )
    }
}

/// An fp8 latent cache (vLLM's `kv_cache_dtype="fp8"` on MLA): `concat_and_cache_mla` stores
/// each row of `kv_c_normed ‖ k_pe` as `e4m3(x/scale)` (the division in f32, E4M3 round to
/// nearest even, saturating) with one per-tensor scale, `k_scale` (1.0 unless the checkpoint
/// carries one), and the attention reads `scale·e4m3(x/scale)` back.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KvCacheQuant {
    /// The per-tensor scale `k_scale` (positive, finite).
    pub scale: f64,
    /// The dtype the cache write reads (the reference rounds to it first); `None`: the values
    /// as they are.
    pub input: Option<InputDtype>,
    /// The decode query's per-tensor scale `q_scale` where the attention kernel takes an fp8
    /// query too (vLLM's FLASHMLA: `ql_nope ‖ q_pe` quantized as `e4m3(x/q_scale)` before
    /// `flash_mla_with_kvcache_fp8`, which descales by `q_scale`); `None`: the query stays in
    /// the activation dtype (TRITON_MLA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<f64>,
}

impl KvCacheQuant {
    /// `x` as the cache holds it: `scale·e4m3(f32(x)/f32(scale))`, `x` first rounded to
    /// [`KvCacheQuant::input`].
    pub fn round(&self, x: f64) -> f64 {
        scaled_e4m3(self.input.map_or(x, |d| d.round(x)), self.scale)
    }

    /// A decode query element as the kernel reads it: `q_scale·e4m3(f32(x)/f32(q_scale))` after
    /// the input rounding, or `x` itself when the query is not quantized.
    pub fn round_query(&self, x: f64) -> f64 {
        match self.query {
            Some(s) => scaled_e4m3(self.input.map_or(x, |d| d.round(x)), s),
            None => x,
        }
    }

    /// One line for reports.
    pub fn describe(&self) -> String {
        match self.query {
            Some(q) => format!(
                "fp8_e4m3 latent cache, k_scale {}; fp8_e4m3 decode query, q_scale {q}",
                self.scale
            ),
            None => format!("fp8_e4m3 latent cache, k_scale {}", self.scale),
        }
    }
}

/// Whether `s` can be a per-tensor fp8 scale (`k_scale`, `q_scale`): positive, and a normal
/// f32 (engines hold it as one and divide in f32; past f32's range the division is 0 or ∞).
pub fn is_scale(s: f64) -> bool {
    s > 0.0 && (s as f32).is_normal()
}

/// `scale·e4m3(f32(x)/f32(scale))`: a static per-tensor E4M3 quantization read back.
fn scaled_e4m3(x: f64, scale: f64) -> f64 {
    round_e4m3(f64::from(x as f32 / scale as f32)) * f64::from(scale as f32)
}

/// The fp8 quantization of the two operands of a scoring product `q·k` (a DSA indexer's query
/// and key; an fp8 KV cache's query and key), each with its own blocks and scale floor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QkQuant {
    /// The query's (per token and head, in blocks).
    pub q: BlockQuant,
    /// The key's (per token, in blocks).
    pub k: BlockQuant,
}

/// The smallest power of two ≥ `x` (`x` positive, finite and normal).
fn pow2_ceil(x: f64) -> f64 {
    let mut p = 2f64.powi(x.log2().ceil() as i32);
    // log2 of a value just off a power of two may round onto it: correct by one either way.
    if p < x {
        p *= 2.0;
    }
    while p / 2.0 >= x && p / 2.0 > 0.0 {
        p /= 2.0;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite E4M3 value with its code: sign, exponent e (bias 7), mantissa m; e = 0 is
    /// subnormal (m/8 · 2^-6); code 0x7F (and 0xFF) is NaN. Built from the format's definition,
    /// not from the crate.
    fn table() -> Vec<(u8, f64)> {
        (0u8..=255)
            .filter(|c| c & 0x7F != 0x7F)
            .map(|c| {
                let (s, e, m) = (c >> 7, i32::from((c >> 3) & 0xF), f64::from(c & 7));
                let mag = if e == 0 {
                    m / 8.0 * 2f64.powi(-6)
                } else {
                    (1.0 + m / 8.0) * 2f64.powi(e - 7)
                };
                (c, if s == 1 { -mag } else { mag })
            })
            .collect()
    }

    /// The nearest table value to `x` (ties to the even code), saturating beyond ±448: the
    /// definition, by search.
    fn nearest(t: &[(u8, f64)], x: f64) -> (u8, f64) {
        let x = x.clamp(-E4M3_MAX, E4M3_MAX);
        let mut best = t[0];
        for &(c, v) in t {
            let (d, db) = ((v - x).abs(), (best.1 - x).abs());
            // Among equal distances prefer the even code; ±0 keep the sign of x.
            let tie_better = d == db
                && ((c & 1 == 0 && best.0 & 1 == 1) || (v == 0.0 && v.is_sign_negative() == x.is_sign_negative()));
            if d < db || tie_better {
                best = (c, v);
            }
        }
        best
    }

    #[test]
    fn every_code_decodes_to_its_definition_and_rounds_to_itself() {
        let t = table();
        assert_eq!(t.len(), 254);
        for &(c, v) in &t {
            assert_eq!(e4m3_value(c).to_bits(), v.to_bits(), "code {c:#04x}");
            assert_eq!(e4m3_code(v), c, "value {v}");
        }
        assert!(e4m3_value(0x7F).is_nan() && e4m3_value(0xFF).is_nan());
        assert_eq!(t.iter().map(|x| x.1).fold(0f64, f64::max), E4M3_MAX);
        assert_eq!(e4m3_value(0x01), 2f64.powi(-9), "the smallest subnormal");
        assert_eq!(e4m3_value(0x08), 2f64.powi(-6), "the smallest normal");
    }

    #[test]
    fn rounding_is_the_nearest_value_ties_to_even_with_saturation() {
        let t = table();
        let mut pos: Vec<f64> = t.iter().map(|x| x.1).filter(|v| *v >= 0.0).collect();
        pos.sort_by(f64::total_cmp);
        pos.dedup();
        // Every value, every midpoint between neighbours and points just off them, both signs.
        let mut probes = Vec::new();
        for w in pos.windows(2) {
            let (a, b) = (w[0], w[1]);
            let mid = (a + b) / 2.0;
            for x in [
                a,
                b,
                mid,
                mid * (1.0 + 1e-12),
                mid * (1.0 - 1e-12),
                a + (b - a) / 3.0,
                b - (b - a) / 5.0,
            ] {
                probes.push(x);
                probes.push(-x);
            }
        }
        // Beyond the top: below the 448/480 midpoint, on it, past it, huge, infinite.
        probes.extend([449.0, 463.999, 464.0, 464.001, 500.0, 1e6, f64::MAX, f64::INFINITY]);
        probes.extend([-449.0, -464.0, -1e6, f64::NEG_INFINITY]);
        // Below the smallest subnormal: half of it is a tie to 0 (even), just above rounds up.
        let tiny = 2f64.powi(-9);
        probes.extend([
            tiny / 2.0,
            tiny / 2.0 * (1.0 + 1e-9),
            tiny / 4.0,
            1e-300,
            -tiny / 2.0,
            0.0,
            -0.0,
        ]);
        for x in probes {
            let (c, v) = nearest(&t, x);
            assert_eq!(e4m3_code(x), c, "x = {x:e}: code");
            assert_eq!(round_e4m3(x).to_bits(), v.to_bits(), "x = {x:e}: value");
        }
        // Hand-checked ties: 1.0625 lies between 1.0 (mantissa 0) and 1.125 (mantissa 1) → 1.0;
        // 1.1875 between 1.125 and 1.25 (mantissa 2) → 1.25; 464 between 448 and (no) 480 → 448.
        assert_eq!(round_e4m3(1.0625), 1.0);
        assert_eq!(round_e4m3(1.1875), 1.25);
        assert_eq!(round_e4m3(464.0), 448.0);
        assert_eq!(round_e4m3(-1e30), -448.0);
        assert!(round_e4m3(f64::NAN).is_nan());
        // Subnormals: 3.4·2^-9 → 3·2^-9; 2.5·2^-9 → 2·2^-9 (tie to even).
        assert_eq!(round_e4m3(3.4 * tiny), 3.0 * tiny);
        assert_eq!(round_e4m3(2.5 * tiny), 2.0 * tiny);
    }

    #[test]
    fn a_ue8m0_block_scale_is_the_next_power_of_two_and_scales_exactly() {
        let q = BlockQuant {
            block: 4,
            scale: ScaleFormat::Ue8m0,
            amax_floor: 1e-10,
            input: None,
        };
        // amax 3.0: 3/448 = 0.0067 → 2^-7 = 0.0078125. amax 448·2^-7 = 3.5 exactly → 2^-7.
        assert_eq!(q.scale_of(3.0), 2f64.powi(-7));
        assert_eq!(q.scale_of(3.5), 2f64.powi(-7));
        assert_eq!(q.scale_of(3.5000001), 2f64.powi(-6));
        // All zeros: the floor, 1e-10/448 = 2.2e-13 → 2^-42.
        assert_eq!(q.scale_of(0.0), 2f64.powi(-42));
        // By hand, a block [3.0, -1.3, 0.02, 0.0] with scale 2^-7 (x·128):
        // 384 → 384 (1.5·2^8); −166.4 → −160 (1.25·2^7, the step there is 16); 2.56 → 2.5
        // (1.25·2^1, step 0.25); 0 → 0. Back: 3.0, −1.25, 0.01953125, 0.
        let mut x = vec![3.0, -1.3, 0.02, 0.0, /* a second block */ 0.5];
        let scales = q.quantize(&mut x);
        assert_eq!(scales, vec![2f64.powi(-7), 2f64.powi(-9)]);
        assert_eq!(x, vec![3.0, -1.25, 0.01953125, 0.0, 0.5]);
    }

    #[test]
    fn an_f32_scale_and_a_bf16_input_round_as_the_engine_does() {
        let k = BlockQuant {
            block: 2,
            scale: ScaleFormat::F32,
            amax_floor: 1e-4,
            input: Some(InputDtype::Bf16),
        };
        // [1.0, 0.3]: 0.3 → bf16 0.30078125; scale f32(1/448); 0.30078125/scale ≈ 134.75, in
        // [128, 256) where the E4M3 step is 16: 128 is nearer than 144. The max maps to 448.
        let mut x = vec![1.0, 0.3];
        let s = k.quantize(&mut x)[0];
        assert_eq!(s, f64::from(1f32 / 448f32));
        assert_eq!(x[0], 448.0 * s);
        assert_eq!(x[1], 128.0 * s);
        // The floor: an all-zero block keeps a finite scale and zeros.
        let mut z = vec![0.0, -0.0];
        assert_eq!(k.quantize(&mut z)[0], f64::from(1e-4f32 / 448f32));
        assert_eq!(z, vec![0.0, -0.0]);
        assert_eq!(InputDtype::F16.round(1.0 + 2f64.powi(-12)), 1.0);
        assert_eq!(InputDtype::F32.round(0.1), f64::from(0.1f32));
    }

    #[test]
    fn activation_groups_are_per_row_and_per_rank_slice() {
        // Two rows of 6 columns, groups of 4: each row has its own groups [0..4), [4..6).
        let q = ActQuant::token_group(4, None);
        let row = [3.0, -1.3, 0.02, 0.0, 0.5, 0.25];
        let mut x: Vec<f64> = row
            .iter()
            .chain(row.iter().map(|v| v * 2.0).collect::<Vec<_>>().iter())
            .copied()
            .collect();
        let scales = q.quantize(&mut x, 6, 1);
        let s = |a: f64| f64::from(a as f32 / 448f32);
        assert_eq!(scales, vec![s(3.0), s(0.5), s(6.0), s(1.0)]);
        // The group maximum maps to 448 exactly; 0.25/s(0.5) = 224, an E4M3 value.
        assert_eq!(x[0], 448.0 * s(3.0));
        assert_eq!(x[4], 448.0 * s(0.5));
        assert_eq!(x[5], 224.0 * s(0.5));
        // -1.3/s(3.0) = -194.13...: the E4M3 step in [128, 256) is 16, so -192.
        assert_eq!(x[1], -192.0 * s(3.0));
        // Two rank slices of 3 columns with groups of 4: each slice is one group of 3.
        let mut y = row.to_vec();
        assert_eq!(q.quantize(&mut y, 6, 2), vec![s(3.0), s(0.5)]);
        // Per tensor: one scale from the largest magnitude of both rows.
        let mut z: Vec<f64> = row.iter().chain(row.iter()).copied().collect();
        assert_eq!(ActQuant::tensor(None).quantize(&mut z, 6, 1), vec![s(3.0)]);
        assert_eq!(z[4], round_e4m3(f64::from(0.5f32 / s(3.0) as f32)) * s(3.0));
        // Rows beyond the batch with a larger magnitude coarsen every value: 0.02 flushes to the
        // smallest subnormal's neighbourhood.
        let mut p = row.to_vec();
        let big = ActQuant::tensor(None).quantize_columns(&mut p, 6, 0..6, Some(3000.0));
        assert_eq!(big, s(3000.0));
        assert_eq!(p[2], round_e4m3(f64::from(0.02f32 / s(3000.0) as f32)) * s(3000.0));
        assert!((p[2] - 0.02).abs() > 0.1 * 0.02, "0.02 kept {}", p[2]);
        // f32 buffers round-trip through the same arithmetic.
        let mut f: Vec<f32> = row.iter().map(|&v| v as f32).collect();
        q.quantize_f32(&mut f, 6, 1);
        assert_eq!(f[1], (-192.0 * s(3.0)) as f32);
    }

    #[test]
    fn pow2_ceil_is_exact_at_and_around_powers_of_two() {
        for e in [-1000, -60, -9, 0, 1, 30, 1000] {
            let p = 2f64.powi(e);
            assert_eq!(pow2_ceil(p), p, "2^{e}");
            assert_eq!(pow2_ceil(p * (1.0 + f64::EPSILON)), p * 2.0, "just above 2^{e}");
            assert_eq!(pow2_ceil(p * (1.0 - f64::EPSILON / 2.0)), p, "just below 2^{e}");
        }
    }
}
