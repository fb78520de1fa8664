//! Test support: a small GGUF writer for building valid and deliberately broken files in memory.
//!
//! Tests of the reader's error handling need files that are wrong in one precise place. Building
//! them byte by byte (as candle's `tests/gguf_tests.rs` does) keeps every case readable; the
//! builder also records the byte offset at which each field starts, so truncation tests can cut
//! the file at every field boundary.

#![allow(dead_code)]

use std::path::PathBuf;

/// A metadata value to write.
#[derive(Debug, Clone)]
pub enum Val {
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    ArrStr(Vec<String>),
    ArrF32(Vec<f32>),
    /// Raw value type id and raw bytes (for hostile values).
    Raw(u32, Vec<u8>),
}

/// One tensor to write: name, ggml dims (ne, innermost first), ggml type id, data bytes.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub ne: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
    /// Override the computed offset (hostile files).
    pub offset_override: Option<u64>,
}

/// A GGUF file under construction.
#[derive(Debug, Clone)]
pub struct GgufBuilder {
    pub magic: [u8; 4],
    pub version: u32,
    pub kvs: Vec<(String, Val)>,
    pub tensors: Vec<TensorSpec>,
    pub alignment: u64,
    /// Override the tensor count written in the header.
    pub tensor_count_override: Option<u64>,
    /// Override the metadata count written in the header.
    pub kv_count_override: Option<u64>,
}

/// The bytes of a built file and the start offset of every field, with a name.
pub struct Built {
    pub bytes: Vec<u8>,
    pub fields: Vec<(usize, String)>,
}

impl Default for GgufBuilder {
    fn default() -> Self {
        GgufBuilder {
            magic: *b"GGUF",
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
            tensor_count_override: None,
            kv_count_override: None,
        }
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

impl GgufBuilder {
    pub fn kv(&mut self, k: &str, v: Val) -> &mut Self {
        self.kvs.push((k.to_string(), v));
        self
    }

    pub fn remove_kv(&mut self, k: &str) -> &mut Self {
        self.kvs.retain(|(kk, _)| kk != k);
        self
    }

    pub fn set_kv(&mut self, k: &str, v: Val) -> &mut Self {
        self.remove_kv(k);
        self.kv(k, v)
    }

    /// Adds an F32 tensor with PyTorch shape `shape` and the given values.
    pub fn f32_tensor(&mut self, name: &str, shape: &[u64], vals: &[f32]) -> &mut Self {
        let ne: Vec<u64> = shape.iter().rev().copied().collect();
        let data = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            ne,
            type_id: 0,
            data,
            offset_override: None,
        });
        self
    }

