//! Site comparison on the GPU, where the traces are computed.
//!
//! At real size a layer's traces are gigabytes (DeepSeek-V3 at T = 4096: about 8 GB of f64
//! reference sites, 4 GB of f32 sites per path). Copying them to the host to be judged, and
//! page-faulting the host memory they land in, took most of the wall time of a GPU run. Here
//! the reference sites stay on the device ([`SplitTrace`]), each path's sites are copied into
//! device buffers as they are recorded (`CudaOps::keep_sites_on_device`), and the two passes of
//! the element comparison (`kernels/compare.cu`) run on the device; per site only the block
//! partials of [`ElementSums`] and the two values at the worst element come back. A site is
//! downloaded only when something on the host needs its values: a detector or a report after a
//! divergence, a site recorded on the host by the other side, or golden recording.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::core::canary::{CANARY_BITS, CANARY_MASK};
use crate::core::error::{Error, Result};
use crate::core::sums::{ElementSums, Pass1, Pass2};
use crate::core::trace::{Site, Trace, TraceTensor};
use crate::device::Module;
use crate::device::context::Device;

/// Threads per block of the comparison kernels (`CMP_THREADS` in compare.cu).
const THREADS: u32 = 256;
/// Most blocks of one comparison pass: enough to fill an H200 several times over, few enough
/// that the partials are a few tens of KB.
const MAX_BLOCKS: usize = 2048;

/// One site held on the device: its shape (row-major) and values (`T` = f64 for the
/// reference, f32 for a path; the buffer may be longer than the shape's element count).
#[derive(Debug)]
pub struct DeviceSite<T> {
    /// The site.
    pub site: Site,
    /// Shape in the site's MLA dims (as the host trace would record it).
    pub shape: Vec<usize>,
    /// The values; the first `shape.iter().product()` elements are the site.
    pub buf: CudaSlice<T>,
}

impl<T> DeviceSite<T> {
    /// Elements of the site.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A trace kept partly on the device: the f64 reference of a layer computed by the GPU reference,
/// whose sites stay on the GPU except the per-rank weight sites under TP, which the host builds
/// and keeps.
#[derive(Debug, Default)]
pub struct SplitTrace {
    /// Sites recorded on the host.
    pub host: Trace,
    /// Sites kept on the device, in recording order.
    pub device: Vec<DeviceSite<f64>>,
}

impl SplitTrace {
    /// The device copy of `site`, if it is on the device.
    pub fn device_site(&self, site: &Site) -> Option<&DeviceSite<f64>> {
        self.device.iter().find(|d| d.site == *site)
    }

    /// The host values of `site`: the host record, or the device one downloaded.
    ///
    /// Errors: [`Error::Cuda`] on a failed download.
    pub fn host_site(&self, dev: &Device, site: &Site) -> Result<Option<TraceTensor>> {
        if let Some(t) = self.host.get(site) {
            return Ok(Some(t.clone()));
        }
        self.device_site(site)
            .map(|d| Ok(TraceTensor::f64(d.shape.clone(), download(dev, &d.buf, d.numel())?)))
            .transpose()
    }

    /// Every site on the host (downloading the device ones): the whole trace, as the CPU
    /// reference would return it.
    ///
    /// Errors: [`Error::Cuda`] on a failed download.
    pub fn to_host(&self, dev: &Device) -> Result<Trace> {
        let mut tr = self.host.clone();
        for d in &self.device {
            tr.record(
                d.site,
                TraceTensor::f64(d.shape.clone(), download(dev, &d.buf, d.numel())?),
            );
        }
        Ok(tr)
    }

    /// The sites for which `want` holds on the host (downloading the device ones), in the order
    /// [`crate::backend::cuda::reference::reference_layer`] records them: the device sites in
    /// recording order, then the host ones. The others are not copied.
    ///
    /// Errors: [`Error::Cuda`] on a failed download.
    pub fn to_host_where(&self, dev: &Device, want: impl Fn(&Site) -> bool) -> Result<Trace> {
        let mut tr = Trace::new();
        for d in self.device.iter().filter(|d| want(&d.site)) {
            tr.record(
                d.site,
                TraceTensor::f64(d.shape.clone(), download(dev, &d.buf, d.numel())?),
            );
        }
        for (s, t) in self.host.entries().iter().filter(|(s, _)| want(s)) {
            tr.record(*s, t.clone());
        }
        Ok(tr)
    }
}

/// The first `n` elements of `b` on the host.
///
/// Errors: [`Error::Cuda`] on a failed copy.
pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
    dev: &Device,
    b: &CudaSlice<T>,
    n: usize,
) -> Result<Vec<T>> {
    let n = n.min(b.len());
    let mut v = vec![T::default(); n];
    if n > 0 {
        dev.stream()
            .memcpy_dtoh(&b.slice(0..n), &mut v)
            .map_err(|e| Error::cuda(format!("download of {n} elements: {e:?}")))?;
    }
    Ok(v)
}

