//! The MLA architectures a GGUF file can declare, and what each does differently.
//!
//! `general.architecture` decides more than the key prefix: MiniCPM3 rotates NeoX halves and
//! scales its embedding and residual branches, DeepSeek-V3.2 and GLM-5 add the DSA indexer with
//! opposite indexer RoPE pairings, and each family has its own default when
//! `expert_gating_func` is absent. [`Arch`] names the four families this build loads, and each
//! of those differences is one method named for what it means, with its llama.cpp source, so
//! that no other module compares the architecture's name. It prints and serializes as the ggml
//! name (`deepseek2`), so reports and JSON carry the string the file holds.

use std::fmt;

use serde::{Serialize, Serializer};

use crate::model::config::{GatingFunc, RopeStyle};

/// A GGUF architecture whose attention is MLA and which this build loads
/// (docs/architectures.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `deepseek2`: DeepSeek-V2/V2.5/V3, Kimi-K2, GLM-4.7-Flash.
    Deepseek2,
    /// `deepseek32`: DeepSeek-V3.2 (MLA plus the DSA lightning indexer).
    Deepseek32,
    /// `glm-dsa`: GLM-5/5.1/5.2 (MLA plus the DSA lightning indexer, shared indexer layers).
    GlmDsa,
    /// `minicpm3`: MiniCPM3 (MLA run unabsorbed, NeoX RoPE, model-level scales).
    Minicpm3,
}

impl Arch {
    /// Every supported architecture, in the order the unsupported-architecture error lists them.
    pub const ALL: [Arch; 4] = [Arch::Deepseek2, Arch::Deepseek32, Arch::GlmDsa, Arch::Minicpm3];

