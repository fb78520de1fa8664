//! Name maps: how an engine's own tensor names and layouts become our sites.
//!
//! A hook that can name its tensors as sites (`L3.kv_c_normed`) needs no map; one that records
//! what the engine calls them (llama.cpp's graph names such as `kv_cmpr-3#1`) does. A [`Map`]
//! holds ordered rename rules, each optionally conditioned on the model ([`Condition`]: one
//! engine name can mean different tensors in the absorbed and the expanded graph), and may
//! override the dump's declared conventions. The built-in maps are `hf`, `vllm` and
//! `llama.cpp` (the JSON file `src/model/maps/llama.cpp.json`, shared with the Python hook);
//! `weights --check` reads the same map files for parameter names. Docs: docs/dump-format.md,
//! "Maps".

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::conventions::{KvAOrder, Layout, RopeOrder};
use crate::core::error::{Error, Result};
use crate::core::trace::{Site, Stage};
use crate::model::config::{KvBLayout, MlaConfig};

/// A condition on a map's rename rule, evaluated from the model's [`MlaConfig`] and the rule's
/// layer: some engine names mean different tensors depending on the model (llama.cpp's `kqv-N` is
/// the latent attention output `[T, N, L]` in the absorbed graph of split-kv_b files, but the
/// per-head value output `[T, N, V]` in the expanded graph it runs for legacy fused-kv_b files) or
/// on the layer (llama.cpp's `ffn_out-N` is the dense MLP's `down_proj` output in a dense layer,
/// but the routed plus shared experts' sum, which is no site, in an MoE layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Condition {
    /// The file stores `attn_k_b`/`attn_v_b` ([`KvBLayout::Split`]; llama.cpp runs its absorbed
    /// MLA graph).
    #[serde(rename = "split_kv_b")]
    SplitKvB,
    /// The file stores one legacy `attn_kv_b` ([`KvBLayout::Fused`]; llama.cpp runs the expanded
    /// MHA graph).
    #[serde(rename = "fused_kv_b")]
    FusedKvB,
    /// The model compresses q (`q_lora_rank` > 0: `q_a_proj`, `q_a_layernorm`, `q_b_proj`).
    #[serde(rename = "q_lora")]
    QLora,
    /// The model projects q directly (`q_proj`; no or zero `q_lora_rank`).
    #[serde(rename = "no_q_lora")]
    NoQLora,
    /// The rule's layer runs a dense MLP: a layer below `leading_dense_block_count`, or any layer
    /// of a file without routed experts (not [`MlaConfig::is_moe_layer`]). Needs a layer: the
    /// `{n}` the rule matched, or the layer of its full-site target.
    #[serde(rename = "dense_ffn")]
    DenseFfn,
    /// The rule's layer runs the MoE FFN (router, routed and shared experts:
    /// [`MlaConfig::is_moe_layer`]). Needs a layer, as [`Condition::DenseFfn`].
    #[serde(rename = "moe_ffn")]
    MoeFfn,
}

impl Condition {
    /// The condition's name in map files (`split_kv_b`, `fused_kv_b`, `q_lora`, `no_q_lora`,
    /// `dense_ffn`, `moe_ffn`).
    pub fn name(self) -> &'static str {
        match self {
            Condition::SplitKvB => "split_kv_b",
            Condition::FusedKvB => "fused_kv_b",
            Condition::QLora => "q_lora",
            Condition::NoQLora => "no_q_lora",
            Condition::DenseFfn => "dense_ffn",
            Condition::MoeFfn => "moe_ffn",
        }
    }

    /// True when the condition holds for `cfg` (its `kv_b_layout`, `q_lora_rank` and MoE layers)
    /// at `layer` (the rule's layer; `None` for a rule without one, for which the layer
    /// conditions [`Condition::DenseFfn`] and [`Condition::MoeFfn`] never hold).
    pub fn holds(self, cfg: &MlaConfig, layer: Option<usize>) -> bool {
        match self {
            Condition::SplitKvB => cfg.kv_b_layout == KvBLayout::Split,
            Condition::FusedKvB => cfg.kv_b_layout == KvBLayout::Fused,
            Condition::QLora => cfg.q_lora_rank.is_some_and(|r| r > 0),
            Condition::NoQLora => !Condition::QLora.holds(cfg, layer),
            Condition::DenseFfn => layer.is_some_and(|l| !cfg.is_moe_layer(l)),
            Condition::MoeFfn => layer.is_some_and(|l| cfg.is_moe_layer(l)),
        }
    }
}

