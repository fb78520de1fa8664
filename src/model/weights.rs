//! Loading one layer's MLA weights from a GGUF file, dequantized to f32.
//!
//! Asking about layer 3 of a 400 GB model must cost about one layer, so this module looks up the
//! tensors of that layer only, checks their shapes against [`MlaConfig`] (naming the tensor and the
//! dims on mismatch) and dequantizes them. It also hands out row and column slices cut from the
//! RAW quantized bytes, the way an engine with quantized weights shards them across TP ranks; a
//! cut that does not fall on a quant block boundary is refused with [`SliceError::Misaligned`].
//!
//! Tensor names and layouts are llama.cpp's (`src/llama-arch.cpp`, `LLM_ARCH_DEEPSEEK2`), each
//! taken from its row of [`crate::model::tensors`]. Every matrix here is in PyTorch `[out, in]`
//! layout (the GGUF `ne` reversed).

use ndarray::{Array1, Array2, Array3};
use serde::Serialize;

use crate::core::error::{Error, Result};
use crate::model::config::{KvBLayout, MlaConfig};
use crate::model::gguf::{GgmlType, GgufFile, TensorInfo, dequant};
use crate::model::tensors::ModelTensor as T;

/// The query projection of one layer.
#[derive(Debug, Clone)]
pub enum QWeights {
    /// With `Lq`: `attn_q_a` \[Lq, H], `attn_q_a_norm` \[Lq], `attn_q_b` \[N·(P+R), Lq].
    Lora {
        /// `q_a_proj`, [Lq, H].
        q_a: Array2<f32>,
        /// `q_a_layernorm` weight, \[Lq].
        q_a_norm: Array1<f32>,
        /// `q_b_proj`, [N·(P+R), Lq].
        q_b: Array2<f32>,
    },
    /// Without `Lq`: `attn_q` [N·(P+R), H] (vLLM `q_proj`).
    Direct {
        /// `q_proj`, [N·(P+R), H].
        q: Array2<f32>,
    },
}

/// The `kv_b_proj` up-projection as the file stores it.
#[derive(Debug, Clone)]
pub enum KvBWeights {
    /// MLA-era split pair: `attn_k_b` [N, L, P] (stored transposed) and `attn_v_b` [N, V, L].
    Split {
        /// `attn_k_b`, PyTorch [N, L, P].
        k_b: Array3<f32>,
        /// `attn_v_b`, PyTorch [N, V, L].
        v_b: Array3<f32>,
    },
    /// Legacy `attn_kv_b`, [N·(P+V), L], per head `[k_nope rows | v rows]`.
    Fused {
        /// `kv_b_proj`, [N·(P+V), L].
        kv_b: Array2<f32>,
    },
}

/// Dense SwiGLU FFN of a layer (`ffn_norm`, `ffn_gate`, `ffn_up`, `ffn_down`).
#[derive(Debug, Clone)]
pub struct DenseFfn {
    /// `ffn_norm` weight, \[H].
    pub norm: Array1<f32>,
    /// `ffn_gate`, [F, H].
    pub gate: Array2<f32>,
    /// `ffn_up`, [F, H].
    pub up: Array2<f32>,
    /// `ffn_down`, [H, F].
    pub down: Array2<f32>,
}

/// One SwiGLU FFN in PyTorch layout: `down(silu(gate·x) ⊙ up·x)`. Used for one routed expert
/// (width `F_e`) and for the shared experts (width `n_shared · F_e`).
#[derive(Debug, Clone)]
pub struct SwiGlu {
    /// `gate_proj`, [F, H].
    pub gate: Array2<f32>,
    /// `up_proj`, [F, H].
    pub up: Array2<f32>,
    /// `down_proj`, [H, F].
    pub down: Array2<f32>,
}

/// The small, always-needed weights of one MoE layer, dequantized to f32; the routed experts
/// stay in the file and are dequantized one at a time by [`MoeWeights::expert`], so that a layer
/// of a 256-expert model costs only the experts its tokens select.
///
/// Tensors (llama.cpp `LLM_ARCH_DEEPSEEK2`, PyTorch shapes): `ffn_norm` \[H], `ffn_gate_inp`
/// \[E, H] (the router), `exp_probs_b.bias` \[E] (optional), `ffn_{gate,up}_exps` \[E, F_e, H],
/// `ffn_down_exps` [E, H, F_e], `ffn_{gate,up}_shexp` [n_shared·F_e, H], `ffn_down_shexp`
/// [H, n_shared·F_e] (absent when `expert_shared_count` is 0).
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Layer index.
    pub layer: usize,
    /// `ffn_norm` weight, \[H].
    pub norm: Array1<f32>,
    /// `ffn_gate_inp` (HF `mlp.gate.weight`), the router, [E, H].
    pub router: Array2<f32>,
    /// `exp_probs_b.bias` (HF `e_score_correction_bias`), \[E]: added to the scores to choose the
    /// experts, never to their weights. `None` when the file has none (DeepSeek-V2).
    pub exp_probs_b: Option<Array1<f32>>,
    /// The shared experts as one FFN of width `n_shared · F_e`; `None` without shared experts.
    pub shared: Option<SwiGlu>,
    /// Storage type of every tensor of the layer's FFN (experts included), in load order.
    pub types: Vec<TensorType>,
    /// `F_e`.
    expert_ffn: usize,
    /// `H`.
    hidden: usize,
    /// `E`.
    n_expert: usize,
}

