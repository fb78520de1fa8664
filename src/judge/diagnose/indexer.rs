//! The DSA indexer detectors: the indexer's RoPE pairing (`indexer-rope-style`), a top-k buffer
//! reused across chunks (`indexer-topk-stale`), and any other change of the selected keys
//! (`indexer-selection`).
//!
//! DeepSeek-V3.2 and GLM's sparse attention let a small indexer pick the top-k keys each token
//! attends to. Its bugs change which keys are seen, not the values computed from them, so they
//! are judged on the scores (re-scored from the reference's un-rotated `idx_q`/`idx_k`) and on
//! the selections as sets (Jaccard overlap, ties at the cut excused within the precision's band).

use std::collections::BTreeSet;

use super::{Detection, SiteCtx};
use crate::compute::indexer;
use crate::compute::reference::rope_inv_freq;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage};
use crate::judge::metrics::Status;
use crate::model::config::RopeStyle;

/// The reference's indexer inputs of this layer, re-scored with `style` (f64): `idx_scores`
/// [T, S] as the reference lays it out. `None` when a site is missing.
fn rescore_indexer(x: &SiteCtx<'_>, style: RopeStyle) -> Option<Vec<f64>> {
    let idx_cfg = x.input.cfg.indexer.as_ref()?;
    let q = x.ref_site(Stage::IdxQ)?.to_f64();
    let k = x.ref_site(Stage::IdxK)?.to_f64();
    let w = x.ref_site(Stage::IdxWeights)?.to_f64();
    let (ni, d) = (idx_cfg.n_head, idx_cfg.head_dim);
    let inv = rope_inv_freq(x.input.cfg);
    let pos = x.input.batch.positions();
    let t = pos.len();
    if q.len() != t * ni * d || k.len() != t * d || w.len() != t * ni {
        return None;
    }
    let (mut qr, mut kr) = (q, k);
    indexer::rope_indexer(&mut qr, &mut kr, idx_cfg, &pos, &inv, style);
    Some(indexer::scores(idx_cfg, x.input.batch, &qr, &kr, &w))
}

/// `idx_scores` differs while the indexer's q and k matched: the other RoPE pairing applied to
/// the reference's own un-rotated `idx_q`/`idx_k` explains the candidate's scores (the
/// DeepSeek-V3.2 indexer bug: interleaved pairs where the indexer wants NeoX halves).
pub(super) fn indexer_rope_style(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage != Stage::IdxScores {
        return None;
    }
    let idx_cfg = x.input.cfg.indexer.as_ref()?;
    let wrong = idx_cfg.rope_style.other();
    let alt = rescore_indexer(x, wrong)?;
    let e = x.explained_by(&alt)?;
    let sel = x.ref_site(Stage::IdxTopk);
    let k = sel.map_or(0, |t| t.shape.last().copied().unwrap_or(0));
    let longer = x.input.batch.seqs.iter().any(|s| s.len > idx_cfg.top_k);
    Some(Detection::new(
        format!(
            "{} rotation of the reference's un-rotated idx_q/idx_k explains idx_scores (rel_l2 {} vs {} as is){}",
            wrong.name(),
            sci(e, 2),
            sci(x.as_is(), 2),
            if longer {
                format!(
                    "; the sequences are longer than top-k {k}, so the wrong scores change which keys attention sees"
                )
            } else {
                format!(
                    "; every sequence is at most top-k {} long, so attention is unaffected here (it shows past top-k)",
                    idx_cfg.top_k
                )
            }
        ),
        format!(
            "the {} indexer rotates {} (x[i], x[i+R/2]) on the first R dims of each indexer head, unlike its main MLA RoPE; check the indexer's rotary call (is_neox_style / rope type)",
            x.input.cfg.arch,
            match idx_cfg.rope_style {
                RopeStyle::Neox => "NeoX halves",
                RopeStyle::Interleaved => "adjacent pairs",
            }
        ),
    ))
}

/// Per token, a set of kept key indices.
type KeySets = Vec<Vec<usize>>;

/// Tokens whose selections differ only at ties within the precision's band (see
/// [`crate::judge::tolerance::selection_tie_band`]); empty without the reference's `idx_scores`.
fn tie_rows(x: &SiteCtx<'_>, r: &KeySets, c: &KeySets) -> BTreeSet<usize> {
    let Some(sc) = x.ref_site(Stage::IdxScores) else {
        return BTreeSet::new();
    };
    let s = sc.shape.last().copied().unwrap_or(0);
    let scores = sc.to_f64();
    let (band, _) = crate::judge::tolerance::selection_tie_band(x.input.precision);
    (0..r.len().min(c.len()))
        .filter(|&i| {
            r[i] != c[i]
                && scores
                    .get(i * s..(i + 1) * s)
                    .and_then(|row| indexer::tie_gap(&r[i], &c[i], row, band))
                    .is_some()
        })
        .collect()
}