/// One rename rule of a [`Map`]. JSON: `[pattern, target]` or `[pattern, target, condition]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rename {
    /// Dump tensor name; `{n}` matches a layer number (decimal digits).
    pub pattern: String,
    /// A stage (`kv_c_normed`, completed with the layer `{n}` matched) or a full site
    /// (`L0.hidden_in`); for `weights --check`, a param or `L<n>.<param>[.rank<r>]`.
    pub target: String,
    /// The rule applies only when this holds for the model (absent: always).
    pub when: Option<Condition>,
}

impl Rename {
    /// An unconditional rule.
    pub fn new(pattern: impl Into<String>, target: impl Into<String>) -> Rename {
        Rename {
            pattern: pattern.into(),
            target: target.into(),
            when: None,
        }
    }

    /// True when the rule applies to `cfg` at `layer` (the layer it matched; no condition, or the
    /// condition holds there).
    pub fn applies(&self, cfg: &MlaConfig, layer: Option<usize>) -> bool {
        self.when.is_none_or(|c| c.holds(cfg, layer))
    }
}

impl Serialize for Rename {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut q = s.serialize_seq(Some(if self.when.is_some() { 3 } else { 2 }))?;
        q.serialize_element(&self.pattern)?;
        q.serialize_element(&self.target)?;
        if let Some(c) = &self.when {
            q.serialize_element(c)?;
        }
        q.end()
    }
}

impl<'de> Deserialize<'de> for Rename {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Rename, D::Error> {
        use serde::de::{Error as _, IgnoredAny, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Rename;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("[pattern, target] or [pattern, target, condition]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> std::result::Result<Rename, A::Error> {
                let pattern: String = a.next_element()?.ok_or_else(|| A::Error::invalid_length(0, &self))?;
                let target: String = a.next_element()?.ok_or_else(|| A::Error::invalid_length(1, &self))?;
                let when: Option<Condition> = a.next_element()?;
                if a.next_element::<IgnoredAny>()?.is_some() {
                    return Err(A::Error::invalid_length(4, &self));
                }
                Ok(Rename { pattern, target, when })
            }
        }
        d.deserialize_seq(V)
    }
}

/// A map from an engine's dump to our sites (docs/dump-format.md, "Maps").
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Map {
    /// Name shown in reports.
    #[serde(default)]
    pub name: Option<String>,
    /// Overrides the dump's `rope_order` metadata (listed among the conversions).
    #[serde(default)]
    pub rope_order: Option<RopeOrder>,
    /// Overrides the dump's `layout` metadata (listed among the conversions).
    #[serde(default)]
    pub layout: Option<Layout>,
    /// Overrides the dump's `kv_a_order` metadata (listed among the conversions).
    #[serde(default)]
    pub kv_a_order: Option<KvAOrder>,
    /// Rename rules, tried in order; the first that matches and applies to the model wins.
    #[serde(default)]
    pub rename: Vec<Rename>,
}

/// The built-in `llama.cpp` map (graph-callback names written by `python -m mla_diff_hooks.llama_cpp`).
const LLAMA_CPP_MAP: &str = include_str!("../maps/llama.cpp.json");

impl Map {
    /// A built-in map (`hf`, `vllm`, `llama.cpp`) or a JSON file.
    ///
    /// `hf` sets `rope_order = hf` (HF's `[even | odd]` rotated halves); `vllm` changes nothing
    /// (vLLM's DeepSeek rope is interleaved and its tensors token-major, the defaults: the dump's
    /// own metadata stands); `llama.cpp` is `src/model/maps/llama.cpp.json`.
    ///
    /// Errors: [`Error::Io`] / [`Error::Json`] for an unreadable or invalid file (naming the field
    /// serde rejects, e.g. an unknown condition).
    pub fn load(spec: &str) -> Result<Map> {
        match spec {
            "hf" => Ok(Map {
                name: Some("hf".into()),
                rope_order: Some(RopeOrder::Hf),
                ..Map::default()
            }),
            "vllm" => Ok(Map {
                name: Some("vllm".into()),
                ..Map::default()
            }),
            "llama.cpp" => serde_json::from_str(LLAMA_CPP_MAP).map_err(|e| Error::Json {
                path: PathBuf::from("<built-in llama.cpp map>"),
                reason: e.to_string(),
            }),
            path => {
                let p = Path::new(path);
                if !p.exists() {
                    return Err(Error::Usage(format!(
                        "--map {path}: not a built-in map (hf, vllm, llama.cpp) and no such file"
                    )));
                }
                let bytes = crate::core::fsio::read_regular(p)?;
                serde_json::from_slice(&bytes).map_err(|e| Error::Json {
                    path: p.to_path_buf(),
                    reason: e.to_string(),
                })
            }
        }
    }