impl MoeWeights {
    /// Loads layer `layer`'s router, bias, norm and shared experts, and checks the shapes of the
    /// three routed-expert tensors without reading their data.
    ///
    /// Errors: [`Error::Usage`] when `cfg` has no MoE config for this layer,
    /// [`Error::MissingTensor`] (naming the tensor), [`Error::TensorShape`] (with the dims the
    /// expectation came from), [`Error::Dequant`].
    pub fn load(file: &GgufFile, cfg: &MlaConfig, layer: usize) -> Result<Self> {
        let moe = match &cfg.moe {
            Some(m) if cfg.is_moe_layer(layer) && layer < cfg.n_layer => m,
            _ => {
                // Callers ask only for the layers `cfg.is_moe_layer` names.
                return Err(Error::internal(format!(
                    "{}: layer {layer} is not an MoE layer (leading_dense_block_count {}, expert_count {})",
                    file.path().display(),
                    cfg.leading_dense_block_count,
                    cfg.moe.as_ref().map_or(0, |m| m.n_expert)
                )));
            }
        };
        let (h, e, fe) = (cfg.hidden, moe.n_expert, moe.expert_ffn);
        let name = |t: T| t.name(layer);
        let mut types = Vec::new();
        let ty = &mut types;
        let norm = load_1d(file, ty, &name(T::FfnNorm), h, "H")?;
        let router = load_2d(file, ty, &name(T::FfnGateInp), [e, h], "E × H (expert_count × H)")?;
        let bias_name = T::ExpProbsB.name(layer);
        let exp_probs_b = match file.tensor(&bias_name) {
            Some(_) => Some(load_1d(file, ty, &bias_name, e, "E (expert_count)")?),
            None => None,
        };
        for (t, shape, why) in [
            (
                T::FfnGateExps,
                [e, fe, h],
                "E × F_e × H (expert_count × expert_feed_forward_length × H)",
            ),
            (
                T::FfnUpExps,
                [e, fe, h],
                "E × F_e × H (expert_count × expert_feed_forward_length × H)",
            ),
            (
                T::FfnDownExps,
                [e, h, fe],
                "E × H × F_e (expert_count × H × expert_feed_forward_length)",
            ),
        ] {
            let info = checked(file, &name(t), &shape, why)?;
            ty.push(TensorType {
                name: name(t),
                ggml_type: info.ggml_type,
            });
        }
        let shared = if moe.n_expert_shared > 0 {
            let fs = moe.n_expert_shared * fe;
            let why = "n_shared·F_e × H (expert_shared_count · expert_feed_forward_length × H)";
            Some(SwiGlu {
                gate: load_2d(file, ty, &name(T::FfnGateShexp), [fs, h], why)?,
                up: load_2d(file, ty, &name(T::FfnUpShexp), [fs, h], why)?,
                down: load_2d(
                    file,
                    ty,
                    &name(T::FfnDownShexp),
                    [h, fs],
                    "H × n_shared·F_e (H × expert_shared_count · expert_feed_forward_length)",
                )?,
            })
        } else {
            None
        };
        Ok(MoeWeights {
            layer,
            norm,
            router,
            exp_probs_b,
            shared,
            types,
            expert_ffn: fe,
            hidden: h,
            n_expert: e,
        })
    }

    /// Routed expert `expert`'s three matrices, dequantized from that expert's slice of the raw
    /// bytes of the 3-D tensors only: `ffn_{gate,up}_exps` viewed as [E·F_e, H] (rows
    /// `expert·F_e..(expert+1)·F_e`) and `ffn_down_exps` as [E·H, F_e] (rows
    /// `expert·H..(expert+1)·H`). Whole rows are always block-aligned.
    ///
    /// Errors: [`Error::Internal`] for `expert ≥ E` (expert ids come from the reference's own
    /// router, below E); missing tensor; dequantization.
    pub fn expert(&self, file: &GgufFile, expert: usize) -> Result<SwiGlu> {
        if expert >= self.n_expert {
            return Err(Error::internal(format!(
                "{}: expert {expert} out of range: layer {} has {} experts",
                file.path().display(),
                self.layer,
                self.n_expert
            )));
        }
        let (fe, h) = (self.expert_ffn, self.hidden);
        let name = |t: T| t.name(self.layer);
        Ok(SwiGlu {
            gate: dequant_rows(file, &name(T::FfnGateExps), expert * fe..(expert + 1) * fe)?,
            up: dequant_rows(file, &name(T::FfnUpExps), expert * fe..(expert + 1) * fe)?,
            down: dequant_rows(file, &name(T::FfnDownExps), expert * h..(expert + 1) * h)?,
        })
    }