/// Element `i` of `b` on the host.
fn one<T: cudarc::driver::DeviceRepr + Default + Copy>(dev: &Device, b: &CudaSlice<T>, i: usize) -> Result<T> {
    let mut v = [T::default()];
    dev.stream()
        .memcpy_dtoh(&b.slice(i..i + 1), &mut v[..])
        .map_err(|e| Error::cuda(format!("download of element {i}: {e:?}")))?;
    Ok(v[0])
}

/// A host tensor as f64 on the device (a reference site recorded on the host, compared with a
/// path's device site).
///
/// Errors: [`Error::Cuda`] on a failed upload.
pub fn upload_f64(dev: &Device, t: &TraceTensor) -> Result<CudaSlice<f64>> {
    let v = t.to_f64();
    dev.stream()
        .clone_htod(if v.is_empty() { &[0.0][..] } else { &v[..] })
        .map_err(|e| Error::cuda(format!("upload: {e:?}")))
}

/// A host tensor as f32 on the device (a path's site recorded on the host, compared with a
/// device reference site). f64 candidates round to f32; the paths record f32 only.
///
/// Errors: [`Error::Cuda`] on a failed upload.
pub fn upload_f32(dev: &Device, t: &TraceTensor) -> Result<CudaSlice<f32>> {
    let v: Vec<f32> = match t.f32_data() {
        Some(d) => d.to_vec(),
        None => t.to_f64().into_iter().map(|x| x as f32).collect(),
    };
    dev.stream()
        .clone_htod(if v.is_empty() { &[0.0f32][..] } else { &v[..] })
        .map_err(|e| Error::cuda(format!("upload: {e:?}")))
}

/// `out[k] = src[idx[k]]` for rows of `row_len` elements: the rows `idx` (row indices into
/// `src` read as `[rows, row_len]`) of an f64 site on the device, gathered there (`gather_rows_f64`
/// of `kernels/compare.cu`): a format-2 step's rows of a layer reference, or with a head subset
/// its `(row, head)` rows, judged without crossing PCIe.
///
/// Errors: [`Error::Internal`] when an index reaches past `src`; [`Error::Cuda`] on a failed
/// allocation, copy or launch.
pub fn gather_rows_f64(dev: &Device, src: &CudaSlice<f64>, idx: &[usize], row_len: usize) -> Result<CudaSlice<f64>> {
    let rows_in = src.len() / row_len.max(1);
    if let Some(&bad) = idx.iter().find(|&&i| i >= rows_in) {
        return Err(Error::Internal(format!(
            "device gather: row {bad} asked of a buffer of {rows_in} rows of {row_len}"
        )));
    }
    let n = idx.len() * row_len;
    let stream = dev.stream();
    // SAFETY: every element below n is written by the kernel before any read.
    let mut dst = unsafe { stream.alloc::<f64>(n.max(1)) }
        .map_err(|e| Error::cuda(format!("cuMemAlloc of {n} gathered f64: {e:?}")))?;
    if n == 0 {
        return Ok(dst);
    }
    let idx64: Vec<i64> = idx.iter().map(|&i| i as i64).collect();
    let idx_d = stream
        .clone_htod(&idx64[..])
        .map_err(|e| Error::cuda(format!("upload of {} row indices: {e:?}", idx.len())))?;
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535 * 16);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (nn, rl) = (idx.len() as i64, row_len as i64);
    let f = dev.func(Module::Compare, "gather_rows_f64")?;
    let mut b = stream.launch_builder(&f);
    b.arg(src).arg(&idx_d).arg(&mut dst).arg(&nn).arg(&rl);
    // SAFETY: argument types match gather_rows_f64; every index was checked against src above and
    // dst holds n elements.
    unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch gather_rows_f64: {e:?}")))?;
    Ok(dst)
}

