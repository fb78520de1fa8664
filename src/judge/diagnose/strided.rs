//! The strided-view detector (`strided-view`): a view of a fused tensor read with another
//! tensor's stride or offset.
//!
//! MLA cuts most of its operands out of fused outputs: `kv_c` and `k_pe` are column ranges of
//! `kv_a` (row stride L+R), `q_pe` the last R columns of each head of `q` (head stride P+R),
//! `k_nope` and `v` the halves of each head of `kv_b_proj`'s output (head stride P+V). A kernel
//! that assumes contiguous rows, or a view built with another tensor's stride, reads the right
//! memory in the wrong places: the first row (or head) is right and the rest is wrong, which no
//! scale or permutation of the reference explains (llama.cpp#12956: norm and RoPE kernels on
//! non-contiguous views). The detector replays the cut from the fused tensor that passed (the
//! path's own where it was compared, else the reference's) with each stride and offset of a
//! small set (the widths of MLA's tensors: L, R, L+R, P, V, P+R, P+V, Lq, Lq+L+R, H), carries it
//! through what the stage does next (the RMSNorm of `kv_c`, the RoPE of `k_pe`/`q_pe`), and
//! names the one that reproduces the failing site on sampled tokens.

use super::blocks::rel_l2;
use super::{Detection, SiteCtx};
use crate::compute::indexer;
use crate::compute::reference::rope_inv_freq;
use crate::core::sci::sci;
use crate::core::trace::{Site, Stage, TraceTensor};

/// Tokens the replay reads at most (evenly spread, the first included): a wrong stride moves
/// every row after the first, so a spread sample shows it as the whole tensor does.
const SAMPLE_TOKENS: usize = 64;

/// Tokens `kv_b_proj`'s output is recomputed for at `k_nope`/`v` (N·(P+V)·L each).
const KV_B_TOKENS: usize = 16;

/// What the stage does with the cut before the site records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Nothing: the site is the cut (`k_pe`, `k_nope`, `v`).
    Nothing,
    /// The latent RMSNorm `kv_a_layernorm` (`kv_c_normed`).
    RmsNorm,
    /// RoPE at the token's position (`k_pe_roped`, `q_pe_roped`).
    Rope,
}

/// One candidate view: row (token) stride, head stride (per-head cuts), column offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct View {
    row: usize,
    head: usize,
    off: usize,
}

/// `strided-view` at a site cut out of a fused tensor: `kv_c_normed` (the RMSNorm of `kv_a`'s
/// first L columns), `k_pe` and, when `k_pe` was not compared, `k_pe_roped` (`kv_a`'s last R
/// columns), `q_pe_roped` (each head's last R columns of `q`), `k_nope` and `v` (each head's
/// halves of `kv_b_proj`'s output): another row or head stride, or another offset, of the
/// small set explains the sampled tokens.
pub(super) fn strided_view(x: &SiteCtx<'_>) -> Option<Detection> {
    let m = x.diff.metrics.as_ref()?;
    if m.nonfinite_cand > 0 {
        return None;
    }
    let cfg = x.input.cfg;
    let [n, l, p, r, v] = cfg.dims().nlprv();
    match x.site.stage {
        Stage::KvCNormed => kv_a_cut(x, 0, l, Then::RmsNorm),
        Stage::KPe => kv_a_cut(x, l, r, Then::Nothing),
        // Also where `k_pe` passed: the rope may be handed another view of the same buffer
        // than the one a hook recorded.
        Stage::KPeRoped => kv_a_cut(x, l, r, Then::Rope),
        Stage::QPeRoped => cut(
            x,
            Fused {
                name: &Stage::Q.name(),
                data: &own_or_reference(x, Stage::Q)?.to_f64(),
                row: n * (p + r),
            },
            n,
            View {
                row: n * (p + r),
                head: p + r,
                off: p,
            },
            r,
            Then::Rope,
        ),
        Stage::KNope | Stage::V => kv_b_cut(x, n, l, p, v),
        _ => None,
    }
}