    /// Tensors of the loaded part (norm, router, bias, shared experts) holding NaN or ±Inf, as
    /// [`LayerWeights::nonfinite`] reports them. Routed experts are checked as they are
    /// dequantized ([`SwiGlu::nonfinite`]).
    pub fn nonfinite(&self) -> Vec<NonFiniteTensor> {
        let n = |t: T| t.name(self.layer);
        let mut out = Vec::new();
        scan_nonfinite(n(T::FfnNorm), &self.norm, &mut out);
        scan_nonfinite(n(T::FfnGateInp), &self.router, &mut out);
        if let Some(b) = &self.exp_probs_b {
            scan_nonfinite(n(T::ExpProbsB), b, &mut out);
        }
        if let Some(sh) = &self.shared {
            out.extend(sh.nonfinite(self.layer, SwiGlu::SHARED, None));
        }
        out
    }
}

impl SwiGlu {
    /// The tensors of the shared experts: `ffn_{gate,up,down}_shexp`.
    pub const SHARED: [T; 3] = [T::FfnGateShexp, T::FfnUpShexp, T::FfnDownShexp];
    /// The tensors of the routed experts: `ffn_{gate,up,down}_exps`.
    pub const ROUTED: [T; 3] = [T::FfnGateExps, T::FfnUpExps, T::FfnDownExps];

    /// Non-finite values of the three matrices, named after `tensors` (gate, up, down; [`SwiGlu::SHARED`] or
    /// [`SwiGlu::ROUTED`]) in layer `layer`, with ` (expert e)` appended for a routed expert.
    pub fn nonfinite(&self, layer: usize, tensors: [T; 3], expert: Option<usize>) -> Vec<NonFiniteTensor> {
        let mut out = Vec::new();
        let tag = expert.map_or(String::new(), |e| format!(" (expert {e})"));
        for (t, m) in tensors.into_iter().zip([&self.gate, &self.up, &self.down]) {
            scan_nonfinite(format!("{}{tag}", t.name(layer)), m, &mut out);
        }
        out
    }
}

/// Appends a [`NonFiniteTensor`] for `name` when `a` holds any NaN or ±Inf. A contiguous array is scanned in parallel chunks (a real layer's weights are
/// hundreds of MB, which one thread took half a second to walk).
fn scan_nonfinite<S, D>(name: String, a: &ndarray::ArrayBase<S, D>, out: &mut Vec<NonFiniteTensor>)
where
    S: ndarray::Data<Elem = f32>,
    D: ndarray::Dimension,
{
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let (count, first) = match a.as_slice() {
        Some(v) => v
            .par_chunks(CHUNK)
            .enumerate()
            .map(|(k, c)| {
                let bad = c.iter().filter(|x| !x.is_finite()).count();
                (bad, c.iter().position(|x| !x.is_finite()).map(|i| k * CHUNK + i))
            })
            .reduce(|| (0, None), |(a, fa), (b, fb)| (a + b, fa.into_iter().chain(fb).min())),
        None => a
            .iter()
            .enumerate()
            .filter(|(_, x)| !x.is_finite())
            .fold((0, None), |(n, f), (i, _)| (n + 1, f.or(Some(i)))),
    };
    if let Some(first_index) = first {
        out.push(NonFiniteTensor {
            name,
            count,
            first_index,
        });
    }
}

/// A dequantized weight tensor that holds NaN or ±Inf (the GGUF file itself is corrupt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteTensor {
    /// GGUF tensor name (`blk.{layer}.attn_q_b.weight`), with ` (expert e)` appended for a slice
    /// of a routed expert tensor.
    pub name: String,
    /// Number of non-finite values in the tensor.
    pub count: usize,
    /// Flat index of the first non-finite value, in the dequantized tensor's logical
    /// (PyTorch, row-major) order.
    pub first_index: usize,
}

/// One tensor's name and storage type, for reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorType {
    /// GGUF tensor name.
    pub name: String,
    /// ggml storage type.
    pub ggml_type: GgmlType,
}

/// All weights of one MLA layer, dequantized to f32 in PyTorch layout.
///
/// Built by [`LayerWeights::load`]; shapes are in the dim names of docs/mla.md.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// Layer index.
    pub layer: usize,
    /// `attn_norm` weight, \[H].
    pub attn_norm: Array1<f32>,
    /// Query projection.
    pub q: QWeights,
    /// `attn_kv_a_mqa` (vLLM `kv_a_proj_with_mqa`), [L+R, H].
    pub kv_a_mqa: Array2<f32>,
    /// `attn_kv_a_norm` (vLLM `kv_a_layernorm`), \[L].
    pub kv_a_norm: Array1<f32>,
    /// `kv_b_proj` as stored.
    pub kv_b: KvBWeights,
    /// `attn_output` (vLLM `o_proj`), [H, N·V].
    pub o_proj: Array2<f32>,
    /// Dense FFN; `None` for an MoE layer (its FFN is [`MoeWeights`], loaded on its own).
    pub ffn: Option<DenseFfn>,
    /// The DSA lightning indexer that selects this layer's keys (`deepseek32`/`glm-dsa`): this
    /// layer's own, or for a GLM "shared" layer the nearest earlier full layer's. `None` for
    /// dense-attention MLA.
    pub indexer: Option<IndexerWeights>,
    /// Storage type of every tensor loaded, in load order.
    pub types: Vec<TensorType>,
}

