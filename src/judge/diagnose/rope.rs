//! The RoPE pairing detector (`rope-style`): the rotary embedding applied with the other
//! pairing.
//!
//! DeepSeek's MLA rotates adjacent pairs (x\[2i], x\[2i+1]) while most other models rotate NeoX
//! halves (x\[i], x\[i+R/2]), and an engine that picks the wrong one produces `q_pe_roped` and
//! `k_pe_roped` that are right in norm and wrong in every direction. The detector rotates the
//! reference's un-rotated input with the other pairing (and, for a dump converted from HF's
//! `[even | odd]` order, through that conversion) and checks whether it explains the candidate.

use super::{Detection, SiteCtx};
use crate::compute::indexer;
use crate::compute::reference::rope_inv_freq;
use crate::core::sci::sci;
use crate::core::trace::Stage;
use crate::model::config::RopeStyle;

/// Rotates every `r`-wide row of `data` at its position with the given pairing.
fn rotate(data: &[f64], r: usize, positions: &[usize], inv_freq: &[f64], style: RopeStyle) -> Vec<f64> {
    let mut out = data.to_vec();
    for (row, &pos) in out.chunks_mut(r).zip(positions) {
        indexer::rope_f64(row, pos, inv_freq, style);
    }
    out
}

/// `rope-style` at `q_pe_roped`/`k_pe_roped`: the reference's un-rotated input rotated with the
/// other pairing explains the candidate.
pub(super) fn rope_style(x: &SiteCtx<'_>) -> Option<Detection> {
    let cfg = x.input.cfg;
    let [n, _, p, r, _] = cfg.dims().nlprv();
    let pos = x.input.batch.positions();
    let inv = rope_inv_freq(cfg);
    let (raw, positions): (Vec<f64>, Vec<usize>) = match x.site.stage {
        Stage::QPeRoped => {
            let q = x.ref_site(Stage::Q)?;
            let t = q.shape[0];
            let raw = (0..t * n)
                .flat_map(|i| (0..r).map(move |d| (i, d)))
                .map(|(i, d)| q.get(i * (p + r) + p + d))
                .collect();
            (raw, (0..t * n).map(|i| pos[i / n]).collect())
        }
        Stage::KPeRoped => (x.ref_site(Stage::KPe)?.to_f64(), pos.clone()),
        _ => return None,
    };
    let wrong = cfg.rope_style.other();
    let alt = rotate(&raw, r, &positions, &inv, wrong);
    // An engine dump read with `rope_order = hf` has had its halves re-interleaved; a NeoX
    // rotation there comes out in natural order, so also try NeoX seen through that conversion.
    let alt_hf: Vec<f64> = alt
        .chunks(r)
        .flat_map(|c| (0..r).map(move |k| if k % 2 == 0 { c[k / 2] } else { c[r / 2 + k / 2] }))
        .collect();
    let (e, through_hf) = match x.explained_by(&alt) {
        Some(e) => (e, false),
        None if wrong == RopeStyle::Neox => (x.explained_by(&alt_hf)?, true),
        None => return None,
    };
    if wrong == RopeStyle::Interleaved {
        return Some(Detection::new(
            format!(
                "interleaved rotation (x[2i], x[2i+1]) of the reference's un-rotated input explains {} ({})",
                x.site.stage.name(),
                x.vs_as_is(e)
            ),
            format!(
                "{} rotates NeoX halves (x[i], x[i+R/2]): vLLM is_neox_style=True, llama.cpp rope type NEOX",
                cfg.arch
            ),
        ));
    }
    Some(Detection::new(
        format!(
            "NeoX rotation (x[i], x[i+R/2]) of the reference's un-rotated input explains {}{} (rel_l2 {} vs {} as is)",
            x.site.stage.name(),
            if through_hf {
                " once the dump's HF [even | odd] rope-order conversion is undone"
            } else {
                ""
            },
            sci(e, 2),
            sci(x.as_is(), 2)
        ),
        "DeepSeek MLA rotates adjacent pairs (x[2i], x[2i+1]): vLLM is_neox_style=False, llama.cpp rope type NORM"
            .into(),
    ))
}
