//! The dense MLP after attention, as vLLM's `DeepseekV2MLP` runs it under tensor parallelism:
//! `post_attention_layernorm`, the merged-column `gate_up_proj` (each rank holds its slice of
//! `ffn_gate` and of `ffn_up`, one GEMM), SiLU·up, the row-parallel `down_proj` whose per-rank
//! partials are all-reduced, and the residual adds.
//!
//! The MLP is where the GGUF plugin's merged-column loader hands every rank rank 0's slice
//! (vllm-gguf-plugin#103), so its weights are cut per rank as vLLM cuts them and the
//! `tp-gate-up-rank0` fault acts in that cut. The slices are taken from the dequantized whole
//! tensors (the layer's one dequantization, taken over from the reference on the CPU): the
//! row-parallel cut of `ffn_down` falls inside a quant block on several fixtures at TP 2 or 4,
//! and what this module judges is the MLP's TP arithmetic and loading, not that cut (attention's
//! cuts judge the quant blocks).

use super::*;

/// One TP rank's MLP weights.
pub(super) struct FfnRank<B> {
    /// `gate_up_proj` `[gate rows c_r ; up rows c_r]`, [2·I/tp, H] (c_r = r·I/tp..(r+1)·I/tp).
    pub(super) gate_up: B,
    /// `down_proj` columns c_r, [H, I/tp].
    pub(super) down: B,
}

/// The dense MLP's weights as the engine holds them after loading: `ffn_norm` \[H] (replicated)
/// and each rank's shards; one rank holds the whole MLP without TP, or when the width I does not
/// divide by the TP size.
pub(super) struct Ffn<B> {
    pub(super) norm: B,
    pub(super) ranks: Vec<FfnRank<B>>,
    /// I, the MLP width (`feed_forward_length`).
    pub(super) f: usize,
}

/// Which rank's slice of `gate_up_proj` rank `rank`'s loader reads: its own, or rank 0's under
/// `tp-gate-up-rank0` (the plugin's `load_merged_column_weight` takes `tp_rank` from a keyword
/// argument `weight_loader_v2` never passes, so it is 0 on every rank).
fn gate_up_source(opts: &PathOptions, rank: usize) -> usize {
    if opts.faults.has(Fault::TpGateUpRank0) { 0 } else { rank }
}

/// The dense MLP's weights of the layer, cut per rank; `None` for a layer without a dense FFN.
/// A note goes to `notes` when `tp-gate-up-rank0` has nothing to act on here, and when the width
/// I does not divide by `--tp` (the MLP then runs unsplit, as one rank).
///
/// Errors: missing tensors, backend errors.
pub(super) fn load_ffn<O: Ops>(
    ops: &O,
    input: &LayerInput<'_>,
    opts: &PathOptions,
    notes: &mut Vec<String>,
) -> Result<Option<Ffn<O::Buf>>> {
    let layer = input.weights.layer;
    let fault = opts.tp > 1 && opts.faults.has(Fault::TpGateUpRank0);
    let Some(fw) = &input.weights.ffn else {
        if fault {
            notes.push(format!(
                "tp-gate-up-rank0: layer {layer} has no dense MLP (an MoE layer, whose engine paths stop at o_proj): the fault had nothing to act on"
            ));
        }
        return Ok(None);
    };
    let (f, h) = (fw.gate.nrows(), input.cfg.hidden);
    let name = |t: ModelTensor| t.name(layer);
    let norm = whole(ops, input, &name(ModelTensor::FfnNorm))?;
    let gate = whole(ops, input, &name(ModelTensor::FfnGate))?;
    let up = whole(ops, input, &name(ModelTensor::FfnUp))?;
    let down = whole(ops, input, &name(ModelTensor::FfnDown))?;
    let parts = if f.is_multiple_of(opts.tp) {
        opts.tp
    } else {
        notes.push(format!(
            "the MLP width {f} does not divide by --tp {}: the MLP runs unsplit on every rank, without per-rank FFN sites{}",
            opts.tp,
            if fault { "; tp-gate-up-rank0 had nothing to act on" } else { "" }
        ));
        1
    };
    let ir = f / parts;
    let merged = |rank: usize| -> Result<O::Buf> {
        let src = gate_up_source(opts, rank) * ir * h;
        let mut gate_up = ops.canary(2 * ir * h)?;
        ops.copy2d(&gate, &mut gate_up, copy_rows(ir, h).src(src, h).dst(0, h))?;
        ops.copy2d(&up, &mut gate_up, copy_rows(ir, h).src(src, h).dst(ir * h, h))?;
        Ok(gate_up)
    };
    let ranks = if parts == 1 {
        // The one rank holds the whole `down_proj`: no copy.
        vec![FfnRank {
            gate_up: merged(0)?,
            down,
        }]
    } else {
        (0..parts)
            .map(|rank| -> Result<FfnRank<O::Buf>> {
                let mut d = ops.canary(h * ir)?;
                ops.copy2d(&down, &mut d, copy_rows(h, ir).src(rank * ir, f).dst(0, ir))?;
                Ok(FfnRank {
                    gate_up: merged(rank)?,
                    down: d,
                })
            })
            .collect::<Result<_>>()?
    };
    Ok(Some(Ffn { norm, ranks, f }))
}

