//! The NaN canary that tells an output never written from one computed wrong.
//!
//! Every path fills its output buffers with one fixed NaN bit pattern before each step. Arithmetic
//! never produces that pattern, so an element that still carries it after the step was never
//! written (a phantom output, unwritten rows), while a NaN that arithmetic produced is a numeric
//! fault. The paths, the dump reader and the detectors all test for it, so it lives at the bottom.

/// Bit pattern of the canary: an f32 NaN with a signalling-style payload that no arithmetic
/// produces (arithmetic on a NaN yields a quiet NaN, bit 22 set; this has bit 22 clear).
pub const CANARY_BITS: u32 = 0x7FA5_A5A5;

/// The canary value (see [`CANARY_BITS`]). Compare with [`is_canary`], never with `==`.
pub const CANARY: f32 = f32::from_bits(CANARY_BITS);

/// Sign and quiet bit cleared: a canary that went through arithmetic (which sets the quiet bit
/// and may flip the sign) still matches [`CANARY_BITS`] under this mask.
pub const CANARY_MASK: u32 = 0x7FBF_FFFF;

/// True when `x` carries exactly the canary's bits (an output element never written).
pub fn is_canary(x: f32) -> bool {
    x.to_bits() == CANARY_BITS
}

/// A buffer of `n` canary values: what every path allocates for an output before a step.
pub fn canary_vec(n: usize) -> Vec<f32> {
    vec![CANARY; n]
}
