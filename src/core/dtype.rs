//! The compute dtype of a backend's paths.
//!
//! One value decides both what a backend rounds its activations to and which rows of the
//! tolerance table judge it, so it sits below both: the backend is built with it and the judge
//! reads it back from the backend, never from a second copy.

use serde::{Deserialize, Serialize};

/// The compute dtype of a path (what its activations are rounded to between kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// f32 activations, f32 accumulation.
    F32,
    /// bf16 activations and weights, f32 accumulation.
    Bf16,
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        })
    }
}