    /// The first rename rule that matches `name` and applies to `cfg` at the layer it names (see
    /// [`Condition`]): the layer matched by `{n}` (`None` for a literal pattern) and the rule's
    /// target.
    pub fn rename_match(&self, name: &str, cfg: &MlaConfig) -> Option<(Option<usize>, &str)> {
        for rule in &self.rename {
            let pat = rule.pattern.as_str();
            let layer = match pat.split_once("{n}") {
                Some((pre, post)) => {
                    let Some(d) = name.strip_prefix(pre).and_then(|rest| rest.strip_suffix(post)) else {
                        continue;
                    };
                    if d.is_empty() || !d.bytes().all(|b| b.is_ascii_digit()) {
                        continue;
                    }
                    match d.parse::<usize>() {
                        Ok(n) => Some(n),
                        Err(_) => continue,
                    }
                }
                None if pat == name => None,
                None => continue,
            };
            // A literal pattern's layer is its full-site target's (`L0.hidden_in`).
            let rule_layer = layer.or_else(|| Site::parse(&rule.target).map(|s| s.layer));
            if !rule.applies(cfg, rule_layer) {
                continue;
            }
            return Some((layer, rule.target.as_str()));
        }
        None
    }

    /// The site a dump tensor name maps to, if a rename rule matches and applies to `cfg`: the
    /// target is a full site (`L0.hidden_in`), or a stage completed with the layer matched by
    /// `{n}`.
    pub fn rename_of(&self, name: &str, cfg: &MlaConfig) -> Option<Site> {
        let (layer, target) = self.rename_match(name, cfg)?;
        Site::parse(target).or_else(|| Some(Site::new(layer?, Stage::parse(target)?)))
    }