/// A cut of `width` columns at column `at` of `kv_a` (`kv_c`: 0, `k_pe`: L), through `then`:
/// replayed from `kv_a` itself (row stride L+R), and on a model with `q_lora_rank` also from
/// the buffer it is a view of, the fused `q_a`/`kv_a` projection's output `q_c ‖ kv_a` (row
/// stride Lq+L+R, as vLLM's `fused_qkv_a_proj` writes it), where a view read with another
/// stride crosses into `q_c`.
fn kv_a_cut(x: &SiteCtx<'_>, at: usize, width: usize, then: Then) -> Option<Detection> {
    let cfg = x.input.cfg;
    let (l, r) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim);
    let kv_a = own_or_reference(x, Stage::KvA)?;
    let own = kv_a.to_f64();
    let view = |row, off| View { row, head: 0, off };
    if let Some(d) = cut(
        x,
        Fused {
            name: &Stage::KvA.name(),
            data: &own,
            row: l + r,
        },
        1,
        view(l + r, at),
        width,
        then,
    ) {
        return Some(d);
    }
    let lq = cfg.q_lora_rank.filter(|&q| q > 0)?;
    let q_c = own_or_reference(x, Stage::QC)?.to_f64();
    let t = own.len() / (l + r).max(1);
    if q_c.len() != t * lq || own.len() != t * (l + r) {
        return None;
    }
    let row = lq + l + r;
    let mut fused = Vec::with_capacity(t * row);
    for ti in 0..t {
        fused.extend_from_slice(&q_c[ti * lq..(ti + 1) * lq]);
        fused.extend_from_slice(&own[ti * (l + r)..(ti + 1) * (l + r)]);
    }
    let src = Fused {
        name: "fused_qkv_a_proj's output (q_c ‖ kv_a)",
        data: &fused,
        row,
    };
    cut(x, src, 1, view(row, lq + at), width, then)
}

/// The strides and offsets a view is replayed with: MLA's tensor widths, each named as evidence
/// names it, without repeats.
fn widths(x: &SiteCtx<'_>) -> Vec<(usize, String)> {
    let cfg = x.input.cfg;
    let [_, l, p, r, v] = cfg.dims().nlprv();
    let mut out: Vec<(usize, String)> = Vec::new();
    let lq = cfg.q_lora_rank;
    let named = [
        (Some(l), "L, kv_c's width"),
        (Some(r), "R, k_pe's width"),
        (Some(l + r), "L+R, kv_a's width"),
        (Some(p), "P, q_nope's and k_nope's width"),
        (Some(v), "V, v's width"),
        (Some(p + r), "P+R, q's per-head width"),
        (Some(p + v), "P+V, kv_b's per-head width"),
        (lq, "Lq, q_c's width"),
        (lq.map(|q| q + l + r), "Lq+L+R, fused_qkv_a's width"),
        (Some(cfg.hidden), "H"),
    ];
    for (w, name) in named {
        if let Some(w) = w.filter(|&w| w > 0)
            && !out.iter().any(|(x, _)| *x == w)
        {
            out.push((w, name.to_string()));
        }
    }
    out
}

/// The name of stride `s` among `ws`, else the number.
fn name_of(ws: &[(usize, String)], s: usize) -> String {
    ws.iter()
        .find(|(w, _)| *w == s)
        .map_or_else(|| s.to_string(), |(_, n)| format!("{s} ({n})"))
}

/// Up to `k` of `0..n`, evenly spread, 0 first.
fn spread(n: usize, k: usize) -> Vec<usize> {
    if n <= k {
        return (0..n).collect();
    }
    let mut v: Vec<usize> = (0..k).map(|i| i * (n - 1) / (k - 1).max(1)).collect();
    v.dedup();
    v
}

/// `stage` of the failing site's layer: the path's own where it was compared, else the
/// reference's.
fn own_or_reference<'a>(x: &'a SiteCtx<'_>, stage: Stage) -> Option<&'a TraceTensor> {
    let site = Site::new(x.site.layer, stage);
    x.path.trace.get(&site).or_else(|| x.input.reference.get(&site))
}