    pub fn build(&self) -> Built {
        let mut b = Vec::new();
        let mut fields = Vec::new();
        fields.push((0, "magic".to_string()));
        b.extend_from_slice(&self.magic);
        fields.push((b.len(), "version".into()));
        b.extend_from_slice(&self.version.to_le_bytes());
        fields.push((b.len(), "tensor_count".into()));
        b.extend_from_slice(
            &self
                .tensor_count_override
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        fields.push((b.len(), "metadata_kv_count".into()));
        b.extend_from_slice(&self.kv_count_override.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            fields.push((b.len(), format!("{k}: key")));
            put_str(&mut b, k);
            fields.push((b.len(), format!("{k}: type")));
            let (t, bytes): (u32, Vec<u8>) = match v {
                Val::U32(x) => (4, x.to_le_bytes().to_vec()),
                Val::I32(x) => (5, x.to_le_bytes().to_vec()),
                Val::F32(x) => (6, x.to_le_bytes().to_vec()),
                Val::Bool(x) => (7, vec![*x as u8]),
                Val::U64(x) => (10, x.to_le_bytes().to_vec()),
                Val::Str(s) => {
                    let mut o = Vec::new();
                    put_str(&mut o, s);
                    (8, o)
                }
                Val::ArrStr(v) => {
                    let mut o = Vec::new();
                    o.extend_from_slice(&8u32.to_le_bytes());
                    o.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    for s in v {
                        put_str(&mut o, s);
                    }
                    (9, o)
                }
                Val::ArrF32(v) => {
                    let mut o = Vec::new();
                    o.extend_from_slice(&6u32.to_le_bytes());
                    o.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    for x in v {
                        o.extend_from_slice(&x.to_le_bytes());
                    }
                    (9, o)
                }
                Val::Raw(t, bytes) => (*t, bytes.clone()),
            };
            b.extend_from_slice(&t.to_le_bytes());
            fields.push((b.len(), format!("{k}: value")));
            b.extend_from_slice(&bytes);
        }
        // Offsets: each tensor's data aligned within the data section.
        let mut offsets = Vec::new();
        let mut off = 0u64;
        for t in &self.tensors {
            offsets.push(t.offset_override.unwrap_or(off));
            off += t.data.len() as u64;
            off = off.div_ceil(self.alignment) * self.alignment;
        }
        for (t, o) in self.tensors.iter().zip(&offsets) {
            fields.push((b.len(), format!("{}: name", t.name)));
            put_str(&mut b, &t.name);
            fields.push((b.len(), format!("{}: n_dims", t.name)));
            b.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for (i, d) in t.ne.iter().enumerate() {
                fields.push((b.len(), format!("{}: ne[{i}]", t.name)));
                b.extend_from_slice(&d.to_le_bytes());
            }
            fields.push((b.len(), format!("{}: type", t.name)));
            b.extend_from_slice(&t.type_id.to_le_bytes());
            fields.push((b.len(), format!("{}: offset", t.name)));
            b.extend_from_slice(&o.to_le_bytes());
        }
        let data_start = (b.len() as u64).div_ceil(self.alignment) * self.alignment;
        b.resize(data_start as usize, 0);
        for (t, o) in self.tensors.iter().zip(&offsets) {
            if t.offset_override.is_some() {
                continue;
            }
            let at = data_start as usize + *o as usize;
            fields.push((at, format!("{}: data", t.name)));
            if b.len() < at {
                b.resize(at, 0);
            }
            b.extend_from_slice(&t.data);
        }
        let end = (b.len() as u64).div_ceil(self.alignment) * self.alignment;
        b.resize(end as usize, 0);
        Built { bytes: b, fields }
    }
}

/// Dims of a test MLA model.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub n_layer: usize,
    pub h: usize,
    pub n: usize,
    pub lq: Option<usize>,
    pub l: usize,
    pub p: usize,
    pub r: usize,
    pub v: usize,
    pub f: usize,
    pub vocab: usize,
}

impl Default for Dims {
    fn default() -> Self {
        Dims {
            n_layer: 2,
            h: 32,
            n: 3,
            lq: Some(16),
            l: 24,
            p: 8,
            r: 4,
            v: 12,
            f: 16,
            vocab: 20,
        }
    }
}

