//! The CPU backend: the [`Ops`] kernels on host memory, f32 with f32 accumulation.
//!
//! It runs everywhere (CI has no GPU), so every path, fault and detector is exercised through
//! it. With `Dtype::Bf16` it rounds GEMM and attention inputs to bf16 (round-to-nearest-even)
//! before computing in f32, as a bf16 engine's kernels would see them. Kernels are in [`ops`].

pub mod ops;

use ndarray::ArrayView2;
use rayon::prelude::*;

use crate::compute::ops::{Copy2d, DecodeArgs, Ops, PrefillArgs, RopeStyle};
use crate::core::canary::canary_vec;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::trace::Site;
use crate::model::gguf::{GgmlType, dequant};

/// The CPU backend.
#[derive(Debug, Clone, Copy)]
pub struct CpuOps {
    dtype: Dtype,
}

impl CpuOps {
    /// A CPU backend computing in `dtype`.
    pub fn new(dtype: Dtype) -> Self {
        CpuOps { dtype }
    }

    /// The values as a kernel reading `dtype` inputs sees them.
    fn rounded<'a>(&self, v: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        match self.dtype {
            Dtype::F32 => std::borrow::Cow::Borrowed(v),
            Dtype::Bf16 => std::borrow::Cow::Owned(v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()),
        }
    }
}

fn view(v: &[f32], rows: usize, cols: usize) -> Result<ArrayView2<'_, f32>> {
    ArrayView2::from_shape((rows, cols), v).map_err(|e| Error::Internal(format!("CPU backend: {e}")))
}

fn check(buf: &[f32], need: usize, what: &str) -> Result<()> {
    if buf.len() < need {
        return Err(Error::Internal(format!(
            "CPU backend: {what} needs {need} elements, buffer has {}",
            buf.len()
        )));
    }
    Ok(())
}

impl Ops for CpuOps {
    type Buf = Vec<f32>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn upload(&self, data: &[f32]) -> Result<Vec<f32>> {
        Ok(data.to_vec())
    }

    fn adopts_host_tensors(&self) -> bool {
        true
    }

    fn adopt(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        Ok(data)
    }

    fn download(&self, b: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(b.clone())
    }
    fn keep_site_owned(&self, _site: Site, shape: &[usize], mut b: Vec<f32>) -> Result<Option<Vec<f32>>> {
        b.truncate(shape.iter().product());
        Ok(Some(b))
    }

    fn canary(&self, n: usize) -> Result<Vec<f32>> {
        Ok(canary_vec(n))
    }

    fn dequant(&self, ty: GgmlType, bytes: &[u8], n: usize, label: &str) -> Result<Vec<f32>> {
        dequant::dequantize(ty, bytes, n).map_err(|reason| Error::Dequant {
            path: "<engine>".into(),
            tensor: label.to_string(),
            reason,
        })
    }

    fn linear(&self, x: &Vec<f32>, t: usize, k: usize, w: &Vec<f32>, o: usize) -> Result<Vec<f32>> {
        check(x, t * k, "linear x")?;
        check(w, o * k, "linear w")?;
        let (xr, wr) = (self.rounded(&x[..t * k]), self.rounded(&w[..o * k]));
        Ok(ops::linear(view(&xr, t, k)?, view(&wr, o, k)?)
            .into_raw_vec_and_offset()
            .0)
    }

    fn add(&self, a: &Vec<f32>, b: &Vec<f32>, n: usize) -> Result<Vec<f32>> {
        check(a, n, "add a")?;
        check(b, n, "add b")?;
        Ok(a[..n].iter().zip(&b[..n]).map(|(x, y)| x + y).collect())
    }

    fn silu_mul(&self, g: &Vec<f32>, u: &Vec<f32>, n: usize) -> Result<Vec<f32>> {
        check(g, n, "silu_mul g")?;
        check(u, n, "silu_mul u")?;
        Ok(g[..n]
            .iter()
            .zip(&u[..n])
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect())
    }

    fn rms_norm(
        &self,
        src: &Vec<f32>,
        rows: usize,
        off: usize,
        stride: usize,
        width: usize,
        g: &Vec<f32>,
        eps: f32,
    ) -> Result<Vec<f32>> {
        check(g, width, "rms_norm weight")?;
        Ok(ops::rms_norm_strided(src, rows, off, stride, width, g, eps))
    }

