//! The MoE routing detector (`moe-routing`): tokens that select other experts.
//!
//! A routing bug (the score-correction bias in the weights, a wrong group limit, sigmoid where
//! the model says softmax) changes which experts a token reaches while every expert computes
//! correctly, so the divergence first shows in `moe_topk`, an id set. The detector lists the
//! tokens whose sets differ, the ids only one side chose with their reference router logits, and
//! whether the router logits themselves matched, which separates a wrong rule from wrong inputs.

use super::{Detection, SiteCtx};
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage};
use crate::judge::metrics::{self, Status};

/// `moe_topk` differs as a set: lists the tokens and the ids only one side selected, with the
/// reference's router logits at those ids and whether the candidate's router logits matched.
pub(super) fn moe_routing(x: &SiteCtx<'_>) -> Option<Detection> {
    if x.site.stage != Stage::MoeTopk {
        return None;
    }
    let k = x.refr.shape.last().copied().unwrap_or(1).max(1);
    let (ref_sorted, cand_sorted) = (
        metrics::sorted_rows(x.refr).to_f64(),
        metrics::sorted_rows(x.cand).to_f64(),
    );
    let tokens = ref_sorted.len() / k;
    let logits = x.ref_site(Stage::MoeRouterLogits);
    let n_exp = logits.map_or(0, |l| l.shape.last().copied().unwrap_or(0));
    let id = |v: f64| v as i64;
    let mut rows = Vec::new();
    for t in 0..tokens {
        let (ref_ids, cand_ids) = (&ref_sorted[t * k..(t + 1) * k], &cand_sorted[t * k..(t + 1) * k]);
        let only_ref: Vec<i64> = ref_ids
            .iter()
            .filter(|v| !cand_ids.contains(v))
            .map(|&v| id(v))
            .collect();
        let only_cand: Vec<i64> = cand_ids
            .iter()
            .filter(|v| !ref_ids.contains(v))
            .map(|&v| id(v))
            .collect();
        if only_ref.is_empty() && only_cand.is_empty() {
            continue;
        }
        let logit = |e: i64| {
            logits
                .filter(|_| e >= 0 && (e as usize) < n_exp)
                .map_or("n/a".to_string(), |l| format!("{:.4}", l.get(t * n_exp + e as usize)))
        };
        let show = |v: &[i64]| {
            v.iter()
                .map(|&e| format!("{e} (logit {})", logit(e)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let set = |v: &[f64]| v.iter().map(|&x| id(x).to_string()).collect::<Vec<_>>().join(", ");
        rows.push(format!(
            "token {t}: reference {{{}}}, candidate {{{}}} (only reference: {}; only candidate: {})",
            set(ref_ids),
            set(cand_ids),
            show(&only_ref),
            show(&only_cand)
        ));
    }
    if rows.is_empty() {
        return None;
    }
    let logit_site = Site::new(x.site.layer, Stage::MoeRouterLogits);
    let logits_state = match x.path.diffs.iter().find(|d| d.site == logit_site) {
        Some(d) if d.status == Status::Pass => format!(
            "the router logits match (rel_l2 {}), so the selection rule differs",
            sci(d.metrics.as_ref().map_or(0.0, |m| m.rel_l2), 2)
        ),
        Some(_) => "the router logits differ too".to_string(),
        None => "the candidate's router logits were not compared".to_string(),
    };
    let shown = rows.len().min(4);
    Some(Detection::new(
        format!(
            "{} of {tokens} tokens select other experts ({logits_state}): {}{}",
            rows.len(),
            rows[..shown].join("; "),
            if rows.len() > shown {
                format!("; … {} more", rows.len() - shown)
            } else {
                String::new()
            }
        ),
        "experts are chosen on scores + exp_probs_b (the score-correction bias: for the choice only, never in the \
         weights), within the expert_group_used_count best groups (a group scores the sum of its two best \
         experts), with scores = sigmoid or softmax of the logits per expert_gating_func; check each against \
         the engine. A difference only where two scores tie at the k-th place is rounding, not a bug"
            .into(),
    ))
}
