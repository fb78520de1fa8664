//! `fp8-act-scale`: an fp8 GEMM whose input was quantized with a per-tensor scale its batch does
//! not give.
//!
//! A per-tensor dynamic scale is `amax/448` over the GEMM's input. When the amax also covers
//! values that are not the batch's (the rows an engine pads a CUDA-graph batch with, which hold
//! whatever memory held: SGLang PR #26133, gibberish only with padded batches), the scale is too
//! large and every value loses precision, most of them sinking into E4M3's subnormals. Every
//! input the candidate recorded is right and the output is wrong by a dense error. The replay
//! recomputes the failing product from its inputs as recorded, quantized under one per-tensor
//! scale `f` times the batch's own for `f` from √2 to 2²⁰ (half-octave steps), and names the
//! class when the best `f` reproduces the candidate far better than the reference does. Only
//! runs judged by the fp8 rows are tested, and only the products [`super::precision`] knows
//! (`q_c`, `kv_a`, `k_nope`, `v`, `ql_nope`, the absorbed `attn_out`).

use rayon::prelude::*;

use super::blocks::rel_l2;
use super::precision::product_of;
use super::{Detection, SiteCtx};
use crate::core::fp8::{ActQuant, InputDtype};
use crate::core::sci::sci;
use crate::judge::tolerance::{Precision, tolerance};

/// Output elements the replay computes at most per hypothesis.
const SAMPLE_ELEMENTS: usize = 2048;

/// The candidate must sit at most this fraction of its error as is from the best replay.
const FAR_NEARER: f64 = 0.25;

/// `fp8-act-scale`: the failing product replayed with its input under each too-large per-tensor
/// scale (see the module doc).
pub(super) fn act_scale(x: &SiteCtx<'_>) -> Option<Detection> {
    let input = match x.input.precision {
        Precision::Fp8 => InputDtype::F32,
        Precision::Bf16Fp8 => InputDtype::Bf16,
        _ => return None,
    };
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 || m.nonfinite_cand > 0 {
        return None;
    }
    let pr = product_of(x)?;
    let (g, o, k) = (pr.groups, pr.o, pr.k);
    let idx = pr.sample(SAMPLE_ELEMENTS);
    let at = |i: usize| (i / (g * o), (i / o) % g, i % o);
    let cand: Vec<f64> = idx.iter().map(|&i| x.cand.get(i)).collect();
    let refr: Vec<f64> = idx.iter().map(|&i| x.refr.get(i)).collect();
    let as_is = rel_l2(&cand, &refr);
    let amax = pr.x.iter().fold(0f64, |a, v| a.max(v.abs()));
    if !(amax > 0.0 && as_is.is_finite()) {
        return None;
    }
    let q = ActQuant::tensor(Some(input));
    // The replay under one per-tensor scale covering `cover` (an amax of at least the batch's).
    let replay = |cover: f64| -> Vec<f64> {
        let mut xq = pr.x.clone();
        q.quantize_columns(&mut xq, k, 0..k, Some(cover));
        idx.par_iter()
            .map(|&i| {
                let (ti, gi, oi) = at(i);
                let xs = if pr.x_shared {
                    &xq[ti * k..(ti + 1) * k]
                } else {
                    &xq[(ti * g + gi) * k..(ti * g + gi + 1) * k]
                };
                let (_, ws) = pr.operands(ti, gi, oi);
                xs.iter().zip(ws).map(|(a, b)| a * b).sum()
            })
            .collect()
    };
    let (f, e) = best_cover(x, &cand, as_is, amax, &replay)?;
    Some(Detection::new(
        format!(
            "{} replayed from {} as recorded, the input quantized to fp8 with one per-tensor scale {}× the batch's own \
             (an amax of {} where the batch's largest |value| is {}): rel_l2 {} vs {} as is ({} sampled elements)",
            x.site.stage.name(),
            pr.from,
            sci(f, 3),
            sci(amax * f, 3),
            sci(amax, 3),
            sci(e, 2),
            sci(as_is, 2),
            idx.len(),
        ),
        "the per-tensor fp8 scale of this GEMM's input covers values the batch does not hold: an amax taken over a \
         padded buffer (a CUDA-graph batch's rows past the last token, stale memory: SGLang PR #26133) or over another \
         tensor; take the amax over the batch's rows only, or zero the padding before the scale is computed"
            .to_string(),
    ))
}

