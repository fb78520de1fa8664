//! Shapes and element orders: each site's expected shape, and the conversions that bring a
//! dumped tensor to it.
//!
//! The comparison needs every site in our shape and order (docs/design.md, "Sites"). Engines
//! store the same values differently: flattened `[T, N·X]`, a `[T, 1, X]` singleton, head-major
//! `[N, T, X]` (FlashAttention's and FlashMLA's `[N, T]` LSE too), HF's `[even | odd]` rope
//! halves, `[rope | latent]` kv_a rows. Each conversion here is exact (a reshape, a transpose
//! or a permutation, never arithmetic), is taken only when the declared convention or the shape
//! leaves one reading, and comes back as a note the report lists, so an undone layout is visible
//! and a layout that fits no reading is an error naming the accepted shapes.

use super::conventions::Layout;
use crate::core::trace::Stage;
use crate::model::config::MlaConfig;

/// The expected shape of `stage` for `t` tokens of one sequence from position 0 (the DSA sites'
/// key axis S = T): [`expected_shape_keys`] with `s = t`.
pub fn expected_shape(stage: Stage, cfg: &MlaConfig, t: usize) -> Option<Vec<usize>> {
    expected_shape_keys(stage, cfg, t, t)
}

/// The expected shape of `stage` for `t` tokens whose longest sequence holds `s` positions (its
/// cached context included: a decode step's one row of a 300-token sequence has `s` = 300),
/// `None` for stages without a fixed expectation: the per-rank sites, and
/// `ffn_gate`/`ffn_up`/`ffn_act` [T, I], whose width I is the dense FFN's in a dense layer and
/// the shared experts' in an MoE layer (the comparison still checks them against the
/// reference's shape). Only the DSA sites read `s`: `idx_scores` [T, S] and `idx_topk`
/// [T, min(top_k, S)], as wide as the reference's over the same sequences.
pub fn expected_shape_keys(stage: Stage, cfg: &MlaConfig, t: usize, s: usize) -> Option<Vec<usize>> {
    let [n, l, p, r, v] = cfg.dims().nlprv();
    let h = cfg.dims().hidden;
    let lq = cfg.q_lora_rank.unwrap_or(0);
    Some(match stage {
        Stage::HiddenIn | Stage::AttnIn | Stage::OProj | Stage::HiddenOut => vec![t, h],
        Stage::FfnIn | Stage::FfnOut => vec![t, h],
        Stage::QC | Stage::QCNormed => vec![t, lq],
        Stage::Q => vec![t, n, p + r],
        Stage::KvA => vec![t, l + r],
        Stage::KvCNormed => vec![t, l],
        Stage::KPe | Stage::KPeRoped => vec![t, r],
        Stage::QPeRoped => vec![t, n, r],
        Stage::KNope => vec![t, n, p],
        Stage::V | Stage::AttnOut => vec![t, n, v],
        Stage::CtxOutChunk(_) | Stage::CtxOut | Stage::SuffixOut => vec![t, n, v],
        Stage::CtxLseChunk(_) | Stage::CtxLse | Stage::SuffixLse => vec![t, n],
        Stage::QlNope | Stage::AttnLatent => vec![t, n, l],
        Stage::Lse => vec![t, n],
        Stage::WFusedQkvA => vec![lq + l + r, h],
        Stage::WKvB => vec![n * (p + v), l],
        Stage::WUkT => vec![n, p, l],
        Stage::WUv => vec![n, l, v],
        Stage::MoeRouterLogits => vec![t, cfg.moe.as_ref()?.n_expert],
        Stage::MoeTopk => vec![t, cfg.moe.as_ref()?.n_expert_used],
        Stage::MoeOut | Stage::SharedOut => vec![t, h],
        Stage::IdxQ => {
            let ix = cfg.indexer.as_ref()?;
            vec![t, ix.n_head, ix.head_dim]
        }
        Stage::IdxK => vec![t, cfg.indexer.as_ref()?.head_dim],
        Stage::IdxWeights => vec![t, cfg.indexer.as_ref()?.n_head],
        Stage::IdxScores => vec![t, s],
        Stage::IdxTopk => vec![t, cfg.indexer.as_ref()?.top_k.min(s)],
        Stage::FfnGate | Stage::FfnUp | Stage::FfnAct => return None,
        Stage::WRank(..) | Stage::OProjRank(..) | Stage::FfnGateUpRank(..) | Stage::FfnDownRank(..) => return None,
    })
}