    /// The ggml name, as `general.architecture` and every metadata key prefix spell it.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Deepseek2 => "deepseek2",
            Arch::Deepseek32 => "deepseek32",
            Arch::GlmDsa => "glm-dsa",
            Arch::Minicpm3 => "minicpm3",
        }
    }

    /// The architecture named `name` (a `general.architecture` value); `None` for one this build
    /// does not load.
    pub fn parse(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// `supported` of the unsupported-architecture error: `deepseek2, deepseek32, glm-dsa,
    /// minicpm3`.
    pub fn supported_list() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }

    /// True when an absent `attention.value_length` means `V = H/N`: MiniCPM3's converter
    /// writes no value length and llama.cpp then uses its `n_embd_head_v` default `H/N`, which
    /// equals `v_head_dim` in every released MiniCPM3. Every other family requires the key.
    pub fn value_length_defaults_to_head_width(self) -> bool {
        self == Arch::Minicpm3
    }

    /// Pairing of the main MLA RoPE (`q_pe`, `k_pe`): NeoX for MiniCPM3, interleaved for the
    /// DeepSeek and GLM families (llama.cpp `llama_model_rope_type`).
    pub fn main_rope_style(self) -> RopeStyle {
        match self {
            Arch::Minicpm3 => RopeStyle::Neox,
            Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa => RopeStyle::Interleaved,
        }
    }

    /// True for the families with the DSA lightning indexer (`deepseek32`, `glm-dsa`), whose
    /// `attention.indexer.*` keys are required.
    pub fn has_dsa_indexer(self) -> bool {
        matches!(self, Arch::Deepseek32 | Arch::GlmDsa)
    }

    /// Pairing of the DSA indexer's RoPE: NeoX halves for DeepSeek-V3.2 (unlike its interleaved
    /// main path; HF `DeepseekV32Indexer`), interleaved pairs for GLM-5 (llama.cpp `glm-dsa.cpp`
    /// ropes indexer keys NORM).
    pub fn indexer_rope_style(self) -> RopeStyle {
        match self {
            Arch::Deepseek32 => RopeStyle::Neox,
            Arch::Deepseek2 | Arch::GlmDsa | Arch::Minicpm3 => RopeStyle::Interleaved,
        }
    }

    /// The router's gating function when the file has no `expert_gating_func` key, as llama.cpp's
    /// loader of each architecture decides it; `None` when the key is required (deepseek32).
    /// `trunk` is `block_count − nextn_predict_layers`, `vocab` the embedding's rows: a
    /// `deepseek2` file with 47 or 48 trunk layers and 154880 tokens is GLM-4.7-Flash, whose
    /// router is sigmoid; GLM-5 (`glm-dsa`) is sigmoid; every other file falls back to softmax
    /// (old DeepSeek-V2 files).
    pub fn gating_when_absent(self, trunk: usize, vocab: usize) -> Option<GatingFunc> {
        match self {
            Arch::GlmDsa => Some(GatingFunc::Sigmoid),
            Arch::Deepseek32 => None,
            Arch::Deepseek2 if matches!(trunk, 47 | 48) && vocab == 154_880 => Some(GatingFunc::Sigmoid),
            Arch::Deepseek2 | Arch::Minicpm3 => Some(GatingFunc::Softmax),
        }
    }

    /// Multiplies the token embedding on the token path: 12 for MiniCPM3 (llama.cpp's hard-coded
    /// `scale_emb`; GGUF has no key for it), 1 otherwise. Unitless.
    pub fn embedding_scale(self) -> f64 {
        match self {
            Arch::Minicpm3 => 12.0,
            Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa => 1.0,
        }
    }

    /// Multiplies each residual branch (attention and FFN output) before its add:
    /// `scale_depth/√n_layer` = 1.4/√n_layer for MiniCPM3 (llama.cpp's hard-coded
    /// `scale_depth`), 1 otherwise. Unitless; `n_layer` is `block_count`.
    pub fn residual_scale(self, n_layer: usize) -> f64 {
        match self {
            Arch::Minicpm3 => 1.4 / (n_layer as f64).sqrt(),
            Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa => 1.0,
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Arch {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_print_as_ggml_names() {
        for a in Arch::ALL {
            assert_eq!(Arch::parse(a.name()), Some(a));
            assert_eq!(a.to_string(), a.name());
            assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{}\"", a.name()));
        }
        assert_eq!(Arch::parse("llama"), None);
        assert_eq!(Arch::parse("DeepSeek2"), None);
        assert_eq!(Arch::supported_list(), "deepseek2, deepseek32, glm-dsa, minicpm3");
    }

    #[test]
    fn quirks_per_family() {
        use Arch::*;
        assert_eq!(
            Arch::ALL.map(Arch::main_rope_style),
            [
                RopeStyle::Interleaved,
                RopeStyle::Interleaved,
                RopeStyle::Interleaved,
                RopeStyle::Neox
            ]
        );
        assert_eq!(Arch::ALL.map(Arch::has_dsa_indexer), [false, true, true, false]);
        assert_eq!(Deepseek32.indexer_rope_style(), RopeStyle::Neox);
        assert_eq!(GlmDsa.indexer_rope_style(), RopeStyle::Interleaved);
        assert_eq!(
            Arch::ALL.map(Arch::value_length_defaults_to_head_width),
            [false, false, false, true]
        );
        assert_eq!(GlmDsa.gating_when_absent(61, 1000), Some(GatingFunc::Sigmoid));
        assert_eq!(Deepseek32.gating_when_absent(61, 1000), None);
        assert_eq!(Deepseek2.gating_when_absent(47, 154_880), Some(GatingFunc::Sigmoid));
        assert_eq!(Deepseek2.gating_when_absent(48, 154_880), Some(GatingFunc::Sigmoid));
        assert_eq!(Deepseek2.gating_when_absent(49, 154_880), Some(GatingFunc::Softmax));
        assert_eq!(Deepseek2.gating_when_absent(47, 129_280), Some(GatingFunc::Softmax));
        assert_eq!(Minicpm3.embedding_scale(), 12.0);
        assert_eq!(Deepseek2.embedding_scale(), 1.0);
        assert_eq!(Minicpm3.residual_scale(62), 1.4 / 62f64.sqrt());
        assert_eq!(GlmDsa.residual_scale(62), 1.0);
    }
}
