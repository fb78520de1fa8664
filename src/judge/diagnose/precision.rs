//! `precision`: a matrix product computed at lower precision than the run declares.
//!
//! A product run with fp16 inputs or an fp16 accumulator where the run declares f32 (llama.cpp
//! PR #13137: `q_nope·W_UK` through a half-precision GEMM under an f32 flag) leaves every input
//! right and the output wrong by a small, dense error: about the rounding of the narrow format,
//! on every element. The replay recomputes the failing product from its inputs as the candidate
//! recorded them (which passed) and its weight as a weight site holds it, under each
//! narrow-precision hypothesis: the inputs rounded to f16 or bf16 (accumulation exact), the
//! output rounded too, the running sum rounded after every term (fused multiply-adds), or each
//! product rounded as well. A hypothesis names the class
//! when its replay reproduces the candidate's error in size and in pattern: the candidate is
//! much nearer the replay than the reference, and the replay is as far from the reference as
//! the candidate. A hypothesis the run's declared dtype already covers (its own rounding) is
//! never one, and neither is any when the declared dtype's own replay explains the candidate.
//!
//! The products the replay knows are those whose weight a site holds: `ql_nope` (`q`'s nope
//! part through `w.W_UK_T`), `q_c` and `kv_a` (`attn_in` through `w.fused_qkv_a`), `k_nope` and
//! `v` (`kv_c_normed` through `w.kv_b`), and the absorbed `attn_out` (`attn_latent` through
//! `w.W_UV`). The sample is a spread of output elements, each a full dot product, bounded so
//! that a DeepSeek-V3-size site costs a fraction of a second.

use rayon::prelude::*;

use super::blocks::rel_l2;
use super::{Detection, SiteCtx};
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};
use crate::judge::tolerance::{PRECISION_FAR_BELOW, PRECISION_SIZE_BAND, Precision};

/// Output elements the replay computes at most (each a dot product of the contraction length).
const SAMPLE_ELEMENTS: usize = 4096;

/// A narrow float format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Narrow {
    F16,
    Bf16,
}

impl Narrow {
    fn round(self, v: f64) -> f64 {
        match self {
            Narrow::F16 => half::f16::from_f64(v).to_f64(),
            Narrow::Bf16 => half::bf16::from_f64(v).to_f64(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Narrow::F16 => "f16",
            Narrow::Bf16 => "bf16",
        }
    }
}

/// Where the narrow format enters the product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Where {
    /// Both operands rounded; the sum exact.
    Inputs,
    /// Both operands and the result rounded.
    InputsOutput,
    /// Both operands rounded and the running sum rounded after every term, in the contraction
    /// order (a half-precision accumulator with fused multiply-adds).
    Accumulator,
    /// As [`Where::Accumulator`] with each product rounded too before it is added (narrow
    /// arithmetic without fused multiply-adds).
    Arithmetic,
}

impl Where {
    fn describe(self, f: Narrow) -> String {
        let n = f.name();
        match self {
            Where::Inputs => format!("inputs rounded to {n}, the sum exact"),
            Where::InputsOutput => format!("inputs and output rounded to {n}"),
            Where::Accumulator => format!("inputs rounded to {n} and the running sum rounded to {n} after every term"),
            Where::Arithmetic => format!("inputs, every product and the running sum after every term rounded to {n}"),
        }
    }
}

/// The rounding the declared dtype itself applies to a product, as a hypothesis (`None`: f32,
/// none worth replaying).
fn declared(p: Precision) -> Option<(Narrow, Where)> {
    match p {
        Precision::F32 => None,
        Precision::Bf16 => Some((Narrow::Bf16, Where::Inputs)),
        Precision::EngineBf16 => Some((Narrow::Bf16, Where::InputsOutput)),
        Precision::EngineF16 => Some((Narrow::F16, Where::InputsOutput)),
        // fp8 GEMM inputs are coarser than any narrow rounding replayed here.
        Precision::Fp8 | Precision::Bf16Fp8 => None,
    }
}

/// The hypotheses worth testing under the declared dtype `p`: every narrow rounding that is
/// coarser than what `p` declares (an f32 run: all; a bf16 run: the narrow accumulators and a
/// bf16 output; an engine's bf16: the narrow accumulators; an engine's f16: a bf16 product and
/// the f16 accumulators).
fn hypotheses(p: Precision) -> Vec<(Narrow, Where)> {
    use Narrow::*;
    use Where::*;
    match p {
        Precision::F32 => vec![
            (F16, Inputs),
            (F16, InputsOutput),
            (F16, Accumulator),
            (F16, Arithmetic),
            (Bf16, Inputs),
            (Bf16, InputsOutput),
            (Bf16, Accumulator),
            (Bf16, Arithmetic),
        ],
        Precision::Bf16 => vec![
            (Bf16, InputsOutput),
            (F16, Accumulator),
            (F16, Arithmetic),
            (Bf16, Accumulator),
            (Bf16, Arithmetic),
        ],
        Precision::EngineBf16 => vec![
            (F16, Accumulator),
            (F16, Arithmetic),
            (Bf16, Accumulator),
            (Bf16, Arithmetic),
        ],
        Precision::EngineF16 => vec![
            (F16, Accumulator),
            (F16, Arithmetic),
            (Bf16, Inputs),
            (Bf16, InputsOutput),
            (Bf16, Accumulator),
            (Bf16, Arithmetic),
        ],
        // An f16 or bf16 rounding is within fp8's own: nothing to tell apart.
        Precision::Fp8 | Precision::Bf16Fp8 => Vec::new(),
    }
}