/// The DSA lightning indexer's weights (llama.cpp `blk.N.indexer.*`; HF `self_attn.indexer.*`),
/// dequantized to f32 in PyTorch layout. Dims: `N_idx`, `D_idx` of [`crate::model::config::IndexerConfig`].
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    /// The layer these tensors belong to (differs from the layer using them on a shared layer).
    pub source_layer: usize,
    /// `indexer.attn_q_b` (HF `wq_b`), [N_idx·D_idx, Lq].
    pub q_b: Array2<f32>,
    /// `indexer.attn_k` (HF `wk`), [D_idx, H].
    pub k: Array2<f32>,
    /// `indexer.k_norm.weight` (HF `k_norm.weight`, a LayerNorm gain), \[D_idx].
    pub k_norm: Array1<f32>,
    /// `indexer.k_norm.bias` (HF `k_norm.bias`), \[D_idx].
    pub k_norm_b: Array1<f32>,
    /// `indexer.proj` (HF `weights_proj`), [N_idx, H].
    pub proj: Array2<f32>,
}

/// Why a slice of a quantized tensor cannot be cut.
#[derive(Debug)]
pub enum SliceError {
    /// The cut is not on a quant block boundary (it splits a block's shared scale).
    Misaligned {
        /// Tensor name.
        tensor: String,
        /// ggml type of the tensor.
        ggml_type: GgmlType,
        /// Elements per block along `ne[0]`.
        block_size: u64,
        /// The offending column (input-dim) offset or length.
        at: u64,
    },
    /// Any other failure (missing tensor, bad range, dequantization).
    Other(Error),
}

/// Looks up a tensor and checks its PyTorch-order shape.
fn checked<'f>(file: &'f GgufFile, name: &str, expected: &[usize], why: &str) -> Result<&'f TensorInfo> {
    let t = file.require_tensor(name)?;
    let got = t.shape();
    if got.len() != expected.len() || got.iter().zip(expected).any(|(&g, &e)| g != e as u64) {
        return Err(Error::TensorShape {
            path: file.path().to_path_buf(),
            tensor: name.to_string(),
            expected: expected.iter().map(|&e| e as u64).collect(),
            got,
            why: why.to_string(),
        });
    }
    Ok(t)
}

/// Dequantizes a whole tensor to f32 (ggml element order).
pub fn dequant_tensor(file: &GgufFile, t: &TensorInfo) -> Result<Vec<f32>> {
    if let Some(v) = file.values_f32(t) {
        return Ok(v);
    }
    dequant::dequantize(t.ggml_type, &file.tensor_bytes(t), t.n_elements() as usize).map_err(|reason| Error::Dequant {
        path: file.path().to_path_buf(),
        tensor: t.name.clone(),
        reason,
    })
}

fn load_1d(file: &GgufFile, types: &mut Vec<TensorType>, name: &str, n: usize, why: &str) -> Result<Array1<f32>> {
    let t = checked(file, name, &[n], why)?;
    types.push(TensorType {
        name: name.to_string(),
        ggml_type: t.ggml_type,
    });
    Ok(Array1::from(dequant_tensor(file, t)?))
}

fn load_2d(
    file: &GgufFile,
    types: &mut Vec<TensorType>,
    name: &str,
    shape: [usize; 2],
    why: &str,
) -> Result<Array2<f32>> {
    let t = checked(file, name, &shape, why)?;
    types.push(TensorType {
        name: name.to_string(),
        ggml_type: t.ggml_type,
    });
    Array2::from_shape_vec(shape, dequant_tensor(file, t)?).map_err(|e| Error::Dequant {
        path: file.path().to_path_buf(),
        tensor: name.to_string(),
        reason: e.to_string(),
    })
}

fn load_3d(
    file: &GgufFile,
    types: &mut Vec<TensorType>,
    name: &str,
    shape: [usize; 3],
    why: &str,
) -> Result<Array3<f32>> {
    let t = checked(file, name, &shape, why)?;
    types.push(TensorType {
        name: name.to_string(),
        ggml_type: t.ggml_type,
    });
    Array3::from_shape_vec(shape, dequant_tensor(file, t)?).map_err(|e| Error::Dequant {
        path: file.path().to_path_buf(),
        tensor: name.to_string(),
        reason: e.to_string(),
    })
}

