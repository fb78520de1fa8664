//! `quant-scale-layout` at a GEMM's output: a block-scaled weight multiplied with other block
//! scales than its checkpoint's, seen from the activations alone.
//!
//! `weights --check` names a scale grid read in another layout when it holds the engine's loaded
//! weight. A dump often holds only activations, and mla-diff's own paths record no `o_proj`
//! weight site: there the GEMM's output is what the expected weight gives with each 128 × 128
//! block times an unknown factor. Within one row block of the weight the output is linear in
//! the factors of its column blocks, so a least-squares fit over sampled tokens and rows
//! recovers one factor per block from the recorded input. When those factors reproduce the
//! candidate and differ between blocks, the scales applied are each factor times the stored
//! scale, and the layout test `weights --check` uses names them (the grid transposed, transposed
//! and reshaped to its own shape, rounded to powers of two, other blocks' scales). Needs the
//! model's stored scale grid (an fp8 checkpoint as the model); tried at `o_proj`, whose input
//! `attn_out` every path and the engine hooks record whole.

use super::blocks::rel_l2;
use super::loaded::{BlockFactor, applied_layout};
use super::precision::recorded;
use super::{Detection, SiteCtx};
use crate::core::fp8::{ActQuant, InputDtype};
use crate::core::sci::sci;
use crate::core::trace::Stage;
use crate::judge::tolerance::Precision;
use crate::model::gguf::BlockScales;
use crate::model::tensors::ModelTensor;

/// Tokens and rows per row block the fit samples at most (their product per row block is the
/// number of equations for that block's column factors).
const SAMPLE_TOKENS: usize = 32;
const SAMPLE_ROWS: usize = 32;

/// The fitted replay must sit at most this fraction of the error as is.
const FAR_NEARER: f64 = 0.25;

/// Fitted factors within this relative distance count as equal, and applied scales as matching a
/// layout's (a fit over fp8-rounded activations recovers each factor to about 1e-3).
const FACTOR_TOL: f64 = 0.02;

/// `quant-scale-layout` at `o_proj`: one factor per block of the stored scale grid fitted from
/// `attn_out` as recorded (see the module doc).
pub(super) fn gemm_scale_layout(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage != Stage::OProj {
        return None;
    }
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 || m.nonfinite_cand > 0 {
        return None;
    }
    let file = x.input.model?;
    let t = file.tensor(&ModelTensor::AttnOutput.name(x.site.layer))?;
    let g = file.block_scales(t)?;
    let [o, k] = g.shape;
    let input = recorded(x, Stage::AttnOut)?;
    if k == 0 || o == 0 || g.scale.len() != g.grid[0] * g.grid[1] || !input.len().is_multiple_of(k) {
        return None;
    }
    let tokens = input.len() / k;
    if tokens == 0 || x.cand.len() != tokens * o || x.refr.len() != tokens * o {
        return None;
    }
    let w = crate::model::weights::dequant_tensor(file, t).ok()?;
    if w.len() != o * k {
        return None;
    }
    let (input, read) = gemm_input(x, input, &w, [o, k], g.block[1]);
    let fit = fit_blocks(&g, &w, &input, tokens, &|i| x.cand.get(i))?;
    let refr: Vec<f64> = fit.elements.iter().map(|&i| x.refr.get(i)).collect();
    let as_is = rel_l2(&fit.cand, &refr);
    // The recorded input through the stored scales must explain most of the gap to the
    // reference (else the error comes with the input, not the weight), and the fitted factors
    // must reproduce the candidate far better than the stored scales on that same input.
    let stored = rel_l2(&fit.cand, &fit.unit);
    if !(as_is.is_finite() && as_is > 0.0) || rel_l2(&refr, &fit.unit) > 0.5 * as_is {
        return None;
    }
    let e = rel_l2(&fit.cand, &fit.fitted);
    if e > x.explain || e > FAR_NEARER * stored.min(as_is) {
        return None;
    }
    let (lo, hi) = fit
        .blocks
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), b| {
            (lo.min(b.factor), hi.max(b.factor))
        });
    // One factor for every block is a scale of the whole product (`scale-only`).
    if hi - lo <= FACTOR_TOL * hi.abs().max(1.0) {
        return None;
    }
    let off = fit
        .blocks
        .iter()
        .filter(|b| (b.factor - 1.0).abs() > FACTOR_TOL)
        .count();
    let layout = applied_layout(&fit.blocks, &[&g], FACTOR_TOL, x.input.tp);
    Some(Detection::new(
        format!(
            "o_proj replayed from attn_out as recorded{read} through {} ({} grid [{}, {}] of {}×{} blocks) with one factor \
             per block fitted by least squares ({} sampled elements): rel_l2 {} vs {} as is; {off} of {} blocks ≠ 1 \
             (×{} to ×{}): the scales applied are {layout}",
            g.name.strip_suffix("_scale_inv").unwrap_or(&t.name),
            g.name,
            g.grid[0],
            g.grid[1],
            g.block[0],
            g.block[1],
            fit.elements.len(),
            sci(e, 2),
            sci(as_is, 2),
            fit.blocks.len(),
            sci(lo, 3),
            sci(hi, 3),
        ),
        format!(
            "dequantize o_proj with {}[r / {}, c / {}] as stored; check where the loader or the GEMM kernel re-lays \
             the scale grid out (`mla-diff weights --check` on the engine's loaded o_proj names the layout from the \
             weight itself)",
            g.name, g.block[0], g.block[1]
        ),
    ))
}