/// The FFN block after attention with both residual adds: `h1 = hidden + o` (each branch times
/// MiniCPM3's residual scale), `ffn_in = RMSNorm(h1)·ffn_norm`, per rank `gate_up_proj` then
/// SiLU(gate)·up then the `down_proj` partial, the all-reduce of the partials
/// ([`Ops::all_reduce_sum`], the collective of `o_proj`, without its faults), and
/// `hidden_out = h1 + ffn_out`. Returns `hidden_out` `[T, H]` f32.
///
/// Records `ffn_in` [T, H], `ffn_gate`, `ffn_up`, `ffn_act` [T, I] (each rank's columns
/// concatenated), `ffn_out` [T, H]; with several ranks also each rank's `w.gate_up.rank<r>`
/// [2·I/tp, H], `w.down.rank<r>` [H, I/tp], `ffn_gate_up.rank<r>` [T, 2·I/tp] and
/// `ffn_down.rank<r>` [T, H].
///
/// Errors: backend errors.
#[allow(
    clippy::too_many_arguments,
    reason = "the trace and layer it records into, the model, the MLP, and the layer's two inputs with their token count"
)]
pub(super) fn ffn_block<O: Ops>(
    ops: &O,
    tr: &mut Trace,
    layer: usize,
    (cfg, opts): (&MlaConfig, &PathOptions),
    ffn: &Ffn<O::Buf>,
    hidden: &O::Buf,
    o: &O::Buf,
    t: usize,
) -> Result<O::Buf> {
    let hd = cfg.hidden;
    // MiniCPM3 scales each residual branch (llama.cpp `scale_res`); on the host, once.
    let rs = cfg.residual_scale as f32;
    let scaled = |b: &O::Buf| -> Result<O::Buf> {
        let v: Vec<f32> = ops.download(b)?.into_iter().map(|x| x * rs).collect();
        ops.upload(&v)
    };
    let h1 = if rs != 1.0 {
        ops.add(hidden, &scaled(o)?, t * hd)?
    } else {
        ops.add(hidden, o, t * hd)?
    };
    let xn = ops.rms_norm(&h1, t, 0, hd, hd, &ffn.norm, cfg.rms_eps as f32)?;
    let tp = ffn.ranks.len();
    let ir = ffn.f / tp;
    let (mut gates, mut ups, mut acts, mut parts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (rank, fr) in ffn.ranks.iter().enumerate() {
        let xq = fp8_in(ops, opts, &xn, hd)?;
        let gate_up = ops.linear(xq.as_ref().unwrap_or(&xn), t, hd, &fr.gate_up, 2 * ir)?;
        let mut gate = ops.canary(t * ir)?;
        let mut up = ops.canary(t * ir)?;
        ops.copy2d(&gate_up, &mut gate, copy_rows(t, ir).src(0, 2 * ir).dst(0, ir))?;
        ops.copy2d(&gate_up, &mut up, copy_rows(t, ir).src(ir, 2 * ir).dst(0, ir))?;
        if tp > 1 {
            let rk = rank as u32;
            record_buf(
                ops,
                tr,
                layer,
                Stage::WRank(RankedWeight::GateUp, rk),
                &[2 * ir, hd],
                &fr.gate_up,
            )?;
            record_buf(
                ops,
                tr,
                layer,
                Stage::WRank(RankedWeight::Down, rk),
                &[hd, ir],
                &fr.down,
            )?;
            record_buf_owned(ops, tr, layer, Stage::FfnGateUpRank(rk), &[t, 2 * ir], gate_up)?;
        }
        let act = ops.silu_mul(&gate, &up, t * ir)?;
        let aq = fp8_in(ops, opts, &act, ir)?;
        parts.push(ops.linear(aq.as_ref().unwrap_or(&act), t, ir, &fr.down, hd)?);
        gates.push(gate);
        ups.push(up);
        acts.push(act);
    }
    record_buf_owned(ops, tr, layer, Stage::FfnIn, &[t, hd], xn)?;
    for (stage, bufs) in [(Stage::FfnGate, gates), (Stage::FfnUp, ups), (Stage::FfnAct, acts)] {
        record_columns(ops, tr, layer, stage, t, ffn.f, bufs)?;
    }
    if tp > 1 {
        for (rank, part) in parts.iter().enumerate() {
            record_buf(ops, tr, layer, Stage::FfnDownRank(rank as u32), &[t, hd], part)?;
        }
    }
    let out = ops.all_reduce_sum(parts, t * hd, None)?;
    record_buf(ops, tr, layer, Stage::FfnOut, &[t, hd], &out)?;
    let out = if rs != 1.0 { scaled(&out)? } else { out };
    ops.add(&h1, &out, t * hd)
}

/// Records the ranks' `[T, I/tp]` column blocks as one `[T, I]` site: one rank's buffer moved
/// into the trace, several concatenated along the columns on the host.
fn record_columns<O: Ops>(
    ops: &O,
    tr: &mut Trace,
    layer: usize,
    stage: Stage,
    t: usize,
    f: usize,
    mut bufs: Vec<O::Buf>,
) -> Result<()> {
    if bufs.len() == 1 {
        let one = bufs.pop().ok_or_else(|| Error::internal("engine MLP: no rank"))?;
        return record_buf_owned(ops, tr, layer, stage, &[t, f], one);
    }
    let parts: Vec<&O::Buf> = bufs.iter().collect();
    record_heads(ops, tr, layer, stage, &[t, f], &parts)
}
