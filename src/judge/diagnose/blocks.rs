//! The block-permutation finder: which reference blocks, in which order, make up a candidate.
//!
//! Shard-order bugs, TP rank-order bugs, duplicated ranks and missing shards all look the same
//! from outside: a tensor whose blocks along one axis (fused shards, TP ranks, heads, k/v halves)
//! are the right blocks in the wrong places. Given a candidate, a reference of the same shape and
//! a partition of the reference along one axis, this finder matches every block position of the
//! candidate to the reference block that explains it (within a relative-L2 threshold), and
//! describes the result: a permutation such as `[1,0]`, "block 0 everywhere", a duplicate, or a
//! missing block. A candidate that is merely noisy matches nothing displaced and is rejected.

/// Result of matching candidate blocks to reference blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockMatch {
    /// For each candidate block position (in order), the reference block it equals, if any.
    pub map: Vec<Option<usize>>,
    /// Relative L2 error of each matched position against its reference block (NaN if none).
    pub errors: Vec<f64>,
    /// Sizes (along the axis) of the candidate's block positions.
    pub sizes: Vec<usize>,
}

impl BlockMatch {
    /// True when every position holds its own block.
    pub fn is_identity(&self) -> bool {
        self.map.iter().enumerate().all(|(i, m)| *m == Some(i))
    }

    /// True when some position holds another position's block: a layout bug, not noise.
    pub fn explains(&self) -> bool {
        self.map
            .iter()
            .enumerate()
            .any(|(i, m)| matches!(m, Some(j) if *j != i))
    }

    /// True when the positions hold every block exactly once (a pure permutation).
    pub fn is_permutation(&self) -> bool {
        let n = self.map.len();
        let mut seen = vec![false; n];
        for m in &self.map {
            match m {
                Some(j) if *j < n && !seen[*j] => seen[*j] = true,
                _ => return false,
            }
        }
        true
    }

    /// The permutation as `[1,0]`-style text, with `?` for unmatched positions.
    pub fn map_text(&self) -> String {
        let parts: Vec<String> = self
            .map
            .iter()
            .map(|m| m.map_or("?".to_string(), |j| j.to_string()))
            .collect();
        format!("[{}]", parts.join(","))
    }

    /// Reference blocks that appear nowhere in the candidate.
    pub fn missing(&self) -> Vec<usize> {
        (0..self.map.len()).filter(|j| !self.map.contains(&Some(*j))).collect()
    }

    /// Reference blocks that appear more than once.
    pub fn duplicated(&self) -> Vec<usize> {
        (0..self.map.len())
            .filter(|j| self.map.iter().filter(|m| **m == Some(*j)).count() > 1)
            .collect()
    }

    /// A one-line description using `unit` for a block ("shard", "rank", "head").
    pub fn describe(&self, unit: &str) -> String {
        if self.is_permutation() {
            return format!("{unit}s in order {} (a permutation)", self.map_text());
        }
        if let Some(j) = self.map[0].filter(|_| self.map.len() > 1 && self.map.iter().all(|m| *m == self.map[0])) {
            return format!(
                "{unit} {j} everywhere: every position holds {unit} {j}'s block {}",
                self.map_text()
            );
        }
        let mut s = format!("{unit}s in order {}", self.map_text());
        let dup = self.duplicated();
        if !dup.is_empty() {
            s.push_str(&format!("; duplicated: {dup:?}"));
        }
        let miss = self.missing();
        if !miss.is_empty() {
            s.push_str(&format!("; missing: {miss:?}"));
        }
        s
    }
}

/// Relative L2 distance of two equal-length slices (‖a−b‖/‖b‖; ‖a−b‖ when b = 0), f64.
pub fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += (x - y) * (x - y);
        n += y * y;
    }
    if n > 0.0 { (d / n).sqrt() } else { d.sqrt() }
}

/// Gathers the sub-tensor `[.., off..off+len, ..]` along `axis` of a row-major `shape`, flattened.
pub fn take_along(data: &[f64], shape: &[usize], axis: usize, off: usize, len: usize) -> Vec<f64> {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let dim = shape[axis];
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let base = o * dim * inner;
        out.extend_from_slice(&data[base + off * inner..base + (off + len) * inner]);
    }
    out
}

/// Where each block of `sizes`, laid end to end from 0, starts.
fn block_offsets(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |start, &size| {
            let this = *start;
            *start += size;
            Some(this)
        })
        .collect()
}