    fn copy2d(&self, src: &Vec<f32>, dst: &mut Vec<f32>, c: Copy2d) -> Result<()> {
        if c.rows == 0 || c.width == 0 {
            return Ok(());
        }
        let div = c.src_row_div.max(1);
        let last_src = c.src_off + ((c.rows - 1) / div) * c.src_stride + c.width;
        let last_dst = c.dst_off + (c.rows - 1) * c.dst_stride + c.width;
        check(src, last_src, "copy2d source")?;
        check(dst, last_dst, "copy2d destination")?;
        for r in 0..c.rows {
            let s = c.src_off + (r / div) * c.src_stride;
            let d = c.dst_off + r * c.dst_stride;
            dst[d..d + c.width].copy_from_slice(&src[s..s + c.width]);
        }
        Ok(())
    }

    fn transpose(&self, src: &Vec<f32>, batch: usize, rows: usize, cols: usize) -> Result<Vec<f32>> {
        check(src, batch * rows * cols, "transpose")?;
        let mut out = canary_vec(batch * rows * cols);
        for b in 0..batch {
            for i in 0..rows {
                for j in 0..cols {
                    out[b * rows * cols + j * rows + i] = src[b * rows * cols + i * cols + j];
                }
            }
        }
        Ok(out)
    }

    fn gather_rows(&self, src: &Vec<f32>, row_len: usize, idx: &[usize]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(idx.len() * row_len);
        for &i in idx {
            check(src, (i + 1) * row_len, "gather_rows")?;
            out.extend_from_slice(&src[i * row_len..(i + 1) * row_len]);
        }
        Ok(out)
    }

