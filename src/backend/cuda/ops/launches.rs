//! [`Ops`] on the GPU: each engine step as a launch of one of our simple kernels.
//!
//! The engine paths are written once against [`Ops`]; this is where each of its steps becomes a
//! `kernels/*.cu` launch with its buffers length-checked first (a short buffer is an internal
//! error naming the step, never an out-of-bounds read on the device). Steps with a tensor-core
//! kernel branch to [`super::fast`] when this backend runs them, the GEMM goes to
//! [`super::gemm`].

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::compute::collective::ReduceFault;
use crate::compute::ops::{Copy2d, DecodeArgs, Ops, PrefillArgs, RopeStyle, download_parts, host_all_reduce};
use crate::core::canary::CANARY_BITS;
use crate::core::dtype::Dtype;
use crate::core::error::{Error, Result};
use crate::core::trace::Site;
use crate::device::Module;
use crate::device::context::grid1;
use crate::model::gguf::{GgmlType, dequant};

use super::builder::launch;
use super::fast::DecodeMerge;
use super::{CudaOps, DeviceSite};

/// Rows of one flash-prefill block (one warp each), as `FLASH_ROWS` in attention.cu.
const FLASH_ROWS: usize = 4;
/// Keys per flash-prefill shared-memory tile, as `FLASH_BK` in attention.cu.
const FLASH_BK: usize = 16;
/// Largest per-row width the attention kernels' per-lane registers hold (32 lanes × 16).
const MAX_WIDTH: usize = 512;

impl Ops for CudaOps {
    type Buf = CudaSlice<f32>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Through NCCL when `--devices` gave one GPU per partial ([`CudaOps::with_nccl`]), else the
    /// host collective.
    fn all_reduce_sum(
        &self,
        parts: Vec<CudaSlice<f32>>,
        n: usize,
        fault: Option<ReduceFault>,
    ) -> Result<CudaSlice<f32>> {
        let Some(nccl) = self.nccl.as_ref().filter(|c| c.devices().len() == parts.len()) else {
            return host_all_reduce(self, parts, n, fault);
        };
        let host = download_parts(self, &parts, n)?;
        drop(parts);
        let mut copies = nccl.all_reduce_sum(&host, fault)?;
        self.upload(&copies.swap_remove(0))
    }

    fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>> {
        if data.is_empty() {
            return self.canary(0);
        }
        self.dev
            .stream()
            .clone_htod(data)
            .map_err(|e| Error::cuda(format!("upload: {e:?}")))
    }

    fn download(&self, b: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.dev
            .stream()
            .clone_dtoh(b)
            .map_err(|e| Error::cuda(format!("download: {e:?}")))
    }

    fn keep_site(&self, site: Site, shape: &[usize], b: &CudaSlice<f32>) -> Result<Option<Vec<f32>>> {
        let n: usize = shape.iter().product();
        let mut guard = self
            .device_sites
            .lock()
            .map_err(|_| Error::cuda("device site list poisoned"))?;
        let Some(sites) = guard.as_mut() else {
            drop(guard);
            let mut v = self.download(b)?;
            v.truncate(n);
            return Ok(Some(v));
        };
        if n > b.len() {
            return Err(Error::Internal(format!(
                "site {site}: shape {shape:?} holds {n} elements, its buffer {}",
                b.len()
            )));
        }
        // A copy: the engine reuses or frees its buffers after recording them.
        let copy = self
            .dev
            .stream()
            .clone_dtod(&b.slice(0..n.max(1).min(b.len())))
            .map_err(|e| Error::cuda(format!("copy of site {site}: {e:?}")))?;
        sites.push(DeviceSite {
            site,
            shape: shape.to_vec(),
            buf: copy,
        });
        Ok(None)
    }

    fn canary(&self, n: usize) -> Result<CudaSlice<f32>> {
        let mut x = self.alloc(n)?;
        let len = x.len();
        let (nn, bits) = (len as i64, CANARY_BITS);
        launch!(self, Module::Elementwise, "fill_bits", grid1(len), &mut x, &nn, &bits);
        Ok(x)
    }