/// A product site: `out[t, g, o] = Σ_k x[t, g, k] · w[g, o, k]` over `groups` groups (heads, or
/// 1), the inputs as recorded, the weight as a weight site holds it.
pub(super) struct Product {
    /// `x` [T, G, K], or [T, 1, K] shared by every group.
    pub(super) x: Vec<f64>,
    pub(super) x_shared: bool,
    /// `w` [G, O, K].
    pub(super) w: Vec<f64>,
    pub(super) groups: usize,
    pub(super) k: usize,
    pub(super) o: usize,
    /// What the inputs are, for evidence.
    pub(super) from: String,
}

impl Product {
    /// Flat indices of at most `n` output elements (`(t·G + g)·O + o`): all of them when there
    /// are no more, else a spread over the rows, stepping the output column by a stride coprime
    /// with most widths.
    pub(super) fn sample(&self, n: usize) -> Vec<usize> {
        let (rows, o) = (self.tokens() * self.groups, self.o);
        if rows * o <= n {
            return (0..rows * o).collect();
        }
        (0..n)
            .map(|i| (i * rows + rows / 2) / n * o + (i * 97 + 13) % o)
            .collect()
    }

    pub(super) fn tokens(&self) -> usize {
        let per = if self.x_shared { self.k } else { self.groups * self.k };
        self.x.len() / per.max(1)
    }

    /// The operands of output element `(t, g, o)`.
    pub(super) fn operands(&self, t: usize, g: usize, o: usize) -> (&[f64], &[f64]) {
        let xs = if self.x_shared {
            &self.x[t * self.k..(t + 1) * self.k]
        } else {
            &self.x[(t * self.groups + g) * self.k..(t * self.groups + g + 1) * self.k]
        };
        (xs, &self.w[(g * self.o + o) * self.k..(g * self.o + o + 1) * self.k])
    }

    /// Element `(t, g, o)` under the hypothesis (`None`: exact).
    fn element(&self, (t, g, o): (usize, usize, usize), h: Option<(Narrow, Where)>) -> f64 {
        let (xs, ws) = self.operands(t, g, o);
        let Some((f, at)) = h else {
            return xs.iter().zip(ws).map(|(a, b)| a * b).sum();
        };
        match at {
            Where::Inputs => xs.iter().zip(ws).map(|(a, b)| f.round(*a) * f.round(*b)).sum(),
            Where::InputsOutput => f.round(xs.iter().zip(ws).map(|(a, b)| f.round(*a) * f.round(*b)).sum()),
            Where::Accumulator => xs
                .iter()
                .zip(ws)
                .fold(0.0, |acc, (a, b)| f.round(acc + f.round(*a) * f.round(*b))),
            Where::Arithmetic => xs
                .iter()
                .zip(ws)
                .fold(0.0, |acc, (a, b)| f.round(acc + f.round(f.round(*a) * f.round(*b)))),
        }
    }
}

/// The candidate's tensor at `stage` of the failing layer where it holds one, else the
/// reference's, as f64.
pub(super) fn recorded(x: &SiteCtx<'_>, stage: Stage) -> Option<Vec<f64>> {
    let site = Site::new(x.site.layer, stage);
    x.path
        .trace
        .get(&site)
        .or_else(|| x.input.reference.get(&site))
        .map(TraceTensor::to_f64)
}