    fn scatter_rows(&self, dst: &mut Vec<f32>, src: &Vec<f32>, row_len: usize, idx: &[usize]) -> Result<()> {
        check(src, idx.len() * row_len, "scatter_rows source")?;
        for (k, &i) in idx.iter().enumerate() {
            check(dst, (i + 1) * row_len, "scatter_rows destination")?;
            dst[i * row_len..(i + 1) * row_len].copy_from_slice(&src[k * row_len..(k + 1) * row_len]);
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        r: usize,
        positions: &[usize],
        cos: &Vec<f32>,
        sin: &Vec<f32>,
        style: RopeStyle,
    ) -> Result<()> {
        let half = r / 2;
        check(x, rows * r, "rope")?;
        for (row, &pos) in x.chunks_mut(r).take(rows).zip(positions) {
            check(cos, (pos + 1) * half, "rope table")?;
            crate::compute::ops::rope_row(
                row,
                &cos[pos * half..(pos + 1) * half],
                &sin[pos * half..(pos + 1) * half],
                style,
            );
        }
        Ok(())
    }

    fn bmm_heads(&self, x: &Vec<f32>, t: usize, nh: usize, a: usize, w: &Vec<f32>, b: usize) -> Result<Vec<f32>> {
        check(x, t * nh * a, "bmm_heads x")?;
        check(w, nh * a * b, "bmm_heads w")?;
        let (xr, wr) = (self.rounded(&x[..t * nh * a]), self.rounded(&w[..nh * a * b]));
        Ok(ops::bmm_heads(&xr, t, nh, a, &wr, b))
    }

    fn flash_attention(&self, a: &PrefillArgs<'_, Vec<f32>>, out: &mut Vec<f32>, lse: &mut Vec<f32>) -> Result<()> {
        a.check_lens(out, lse, |b, need, what| check(b, need, what))?;
        let (qr, kr, vr) = (self.rounded(a.q), self.rounded(a.k), self.rounded(a.v));
        ops::flash_attention(&a.with_inputs(&*qr, &*kr, &*vr), out, lse);
        Ok(())
    }

    fn cache_write(
        &self,
        cache: &mut Vec<f32>,
        width: usize,
        kv_c: &Vec<f32>,
        k_pe: &Vec<f32>,
        l: usize,
        r: usize,
        slots: &[usize],
    ) -> Result<()> {
        check(kv_c, slots.len() * l, "cache_write kv_c")?;
        check(k_pe, slots.len() * r, "cache_write k_pe")?;
        for (i, &s) in slots.iter().enumerate() {
            check(cache, (s + 1) * width, "cache_write slot")?;
            let row = &mut cache[s * width..(s + 1) * width];
            row[..l].copy_from_slice(&self.rounded(&kv_c[i * l..(i + 1) * l]));
            row[l..l + r].copy_from_slice(&self.rounded(&k_pe[i * r..(i + 1) * r]));
        }
        Ok(())
    }

    fn decode_split(&self, d: &DecodeArgs<'_, Vec<f32>>, parts: &mut Vec<f32>, lses: &mut Vec<f32>) -> Result<()> {
        d.check_lens(parts, lses, |b, need, what| check(b, need, what))?;
        for (i, (table, &c)) in d.tables.iter().zip(d.ctx).enumerate() {
            if c.div_ceil(d.block_size) > table.len() {
                return Err(Error::Internal(format!(
                    "decode: context {c} exceeds row {i}'s block table"
                )));
            }
        }
        // The cache already holds dtype-rounded rows (cache_write stores what a bf16 cache holds).
        let qr = self.rounded(d.q);
        let (n, nh, splits, dv) = (d.n, d.nh, d.splits, d.dv);
        // One job per (token, split, group of up to LANES heads): the heads share the cache rows.
        let groups = nh.div_ceil(ops::LANES);
        let job_of = |job: usize| (job / (splits * groups), (job / groups) % splits, job % groups);
        let results: Vec<(Vec<f32>, Vec<f32>)> = (0..n * splits * groups)
            .into_par_iter()
            .map(|job| {
                let (i, s, g) = job_of(job);
                decode_job(d, &qr, (i, s), g * ops::LANES..((g + 1) * ops::LANES).min(nh))
            })
            .collect();
        for (job, (o, ls)) in results.into_iter().enumerate() {
            let (i, s, g) = job_of(job);
            let h0 = g * ops::LANES;
            if !o.is_empty() {
                parts[((s * n + i) * nh + h0) * dv..][..o.len()].copy_from_slice(&o);
            }
            lses[(s * n + i) * nh + h0..][..ls.len()].copy_from_slice(&ls);
        }
        Ok(())
    }

    fn merge(
        &self,
        parts: &Vec<f32>,
        lses: &Vec<f32>,
        k: usize,
        rows: usize,
        nh: usize,
        dv: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        check(parts, k * rows * nh * dv, "merge parts")?;
        check(lses, k * rows * nh, "merge lses")?;
        let mut out = canary_vec(rows * nh * dv);
        let mut lse = canary_vec(rows * nh);
        out.par_chunks_mut(dv.max(1))
            .zip(lse.par_iter_mut())
            .enumerate()
            .for_each(|(row, (o, l))| {
                let views: Vec<(&[f32], f32)> = (0..k)
                    .map(|s| (&parts[(s * rows * nh + row) * dv..][..dv], lses[s * rows * nh + row]))
                    .collect();
                *l = ops::merge_states(&views, o);
            });
        Ok((out, lse))
    }
}

/// One job of [`CpuOps`]' split-KV decode: split `s` of decode token `i` (`(i, s)`) for the
/// heads `heads`, on the dtype-rounded query rows `qr` `[n, nh, width]` of `d`. Returns the
/// partial output `[heads, dv]` (empty for an empty split, which writes nothing) and the heads'
/// LSEs.
fn decode_job(
    d: &DecodeArgs<'_, Vec<f32>>,
    qr: &[f32],
    (i, s): (usize, usize),
    heads: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let (nh, width, dv) = (d.nh, d.width, d.dv);
    let c = d.ctx[i];
    let sl = c.div_ceil(d.splits);
    let keys = (s * sl).min(c)..((s + 1) * sl).min(c);
    let split = ops::DecodeSplit {
        q: &qr[(i * nh + heads.start) * width..(i * nh + heads.end) * width],
        heads: heads.len(),
        kv: ops::PagedSeq {
            cache: d.cache,
            block_size: d.block_size,
            width,
            table: &d.tables[i],
        },
        keys: keys.clone(),
        scale: d.scale,
        dv,
        empty_lse: d.empty_lse,
    };
    let mut o = canary_vec(heads.len() * dv);
    let ls = ops::decode_split(&split, &mut o);
    (if keys.is_empty() { Vec::new() } else { o }, ls)
}