impl LayerWeights {
    /// Loads and dequantizes layer `layer`'s attention (and dense FFN, if any) weights.
    ///
    /// Touches only this layer's tensor data. Errors: [`Error::LayerOutOfRange`],
    /// [`Error::MissingTensor`], [`Error::TensorShape`] (with the dims the expectation came
    /// from), [`Error::Dequant`].
    pub fn load(file: &GgufFile, cfg: &MlaConfig, layer: usize) -> Result<Self> {
        if layer >= cfg.n_layer {
            return Err(Error::LayerOutOfRange {
                path: file.path().to_path_buf(),
                layer,
                n_layers: cfg.n_layer,
            });
        }
        let [n, l, p, r, v] = cfg.dims().nlprv();
        let h = cfg.dims().hidden;
        let name = |t: T| t.name(layer);
        let mut types = Vec::new();
        let ty = &mut types;
        let attn_norm = load_1d(file, ty, &name(T::AttnNorm), h, "H")?;
        let q = match cfg.q_lora_rank {
            Some(lq) => QWeights::Lora {
                q_a: load_2d(file, ty, &name(T::AttnQA), [lq, h], "Lq × H")?,
                q_a_norm: load_1d(file, ty, &name(T::AttnQANorm), lq, "Lq")?,
                q_b: load_2d(file, ty, &name(T::AttnQB), [n * (p + r), lq], "N·(P+R) × Lq")?,
            },
            None => QWeights::Direct {
                q: load_2d(file, ty, &name(T::AttnQ), [n * (p + r), h], "N·(P+R) × H")?,
            },
        };
        let kv_a_mqa = load_2d(file, ty, &name(T::AttnKvAMqa), [l + r, h], "(L+R) × H")?;
        let kv_a_norm = load_1d(file, ty, &name(T::AttnKvANorm), l, "L")?;
        let kv_b = match cfg.kv_b_layout {
            KvBLayout::Split => KvBWeights::Split {
                k_b: load_3d(
                    file,
                    ty,
                    &name(T::AttnKB),
                    [n, l, p],
                    "N × L × P (k_b is stored transposed)",
                )?,
                v_b: load_3d(file, ty, &name(T::AttnVB), [n, v, l], "N × V × L")?,
            },
            KvBLayout::Fused => KvBWeights::Fused {
                kv_b: load_2d(file, ty, &name(T::AttnKvB), [n * (p + v), l], "N·(P+V) × L")?,
            },
        };
        let o_proj = load_2d(file, ty, &name(T::AttnOutput), [h, n * v], "H × N·V")?;
        let ffn = if cfg.is_moe_layer(layer) || file.tensor(&name(T::FfnGateInp)).is_some() {
            None
        } else {
            let gate_t = file.require_tensor(&name(T::FfnGate))?;
            let f = gate_t.shape()[0] as usize;
            Some(DenseFfn {
                norm: load_1d(file, ty, &name(T::FfnNorm), h, "H")?,
                gate: load_2d(file, ty, &name(T::FfnGate), [f, h], "F × H")?,
                up: load_2d(file, ty, &name(T::FfnUp), [f, h], "F × H")?,
                down: load_2d(file, ty, &name(T::FfnDown), [h, f], "H × F")?,
            })
        };
        let indexer = match (&cfg.indexer, cfg.q_lora_rank) {
            // MTP blocks run without the indexer (llama.cpp `graph_mtp`).
            (Some(ix), Some(lq)) if layer < ix.full.len() => {
                let src = ix.source_layer(layer).unwrap_or(layer);
                let nm = |t: T| t.name(src);
                let (ni, di) = (ix.n_head, ix.head_dim);
                Some(IndexerWeights {
                    source_layer: src,
                    q_b: load_2d(file, ty, &nm(T::IndexerAttnQB), [ni * di, lq], "N_idx·D_idx × Lq")?,
                    k: load_2d(file, ty, &nm(T::IndexerAttnK), [di, h], "D_idx × H")?,
                    k_norm: load_1d(file, ty, &nm(T::IndexerKNorm), di, "D_idx")?,
                    k_norm_b: load_1d(file, ty, &nm(T::IndexerKNormBias), di, "D_idx")?,
                    proj: load_2d(file, ty, &nm(T::IndexerProj), [ni, h], "N_idx × H")?,
                })
            }
            _ => None,
        };
        Ok(LayerWeights {
            layer,
            attn_norm,
            q,
            kv_a_mqa,
            kv_a_norm,
            kv_b,
            o_proj,
            ffn,
            indexer,
            types,
        })
    }
}