    fn take_dequantized(&self, name: &str, n: usize) -> Option<CudaSlice<f32>> {
        self.dev.take_layer_weight(name, n)
    }

    fn dequant(&self, ty: GgmlType, bytes: &[u8], n: usize, label: &str) -> Result<CudaSlice<f32>> {
        if let Some(y) = self.gpu_dequant(ty, bytes, n)? {
            return Ok(y);
        }
        if let Ok(mut notes) = self.notes.lock() {
            notes.push(format!(
                "{ty} has no GPU dequantization kernel: dequantized on the CPU and uploaded ({label})"
            ));
        }
        let v = dequant::dequantize(ty, bytes, n).map_err(|reason| Error::Dequant {
            path: "<engine>".into(),
            tensor: label.to_string(),
            reason,
        })?;
        self.upload(&v)
    }

    fn linear(&self, x: &CudaSlice<f32>, t: usize, k: usize, w: &CudaSlice<f32>, o: usize) -> Result<CudaSlice<f32>> {
        self.cublas_linear(x, t, k, w, o)
    }

    fn add(&self, a: &CudaSlice<f32>, b: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        self.binary("add", [(a, "a"), (b, "b")], n)
    }

    fn silu_mul(&self, g: &CudaSlice<f32>, u: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        self.binary("silu_mul", [(g, "g"), (u, "u")], n)
    }

    fn rms_norm(
        &self,
        src: &CudaSlice<f32>,
        rows: usize,
        off: usize,
        stride: usize,
        width: usize,
        g: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<CudaSlice<f32>> {
        Self::check_len(g, width, "rms_norm weight")?;
        let mut out = self.canary(rows * width)?;
        if rows == 0 {
            return Ok(out);
        }
        let (r, o, s, w, len) = (rows as i64, off as i64, stride as i64, width as i64, src.len() as i64);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            Module::NormRope,
            "rms_norm",
            cfg,
            src,
            g,
            &mut out,
            &r,
            &o,
            &s,
            &w,
            &len,
            &eps
        );
        Ok(out)
    }

    fn copy2d(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, c: Copy2d) -> Result<()> {
        if c.rows == 0 || c.width == 0 {
            return Ok(());
        }
        let div = c.src_row_div.max(1);
        Self::check_len(
            src,
            c.src_off + ((c.rows - 1) / div) * c.src_stride + c.width,
            "copy2d source",
        )?;
        Self::check_len(
            dst,
            c.dst_off + (c.rows - 1) * c.dst_stride + c.width,
            "copy2d destination",
        )?;
        let a = [c.rows, c.width, c.src_off, c.src_stride, div, c.dst_off, c.dst_stride].map(|x| x as i64);
        launch!(
            self,
            Module::Elementwise,
            "copy2d",
            grid1(c.rows * c.width),
            src,
            dst,
            &a[0],
            &a[1],
            &a[2],
            &a[3],
            &a[4],
            &a[5],
            &a[6]
        );
        Ok(())
    }

    fn transpose(&self, src: &CudaSlice<f32>, batch: usize, rows: usize, cols: usize) -> Result<CudaSlice<f32>> {
        Self::check_len(src, batch * rows * cols, "transpose")?;
        let mut out = self.canary(batch * rows * cols)?;
        let (b, r, c) = (batch as i64, rows as i64, cols as i64);
        launch!(
            self,
            Module::Elementwise,
            "transpose",
            grid1(batch * rows * cols),
            src,
            &mut out,
            &b,
            &r,
            &c
        );
        Ok(out)
    }