/// The site's values on `tokens` (rows of `per_token` elements).
fn pick(t: &TraceTensor, tokens: &[usize], per_token: usize) -> Vec<f64> {
    tokens
        .iter()
        .flat_map(|&ti| (ti * per_token..(ti + 1) * per_token).map(|i| t.get(i)))
        .collect()
}

/// A fused tensor a view is cut out of: its name as evidence says it, its values and its width
/// per token in its true layout.
struct Fused<'a> {
    name: &'a str,
    data: &'a [f64],
    row: usize,
}

/// A cut of `heads` blocks of `width` per token out of the fused `src` (`row` wide per token in
/// its true layout), replayed with every view of the set but the true one `truth`, then through
/// `then`: the view that explains the site on the sampled tokens.
fn cut(
    x: &SiteCtx<'_>,
    Fused {
        name: src_name,
        data,
        row,
    }: Fused<'_>,
    heads: usize,
    truth: View,
    width: usize,
    then: Then,
) -> Option<Detection> {
    let t = *x.refr.shape.first()?;
    if data.len() != t * row || x.cand.len() != t * heads * width || x.refr.len() != x.cand.len() {
        return None;
    }
    let tokens = spread(t, SAMPLE_TOKENS);
    let per_token = heads * width;
    let cand = pick(x.cand, &tokens, per_token);
    let as_is = rel_l2(&cand, &pick(x.refr, &tokens, per_token));
    let post = Post::new(x, then, width)?;
    let ws = widths(x);
    let mut views = Vec::new();
    for (s, _) in &ws {
        // Row strides: the width itself; for a per-head cut also the true row with another head
        // stride, and a flat [T·N, s] reading.
        let (rows, head_strides): (Vec<usize>, Vec<usize>) = if heads == 1 {
            (vec![*s], vec![0])
        } else {
            (vec![truth.row, heads * s], vec![*s])
        };
        for &rs in &rows {
            for &hs in &head_strides {
                for off in [truth.off, 0, x.input.cfg.qk_rope_head_dim] {
                    let vw = View { row: rs, head: hs, off };
                    if vw != truth && !views.contains(&vw) {
                        views.push(vw);
                    }
                }
            }
        }
    }
    // The rows and heads on their own strides with the true offset come first (the likelier
    // mistake), then other offsets.
    for vw in views {
        let Some(alt) = replay_view(data, &tokens, heads, width, vw, &post) else {
            continue;
        };
        let e = rel_l2(&cand, &alt);
        if e <= x.explain && e < as_is {
            return Some(describe(
                x,
                src_name,
                truth,
                vw,
                heads,
                width,
                then,
                &ws,
                e,
                as_is,
                tokens.len(),
            ));
        }
    }
    None
}

/// What follows the cut, with what it needs: the RMSNorm's weight (fitted from the reference's
/// input and output of the norm) and epsilon, or RoPE's frequencies, style and token positions.
struct Post {
    then: Then,
    gamma: Vec<f64>,
    eps: f64,
    inv: Vec<f64>,
    style: crate::model::config::RopeStyle,
    positions: Vec<usize>,
}

impl Post {
    fn new(x: &SiteCtx<'_>, then: Then, width: usize) -> Option<Post> {
        let cfg = x.input.cfg;
        let mut post = Post {
            then,
            gamma: Vec::new(),
            eps: cfg.rms_eps,
            inv: Vec::new(),
            style: cfg.rope_style,
            positions: x.input.batch.positions(),
        };
        match then {
            Then::Nothing => {}
            Then::Rope => post.inv = rope_inv_freq(cfg),
            Then::RmsNorm => post.gamma = norm_weight(x, width)?,
        }
        Some(post)
    }
}