impl LayerWeights {
    /// The GGUF names of this layer's projection matrices (q, `kv_a`, kv_b, `o_proj`, the dense
    /// FFN's gate/up/down) that hold only zeros (±0.0) after dequantization, in load order: what
    /// such a matrix feeds is zero in the reference and on every path alike, so those sites pass
    /// without judging anything. Empty arrays (tensors handed over) are not listed.
    pub fn zero_matrices(&self) -> Vec<String> {
        fn zero<S: ndarray::Data<Elem = f32>, D: ndarray::Dimension>(a: &ndarray::ArrayBase<S, D>) -> bool {
            !a.is_empty() && a.iter().all(|&x| x == 0.0)
        }
        let n = |t: T| t.name(self.layer);
        let mut out = Vec::new();
        let mut check = |t: T, z: bool| {
            if z {
                out.push(n(t));
            }
        };
        match &self.q {
            QWeights::Lora { q_a, q_b, .. } => {
                check(T::AttnQA, zero(q_a));
                check(T::AttnQB, zero(q_b));
            }
            QWeights::Direct { q } => check(T::AttnQ, zero(q)),
        }
        check(T::AttnKvAMqa, zero(&self.kv_a_mqa));
        match &self.kv_b {
            KvBWeights::Split { k_b, v_b } => {
                check(T::AttnKB, zero(k_b));
                check(T::AttnVB, zero(v_b));
            }
            KvBWeights::Fused { kv_b } => check(T::AttnKvB, zero(kv_b)),
        }
        check(T::AttnOutput, zero(&self.o_proj));
        if let Some(f) = &self.ffn {
            check(T::FfnGate, zero(&f.gate));
            check(T::FfnUp, zero(&f.up));
            check(T::FfnDown, zero(&f.down));
        }
        out
    }

    /// Tensors of this layer holding NaN or ±Inf after dequantization, in load order.
    pub fn nonfinite(&self) -> Vec<NonFiniteTensor> {
        let n = |t: T| t.name(self.layer);
        let mut out = Vec::new();
        scan_nonfinite(n(T::AttnNorm), &self.attn_norm, &mut out);
        match &self.q {
            QWeights::Lora { q_a, q_a_norm, q_b } => {
                scan_nonfinite(n(T::AttnQA), q_a, &mut out);
                scan_nonfinite(n(T::AttnQANorm), q_a_norm, &mut out);
                scan_nonfinite(n(T::AttnQB), q_b, &mut out);
            }
            QWeights::Direct { q } => scan_nonfinite(n(T::AttnQ), q, &mut out),
        }
        scan_nonfinite(n(T::AttnKvAMqa), &self.kv_a_mqa, &mut out);
        scan_nonfinite(n(T::AttnKvANorm), &self.kv_a_norm, &mut out);
        match &self.kv_b {
            KvBWeights::Split { k_b, v_b } => {
                scan_nonfinite(n(T::AttnKB), k_b, &mut out);
                scan_nonfinite(n(T::AttnVB), v_b, &mut out);
            }
            KvBWeights::Fused { kv_b } => scan_nonfinite(n(T::AttnKvB), kv_b, &mut out),
        }
        scan_nonfinite(n(T::AttnOutput), &self.o_proj, &mut out);
        if let Some(f) = &self.ffn {
            scan_nonfinite(n(T::FfnNorm), &f.norm, &mut out);
            scan_nonfinite(n(T::FfnGate), &f.gate, &mut out);
            scan_nonfinite(n(T::FfnUp), &f.up, &mut out);
            scan_nonfinite(n(T::FfnDown), &f.down, &mut out);
        }
        if let Some(ix) = &self.indexer {
            let n = |t: T| t.name(ix.source_layer);
            scan_nonfinite(n(T::IndexerAttnQB), &ix.q_b, &mut out);
            scan_nonfinite(n(T::IndexerAttnK), &ix.k, &mut out);
            scan_nonfinite(n(T::IndexerKNorm), &ix.k_norm, &mut out);
            scan_nonfinite(n(T::IndexerKNormBias), &ix.k_norm_b, &mut out);
            scan_nonfinite(n(T::IndexerProj), &ix.proj, &mut out);
        }
        out
    }
}

/// Whole tensors of one layer as [`LayerWeights::load`] dequantized them, handed on by
/// [`LayerWeights::hand_over`] once the reference has used them, so that an engine path that
/// loads a whole tensor takes these values instead of dequantizing the same bytes again (and
/// the layer's weights are held once, not twice).
///
/// Each entry is a GGUF tensor name and its values in the row-major order of the 2-D view
/// `[n_rows, ne0]` (f32, exactly what the CPU decoder produces). Each tensor can be taken once;
/// TP shards are not here: they are cut from the raw bytes per rank, where a misaligned cut is
/// found.
#[derive(Debug, Default)]
pub struct Dequantized(std::sync::Mutex<std::collections::HashMap<String, Vec<f32>>>);

impl Dequantized {
    /// Takes tensor `name` if it was handed over with exactly `n` elements (a whole tensor);
    /// `None` otherwise (a shard, a tensor already taken, another tensor of the same name).
    pub fn take(&self, name: &str, n: usize) -> Option<Vec<f32>> {
        let mut m = self.0.lock().ok()?;
        if m.get(name).is_some_and(|v| v.len() == n) {
            m.remove(name)
        } else {
            None
        }
    }

    /// Tensors still held.
    pub fn len(&self) -> usize {
        self.0.lock().map_or(0, |m| m.len())
    }