/// Brings a dumped tensor to the site's shape: equal, flattened trailing dims, `[T, 1, X]` for
/// `[T, X]`, or head-major (transposed): `[N, T, X]` for a `[T, N, X]` site and, when `per_head`
/// (the `[T, N]` lse), `[N, T]` for `[T, N]`. Under `layout = head-major` the head-major form is
/// expected; otherwise it is taken only when `N ≠ T` and it is the only reading that fits.
/// Returns the data in our order and a note when something was converted.
pub(super) fn normalize_shape(
    data: Vec<f64>,
    shape: &[usize],
    want: &[usize],
    layout: Layout,
    per_head: bool,
) -> std::result::Result<(Vec<f64>, Option<String>), String> {
    let numel: usize = want.iter().product();
    let head_major = |data: &[f64], nn: usize, tt: usize, x: usize| {
        let mut out = vec![0.0; data.len()];
        for h in 0..nn {
            for ti in 0..tt {
                for k in 0..x {
                    out[(ti * nn + h) * x + k] = data[(h * tt + ti) * x + k];
                }
            }
        }
        out
    };
    // (T, N, X) of a site with a head axis: [T, N, X], or the [T, N] lse with X = 1.
    let dims = match want {
        [t, n, x] => Some((*t, *n, *x)),
        [t, n] if per_head => Some((*t, *n, 1)),
        _ => None,
    };
    let (hm_shape, hm_text, tm_text) = match want {
        [t, n, x] => (vec![*n, *t, *x], "[N, T, X]", "[T, N, X]"),
        [t, n] => (vec![*n, *t], "[N, T]", "[T, N]"),
        _ => (Vec::new(), "", ""),
    };
    let hm_shape_ok = dims.is_some() && shape == hm_shape.as_slice();
    if layout == Layout::HeadMajor
        && let Some((tt, nn, x)) = dims
    {
        if hm_shape_ok {
            let out = head_major(&data, nn, tt, x);
            return Ok((out, Some(format!("head-major {hm_text} transposed to {tm_text}"))));
        }
        if !(want.len() == 2 && shape == want && tt != nn) {
            return Err(format!("layout=head-major expects {hm_text} = {hm_shape:?}"));
        }
    }
    if shape == want {
        return Ok((data, None));
    }
    let n: usize = shape.iter().product();
    if n == numel && !shape.is_empty() && shape[0] == want[0] {
        // [T, N·X] for [T, N, X], [T, 1, X] for [T, X], or any other split of the trailing dims.
        if crate::core::trace::shapes_compatible(want, shape)
            || shape.iter().skip(1).product::<usize>() == numel / want[0]
        {
            return Ok((data, Some(format!("shape {shape:?} read as {want:?}"))));
        }
    }
    if hm_shape_ok
        && let Some((tt, nn, x)) = dims
        && tt != nn
    {
        let out = head_major(&data, nn, tt, x);
        return Ok((
            out,
            Some(format!(
                "head-major {hm_text} transposed to {tm_text} (the only reading that fits)"
            )),
        ));
    }
    Err(format!(
        "expected {want:?} (or a flattened [T, …] form{})",
        if dims.is_some() {
            format!(", or head-major {hm_text} = {hm_shape:?}")
        } else {
            String::new()
        }
    ))
}