/// The product behind the failing site, when the replay knows it and the trace holds its
/// operands.
pub(super) fn product_of(x: &SiteCtx<'_>) -> Option<Product> {
    let cfg = x.input.cfg;
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let hd = cfg.hidden;
    let lq = cfg.q_lora_rank.unwrap_or(0);
    // [G, K, O] per group, transposed to [G, O, K].
    let transpose = |w: Vec<f64>, g: usize, k: usize, o: usize| -> Vec<f64> {
        let mut t = vec![0.0; g * o * k];
        for gi in 0..g {
            for ki in 0..k {
                for oi in 0..o {
                    t[(gi * o + oi) * k + ki] = w[(gi * k + ki) * o + oi];
                }
            }
        }
        t
    };
    let pr = match x.site.stage {
        Stage::QlNope => {
            let q = recorded(x, Stage::Q)?;
            let nope: Vec<f64> = q.chunks(p + r).flat_map(|h| h[..p].to_vec()).collect();
            let w = recorded(x, Stage::WUkT)?;
            (w.len() == n * p * l).then(|| Product {
                x: nope,
                x_shared: false,
                w: transpose(w, n, p, l),
                groups: n,
                k: p,
                o: l,
                from: "q's nope part through w.W_UK_T".into(),
            })?
        }
        Stage::QC | Stage::KvA => {
            if x.site.stage == Stage::QC && lq == 0 {
                return None;
            }
            let w = recorded(x, Stage::WFusedQkvA)?;
            let rows = if x.site.stage == Stage::QC {
                0..lq
            } else {
                lq..lq + l + r
            };
            (w.len() == (lq + l + r) * hd).then(|| Product {
                x: recorded(x, Stage::AttnIn).unwrap_or_default(),
                x_shared: true,
                w: w[rows.start * hd..rows.end * hd].to_vec(),
                groups: 1,
                k: hd,
                o: rows.len(),
                from: "attn_in through w.fused_qkv_a".into(),
            })?
        }
        Stage::KNope | Stage::V => {
            let w = recorded(x, Stage::WKvB)?;
            if w.len() != n * (p + v) * l {
                return None;
            }
            let (off, o) = if x.site.stage == Stage::KNope { (0, p) } else { (p, v) };
            let w: Vec<f64> = (0..n)
                .flat_map(|h| w[(h * (p + v) + off) * l..(h * (p + v) + off + o) * l].to_vec())
                .collect();
            Product {
                x: recorded(x, Stage::KvCNormed)?,
                x_shared: true,
                w,
                groups: n,
                k: l,
                o,
                from: "kv_c_normed through w.kv_b".into(),
            }
        }
        Stage::AttnOut => {
            // The absorbed path's output projection: only where the candidate holds its latent.
            let lat = x.path.trace.get(&Site::new(x.site.layer, Stage::AttnLatent))?.to_f64();
            let w = recorded(x, Stage::WUv)?;
            (w.len() == n * l * v).then(|| Product {
                x: lat,
                x_shared: false,
                w: transpose(w, n, l, v),
                groups: n,
                k: l,
                o: v,
                from: "attn_latent through w.W_UV".into(),
            })?
        }
        _ => return None,
    };
    let t = pr.tokens();
    (t > 0 && t * pr.groups * pr.o == x.refr.len() && x.cand.len() == x.refr.len() && !pr.x.is_empty()).then_some(pr)
}

/// `precision`: the failing product replayed under each narrow-precision hypothesis (see the
/// module doc); the best that reproduces the candidate's error names the class.
pub(super) fn precision(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 || m.nonfinite_cand > 0 {
        return None;
    }
    let pr = product_of(x)?;
    let (g, o) = (pr.groups, pr.o);
    let idx = pr.sample(SAMPLE_ELEMENTS);
    let at = |i: usize| (i / (g * o), (i / o) % g, i % o);
    let cand: Vec<f64> = idx.iter().map(|&i| x.cand.get(i)).collect();
    let refr: Vec<f64> = idx.iter().map(|&i| x.refr.get(i)).collect();
    let replay = |h: Option<(Narrow, Where)>| -> Vec<f64> { idx.par_iter().map(|&i| pr.element(at(i), h)).collect() };
    // The exact product of the recorded operands must be the reference (else the operands or
    // the layout are not what this site multiplies).
    let exact = replay(None);
    let as_is = rel_l2(&cand, &refr);
    if rel_l2(&refr, &exact) > 0.1 * as_is.max(1e-12) {
        return None;
    }
    let precision = x.input.precision;
    // The declared dtype's own rounding must not explain it.
    if let Some(d) = declared(precision)
        && rel_l2(&cand, &replay(Some(d))) <= x.explain
    {
        return None;
    }
    let (h, e, size) = hypotheses(precision)
        .into_iter()
        .map(|h| {
            let rep = replay(Some(h));
            (h, rel_l2(&cand, &rep), rel_l2(&rep, &refr))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))?;
    // Far nearer the replay than the reference, and the replay's own error the candidate's size.
    let pattern = e <= x.explain || e <= PRECISION_FAR_BELOW.0 * as_is;
    let band = PRECISION_SIZE_BAND.0;
    let sized = size >= as_is / band && size <= band * as_is;
    if !(pattern && sized && e < as_is) {
        return None;
    }
    let (f, place) = h;
    Some(Detection::new(
        format!(
            "{} replayed from {} as recorded, with {}: rel_l2 {} vs {} as is (the replay's own error {}, the \
             candidate's size; {} sampled elements); the run declares {}",
            x.site.stage.name(),
            pr.from,
            place.describe(f),
            sci(e, 2),
            sci(as_is, 2),
            sci(size, 2),
            idx.len(),
            precision.name(),
        ),
        format!(
            "this product ran in {} where the run declares {}: a GEMM with half-precision inputs or compute type \
             (llama.cpp PR #13137: q_nope·W_UK through an fp16 matmul without GGML_PREC_F32); ask the kernel for \
             f32 accumulation (a 32F compute type, the precision flag set) and operands in the declared dtype",
            f.name(),
            precision.name()
        ),
    ))
}