    fn gather_rows(&self, src: &CudaSlice<f32>, row_len: usize, idx: &[usize]) -> Result<CudaSlice<f32>> {
        if let Some(&m) = idx.iter().max() {
            Self::check_len(src, (m + 1) * row_len, "gather_rows")?;
        }
        let mut out = self.canary(idx.len() * row_len)?;
        if idx.is_empty() {
            return Ok(out);
        }
        let d = self.idx(idx)?;
        let (n, rl) = (idx.len() as i64, row_len as i64);
        launch!(
            self,
            Module::Elementwise,
            "gather_rows",
            grid1(idx.len() * row_len),
            src,
            &d,
            &mut out,
            &n,
            &rl
        );
        Ok(out)
    }

    fn scatter_rows(
        &self,
        dst: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        row_len: usize,
        idx: &[usize],
    ) -> Result<()> {
        if idx.is_empty() {
            return Ok(());
        }
        Self::check_len(src, idx.len() * row_len, "scatter_rows source")?;
        if let Some(&m) = idx.iter().max() {
            Self::check_len(dst, (m + 1) * row_len, "scatter_rows destination")?;
        }
        let d = self.idx(idx)?;
        let (n, rl) = (idx.len() as i64, row_len as i64);
        launch!(
            self,
            Module::Elementwise,
            "scatter_rows",
            grid1(idx.len() * row_len),
            dst,
            src,
            &d,
            &n,
            &rl
        );
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        rows: usize,
        r: usize,
        positions: &[usize],
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        style: RopeStyle,
    ) -> Result<()> {
        Self::check_len(x, rows * r, "rope")?;
        let half = r / 2;
        if let Some(&m) = positions.iter().take(rows).max() {
            Self::check_len(cos, (m + 1) * half, "rope cos table")?;
            Self::check_len(sin, (m + 1) * half, "rope sin table")?;
        }
        if rows == 0 {
            return Ok(());
        }
        let pos = self.idx(&positions[..rows])?;
        let (rr, rl, neox) = (rows as i64, r as i64, i32::from(style == RopeStyle::Neox));
        launch!(
            self,
            Module::NormRope,
            "rope",
            grid1(rows * half),
            x,
            &pos,
            cos,
            sin,
            &rr,
            &rl,
            &neox
        );
        Ok(())
    }

    fn bmm_heads(
        &self,
        x: &CudaSlice<f32>,
        t: usize,
        nh: usize,
        a: usize,
        w: &CudaSlice<f32>,
        b: usize,
    ) -> Result<CudaSlice<f32>> {
        Self::check_len(x, t * nh * a, "bmm_heads x")?;
        Self::check_len(w, nh * a * b, "bmm_heads w")?;
        let mut out = self.canary(t * nh * b)?;
        let (tt, n, aa, bb, bf) = (
            t as i64,
            nh as i64,
            a as i64,
            b as i64,
            i32::from(self.dtype == Dtype::Bf16),
        );
        launch!(
            self,
            Module::Elementwise,
            "bmm_heads",
            grid1(t * nh * b),
            x,
            w,
            &mut out,
            &tt,
            &n,
            &aa,
            &bb,
            &bf
        );
        Ok(out)
    }