/// Deterministic pseudo-random values in [-scale, scale].
pub fn vals(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A complete, valid F32 `deepseek2` model with MLA-era keys and split kv_b (or legacy with
/// `legacy = true`).
pub fn deepseek2(d: Dims, legacy: bool) -> GgufBuilder {
    let mut g = GgufBuilder::default();
    let a = "deepseek2";
    g.kv("general.architecture", Val::Str(a.into()));
    g.kv(&format!("{a}.block_count"), Val::U32(d.n_layer as u32));
    g.kv(&format!("{a}.embedding_length"), Val::U32(d.h as u32));
    g.kv(&format!("{a}.attention.head_count"), Val::U32(d.n as u32));
    if let Some(lq) = d.lq {
        g.kv(&format!("{a}.attention.q_lora_rank"), Val::U32(lq as u32));
    }
    g.kv(&format!("{a}.attention.kv_lora_rank"), Val::U32(d.l as u32));
    if legacy {
        g.kv(&format!("{a}.attention.head_count_kv"), Val::U32(d.n as u32));
        g.kv(&format!("{a}.attention.key_length"), Val::U32((d.p + d.r) as u32));
        g.kv(&format!("{a}.attention.value_length"), Val::U32(d.v as u32));
    } else {
        g.kv(&format!("{a}.attention.head_count_kv"), Val::U32(1));
        g.kv(&format!("{a}.attention.key_length"), Val::U32((d.l + d.r) as u32));
        g.kv(&format!("{a}.attention.value_length"), Val::U32(d.l as u32));
        g.kv(&format!("{a}.attention.key_length_mla"), Val::U32((d.p + d.r) as u32));
        g.kv(&format!("{a}.attention.value_length_mla"), Val::U32(d.v as u32));
    }
    g.kv(&format!("{a}.attention.layer_norm_rms_epsilon"), Val::F32(1e-6));
    g.kv(&format!("{a}.rope.dimension_count"), Val::U32(d.r as u32));
    g.kv(&format!("{a}.rope.freq_base"), Val::F32(10000.0));
    g.kv(
        "tokenizer.ggml.tokens",
        Val::ArrStr((0..d.vocab).map(|i| format!("t{i}")).collect()),
    );
    let mut seed = 1;
    let mut t = |g: &mut GgufBuilder, name: &str, shape: &[usize], scale: f32| {
        seed += 1;
        let n: usize = shape.iter().product();
        let mut v = vals(seed, n, scale);
        if shape.len() == 1 {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        let sh: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
        g.f32_tensor(name, &sh, &v);
    };
    t(&mut g, "token_embd.weight", &[d.vocab, d.h], 1.0);
    for i in 0..d.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        t(&mut g, &b("attn_norm"), &[d.h], 0.2);
        match d.lq {
            Some(lq) => {
                t(&mut g, &b("attn_q_a"), &[lq, d.h], 0.3);
                t(&mut g, &b("attn_q_a_norm"), &[lq], 0.2);
                t(&mut g, &b("attn_q_b"), &[d.n * (d.p + d.r), lq], 0.3);
            }
            None => t(&mut g, &b("attn_q"), &[d.n * (d.p + d.r), d.h], 0.3),
        }
        t(&mut g, &b("attn_kv_a_mqa"), &[d.l + d.r, d.h], 0.3);
        t(&mut g, &b("attn_kv_a_norm"), &[d.l], 0.2);
        if legacy {
            t(&mut g, &b("attn_kv_b"), &[d.n * (d.p + d.v), d.l], 0.3);
        } else {
            t(&mut g, &b("attn_k_b"), &[d.n, d.l, d.p], 0.3);
            t(&mut g, &b("attn_v_b"), &[d.n, d.v, d.l], 0.3);
        }
        t(&mut g, &b("attn_output"), &[d.h, d.n * d.v], 0.1);
        t(&mut g, &b("ffn_norm"), &[d.h], 0.2);
        t(&mut g, &b("ffn_gate"), &[d.f, d.h], 0.2);
        t(&mut g, &b("ffn_up"), &[d.f, d.h], 0.2);
        t(&mut g, &b("ffn_down"), &[d.h, d.f], 0.2);
    }
    g
}

/// Writes `bytes` to a fresh temp file and returns its path (kept alive by the returned dir).
pub fn write_temp(bytes: &[u8], name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).expect("write temp file");
    (dir, p)
}

/// Writes `tensors` (name, shape, f32 values) as an F32 safetensors file at `path` with string
/// metadata `meta`: an engine's WEIGHTS file as the hooks write one.
pub fn write_f32_safetensors(
    path: &std::path::Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    meta: &[(&str, &str)],
) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.2.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.1.clone(), b).expect("tensor view");
            (t.0.clone(), v)
        })
        .collect();
    let meta: std::collections::HashMap<String, String> =
        meta.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect();
    std::fs::write(path, safetensors::serialize(views, Some(meta)).expect("serialize")).expect("write safetensors");
}

