//! The comparison of [`crate::judge::metrics`] for traces that stay on the GPU.
//!
//! With the CUDA backend and the GPU reference, a layer's reference sites and each path's sites
//! are kept on the device (see [`crate::backend::cuda::compare`]); this module judges them there
//! and builds the same [`SiteDiff`]s [`metrics::diff`] would: device sites against device
//! reference sites through the device passes, everything else (sites either side recorded on
//! the host, id sets) on the host with the reference site downloaded. Only the numbers of the
//! verdict cross PCIe on a clean layer.

use std::borrow::Cow;

use crate::backend::cuda::compare::{DeviceSite, SplitTrace, element_sums, upload_f32, upload_f64};
use crate::core::error::Result;
use crate::core::trace::{Trace, shapes_compatible};
use crate::device::context::Device;
use crate::judge::metrics::{self, SiteDiff, Status};
use crate::judge::tolerance::{Precision, tolerance};

/// Compares one path's sites with the reference, both split between host and device, under
/// the tolerance rows of `precision`: one [`SiteDiff`] per candidate site (host or device), in
/// data-flow order, as [`metrics::diff`] of the two whole host traces would give (counts and
/// the worst element identical; sums to f64 rounding).
///
/// Errors: [`crate::core::error::Error::Cuda`] on a failed launch or copy.
pub fn diff(
    dev: &Device,
    reference: &SplitTrace,
    cand_host: &Trace,
    cand_device: &[DeviceSite<f32>],
    precision: impl Into<Precision>,
) -> Result<Vec<SiteDiff>> {
    let precision = precision.into();
    // Sites the path recorded on the host: judged on the host against the reference's values
    // (downloaded when the reference kept them on the device).
    let mut ref_host = Trace::new();
    for site in cand_host.sites_in_order() {
        if let Some(t) = reference.host_site(dev, &site)? {
            ref_host.record(site, t);
        }
    }
    let mut out = metrics::diff(&ref_host, cand_host, precision);
    drop(ref_host);
    for c in cand_device {
        let site = c.site;
        let d = if site.stage.is_id_set() {
            // Id sets compare sorted rows: on the host.
            let mut one = Trace::new();
            one.record(
                site,
                crate::core::trace::TraceTensor::f32(
                    c.shape.clone(),
                    crate::backend::cuda::compare::download(dev, &c.buf, c.numel())?,
                ),
            );
            let mut r = Trace::new();
            if let Some(t) = reference.host_site(dev, &site)? {
                r.record(site, t);
            }
            metrics::diff(&r, &one, precision).remove(0)
        } else if let Some((shape, buf)) = match reference.device_site(&site) {
            Some(r) => Some((r.shape.clone(), Cow::Borrowed(&r.buf))),
            // A reference site recorded on the host (the CPU-built weight sites under TP):
            // copied to the device for this comparison.
            None => reference
                .host
                .get(&site)
                .map(|t| Ok::<_, crate::core::error::Error>((t.shape.clone(), Cow::Owned(upload_f64(dev, t)?))))
                .transpose()?,
        } {
            if !shapes_compatible(&shape, &c.shape) {
                metrics::shape_mismatch(site, &shape, &c.shape, precision)
            } else {
                let (tol, _) = tolerance(site.stage, precision);
                let n = shape.iter().product::<usize>().min(c.numel());
                let sums = element_sums(dev, &buf, &c.buf, n, tol.atol_rms, tol.rtol)?;
                metrics::diff_from_sums(site, &shape, &c.shape, &sums, precision)
            }
        } else {
            SiteDiff {
                site,
                status: Status::NoReference,
                shape_ref: vec![],
                shape_cand: c.shape.clone(),
                metrics: None,
                failed: vec!["no_reference"],
                tolerance: tolerance(site.stage, precision).0,
                note: None,
            }
        };
        out.push(d);
    }
    out.sort_by_key(|d| d.site.order());
    Ok(out)
}

/// [`diff`] for a host candidate trace against a reference split between host and device,
/// uploading the candidate's sites that meet a device reference site (used by tests to check
/// the device passes against [`metrics::diff`] on the same data).
///
/// Errors: as [`diff`].
pub fn diff_host_candidate(
    dev: &Device,
    reference: &SplitTrace,
    cand: &Trace,
    precision: impl Into<Precision>,
) -> Result<Vec<SiteDiff>> {
    let precision = precision.into();
    let mut host = Trace::new();
    let mut device = Vec::new();
    for site in cand.sites_in_order() {
        let Some(t) = cand.get(&site) else { continue };
        if reference.device_site(&site).is_some() && !site.stage.is_id_set() {
            device.push(DeviceSite {
                site,
                shape: t.shape.clone(),
                buf: upload_f32(dev, t)?,
            });
        } else {
            host.record(site, t.clone());
        }
    }
    diff(dev, reference, &host, &device, precision)
}