/// The GEMM's input as the engine's GEMM read it: as recorded, or under the fp8 rows quantized
/// to E4M3 per token in groups of `group` columns (vLLM's block-fp8 GEMMs) or with one
/// per-tensor scale, whichever makes the reference's own input through the stored weight `w`
/// `[O, K]` closest to the reference's output on a sample (the reference quantizes as the run
/// declared). Returns the input and how it was read, as evidence words.
fn gemm_input(
    x: &SiteCtx<'_>,
    input: Vec<f64>,
    w: &[f32],
    [o, k]: [usize; 2],
    group: usize,
) -> (Vec<f64>, &'static str) {
    let read = match x.input.precision {
        Precision::Fp8 => Some(InputDtype::F32),
        Precision::Bf16Fp8 => Some(InputDtype::Bf16),
        _ => None,
    };
    let Some(read) = read else {
        return (input, "");
    };
    let Some(ref_in) = x
        .ref_site(Stage::AttnOut)
        .map(|t| t.to_f64())
        .filter(|r| r.len() == input.len())
    else {
        return (input, "");
    };
    let tokens = input.len() / k;
    let sample: Vec<usize> = spread(tokens * o, 256);
    let distance = |xs: &[f64]| {
        let (p, r): (Vec<f64>, Vec<f64>) = sample
            .iter()
            .map(|&i| {
                let (t, row) = (i / o, i % o);
                let p: f64 = (0..k).map(|c| f64::from(w[row * k + c]) * xs[t * k + c]).sum();
                (p, x.refr.get(i))
            })
            .unzip();
        rel_l2(&r, &p)
    };
    let quantized = |q: Option<ActQuant>, v: &[f64]| {
        let mut v = v.to_vec();
        if let Some(q) = q {
            q.quantize(&mut v, k, 1);
        }
        v
    };
    let mut best = (f64::INFINITY, None, "");
    for (q, how) in [
        (None, ""),
        (
            Some(ActQuant::token_group(group, Some(read))),
            " (quantized to fp8 per token in groups of the weight's block columns)",
        ),
        (
            Some(ActQuant::tensor(Some(read))),
            " (quantized to fp8 with one per-tensor scale)",
        ),
    ] {
        let d = distance(&quantized(q, &ref_in));
        if d < best.0 {
            best = (d, q, how);
        }
    }
    (quantized(best.1, &input), best.2)
}