/// The latent RMSNorm's weight \[L\] read off the reference: `kv_c_normed = kv_c / rms(kv_c) · w`,
/// so each column's `w = kv_c_normed · rms / kv_c` at the token where `|kv_c|` is largest
/// (`kv_a` [T, L+R] and `kv_c_normed` [T, L] the reference's; `eps` the norm's).
fn latent_norm_weight(kv_a: &[f64], kv_c_normed: &[f64], t: usize, l: usize, r: usize, eps: f64) -> Vec<f64> {
    let lat = |ti: usize| &kv_a[ti * (l + r)..ti * (l + r) + l];
    let rms: Vec<f64> = (0..t)
        .map(|ti| (lat(ti).iter().map(|v| v * v).sum::<f64>() / l.max(1) as f64 + eps).sqrt())
        .collect();
    (0..l)
        .map(|j| {
            let ti = (0..t)
                .max_by(|&a, &b| lat(a)[j].abs().total_cmp(&lat(b)[j].abs()))
                .unwrap_or(0);
            let k = lat(ti)[j];
            if k == 0.0 {
                0.0
            } else {
                kv_c_normed[ti * l + j] * rms[ti] / k
            }
        })
        .collect()
}

/// The per-tensor scale factor f (√2 … 2²⁰ in half octaves) whose `replay(amax·f)` is nearest
/// the sampled candidate values `cand`, and its rel_l2: named only when it leaves at most
/// [`FAR_NEARER`] of the error as is (`as_is`) and is within the site's row, while the batch's
/// own scale (`replay(amax)`: a token-group run's rounding, or no fp8 bug at all) does not.
fn best_cover(
    x: &SiteCtx<'_>,
    cand: &[f64],
    as_is: f64,
    amax: f64,
    replay: &dyn Fn(f64) -> Vec<f64>,
) -> Option<(f64, f64)> {
    if rel_l2(cand, &replay(amax)) <= FAR_NEARER * as_is {
        return None;
    }
    let (f, e) = (1..=40)
        .map(|j| {
            let f = 2f64.powf(f64::from(j) / 2.0);
            (f, rel_l2(cand, &replay(amax * f)))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))?;
    let row = tolerance(x.site.stage, x.input.precision).0.rel_l2;
    (e <= FAR_NEARER * as_is && e <= row).then_some((f, e))
}

/// Token rows [`act_scale_normed`] replays at most (spread over the batch): every hypothesis
/// moves every row alike, and a row needs the whole GEMM row for its RMS.
const NORMED_ROWS: usize = 32;