/// Per token, the reference's and the candidate's `idx_topk` sets.
fn topk_pairs(x: &SiteCtx<'_>) -> Option<(KeySets, KeySets)> {
    if x.site.stage != Stage::IdxTopk {
        return None;
    }
    let k = x.refr.shape.last().copied().unwrap_or(0);
    let kc = x.cand.shape.last().copied().unwrap_or(0);
    let r = indexer::topk_sets(&x.refr.to_f64(), k);
    let c = indexer::topk_sets(&x.cand.to_f64(), kc);
    (r.len() == c.len()).then_some((r, c))
}

/// `idx_topk` differs while `idx_scores` matched, and each differing token's set equals the
/// reference's set of an earlier token of its sequence at one common distance: a top-k buffer
/// from a previous chunk was reused.
pub(super) fn indexer_topk_stale(x: &SiteCtx<'_>) -> Option<Detection> {
    let (r, c) = topk_pairs(x)?;
    let ties = tie_rows(x, &r, &c);
    let bad: Vec<usize> = (0..r.len()).filter(|&i| r[i] != c[i] && !ties.contains(&i)).collect();
    if bad.is_empty() {
        return None;
    }
    let seq = indexer::seq_index(x.input.batch);
    // Each differing token must be (much) closer to the reference's selection of the token d
    // earlier than to its own; equality is not required, since a reduced-precision indexer also
    // flips ties in the stale rows.
    let explained = |d: usize, i: usize| {
        seq[i] >= d && {
            let stale = indexer::jaccard(&c[i], &r[i - d]);
            stale >= 0.6 && stale > indexer::jaccard(&c[i], &r[i])
        }
    };
    // The stride that explains every differing token best (the largest summed overlap).
    let fit = |d: usize| bad.iter().map(|&i| indexer::jaccard(&c[i], &r[i - d])).sum::<f64>();
    let d = (1..=seq.iter().copied().max().unwrap_or(0))
        .filter(|&d| bad.iter().all(|&i| explained(d, i)))
        .max_by(|&a, &b| fit(a).total_cmp(&fit(b)).then(b.cmp(&a)))?;
    let scores_state = match x
        .path
        .diffs
        .iter()
        .find(|s| s.site == Site::new(x.site.layer, Stage::IdxScores))
    {
        Some(s) if s.status == Status::Pass => "idx_scores match, so the scores were right and the selection is old",
        Some(_) => "idx_scores differ too",
        None => "idx_scores were not compared",
    };
    let j = indexer::jaccard(&r[bad[0]], &c[bad[0]]);
    Some(Detection::new(
        format!(
            "{} of {} tokens keep the reference's selection of the token {d} positions earlier ({scores_state}); token {}: Jaccard {:.3} with its own selection",
            bad.len(),
            r.len(),
            bad[0],
            j
        ),
        format!(
            "a top-k index buffer is reused across chunks: the new tokens read the previous chunk's indices (stride {d} = the tokens each chunked-prefill step adds, --new-tokens here); recompute or re-slice the indexer output per chunk"
        ),
    ))
}

/// `idx_topk` differs as a set: the tokens, their Jaccard overlap, and whether the scores matched
/// (then ties at the cut or a wrong selection rule) or not.
pub(super) fn indexer_selection(x: &SiteCtx<'_>) -> Option<Detection> {
    let (ref_topk, cand_topk) = topk_pairs(x)?;
    let differing: Vec<usize> = (0..ref_topk.len()).filter(|&i| ref_topk[i] != cand_topk[i]).collect();
    if differing.is_empty() {
        return None;
    }
    let jaccards: Vec<f64> = differing
        .iter()
        .map(|&i| indexer::jaccard(&ref_topk[i], &cand_topk[i]))
        .collect();
    let mean = jaccards.iter().sum::<f64>() / jaccards.len() as f64;
    let scores_pass = x
        .path
        .diffs
        .iter()
        .find(|s| s.site == Site::new(x.site.layer, Stage::IdxScores))
        .map(|s| s.status == Status::Pass);
    let shown: Vec<String> = differing
        .iter()
        .zip(&jaccards)
        .take(4)
        .map(|(&i, j)| {
            let only_ref: Vec<usize> = ref_topk[i]
                .iter()
                .filter(|p| !cand_topk[i].contains(p))
                .copied()
                .collect();
            let only_cand: Vec<usize> = cand_topk[i]
                .iter()
                .filter(|p| !ref_topk[i].contains(p))
                .copied()
                .collect();
            format!("token {i}: Jaccard {j:.3}, only reference {only_ref:?}, only candidate {only_cand:?}")
        })
        .collect();
    Some(Detection::new(
        format!(
            "{} of {} tokens keep other keys (mean Jaccard {mean:.3}; {}): {}",
            differing.len(),
            ref_topk.len(),
            match scores_pass {
                Some(true) => "idx_scores match, so the selection rule differs (k, masking, tie order)",
                Some(false) => "idx_scores differ too",
                None => "idx_scores were not compared",
            },
            shown.join("; ")
        ),
        "keep the top_k largest scores among keys at or before the token (ties to the lower position); a shared-indexer layer reuses the latest full layer's selection".into(),
    ))
}