    fn flash_attention(
        &self,
        a: &PrefillArgs<'_, CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (nh, dqk, dv) = (a.nh, a.dqk, a.dv);
        if dqk > MAX_WIDTH || dv > MAX_WIDTH {
            return Err(Error::cuda(format!(
                "flash_prefill supports head widths up to {MAX_WIDTH}, got P+R={dqk}, V={dv}"
            )));
        }
        a.check_lens(out, lse, Self::check_len)?;
        // The tensor-core path builds its own tile list (its block height depends on the
        // configuration) and uploads bf16 copies itself.
        if self.uses_fast() && dqk.is_multiple_of(16) && dv.is_multiple_of(16) {
            return self.flash_prefill_fast(a, out, lse);
        }
        let mut segs = Vec::new();
        let mut tiles = Vec::new();
        for (si, sg) in a.segments.iter().enumerate() {
            segs.extend([sg.q_off, sg.q_len, sg.k_off, sg.k_len, usize::from(sg.causal)]);
            for q0 in (0..sg.q_len).step_by(FLASH_ROWS) {
                tiles.extend([si, q0]);
            }
        }
        if tiles.is_empty() {
            return Ok(());
        }
        let n_tiles = tiles.len() / 2;
        let (segs_d, tiles_d) = (self.idx(&segs)?, self.idx(&tiles)?);
        let krows_d = self.idx(a.key_rows.unwrap_or(&[]))?;
        let indirect = i32::from(a.key_rows.is_some());
        let cfg = LaunchConfig {
            grid_dim: (n_tiles as u32, nh as u32, 1),
            block_dim: (32 * FLASH_ROWS as u32, 1, 1),
            shared_mem_bytes: ((FLASH_BK * (dqk + dv) + FLASH_ROWS * dqk) * 4) as u32,
        };
        let (h, qk_width, v_width, em) = (nh as i64, dqk as i64, dv as i64, a.empty.code());
        // The f32 kernel reads the inputs as they are, the bf16 one bf16 copies of them.
        let (name, bf16) = match self.dtype {
            Dtype::F32 => ("flash_prefill_f32", None),
            Dtype::Bf16 => (
                "flash_prefill_bf16",
                Some([
                    self.to_bf16(a.q, a.q.len())?,
                    self.to_bf16(a.k, a.k.len())?,
                    self.to_bf16(a.v, a.v.len())?,
                ]),
            ),
        };
        let f = self.func(Module::Attention, name)?;
        let mut b = self.dev.stream().launch_builder(&f);
        match &bf16 {
            Some([qb, kb, vb]) => b.arg(qb).arg(kb).arg(vb),
            None => b.arg(a.q).arg(a.k).arg(a.v),
        };
        b.arg(out)
            .arg(lse)
            .arg(&segs_d)
            .arg(&tiles_d)
            .arg(&krows_d)
            .arg(&indirect)
            .arg(&h);
        b.arg(&qk_width).arg(&v_width).arg(&a.scale).arg(&em);
        // SAFETY: the arguments match the kernel's signature in attention.cu (inputs in the
        // dtype's element type), and every buffer was length-checked above.
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch {name}: {e:?}")))?;
        self.sync(name)
    }

    fn cache_write(
        &self,
        cache: &mut CudaSlice<f32>,
        width: usize,
        kv_c: &CudaSlice<f32>,
        k_pe: &CudaSlice<f32>,
        l: usize,
        r: usize,
        slots: &[usize],
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        if l + r != width {
            return Err(Error::internal(format!(
                "CUDA backend: cache_write: row width {width} != L+R = {}",
                l + r
            )));
        }
        Self::check_len(kv_c, slots.len() * l, "cache_write kv_c")?;
        Self::check_len(k_pe, slots.len() * r, "cache_write k_pe")?;
        if let Some(&m) = slots.iter().max() {
            Self::check_len(cache, (m + 1) * width, "cache_write slot")?;
        }
        let s = self.idx(slots)?;
        let (n, ll, rr) = (slots.len() as i64, l as i64, r as i64);
        launch!(
            self,
            Module::Elementwise,
            "cache_write",
            grid1(slots.len() * width),
            cache,
            kv_c,
            k_pe,
            &s,
            &n,
            &ll,
            &rr
        );
        Ok(())
    }