    /// One line per setting this map overrides (`rope_order`, `layout`, `kv_a_order`), naming the
    /// dump's own metadata value: for the report's conversions.
    pub fn override_lines(&self, metadata: &BTreeMap<String, String>) -> Vec<String> {
        let name = self.name.as_deref().unwrap_or("map");
        let mut out = Vec::new();
        let settings = [
            ("rope_order", self.rope_order.map(RopeOrder::name)),
            ("layout", self.layout.map(Layout::name)),
            ("kv_a_order", self.kv_a_order.map(KvAOrder::name)),
        ];
        for (key, value) in settings {
            let Some(v) = value else { continue };
            let dump = metadata.get(key).map(|s| s.trim());
            out.push(format!(
                "map `{name}` sets {key} = {v} ({})",
                match dump {
                    None => "the dump has no such metadata".to_string(),
                    Some(d) if d == v => format!("the dump's metadata says {d} too"),
                    Some(d) => format!("overrides the dump's metadata {key} = {d}"),
                }
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_patterns() {
        let m = Map {
            rename: vec![
                Rename::new("kv_cmpr-{n}#1", "kv_c_normed"),
                Rename::new("inp_embd#0", "L0.hidden_in"),
                Rename::new("l_out-{n}#0", "hidden_out"),
            ],
            ..Map::default()
        };
        let cfg = cfg(KvBLayout::Split, Some(64));
        assert_eq!(m.rename_of("kv_cmpr-12#1", &cfg), Site::parse("L12.kv_c_normed"));
        assert_eq!(m.rename_of("kv_cmpr-12#0", &cfg), None);
        assert_eq!(m.rename_of("kv_cmpr-x#1", &cfg), None);
        assert_eq!(m.rename_of("inp_embd#0", &cfg), Site::parse("L0.hidden_in"));
        assert_eq!(m.rename_of("l_out-0#0", &cfg), Site::parse("L0.hidden_out"));
    }

    /// The embedded fixture's config with the given kv_b layout and q_lora_rank (the other
    /// dims do not matter to the rules).
    fn cfg(kv_b_layout: KvBLayout, q_lora_rank: Option<usize>) -> MlaConfig {
        let file = crate::model::fixture::open_model(None).expect("embedded fixture");
        MlaConfig {
            kv_b_layout,
            q_lora_rank,
            ..MlaConfig::from_gguf(&file).expect("embedded fixture config")
        }
    }

    #[test]
    fn rename_conditions_select_rules_by_model() {
        let m: Map = serde_json::from_str(
            r#"{"rename": [["q-{n}#1", "q_c_normed", "q_lora"], ["q-{n}#1", "q", "no_q_lora"],
                           ["kqv-{n}#0", "attn_latent", "split_kv_b"], ["kv-{n}#0", "k_nope", "fused_kv_b"]]}"#,
        )
        .unwrap();
        assert_eq!(m.rename[0].when, Some(Condition::QLora));
        let (split_lora, fused_plain) = (cfg(KvBLayout::Split, Some(64)), cfg(KvBLayout::Fused, None));
        assert_eq!(m.rename_of("q-3#1", &split_lora), Site::parse("L3.q_c_normed"));
        assert_eq!(m.rename_of("q-3#1", &fused_plain), Site::parse("L3.q"));
        assert_eq!(m.rename_of("kqv-0#0", &split_lora), Site::parse("L0.attn_latent"));
        assert_eq!(m.rename_of("kqv-0#0", &fused_plain), None);
        assert_eq!(m.rename_of("kv-0#0", &split_lora), None);
        assert_eq!(m.rename_of("kv-0#0", &fused_plain), Site::parse("L0.k_nope"));
        // q_lora_rank 0 counts as no q_lora.
        assert!(Condition::NoQLora.holds(&cfg(KvBLayout::Split, Some(0)), None));
        // Round trip: two- and three-element rules.
        let back: Map = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!(serde_json::to_string(&Rename::new("a", "b")).unwrap() == r#"["a","b"]"#);
        // Unknown condition, too short or too long: serde errors naming what is wrong.
        let e = serde_json::from_str::<Map>(r#"{"rename": [["a", "b", "absorbed"]]}"#).unwrap_err();
        assert!(e.to_string().contains("unknown variant `absorbed`"), "{e}");
        let e = serde_json::from_str::<Map>(r#"{"rename": [["a"]]}"#).unwrap_err();
        assert!(e.to_string().contains("invalid length 1"), "{e}");
        assert!(serde_json::from_str::<Map>(r#"{"rename": [["a", "b", "q_lora", "x"]]}"#).is_err());
    }

    /// `dense_ffn` holds at the layers that run a dense MLP, `moe_ffn` at the others: moe-v3-f32
    /// has one leading dense layer (0) and MoE layers 1 and 2; the embedded fixture has no MoE
    /// layer.
    #[test]
    fn ffn_conditions_follow_the_layer() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("golden/models/moe-v3-f32.gguf");
        let moe = MlaConfig::from_gguf(&crate::model::gguf::GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!((moe.leading_dense_block_count, moe.n_layer), (1, 3));
        let m: Map = serde_json::from_str(
            r#"{"rename": [["ffn_out-{n}#0", "ffn_out", "dense_ffn"], ["ffn_shexp-{n}#0", "shared_out", "moe_ffn"],
                           ["first_ffn_out", "L0.ffn_out", "dense_ffn"], ["last_ffn_out", "L2.ffn_out", "dense_ffn"],
                           ["no_layer", "ffn_out", "dense_ffn"]]}"#,
        )
        .unwrap();
        assert_eq!(m.rename[0].when, Some(Condition::DenseFfn));
        assert_eq!(m.rename_of("ffn_out-0#0", &moe), Site::parse("L0.ffn_out"));
        assert_eq!(m.rename_of("ffn_out-1#0", &moe), None);
        assert_eq!(m.rename_of("ffn_out-2#0", &moe), None);
        assert_eq!(m.rename_of("ffn_shexp-2#0", &moe), Site::parse("L2.shared_out"));
        assert_eq!(m.rename_of("ffn_shexp-0#0", &moe), None);
        // A literal pattern takes its full-site target's layer; without a layer it never holds.
        assert_eq!(m.rename_of("first_ffn_out", &moe), Site::parse("L0.ffn_out"));
        assert_eq!(m.rename_of("last_ffn_out", &moe), None);
        assert_eq!(m.rename_match("no_layer", &moe), None);
        assert!(!Condition::DenseFfn.holds(&moe, None) && !Condition::MoeFfn.holds(&moe, None));
        let dense = cfg(KvBLayout::Split, Some(64));
        assert!(dense.moe.is_none());
        assert_eq!(m.rename_of("ffn_out-1#0", &dense), Site::parse("L1.ffn_out"));
        assert_eq!(m.rename_of("ffn_shexp-1#0", &dense), None);
        assert_eq!(
            (Condition::DenseFfn.name(), Condition::MoeFfn.name()),
            ("dense_ffn", "moe_ffn")
        );
    }

    #[test]
    fn map_overrides_are_listed() {
        let meta: BTreeMap<String, String> = [("rope_order".to_string(), "hf".to_string())].into_iter().collect();
        let m = Map {
            name: Some("m".into()),
            rope_order: Some(RopeOrder::Interleaved),
            kv_a_order: Some(KvAOrder::RopeLatent),
            ..Map::default()
        };
        assert_eq!(
            m.override_lines(&meta),
            vec![
                "map `m` sets rope_order = interleaved (overrides the dump's metadata rope_order = hf)".to_string(),
                "map `m` sets kv_a_order = rope-latent (the dump has no such metadata)".to_string(),
            ]
        );
        assert!(Map::load("vllm").unwrap().override_lines(&meta).is_empty());
    }
}