/// Runs the `mla-diff` binary; returns (exit code, stdout, stderr).
pub fn run_bin(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mla-diff"))
        .args(args)
        .output()
        .expect("run mla-diff");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The repository root: `$MLA_DIFF_REPO` when set (test binaries carried to another machine),
/// else the source tree the tests were built from.
pub fn repo() -> PathBuf {
    std::env::var_os("MLA_DIFF_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

impl Built {
    /// Offset of the first field called `name` (a test bug, so a panic, when absent).
    pub fn field(&self, name: &str) -> usize {
        self.fields
            .iter()
            .find(|(_, n)| n == name)
            .map(|(o, _)| *o)
            .unwrap_or_else(|| panic!("no field `{name}` in the built file"))
    }

    /// Overwrites the bytes at `off` with `bytes`.
    pub fn patch(mut self, off: usize, bytes: &[u8]) -> Self {
        self.bytes[off..off + bytes.len()].copy_from_slice(bytes);
        self
    }

    /// Overwrites the little-endian u32 that starts field `field`.
    pub fn patch_u32(self, field: &str, v: u32) -> Self {
        let at = self.field(field);
        self.patch(at, &v.to_le_bytes())
    }

    /// Overwrites the little-endian u64 that starts field `field`.
    pub fn patch_u64(self, field: &str, v: u64) -> Self {
        let at = self.field(field);
        self.patch(at, &v.to_le_bytes())
    }
}

/// The payload of a GGUF array value (element type, count, element bytes), for `Val::Raw(9, …)`.
/// The count is written as given, so it may disagree with the bytes (hostile files).
pub fn raw_array(elem_type: u32, count: u64, elems: &[u8]) -> Vec<u8> {
    let mut v = elem_type.to_le_bytes().to_vec();
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(elems);
    v
}

/// Offsets (relative to the data section) that `GgufBuilder::build` gives each tensor.
pub fn data_offsets(g: &GgufBuilder) -> Vec<u64> {
    let mut out = Vec::new();
    let mut off = 0u64;
    for t in &g.tensors {
        out.push(t.offset_override.unwrap_or(off));
        off += t.data.len() as u64;
        off = off.div_ceil(g.alignment) * g.alignment;
    }
    out
}

/// Index of tensor `name` in the builder (a test bug, so a panic, when absent).
pub fn tensor_pos(g: &GgufBuilder, name: &str) -> usize {
    g.tensors
        .iter()
        .position(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor `{name}` in the builder"))
}

/// MoE settings of a test model (the `deepseek2.expert_*` keys and the expert tensors).
#[derive(Debug, Clone, Copy)]
pub struct MoeDims {
    /// E: routed experts.
    pub e: usize,
    /// K: experts per token.
    pub k: usize,
    /// G: expert groups (0: key absent).
    pub g: usize,
    /// Groups kept per token.
    pub g_used: usize,
    /// Shared experts.
    pub shared: usize,
    /// F_e: expert FFN width.
    pub fe: usize,
    /// First MoE layer (`leading_dense_block_count`).
    pub first: usize,
    /// `expert_weights_scale`.
    pub scale: f32,
    /// `expert_weights_norm`.
    pub norm: bool,
    /// `expert_gating_func` (1 softmax, 2 sigmoid).
    pub gating: u32,
    /// Write `exp_probs_b.bias` tensors.
    pub bias: bool,
}

impl Default for MoeDims {
    fn default() -> Self {
        MoeDims {
            e: 16,
            k: 2,
            g: 4,
            g_used: 2,
            shared: 1,
            fe: 8,
            first: 1,
            scale: 2.5,
            norm: true,
            gating: 2,
            bias: true,
        }
    }
}

/// [`deepseek2`] turned into a DeepSeek-V3-style MoE model: layers `m.first..` lose their dense
/// FFN and get a router, a score-correction bias, 3-D expert tensors and shared experts (seeded
/// values), with the matching `expert_*` keys.
pub fn deepseek2_moe(d: Dims, m: MoeDims) -> GgufBuilder {
    let mut g = deepseek2(d, false);
    let a = "deepseek2";
    g.kv(&format!("{a}.leading_dense_block_count"), Val::U32(m.first as u32));
    g.kv(&format!("{a}.expert_count"), Val::U32(m.e as u32));
    g.kv(&format!("{a}.expert_used_count"), Val::U32(m.k as u32));
    if m.g > 0 {
        g.kv(&format!("{a}.expert_group_count"), Val::U32(m.g as u32));
        g.kv(&format!("{a}.expert_group_used_count"), Val::U32(m.g_used as u32));
    }
    g.kv(&format!("{a}.expert_shared_count"), Val::U32(m.shared as u32));
    g.kv(&format!("{a}.expert_feed_forward_length"), Val::U32(m.fe as u32));
    g.kv(&format!("{a}.expert_weights_scale"), Val::F32(m.scale));
    g.kv(&format!("{a}.expert_weights_norm"), Val::Bool(m.norm));
    g.kv(&format!("{a}.expert_gating_func"), Val::U32(m.gating));
    let moe_layer = |name: &str| {
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|l| l >= m.first)
    };
    g.tensors.retain(|t| {
        !(moe_layer(&t.name)
            && ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
                .iter()
                .any(|s| t.name.ends_with(s)))
    });
    let mut seed = 5000;
    let mut t = |g: &mut GgufBuilder, name: &str, shape: &[usize], scale: f32| {
        seed += 1;
        let n: usize = shape.iter().product();
        let sh: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
        g.f32_tensor(name, &sh, &vals(seed, n, scale));
    };
    let (h, e, fe) = (d.h, m.e, m.fe);
    for i in m.first..d.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        t(&mut g, &b("ffn_gate_inp"), &[e, h], 0.5);
        if m.bias {
            t(&mut g, &format!("blk.{i}.exp_probs_b.bias"), &[e], 0.2);
        }
        t(&mut g, &b("ffn_gate_exps"), &[e, fe, h], 0.3);
        t(&mut g, &b("ffn_up_exps"), &[e, fe, h], 0.3);
        t(&mut g, &b("ffn_down_exps"), &[e, h, fe], 0.3);
        if m.shared > 0 {
            t(&mut g, &b("ffn_gate_shexp"), &[m.shared * fe, h], 0.3);
            t(&mut g, &b("ffn_up_shexp"), &[m.shared * fe, h], 0.3);
            t(&mut g, &b("ffn_down_shexp"), &[h, m.shared * fe], 0.3);
        }
    }
    g
}

/// Writes `tensors` (name, dtype, shape, little-endian bytes) with `metadata` as a safetensors
/// file at `path`.
pub fn write_safetensors<N: AsRef<str>>(
    path: &std::path::Path,
    tensors: &[(N, safetensors::Dtype, Vec<usize>, Vec<u8>)],
    metadata: Option<std::collections::HashMap<String, String>>,
) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.as_ref().to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, metadata).unwrap()).unwrap();
}