    /// True when no tensor is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The values of `a` in row-major order, without a copy when `a` is in standard layout.
pub(crate) fn into_row_major<A: Clone, D: ndarray::Dimension>(a: ndarray::Array<A, D>) -> Vec<A> {
    if a.is_standard_layout() {
        let len = a.len();
        let (mut v, off) = a.into_raw_vec_and_offset();
        v.drain(..off.unwrap_or(0).min(v.len()));
        v.truncate(len);
        v
    } else {
        a.iter().cloned().collect()
    }
}

impl LayerWeights {
    /// Moves the attention tensors an engine loads whole (norms, `q_a`/`q_b` or `q`, `kv_a`,
    /// `kv_b` or `k_b`/`v_b`, `o_proj`) out of `self` into a [`Dequantized`], leaving empty
    /// arrays in their place: call it only once nothing reads them here (after the reference).
    /// The FFN, the indexer and `types` stay.
    pub fn hand_over(&mut self) -> Dequantized {
        let n = |t: T| t.name(self.layer);
        let mut m = std::collections::HashMap::new();
        let take2 = |a: &mut Array2<f32>| into_row_major(std::mem::replace(a, Array2::zeros((0, 0))));
        let take1 = |a: &mut Array1<f32>| into_row_major(std::mem::replace(a, Array1::zeros(0)));
        let take3 = |a: &mut Array3<f32>| into_row_major(std::mem::replace(a, Array3::zeros((0, 0, 0))));
        m.insert(n(T::AttnNorm), take1(&mut self.attn_norm));
        match &mut self.q {
            QWeights::Lora { q_a, q_a_norm, q_b } => {
                m.insert(n(T::AttnQA), take2(q_a));
                m.insert(n(T::AttnQANorm), take1(q_a_norm));
                m.insert(n(T::AttnQB), take2(q_b));
            }
            QWeights::Direct { q } => {
                m.insert(n(T::AttnQ), take2(q));
            }
        }
        m.insert(n(T::AttnKvAMqa), take2(&mut self.kv_a_mqa));
        m.insert(n(T::AttnKvANorm), take1(&mut self.kv_a_norm));
        match &mut self.kv_b {
            KvBWeights::Split { k_b, v_b } => {
                m.insert(n(T::AttnKB), take3(k_b));
                m.insert(n(T::AttnVB), take3(v_b));
            }
            KvBWeights::Fused { kv_b } => {
                m.insert(n(T::AttnKvB), take2(kv_b));
            }
        }
        m.insert(n(T::AttnOutput), take2(&mut self.o_proj));
        Dequantized(std::sync::Mutex::new(m))
    }
}

/// A block-aligned piece of a tensor's raw GGUF bytes: whole rows, or a column range of every
/// row, as an engine with quantized weights cuts TP shards. Dequantize it with
/// [`dequant::dequantize`] (CPU) or a backend's dequant kernel.
#[derive(Debug, Clone)]
pub struct RawSlice<'a> {
    /// The tensor's name.
    pub tensor: String,
    /// Its ggml type.
    pub ggml_type: GgmlType,
    /// The raw bytes of the slice, rows back to back.
    pub bytes: std::borrow::Cow<'a, [u8]>,
    /// Rows in the slice (PyTorch dim 0 of the 2-D view `[n_rows, ne0]`).
    pub rows: usize,
    /// Elements per row in the slice.
    pub cols: usize,
}

impl RawSlice<'_> {
    /// Elements in the slice.
    pub fn n_elements(&self) -> usize {
        self.rows * self.cols
    }
}

/// Rows `rows` of the 2-D view `[n_rows, ne0]` of tensor `name`, as raw bytes. Whole rows are
/// always block-aligned (quant blocks run along `ne[0]`).
///
/// Errors: missing tensor, a range past the tensor's rows.
pub fn row_slice<'f>(file: &'f GgufFile, name: &str, rows: std::ops::Range<usize>) -> Result<RawSlice<'f>> {
    let t = file.require_tensor(name)?;
    let ne0 = t.row_len() as usize;
    let n_rows = t.n_rows() as usize;
    if rows.start > rows.end || rows.end > n_rows {
        return Err(Error::input(
            file.path(),
            format!("tensor `{name}`"),
            format!("row range {rows:?} outside its {n_rows} rows"),
        ));
    }
    let rb = t.row_bytes() as usize;
    let bytes = file
        .tensor_bytes_range(t, rows.start * rb..rows.end * rb)
        .ok_or_else(|| {
            Error::input(
                file.path(),
                format!("tensor `{name}`"),
                format!("rows {rows:?} past its data"),
            )
        })?;
    Ok(RawSlice {
        tensor: name.to_string(),
        ggml_type: t.ggml_type,
        bytes,
        rows: rows.len(),
        cols: ne0,
    })
}