/// `[even | odd]` halves of every `r`-wide vector back to interleaved pairs.
pub(super) fn hf_rope_to_interleaved(data: &[f64], r: usize) -> Vec<f64> {
    let half = r / 2;
    let mut out = data.to_vec();
    for (o, i) in out.chunks_mut(r).zip(data.chunks(r)) {
        for k in 0..half {
            o[2 * k] = i[k];
            o[2 * k + 1] = i[half + k];
        }
    }
    out
}

/// `[R | L]` rows to `[L | R]`.
pub(super) fn kv_a_to_latent_rope(data: &[f64], l: usize, r: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(data.len());
    for row in data.chunks(l + r) {
        out.extend_from_slice(&row[r..]);
        out.extend_from_slice(&row[..r]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_and_kv_a_reorders_invert_the_engine_layouts() {
        // interleaved x → hf halves → back.
        let x: Vec<f64> = (0..8).map(f64::from).collect();
        let halves = vec![0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0];
        assert_eq!(hf_rope_to_interleaved(&halves, 8), x);
        let row = vec![10.0, 11.0, 1.0, 2.0, 3.0]; // [rope R=2 | latent L=3]
        assert_eq!(kv_a_to_latent_rope(&row, 3, 2), vec![1.0, 2.0, 3.0, 10.0, 11.0]);
    }

    #[test]
    fn shapes_accepted_and_rejected() {
        let d: Vec<f64> = (0..24).map(f64::from).collect();
        // [T=2, N=3, X=4]: flattened ok, head-major transposed, wrong rejected.
        let (o, note) = normalize_shape(d.clone(), &[2, 12], &[2, 3, 4], Layout::TokenMajor, false).unwrap();
        assert_eq!(o, d);
        assert!(note.unwrap().contains("read as"));
        let (o, note) = normalize_shape(d.clone(), &[3, 2, 4], &[2, 3, 4], Layout::TokenMajor, false).unwrap();
        assert!(note.unwrap().contains("head-major"));
        assert_eq!(&o[4..8], &d[8..12]); // [t=0, h=1] came from [h=1, t=0]
        assert!(normalize_shape(d.clone(), &[4, 6], &[2, 3, 4], Layout::TokenMajor, false).is_err());
        assert!(normalize_shape(d, &[2, 3, 4], &[2, 3, 4], Layout::HeadMajor, false).is_err());
    }

    #[test]
    fn lse_is_accepted_head_major() {
        // lse [T=2, N=3] given as [N, T]: transposed, noted.
        let hm: Vec<f64> = vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]; // [h][t] = 10h + t
        let (o, note) = normalize_shape(hm.clone(), &[3, 2], &[2, 3], Layout::TokenMajor, true).unwrap();
        assert_eq!(o, vec![0.0, 10.0, 20.0, 1.0, 11.0, 21.0]);
        assert_eq!(
            note.unwrap(),
            "head-major [N, T] transposed to [T, N] (the only reading that fits)"
        );
        // A [T, H] site is never transposed.
        assert!(normalize_shape(hm.clone(), &[3, 2], &[2, 3], Layout::TokenMajor, false).is_err());
        // N = T: token-major unless the metadata says head-major.
        let sq: Vec<f64> = vec![0.0, 1.0, 10.0, 11.0]; // [h][t]
        let (o, note) = normalize_shape(sq.clone(), &[2, 2], &[2, 2], Layout::TokenMajor, true).unwrap();
        assert_eq!((o, note), (sq.clone(), None));
        let (o, note) = normalize_shape(sq, &[2, 2], &[2, 2], Layout::HeadMajor, true).unwrap();
        assert_eq!(o, vec![0.0, 10.0, 1.0, 11.0]);
        assert_eq!(note.unwrap(), "head-major [N, T] transposed to [T, N]");
        // Under layout=head-major a token-major lse is still read when only that fits (N ≠ T).
        let (o, note) = normalize_shape(hm.clone(), &[2, 3], &[2, 3], Layout::HeadMajor, true).unwrap();
        assert_eq!((o, note), (hm, None));
    }
}