/// The `dump.conversions` lines of a `compare --json` report.
pub fn conversions(doc: &serde_json::Value) -> Vec<&str> {
    doc["dump"]["conversions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect()
}

/// Runs `mla-diff compare --model MODEL --dump DUMP --json <tmp> EXTRA…` and returns the exit
/// code, stdout, stderr and the JSON report (`Null` when none was written).
pub fn compare_json(
    model: &std::path::Path,
    dump: &std::path::Path,
    extra: &[&str],
) -> (i32, String, String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let j = dir.path().join("c.json");
    let mut args = vec![
        "compare",
        "--model",
        model.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "--json",
        j.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, out, err) = run_bin(&args);
    let doc = std::fs::read(&j)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    (code, out, err, doc)
}

/// The DSA lightning indexer of a test `glm-dsa` model: `N_idx` heads of width `D_idx`, top-k.
#[derive(Debug, Clone, Copy)]
pub struct IndexerDims {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
}

/// A complete, valid F32 `glm-dsa` model (GLM-5's architecture: [`deepseek2`]'s MLA layers with
/// split kv_b and a dense FFN, plus a DSA indexer in every layer).
pub fn glm_dsa(d: Dims, ix: IndexerDims) -> GgufBuilder {
    let mut g = deepseek2(d, false);
    let a = "glm-dsa";
    for (k, v) in g.kvs.iter_mut() {
        if let Some(rest) = k.strip_prefix("deepseek2.") {
            *k = format!("{a}.{rest}");
        } else if k == "general.architecture" {
            *v = Val::Str(a.into());
        }
    }
    g.kv(&format!("{a}.attention.indexer.head_count"), Val::U32(ix.n_head as u32));
    g.kv(
        &format!("{a}.attention.indexer.key_length"),
        Val::U32(ix.head_dim as u32),
    );
    g.kv(&format!("{a}.attention.indexer.top_k"), Val::U32(ix.top_k as u32));
    let lq = d.lq.expect("glm-dsa needs q_lora_rank");
    for i in 0..d.n_layer {
        let b = |s: &str| format!("blk.{i}.indexer.{s}");
        let seed = 1000 + 10 * i as u64;
        let (ni, di) = (ix.n_head, ix.head_dim);
        g.f32_tensor(
            &b("attn_q_b.weight"),
            &[(ni * di) as u64, lq as u64],
            &vals(seed, ni * di * lq, 0.3),
        );
        g.f32_tensor(
            &b("attn_k.weight"),
            &[di as u64, d.h as u64],
            &vals(seed + 1, di * d.h, 0.3),
        );
        let gain: Vec<f32> = vals(seed + 2, di, 0.1).iter().map(|x| x + 1.0).collect();
        g.f32_tensor(&b("k_norm.weight"), &[di as u64], &gain);
        g.f32_tensor(&b("k_norm.bias"), &[di as u64], &vals(seed + 3, di, 0.1));
        g.f32_tensor(
            &b("proj.weight"),
            &[ni as u64, d.h as u64],
            &vals(seed + 4, ni * d.h, 0.3),
        );
    }
    g
}

/// Rewrites a safetensors file's JSON header through `f` (data kept, offsets unchanged; the
/// header padded to 8 bytes with spaces).
pub fn edit_safetensors_header(path: &std::path::Path, f: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut h);
    let mut hj = serde_json::to_vec(&h).unwrap();
    while !hj.len().is_multiple_of(8) {
        hj.push(b' ');
    }
    let mut out = (hj.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hj);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}