/// `kv_a_layernorm`'s weight \[L], fitted per column from the reference's `kv_a` (its first L
/// columns, normalized) and `kv_c_normed`, which it maps one to the other exactly.
fn norm_weight(x: &SiteCtx<'_>, l: usize) -> Option<Vec<f64>> {
    let kv_a = x.ref_site(Stage::KvA)?;
    let out = x.ref_site(Stage::KvCNormed)?;
    let t = *out.shape.first()?;
    let w = kv_a.len() / t.max(1);
    if out.len() != t * l || w < l {
        return None;
    }
    let eps = x.input.cfg.rms_eps;
    let (mut num, mut den) = (vec![0f64; l], vec![0f64; l]);
    for ti in spread(t, SAMPLE_TOKENS) {
        let row: Vec<f64> = (0..l).map(|j| kv_a.get(ti * w + j)).collect();
        let rms = (row.iter().map(|a| a * a).sum::<f64>() / l as f64 + eps).sqrt();
        for j in 0..l {
            let u = row[j] / rms;
            num[j] += out.get(ti * l + j) * u;
            den[j] += u * u;
        }
    }
    Some(
        num.iter()
            .zip(&den)
            .map(|(a, b)| if *b > 0.0 { a / b } else { 0.0 })
            .collect(),
    )
}

/// The cut `vw` of `heads` blocks of `width` out of `data` for each of `tokens`, through `post`;
/// `None` when a read falls outside the tensor.
fn replay_view(data: &[f64], tokens: &[usize], heads: usize, width: usize, vw: View, post: &Post) -> Option<Vec<f64>> {
    let mut out = Vec::with_capacity(tokens.len() * heads * width);
    for &ti in tokens {
        for h in 0..heads {
            let start = ti * vw.row + h * vw.head + vw.off;
            let mut seg = data.get(start..start + width)?.to_vec();
            match post.then {
                Then::Nothing => {}
                Then::Rope => indexer::rope_f64(&mut seg, *post.positions.get(ti)?, &post.inv, post.style),
                Then::RmsNorm => {
                    let rms = (seg.iter().map(|a| a * a).sum::<f64>() / width as f64 + post.eps).sqrt();
                    for (s, g) in seg.iter_mut().zip(&post.gamma) {
                        *s = *s / rms * g;
                    }
                }
            }
            out.extend(seg);
        }
    }
    Some(out)
}

/// The evidence and hint of view `vw` of `src` explaining the site (error `e`, `as_is` on
/// `sampled` tokens), against the true view `truth`.
#[allow(
    clippy::too_many_arguments,
    reason = "the cut (source, true and found view, shape, what follows) and its numbers are all quoted"
)]
fn describe(
    x: &SiteCtx<'_>,
    src: &str,
    truth: View,
    vw: View,
    heads: usize,
    width: usize,
    then: Then,
    ws: &[(usize, String)],
    e: f64,
    as_is: f64,
    sampled: usize,
) -> Detection {
    let site = x.site.stage.name();
    let stride = if heads == 1 {
        format!(
            "with row stride {} instead of {}",
            name_of(ws, vw.row),
            name_of(ws, truth.row)
        )
    } else if vw.row != truth.row {
        format!(
            "as [T·N, {}] rows (head stride {}) instead of per head of [T, N, {}]",
            vw.head,
            name_of(ws, vw.head),
            truth.head
        )
    } else {
        format!(
            "with head stride {} instead of {}",
            name_of(ws, vw.head),
            name_of(ws, truth.head)
        )
    };
    let off = if vw.off == truth.off {
        String::new()
    } else {
        format!(", from column {} instead of {}", vw.off, truth.off)
    };
    let then_text = match then {
        Then::Nothing => "",
        Then::RmsNorm => ", then kv_a_layernorm",
        Then::Rope => ", then RoPE",
    };
    Detection::new(
        format!(
            "{site} equals {}'s {width}-wide cut read {stride}{off}{then_text}, on {sampled} sampled tokens \
             (rel_l2 {} vs {} as is)",
            src,
            sci(e, 2),
            sci(as_is, 2)
        ),
        format!(
            "{site} is a view of {}: the kernel that reads it must use the view's own strides (or get a \
             .contiguous() copy); a kernel that assumes contiguous rows, or a view built with another tensor's \
             stride, reads the right memory in the wrong places (llama.cpp#12956)",
            src
        ),
    )
}