/// `fp8-act-scale` at `kv_c_normed`, for a recording that holds neither the fused q_a/kv_a
/// projection's input nor its output (vLLM's hooks on `fused_qkv_a_proj` not asked for): the
/// latent columns of `attn_in · w.fused_qkv_a` replayed with the input under one per-tensor
/// scale f× the batch's own (as [`act_scale`]), then the latent RMSNorm, whose weight is read
/// off the reference (each column's from the token where the reference's `kv_a` is largest:
/// `kv_c_normed · rms(kv_c) / kv_c`). `attn_in` is the path's where recorded, else the
/// reference's (the layer input passed). Named on the same terms as [`act_scale`], on up to
/// [`NORMED_ROWS`] whole rows.
pub(super) fn act_scale_normed(x: &SiteCtx<'_>) -> Option<Detection> {
    use super::precision::recorded;
    use crate::core::trace::Stage;
    if x.site.stage != Stage::KvCNormed {
        return None;
    }
    let input = match x.input.precision {
        Precision::Fp8 => InputDtype::F32,
        Precision::Bf16Fp8 => InputDtype::Bf16,
        _ => return None,
    };
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_mismatch > 0 || m.nonfinite_cand > 0 {
        return None;
    }
    let cfg = x.input.cfg;
    let (hd, l, r, lq) = (
        cfg.hidden,
        cfg.kv_lora_rank,
        cfg.qk_rope_head_dim,
        cfg.q_lora_rank.unwrap_or(0),
    );
    let w = recorded(x, crate::core::trace::Stage::WFusedQkvA).filter(|w| w.len() == (lq + l + r) * hd)?;
    let xin = recorded(x, Stage::AttnIn)?;
    let attn_in_from = if x
        .path
        .trace
        .get(&crate::core::trace::Site::new(x.site.layer, Stage::AttnIn))
        .is_some()
    {
        "as recorded"
    } else {
        "the reference's: the recording lacks it, and the layer's input passed"
    };
    let t = xin.len() / hd.max(1);
    let ref_kva = x
        .input
        .reference
        .get(&crate::core::trace::Site::new(x.site.layer, Stage::KvA))?
        .to_f64();
    if t == 0 || xin.len() != t * hd || ref_kva.len() != t * (l + r) || x.refr.len() != t * l || x.cand.len() != t * l {
        return None;
    }
    let eps = cfg.rms_eps;
    let rms = |row: &[f64]| (row.iter().map(|v| v * v).sum::<f64>() / row.len().max(1) as f64 + eps).sqrt();
    let norm_w = latent_norm_weight(&ref_kva, &x.refr.to_f64(), t, l, r, eps);
    let rows: Vec<usize> = if t <= NORMED_ROWS {
        (0..t).collect()
    } else {
        (0..NORMED_ROWS).map(|i| i * t / NORMED_ROWS).collect()
    };
    let pick = |v: &dyn Fn(usize) -> f64| -> Vec<f64> {
        rows.iter()
            .flat_map(|&ti| (0..l).map(move |j| ti * l + j))
            .map(v)
            .collect()
    };
    let cand = pick(&|i| x.cand.get(i));
    let refr = pick(&|i| x.refr.get(i));
    let as_is = rel_l2(&cand, &refr);
    let amax = xin.iter().fold(0f64, |a, v| a.max(v.abs()));
    if !(amax > 0.0 && as_is.is_finite()) {
        return None;
    }
    let q = ActQuant::tensor(Some(input));
    let replay = |cover: f64| -> Vec<f64> {
        let mut xq = xin.clone();
        q.quantize_columns(&mut xq, hd, 0..hd, Some(cover));
        rows.par_iter()
            .flat_map_iter(|&ti| {
                let xs = &xq[ti * hd..(ti + 1) * hd];
                let y: Vec<f64> = (0..l)
                    .map(|j| {
                        xs.iter()
                            .zip(&w[(lq + j) * hd..(lq + j + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum()
                    })
                    .collect();
                let s = rms(&y);
                y.into_iter()
                    .zip(&norm_w)
                    .map(move |(v, nw)| v / s * nw)
                    .collect::<Vec<f64>>()
            })
            .collect()
    };
    let (f, e) = best_cover(x, &cand, as_is, amax, &replay)?;
    Some(Detection::new(
        format!(
            "kv_c_normed replayed from attn_in ({}) through w.fused_qkv_a's kv_c rows and the latent RMSNorm (its \
             weight read off the reference), the input quantized to fp8 with one per-tensor scale {}× the batch's own (an amax of {} \
             where the batch's largest |value| is {}): rel_l2 {} vs {} as is ({} rows)",
            attn_in_from,
            sci(f, 3),
            sci(amax * f, 3),
            sci(amax, 3),
            sci(e, 2),
            sci(as_is, 2),
            rows.len(),
        ),
        "the per-tensor fp8 scale of the fused q_a/kv_a projection's input covers values the batch does not hold: an \
         amax taken over a padded buffer (a CUDA-graph batch's rows past the last token, stale memory: SGLang PR \
         #26133) or over another tensor; take the amax over the batch's rows only, or zero the padding first"
            .to_string(),
    ))
}