/// Matches the candidate's blocks along `axis` to the reference blocks of sizes `sizes`
/// (which must sum to `shape[axis]`).
///
/// Positions are found left to right: at each offset, every reference block that fits is tried
/// and the one with the lowest relative L2 error below `threshold` wins. With unequal sizes a
/// position that matches nothing can only be skipped at a reference block boundary; otherwise the
/// search gives up (returns `None`). Returns `None` also for inconsistent arguments.
pub fn find_blocks(
    cand: &[f64],
    refr: &[f64],
    shape: &[usize],
    axis: usize,
    sizes: &[usize],
    threshold: f64,
) -> Option<BlockMatch> {
    if axis >= shape.len() || cand.len() != refr.len() || sizes.iter().sum::<usize>() != shape[axis] || sizes.is_empty()
    {
        return None;
    }
    let offs = block_offsets(sizes);
    let ref_blocks: Vec<Vec<f64>> = offs
        .iter()
        .zip(sizes)
        .map(|(&o, &s)| take_along(refr, shape, axis, o, s))
        .collect();
    let (mut map, mut errors, mut psizes) = (Vec::new(), Vec::new(), Vec::new());
    let mut off = 0;
    while off < shape[axis] {
        let mut best: Option<(usize, f64)> = None;
        for (j, &s) in sizes.iter().enumerate() {
            if off + s > shape[axis] {
                continue;
            }
            let e = rel_l2(&take_along(cand, shape, axis, off, s), &ref_blocks[j]);
            if e <= threshold && best.is_none_or(|(_, be)| e < be) {
                best = Some((j, e));
            }
        }
        match best {
            Some((j, e)) => {
                map.push(Some(j));
                errors.push(e);
                psizes.push(sizes[j]);
                off += sizes[j];
            }
            None => {
                let k = offs.iter().position(|&o| o == off)?;
                map.push(None);
                errors.push(f64::NAN);
                psizes.push(sizes[k]);
                off += sizes[k];
            }
        }
    }
    Some(BlockMatch {
        map,
        errors,
        sizes: psizes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::batch::SplitMix64;

    fn randv(seed: u64, n: usize) -> Vec<f64> {
        let mut r = SplitMix64::new(seed);
        (0..n).map(|_| r.normal()).collect()
    }

    /// Builds a candidate from reference blocks (rows of a [rows, 3] matrix) in `order`.
    fn assemble(refr: &[f64], sizes: &[usize], order: &[Option<usize>]) -> Vec<f64> {
        let offs = block_offsets(sizes);
        let mut out = Vec::new();
        for (pos, o) in order.iter().enumerate() {
            match o {
                Some(j) => out.extend_from_slice(&refr[offs[*j] * 3..(offs[*j] + sizes[*j]) * 3]),
                None => out.extend(randv(99 + pos as u64, sizes[pos] * 3)),
            }
        }
        out
    }

    #[test]
    fn swap_of_unequal_shards_is_found() {
        // Like fused_qkv_a: shard 0 (q_a) 2 rows, shard 1 (kv_a) 5 rows.
        let sizes = [2, 5];
        let refr = randv(1, 7 * 3);
        let cand = assemble(&refr, &sizes, &[Some(1), Some(0)]);
        let m = find_blocks(&cand, &refr, &[7, 3], 0, &sizes, 1e-3).unwrap();
        assert_eq!(m.map, vec![Some(1), Some(0)]);
        assert!(m.explains() && m.is_permutation());
        assert_eq!(m.map_text(), "[1,0]");
    }

    #[test]
    fn rotation_of_equal_blocks_along_inner_axis() {
        // [T=4, heads=3, X=2] with heads rotated: positions hold heads [1,2,0].
        let refr = randv(2, 4 * 3 * 2);
        let mut cand = vec![0.0; refr.len()];
        for t in 0..4 {
            for (pos, src) in [1usize, 2, 0].iter().enumerate() {
                for x in 0..2 {
                    cand[(t * 3 + pos) * 2 + x] = refr[(t * 3 + src) * 2 + x];
                }
            }
        }
        let m = find_blocks(&cand, &refr, &[4, 3, 2], 1, &[1, 1, 1], 1e-3).unwrap();
        assert_eq!(m.map, vec![Some(1), Some(2), Some(0)]);
        assert!(m.is_permutation());
    }

    #[test]
    fn duplicated_rank_is_reported_as_everywhere() {
        let sizes = [3, 3];
        let refr = randv(3, 6 * 3);
        let cand = assemble(&refr, &sizes, &[Some(0), Some(0)]);
        let m = find_blocks(&cand, &refr, &[6, 3], 0, &sizes, 1e-3).unwrap();
        assert_eq!(m.map, vec![Some(0), Some(0)]);
        assert!(m.explains() && !m.is_permutation());
        assert_eq!(m.duplicated(), vec![0]);
        assert_eq!(m.missing(), vec![1]);
        assert!(
            m.describe("rank").contains("rank 0 everywhere"),
            "{}",
            m.describe("rank")
        );
    }

    #[test]
    fn missing_block_is_named() {
        let sizes = [2, 2, 2];
        let refr = randv(4, 6 * 3);
        let cand = assemble(&refr, &sizes, &[Some(1), Some(2), None]);
        let m = find_blocks(&cand, &refr, &[6, 3], 0, &sizes, 1e-3).unwrap();
        assert_eq!(m.map, vec![Some(1), Some(2), None]);
        assert!(m.explains());
        assert_eq!(m.missing(), vec![0]);
        assert!(m.describe("shard").contains("missing: [0]"));
    }

    #[test]
    fn identity_and_noise_are_rejected() {
        let sizes = [2, 2];
        let refr = randv(5, 4 * 3);
        let m = find_blocks(&refr, &refr, &[4, 3], 0, &sizes, 1e-3).unwrap();
        assert!(m.is_identity() && !m.explains());
        // Noise of 1% relative: matches nothing displaced, so no permutation is claimed.
        let noise = randv(6, 12);
        let noisy: Vec<f64> = refr.iter().zip(&noise).map(|(r, n)| r + 0.01 * n).collect();
        let m = find_blocks(&noisy, &refr, &[4, 3], 0, &sizes, 1e-3).unwrap();
        assert!(!m.explains(), "{:?}", m);
        // Heavy noise: nothing matches at all.
        let junk = randv(7, 12);
        let m = find_blocks(&junk, &refr, &[4, 3], 0, &sizes, 1e-3).unwrap();
        assert_eq!(m.map, vec![None, None]);
        assert!(!m.explains());
    }

    #[test]
    fn inconsistent_arguments_give_none() {
        assert!(find_blocks(&[1.0; 4], &[1.0; 4], &[4], 0, &[3], 1e-3).is_none());
        assert!(find_blocks(&[1.0; 4], &[1.0; 4], &[4], 1, &[4], 1e-3).is_none());
    }
}