/// `k_nope` / `v` as a cut of `kv_b_proj`'s output `[T, N·(P+V)]`, recomputed from the path's
/// `kv_c_normed` and `w.kv_b` (its own where compared, else the reference's) on sampled tokens,
/// with another head stride or offset. The grouped split (`[all k_nope | all v]`) is
/// `kv-b-layout`'s and not replayed here.
fn kv_b_cut(x: &SiteCtx<'_>, n: usize, l: usize, p: usize, v: usize) -> Option<Detection> {
    let kv_c = own_or_reference(x, Stage::KvCNormed)?;
    let kvb = own_or_reference(x, Stage::WKvB)?;
    let t = *x.refr.shape.first()?;
    let (width, truth_off) = if x.site.stage == Stage::KNope { (p, 0) } else { (v, p) };
    let row = n * (p + v);
    if kv_c.len() != t * l || kvb.len() != row * l || x.cand.len() != t * n * width || x.refr.len() != x.cand.len() {
        return None;
    }
    let tokens = spread(t, KV_B_TOKENS);
    let w = kvb.to_f64();
    // The output rows of the sampled tokens, [tokens, N·(P+V)], as sampled-token rows 0.. .
    let out: Vec<f64> = tokens
        .iter()
        .flat_map(|&ti| {
            let xr: Vec<f64> = (0..l).map(|d| kv_c.get(ti * l + d)).collect();
            let w = &w;
            (0..row).map(move |o| w[o * l..(o + 1) * l].iter().zip(&xr).map(|(a, b)| a * b).sum::<f64>())
        })
        .collect();
    let local: Vec<usize> = (0..tokens.len()).collect();
    let per_token = n * width;
    let cand = pick(x.cand, &tokens, per_token);
    let as_is = rel_l2(&cand, &pick(x.refr, &tokens, per_token));
    let truth = View {
        row,
        head: p + v,
        off: truth_off,
    };
    let grouped = View {
        row,
        head: width,
        off: if x.site.stage == Stage::KNope { 0 } else { n * p },
    };
    let post = Post {
        then: Then::Nothing,
        gamma: Vec::new(),
        eps: 0.0,
        inv: Vec::new(),
        style: x.input.cfg.rope_style,
        positions: Vec::new(),
    };
    let ws = widths(x);
    for (hs, _) in &ws {
        for off in [truth_off, 0, p, v, n * p] {
            let vw = View { row, head: *hs, off };
            if vw == truth || vw == grouped {
                continue;
            }
            let Some(alt) = replay_view(&out, &local, n, width, vw, &post) else {
                continue;
            };
            let e = rel_l2(&cand, &alt);
            if e <= x.explain && e < as_is {
                let src = "kv_b_proj's output";
                let stride = format!("head stride {} instead of {}", name_of(&ws, *hs), name_of(&ws, p + v));
                let off_text = if off == truth_off {
                    String::new()
                } else {
                    format!(", from column {off} instead of {truth_off}")
                };
                let site = x.site.stage.name();
                return Some(Detection::new(
                    format!(
                        "{site} equals {src}'s {width}-wide cut per head read with {stride}{off_text}, on {} sampled \
                         tokens (rel_l2 {} vs {} as is)",
                        tokens.len(),
                        sci(e, 2),
                        sci(as_is, 2)
                    ),
                    format!(
                        "{site} is a per-head view of kv_b_proj's output [T, N, P+V]: split each head's P+V columns \
                         with the view's own strides; a kernel that assumes contiguous heads reads the right memory \
                         in the wrong places (llama.cpp#12956)"
                    ),
                ));
            }
        }
    }
    None
}