/// The [`ElementSums`] of the first `n` elements of `r` (reference, f64) and `c` (candidate,
/// f32), both on `dev`, with pass 2's absolute tolerance `atol_rms · rms(r)` and relative
/// tolerance `rtol` (the site's tolerance row): the numbers `judge::metrics` builds a site's
/// metrics from, computed by `cmp_pass1` and `cmp_pass2` of `kernels/compare.cu`.
///
/// The host adds the block partials in block order: counts are exact, sums agree with the CPU's
/// to f64 rounding, and the worst element is the same one (largest difference, lowest index).
///
/// Errors: [`Error::Internal`] when `n` exceeds either buffer; [`Error::Cuda`] on a failed launch
/// or copy.
pub fn element_sums(
    dev: &Device,
    r: &CudaSlice<f64>,
    c: &CudaSlice<f32>,
    n: usize,
    atol_rms: f64,
    rtol: f64,
) -> Result<ElementSums> {
    if n > r.len() || n > c.len() {
        return Err(Error::Internal(format!(
            "device compare: {n} elements asked of buffers of {} and {}",
            r.len(),
            c.len()
        )));
    }
    if n == 0 {
        return Ok(ElementSums::default());
    }
    let blocks = n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.stream();
    let alloc_err = |e| Error::cuda(format!("cuMemAlloc of compare partials: {e:?}"));
    let nn = n as i64;
    // SAFETY: every partial is written by its block before the download.
    let mut sums = unsafe { stream.alloc::<f64>(blocks * 4) }.map_err(alloc_err)?;
    let mut counts = unsafe { stream.alloc::<u64>(blocks * 6) }.map_err(alloc_err)?;
    let f1 = dev.func(Module::Compare, "cmp_pass1")?;
    let mut b = stream.launch_builder(&f1);
    b.arg(r)
        .arg(c)
        .arg(&nn)
        .arg(&CANARY_BITS)
        .arg(&CANARY_MASK)
        .arg(&mut sums)
        .arg(&mut counts);
    // SAFETY: argument types match cmp_pass1; reads stay below n ≤ both lengths.
    unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch cmp_pass1: {e:?}")))?;
    let (sums_h, counts_h) = (download(dev, &sums, blocks * 4)?, download(dev, &counts, blocks * 6)?);
    let mut p1 = Pass1::default();
    for (s, u) in sums_h.chunks_exact(4).zip(counts_h.chunks_exact(6)) {
        p1.absorb(&Pass1 {
            nf_r: u[0] as usize,
            nf_c: u[1] as usize,
            nf_mis: u[2] as usize,
            first_mis: (u[3] != u64::MAX).then_some(u[3] as usize),
            canary: u[4] as usize,
            zeros: u[5] as usize,
            rr: s[0],
            cc: s[1],
            dd: s[2],
            rc: s[3],
        });
    }
    // Blocks cover interleaved elements, so the first mismatch is the smallest of theirs.
    p1.first_mis = counts_h
        .chunks_exact(6)
        .filter(|u| u[3] != u64::MAX)
        .map(|u| u[3] as usize)
        .min();
    let rms = p1.rms(n);
    let (atol, floor) = (atol_rms * rms, 1e-3 * rms);
    let mut worst = unsafe { stream.alloc::<f64>(blocks * 2) }.map_err(alloc_err)?;
    let mut idx = unsafe { stream.alloc::<u64>(blocks * 2) }.map_err(alloc_err)?;
    let f2 = dev.func(Module::Compare, "cmp_pass2")?;
    let mut b = stream.launch_builder(&f2);
    b.arg(r)
        .arg(c)
        .arg(&nn)
        .arg(&atol)
        .arg(&rtol)
        .arg(&floor)
        .arg(&mut worst)
        .arg(&mut idx);
    // SAFETY: argument types match cmp_pass2; reads stay below n ≤ both lengths.
    unsafe { b.launch(cfg) }.map_err(|e| Error::cuda(format!("launch cmp_pass2: {e:?}")))?;
    let (worst_h, idx_h) = (download(dev, &worst, blocks * 2)?, download(dev, &idx, blocks * 2)?);
    let mut p2 = Pass2::default();
    for (w, i) in worst_h.chunks_exact(2).zip(idx_h.chunks_exact(2)) {
        let (d, at) = (w[0], i[0] as usize);
        // Blocks interleave: the larger difference wins, the lower index on a tie.
        if d > p2.max_abs || (d == p2.max_abs && d > 0.0 && at < p2.max_i) {
            p2.max_abs = d;
            p2.max_i = at;
        }
        p2.max_rel = p2.max_rel.max(w[1]);
        p2.passed += i[1] as usize;
    }
    Ok(ElementSums {
        n,
        pass1: p1,
        pass2: p2,
        r_at_max: one(dev, r, p2.max_i)?,
        c_at_max: f64::from(one(dev, c, p2.max_i)?),
    })
}