    fn decode_split(
        &self,
        d: &DecodeArgs<'_, CudaSlice<f32>>,
        parts: &mut CudaSlice<f32>,
        lses: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let DecodeArgs {
            q,
            n,
            nh,
            cache,
            block_size,
            width,
            tables,
            ctx,
            splits,
            dv,
            scale,
            empty_lse,
        } = *d;
        if n == 0 {
            return Ok(());
        }
        if dv > MAX_WIDTH {
            return Err(Error::cuda(format!(
                "decode_split supports value widths up to {MAX_WIDTH}, got L={dv}"
            )));
        }
        d.check_lens(parts, lses, Self::check_len)?;
        if self.fast_decode_serves(width, dv) {
            return self.decode_mma(&self.fast_decode_inputs(d)?.launch(), parts, lses, None);
        }
        let (flat, max_blocks) = Self::flat_tables(cache, block_size, width, tables, ctx)?;
        let (tables_d, ctx_d) = (self.idx(&flat)?, self.idx(ctx)?);
        let cfg = LaunchConfig {
            grid_dim: ((n * nh) as u32, splits as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: (width * 4) as u32,
        };
        let a = [n, nh, width, dv, block_size, max_blocks, splits].map(|x| x as i64);
        // The f32 kernel reads q and the cache as they are, the bf16 one bf16 copies of them.
        let (name, bf16) = match self.dtype {
            Dtype::F32 => ("decode_split_f32", None),
            Dtype::Bf16 => (
                "decode_split_bf16",
                Some([self.to_bf16(q, q.len())?, self.to_bf16(cache, cache.len())?]),
            ),
        };
        let f = self.func(Module::Attention, name)?;
        let mut b = self.dev.stream().launch_builder(&f);
        match &bf16 {
            Some([qb, cb16]) => b.arg(qb).arg(cb16),
            None => b.arg(q).arg(cache),
        };
        b.arg(&tables_d).arg(&ctx_d).arg(parts).arg(lses);
        for x in &a {
            b.arg(x);
        }
        b.arg(&scale).arg(&empty_lse);
        // SAFETY: the arguments match the kernel's signature in attention.cu (q and the cache in
        // the dtype's element type), and every buffer was length-checked above.
        unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch {name}: {e:?}")))?;
        self.sync(name)
    }

    fn decode_merged(&self, d: &DecodeArgs<'_, CudaSlice<f32>>) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let DecodeArgs {
            q,
            n,
            nh,
            width,
            splits,
            dv,
            ..
        } = *d;
        if !(n > 0 && dv <= MAX_WIDTH && self.fast_decode_serves(width, dv)) {
            return crate::compute::ops::decode_then_merge(self, d);
        }
        // The fast kernel with the merge fused in: same partials (canary-filled first, as the
        // unfused path; not used by the cluster merge, which keeps them on chip), same merge
        // arithmetic, one launch.
        Self::check_len(q, n * nh * width, "decode q")?;
        let inputs = self.fast_decode_inputs(d)?;
        let cfg = inputs.shape.cfg;
        let on_chip = cfg.cluster_size(self.dev.arch, splits, dv, true) > 0;
        let mut parts = self.canary(if on_chip { 1 } else { splits * n * nh * dv })?;
        let mut lses = self.canary(if on_chip { 1 } else { splits * n * nh })?;
        let mut out = self.canary(n * nh * dv)?;
        let mut lse = self.canary(n * nh)?;
        let mut counters = self
            .dev
            .stream()
            .alloc_zeros::<i32>(n * nh.div_ceil(cfg.heads))
            .map_err(|e| Error::cuda(format!("decode merge counters: {e:?}")))?;
        let merge = DecodeMerge {
            out: &mut out,
            lse: &mut lse,
            counters: &mut counters,
        };
        self.decode_mma(&inputs.launch(), &mut parts, &mut lses, Some(merge))?;
        Ok((out, lse))
    }

    fn merge(
        &self,
        parts: &CudaSlice<f32>,
        lses: &CudaSlice<f32>,
        k: usize,
        rows: usize,
        nh: usize,
        dv: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        Self::check_len(parts, k * rows * nh * dv, "merge parts")?;
        Self::check_len(lses, k * rows * nh, "merge lses")?;
        let mut out = self.canary(rows * nh * dv)?;
        let mut lse = self.canary(rows * nh)?;
        if rows * nh == 0 {
            return Ok((out, lse));
        }
        let a = [k, rows, nh, dv].map(|x| x as i64);
        launch!(
            self,
            Module::Attention,
            "merge_states",
            grid1(rows * nh * dv),
            parts,
            lses,
            &mut out,
            &mut lse,
            &a[0],
            &a[1],
            &a[2],
            &a[3]
        );
        Ok((out, lse))
    }
}