/// `quant-scale-layout` at a TP rank's `o_proj` shard (`w.o_proj.rank<r>`, the rank's heads'
/// input columns): each 128 × 128 block of the shard is the reference's block times one factor
/// (least squares, every block within the explain threshold of its scaled block), the factors
/// not all 1; the scales applied (factor × the stored scale of the block's place in the whole
/// grid) are named as rank 0's columns of the grid (the scale shard cut at offset 0), other
/// blocks' stored scales, or none of those. Needs the model's stored grid and shards that cover
/// whole block columns.
pub(super) fn rank_shard_scale_layout(x: &SiteCtx<'_>) -> Option<Detection> {
    let Stage::WRank(crate::core::trace::RankedWeight::OProj, rank) = x.site.stage else {
        return None;
    };
    let (rank, tp) = (rank as usize, x.input.tp);
    let file = x.input.model?;
    let t = file.tensor(&ModelTensor::AttnOutput.name(x.site.layer))?;
    let g = file.block_scales(t)?;
    let ([o, k], [br, bc], gc) = (g.shape, g.block, g.grid[1]);
    let w = k.checked_div(tp)?;
    if tp < 2 || !k.is_multiple_of(tp) || !w.is_multiple_of(bc) || g.scale.len() != g.grid[0] * gc {
        return None;
    }
    if x.cand.len() != o * w || x.refr.len() != o * w {
        return None;
    }
    let (cand, refr) = (x.cand.to_f64(), x.refr.to_f64());
    let j0 = rank * w / bc;
    let mut blocks = Vec::new();
    for bi in 0..g.grid[0] {
        for bj in 0..w / bc {
            let at =
                || (bi * br..((bi + 1) * br).min(o)).flat_map(|r| (bj * bc..(bj + 1) * bc).map(move |c| r * w + c));
            let (de, ee) = at().fold((0.0, 0.0), |(de, ee), i| {
                (de + cand[i] * refr[i], ee + refr[i] * refr[i])
            });
            if ee == 0.0 {
                continue;
            }
            let a = de / ee;
            let res: f64 = at().map(|i| (cand[i] - a * refr[i]).powi(2)).sum();
            if !a.is_finite() || (res / ee).sqrt() > x.explain {
                return None;
            }
            blocks.push(BlockFactor {
                src: 0,
                at: [bi, j0 + bj],
                factor: a,
                applied: a * f64::from(g.scale[bi * gc + j0 + bj]),
            });
        }
    }
    let off = blocks.iter().filter(|b| (b.factor - 1.0).abs() > FACTOR_TOL).count();
    if off == 0 {
        return None;
    }
    let layout = applied_layout(&blocks, &[&g], FACTOR_TOL, tp);
    let (lo, hi) = blocks.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), b| {
        (lo.min(b.factor), hi.max(b.factor))
    });
    Some(Detection::new(
        format!(
            "each {br}×{bc} block of rank {rank}'s o_proj shard (block columns {j0} to {} of {}) is the reference's block \
             times one factor ({off} of {} blocks ≠ 1, ×{} to ×{}): the scales applied are {layout}",
            j0 + w / bc - 1,
            g.name,
            blocks.len(),
            sci(lo, 3),
            sci(hi, 3),
        ),
        if layout.starts_with("rank 0's scales") {
            format!(
                "cut each rank's shard of {} at the rank's own block columns, as its weight's columns are (rank r: \
                 block columns r·{} onward), and dequantize with {}[r / {br}, c / {bc}] as stored",
                g.name,
                w / bc,
                g.name
            )
        } else {
            format!(
                "dequantize each rank's shard with {}[r / {br}, c / {bc}] of the whole grid as stored; check where the \
                 loader or the GEMM kernel re-lays the scale grid out (`mla-diff weights --check` on the engine's loaded \
                 o_proj names the layout from the weight itself)",
                g.name
            )
        },
    ))
}

/// A per-block factor fit of one GEMM: for each sampled output element (flat index into
/// `[T, O]`), the candidate, the product with the stored scales (`unit`) and with the fitted
/// factors (`fitted`).
struct BlockFit {
    elements: Vec<usize>,
    cand: Vec<f64>,
    unit: Vec<f64>,
    fitted: Vec<f64>,
    /// One per block of the grid whose columns the sampled input reaches.
    blocks: Vec<BlockFactor>,
}

/// `count` indices spread evenly over `0..n` (all of them when `n ≤ count`).
fn spread(n: usize, count: usize) -> Vec<usize> {
    if n <= count {
        return (0..n).collect();
    }
    (0..count).map(|i| i * n / count).collect()
}