/// Columns `cols` (the input dim, `ne[0]`) of every row of tensor `name`, as raw bytes gathered
/// row by row, the way a row-parallel TP shard (e.g. `o_proj`) is cut.
///
/// Returns [`SliceError::Misaligned`] when `cols` does not start and end on a quant block
/// boundary of the tensor's type.
pub fn col_slice<'f>(file: &'f GgufFile, name: &str, cols: std::ops::Range<usize>) -> Result<RawSlice<'f>, SliceError> {
    let t = file.require_tensor(name).map_err(SliceError::Other)?;
    let bs = t.ggml_type.block_size();
    for at in [cols.start as u64, cols.end as u64] {
        if at % bs != 0 {
            return Err(SliceError::Misaligned {
                tensor: name.to_string(),
                ggml_type: t.ggml_type,
                block_size: bs,
                at,
            });
        }
    }
    let ne0 = t.row_len() as usize;
    let n_rows = t.n_rows() as usize;
    if cols.start > cols.end || cols.end > ne0 {
        return Err(SliceError::Other(Error::input(
            file.path(),
            format!("tensor `{name}`"),
            format!("column range {cols:?} outside its {ne0} columns"),
        )));
    }
    let rb = t.row_bytes() as usize;
    let ts = t.ggml_type.type_size() as usize;
    let b0 = cols.start / bs as usize * ts;
    let b1 = cols.end / bs as usize * ts;
    let all = file.tensor_bytes(t);
    let all = &*all;
    let mut bytes = Vec::with_capacity(n_rows * (b1 - b0));
    for r in 0..n_rows {
        bytes.extend_from_slice(&all[r * rb + b0..r * rb + b1]);
    }
    Ok(RawSlice {
        tensor: name.to_string(),
        ggml_type: t.ggml_type,
        bytes: std::borrow::Cow::Owned(bytes),
        rows: n_rows,
        cols: cols.len(),
    })
}

/// Dequantizes a raw slice on the CPU to `[rows, cols]` f32.
pub fn dequant_slice(file: &GgufFile, raw: &RawSlice<'_>) -> Result<Array2<f32>> {
    let data = dequant::dequantize(raw.ggml_type, &raw.bytes, raw.n_elements()).map_err(|reason| Error::Dequant {
        path: file.path().to_path_buf(),
        tensor: raw.tensor.clone(),
        reason,
    })?;
    Array2::from_shape_vec((raw.rows, raw.cols), data).map_err(|e| Error::Internal(e.to_string()))
}

/// Dequantizes rows `rows` of tensor `name` (see [`row_slice`]) to `[rows.len(), ne0]` f32.
pub fn dequant_rows(file: &GgufFile, name: &str, rows: std::ops::Range<usize>) -> Result<Array2<f32>> {
    dequant_slice(file, &row_slice(file, name, rows)?)
}

/// The token path's first `hidden_in` [T, H], f64: [`embed_tokens`] times the architecture's
/// embedding scale (`MlaConfig::embedding_scale`, 12 for MiniCPM3), multiplied in f64 as HF's
/// float64 model does.
///
/// Errors: as [`embed_tokens`].
pub fn embed_hidden(file: &GgufFile, cfg: &MlaConfig, tokens: &[u32]) -> Result<Array2<f64>> {
    let s = cfg.embedding_scale;
    Ok(embed_tokens(file, cfg, tokens)?.mapv(|x| f64::from(x) * s))
}

/// Embedding rows for `tokens` from `token_embd.weight` ([vocab, H]), dequantizing only those rows.
///
/// Errors: missing embedding, a token id ≥ vocab (naming the id and position), dequantization.
pub fn embed_tokens(file: &GgufFile, cfg: &MlaConfig, tokens: &[u32]) -> Result<Array2<f32>> {
    let name = &T::TokenEmbd.name(0);
    let t = checked(file, name, &[cfg.vocab, cfg.hidden], "vocab × H")?;
    let mut out = Array2::zeros((tokens.len(), cfg.hidden));
    for (i, &tok) in tokens.iter().enumerate() {
        if tok as usize >= cfg.vocab {
            return Err(Error::input(
                file.path(),
                "tokens",
                format!(
                    "token id {tok} at position {i} is outside the vocabulary of {} tokens",
                    cfg.vocab
                ),
            ));
        }
        let row = dequant_rows(file, name, tok as usize..tok as usize + 1)?;
        out.row_mut(i).assign(&row.row(0));
    }
    let _ = t;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonfinite_scan_counts_across_chunks_and_reports_the_first_in_logical_order() {
        let mut a = ndarray::Array2::<f32>::from_shape_fn((3, 70_000), |(i, j)| (i * 7 + j) as f32 * 1e-3);
        a[[2, 5]] = f32::NAN;
        a[[0, 69_999]] = f32::INFINITY;
        a[[1, 3]] = f32::NEG_INFINITY;
        let mut out = Vec::new();
        scan_nonfinite("w".into(), &a, &mut out);
        assert_eq!(
            out,
            vec![NonFiniteTensor {
                name: "w".to_string(),
                count: 3,
                first_index: 69_999
            }]
        );
        // A transposed view is not contiguous: scanned in its own (logical) order.
        let mut out = Vec::new();
        scan_nonfinite("t".into(), &a.t(), &mut out);
        assert_eq!(
            out,
            vec![NonFiniteTensor {
                name: "t".to_string(),
                count: 3,
                first_index: 3 * 3 + 1
            }]
        );
        let mut out = Vec::new();
        scan_nonfinite("ok".into(), &ndarray::Array1::<f32>::ones(10), &mut out);
        assert!(out.is_empty());
    }
}