/// Fits, per row block of `g`, the factors of its column blocks that make
/// `Σ_bj F[bi, bj]·(W·x)[bj]` closest to the candidate `cand(t·O + r)`; `w` is the expected
/// weight `[O, K]` row-major, `x` the input `[T, K]`. `None` when no block is reached.
fn fit_blocks(g: &BlockScales, w: &[f32], x: &[f64], tokens: usize, cand: &dyn Fn(usize) -> f64) -> Option<BlockFit> {
    let [o, k] = g.shape;
    let ([br, bc], gc) = (g.block, g.grid[1]);
    let ts = spread(tokens, SAMPLE_TOKENS);
    let mut fit = BlockFit {
        elements: Vec::new(),
        cand: Vec::new(),
        unit: Vec::new(),
        fitted: Vec::new(),
        blocks: Vec::new(),
    };
    for bi in 0..g.grid[0] {
        let rows: Vec<usize> = spread(br.min(o - bi * br), SAMPLE_ROWS)
            .into_iter()
            .map(|r| bi * br + r)
            .collect();
        // Per sampled element, its partial product over each column block.
        let mut parts: Vec<(usize, Vec<f64>)> = Vec::with_capacity(ts.len() * rows.len());
        for &t in &ts {
            for &r in &rows {
                let p = (0..gc)
                    .map(|bj| {
                        (bj * bc..((bj + 1) * bc).min(k))
                            .map(|c| f64::from(w[r * k + c]) * x[t * k + c])
                            .sum()
                    })
                    .collect();
                parts.push((t * o + r, p));
            }
        }
        let mut a = vec![vec![0.0; gc]; gc];
        let mut b = vec![0.0; gc];
        for (i, p) in &parts {
            let c = cand(*i);
            for j in 0..gc {
                b[j] += p[j] * c;
                for l in 0..gc {
                    a[j][l] += p[j] * p[l];
                }
            }
        }
        let f = solve(a, b)?;
        for (i, p) in &parts {
            fit.elements.push(*i);
            fit.cand.push(cand(*i));
            fit.unit.push(p.iter().sum());
            fit.fitted
                .push(p.iter().zip(&f).map(|(p, f)| p * f.unwrap_or(1.0)).sum());
        }
        for (bj, f) in f.iter().enumerate() {
            if let Some(f) = *f {
                fit.blocks.push(BlockFactor {
                    src: 0,
                    at: [bi, bj],
                    factor: f,
                    applied: f * f64::from(g.scale[bi * gc + bj]),
                });
            }
        }
    }
    (!fit.blocks.is_empty()).then_some(fit)
}

/// Solves the normal equations `a·f = b` by Gaussian elimination with partial pivoting over the
/// unknowns whose diagonal is not negligible (a column block the sampled input never reaches
/// has no factor: `None`). `None` overall when the system is singular or not finite.
fn solve(a: Vec<Vec<f64>>, b: Vec<f64>) -> Option<Vec<Option<f64>>> {
    let n = b.len();
    let top = (0..n).map(|j| a[j][j]).fold(0f64, f64::max);
    if !(top > 0.0 && top.is_finite()) {
        return None;
    }
    let live: Vec<usize> = (0..n).filter(|&j| a[j][j] > 1e-12 * top).collect();
    let m = live.len();
    let mut s: Vec<Vec<f64>> = live
        .iter()
        .map(|&j| live.iter().map(|&l| a[j][l]).chain([b[j]]).collect())
        .collect();
    for c in 0..m {
        let p = (c..m).max_by(|&i, &j| s[i][c].abs().total_cmp(&s[j][c].abs()))?;
        s.swap(c, p);
        let d = s[c][c];
        if d.abs() <= 1e-14 * top {
            return None;
        }
        for i in 0..m {
            if i != c {
                let q = s[i][c] / d;
                if q != 0.0 {
                    for l in c..=m {
                        s[i][l] -= q * s[c][l];
                    }
                }
            }
        }
    }
    let mut out = vec![None; n];
    for (i, &j) in live.iter().enumerate() {
        let f = s[i][m] / s[i][i];
        if !f.is_finite() {
            return None;
        }
        out[j] = Some(f);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solve_recovers_the_factors_and_leaves_unreached_blocks_out() {
        // a = Pᵀ P for three equations over two live unknowns and one dead one.
        let p = [[1.0, 2.0, 0.0], [3.0, -1.0, 0.0], [0.5, 0.5, 0.0]];
        let f = [2.0, 0.5];
        let mut a = vec![vec![0.0; 3]; 3];
        let mut b = vec![0.0; 3];
        for row in &p {
            let c = row[0] * f[0] + row[1] * f[1];
            for j in 0..3 {
                b[j] += row[j] * c;
                for l in 0..3 {
                    a[j][l] += row[j] * row[l];
                }
            }
        }
        let out = solve(a, b).unwrap();
        assert!((out[0].unwrap() - 2.0).abs() < 1e-12);
        assert!((out[1].unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(out[2], None);
    }

    #[test]
    fn spread_takes_every_index_of_a_short_range_and_an_even_sample_of_a_long_one() {
        assert_eq!(spread(3, 32), vec![0, 1, 2]);
        assert_eq!(spread(8, 4), vec![0, 2, 4, 6]);
    }
}
