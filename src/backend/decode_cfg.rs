//! Launch configurations of the fast decode kernel (`decode_split_mma`).
//!
//! `kernels/fast_decode.cu` is one kernel with many shapes, chosen by `FD_*` defines at NVRTC
//! compile time. [`DecodeCfg`] is the typed form of those defines: which shape runs for a head
//! count and architecture, its validity rules (the same ones the kernel's static checks encode),
//! its shared-memory size, and the textual syntax of `MLA_DIFF_DECODE_CFG`.

use crate::backend::cfg_fields::{self, Field};
use crate::core::error::{Error, Result};
use crate::device::ComputeCapability;

/// The split count for a grid of `blocks` blocks per split on `slots` resident blocks: the
/// smallest `s` in `1..=max_splits` whose `blocks·s` blocks fill their waves to at least 90 %
/// (`blocks·s / (⌈blocks·s / slots⌉·slots)`), else the one filling them best. More splits than
/// needed only add merge work and per-block start-up.
pub fn wave_splits(blocks: usize, slots: usize, max_splits: usize) -> usize {
    let (blocks, slots) = (blocks.max(1), slots.max(1));
    let fill = |s: usize| (blocks * s) as f64 / ((blocks * s).div_ceil(slots) * slots) as f64;
    let max_splits = max_splits.max(1);
    (1..=max_splits)
        .find(|&s| fill(s) >= 0.9)
        .unwrap_or_else(|| (1..=max_splits).fold(1, |b, s| if fill(s) > fill(b) + 1e-9 { s } else { b }))
}

/// Launch configuration of `decode_split_mma` (the `FD_*` macros of fast_decode.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeCfg {
    /// Heads per block (the MMA's M), a multiple of 16.
    pub heads: usize,
    /// Warps per consumer team (per block with one team).
    pub warps: usize,
    /// Parts the W dimension of Q·Kᵀ is cut into.
    pub parts: usize,
    /// Q fragments held in registers.
    pub q_in_registers: bool,
    /// Cache tiles in the cp.async pipeline.
    pub stages: usize,
    /// Blocks per SM the register allocation must allow (`__launch_bounds__`).
    pub min_blocks: usize,
    /// Softmax in registers by every warp (no P in shared memory, two barriers per tile).
    pub fused: bool,
    /// Producer warps streaming the cache with bulk copies (TMA) into mbarrier-tracked stages
    /// (`FD_TMA`; the rows of a tile are split between them), so the consumer warps issue no
    /// copies; 0: the consumer warps copy with cp.async. Divides 32.
    pub producers: usize,
    /// Merge the splits on chip: the `splits` blocks of one (token, head group) form a
    /// thread-block cluster and merge through distributed shared memory (`FD_CLUSTER` =
    /// splits), instead of global partials, an atomic counter and a last-block merge. Needs
    /// producers; applies only where [`DecodeCfg::cluster_size`] says so, else the fused merge
    /// runs.
    pub cluster: bool,
    /// Hopper's warpgroup MMA (`FD_WG`: `wgmma.mma_async`, compiled for sm_90a) instead of
    /// `mma.sync`: 64 heads and 64 cache rows per tile, two warpgroups, FlashMLA's layout (see
    /// fast_decode.cu). Needs `heads` 64, `warps` 8, `stages` 2, no TMA, cluster, fused softmax or
    /// QREG; runs only on sm_90 ([`ComputeCapability::has_wgmma`]) with L a multiple of 128 and L+R ≤ 576
    /// ([`DecodeCfg::wgmma_fits`]).
    pub wgmma: bool,
    /// Consumer teams of `warps` warps taking alternate tiles of one stage ring (`FD_TEAMS`, 1
    /// or 2: the kernel's rules would allow 4, but 3 and 4 never ran on a GPU): one block per SM
    /// keeps one Q copy and a deep ring while two teams compute.
    /// More than one needs producers, the unfused softmax, and `teams` dividing `2·stages`
    /// with `stages ≥ teams` (the parity waits of fast_decode.cu).
    pub teams: usize,
}

impl DecodeCfg {
    /// The fields of the configuration string, in positional order, with their names and their
    /// values when left out ([`DecodeCfg::parse`]).
    pub const FIELDS: [Field; 11] = [
        Field::required("heads"),
        Field::required("warps"),
        Field::optional("parts", 1),
        Field::optional("qreg", 0),
        Field::required("stages"),
        Field::optional("min_blocks", 1),
        Field::optional("fused", 0),
        Field::optional("tma", 0),
        Field::optional("cluster", 0),
        Field::optional("wgmma", 0),
        Field::optional("teams", 1),
    ];

    /// The default for `nh` heads: the 64-head wgmma block when there are at least 64 heads
    /// ([`DecodeCfg::WGMMA`]: the cache is read once per 64 heads; one block of two warpgroups
    /// per SM; [`DecodeCfg::for_arch`] and [`DecodeCfg::fit`] turn it into the `mma.sync`
    /// [`DecodeCfg::MMA64`] where it cannot run), else the teams block ([`DecodeCfg::TEAMS`]:
    /// one 16-head block per SM, two teams of four consumer warps on a four-stage ring fed by
    /// four producer warps, the splits merged through a thread-block cluster; on the H200 the
    /// memory-bound bench's fastest, BENCHMARKS.md "GPU: the fast CUDA kernels"), which [`DecodeCfg::for_arch`]
    /// turns into the copying form of [`DecodeCfg::TMA16`] below sm_90.
    pub fn for_heads(nh: usize) -> Self {
        if nh >= 64 { DecodeCfg::WGMMA } else { DecodeCfg::TEAMS }
    }

    /// The 16-head block of one team (`16,8,2,0,2,2,0,1`): 8 consumer warps, 2 k-parts, one
    /// producer warp, double-buffered, two blocks per SM, the merge through global memory (the
    /// N < 64 default before the teams block).
    pub const TMA16: DecodeCfg = DecodeCfg {
        heads: 16,
        warps: 8,
        parts: 2,
        q_in_registers: false,
        stages: 2,
        min_blocks: 2,
        fused: false,
        producers: 1,
        cluster: false,
        wgmma: false,
        teams: 1,
    };

    /// The teams block (`16,4,1,0,4,1,0,4,1,0,2`): 16 heads, two teams of 4 consumer warps (one
    /// k-part each), 4 producer warps, 4 stages (so each stage always serves the same team), one
    /// block per SM, the merge through a cluster of the token's splits where
    /// [`DecodeCfg::cluster_size`] allows. With 5 stages (`16,4,1,0,5,1,0,4,1,0,2`) a team also
    /// waits for the other team's release of a stage: 2.5–3 % slower on the H200 (BENCHMARKS.md).
    pub const TEAMS: DecodeCfg = DecodeCfg {
        heads: 16,
        warps: 4,
        parts: 1,
        q_in_registers: false,
        stages: 4,
        min_blocks: 1,
        fused: false,
        producers: 4,
        cluster: true,
        wgmma: false,
        teams: 2,
    };

    /// The wgmma block (`64,8,1,0,2,1,0,0,0,1`): 64 heads, two warpgroups, one block per SM.
    pub const WGMMA: DecodeCfg = DecodeCfg {
        heads: 64,
        warps: 8,
        parts: 1,
        q_in_registers: false,
        stages: 2,
        min_blocks: 1,
        fused: false,
        producers: 0,
        cluster: false,
        wgmma: true,
        teams: 1,
    };

    /// The 64-head `mma.sync` block (`64,8,2,0,2`): what [`DecodeCfg::WGMMA`] falls back to where
    /// wgmma cannot run (not sm_90, or L+R and L outside [`DecodeCfg::wgmma_fits`]).
    pub const MMA64: DecodeCfg = DecodeCfg {
        parts: 2,
        wgmma: false,
        ..DecodeCfg::WGMMA
    };

    /// True when the configuration streams the cache with producer warps (bulk copies, sm_90+).
    pub fn tma(&self) -> bool {
        self.producers > 0
    }

    /// True when the wgmma block handles cache rows of `width` = L+R with `dv` = L value
    /// columns: L a multiple of 128 (64 value columns per wgmma and warpgroup), L ≤ L+R, L+R a
    /// multiple of 16 (the wgmma K) and its shared memory ([`DecodeCfg::smem`]) within the
    /// 227 KiB a block may use (L+R ≤ 576).
    pub fn wgmma_fits(width: usize, dv: usize) -> bool {
        dv > 0
            && dv.is_multiple_of(128)
            && dv <= width
            && width.is_multiple_of(16)
            && DecodeCfg::WGMMA.smem(width) <= 227 * 1024
    }

    /// This configuration as `arch` can run it: the TMA producer warps (bulk copies, mbarriers)
    /// need sm_90 or newer, so below that a one-team block runs with its consumer warps copying
    /// (no clusters either) and a teams block becomes [`DecodeCfg::TMA16`] in that copying form;
    /// the wgmma block needs sm_90 exactly ([`ComputeCapability::has_wgmma`]) and becomes
    /// [`DecodeCfg::MMA64`] elsewhere.
    pub fn for_arch(self, arch: ComputeCapability) -> Self {
        if self.wgmma && !arch.has_wgmma() {
            DecodeCfg::MMA64
        } else if self.tma() && !arch.has_tma() {
            let one = if self.teams > 1 { DecodeCfg::TMA16 } else { self };
            DecodeCfg {
                producers: 0,
                cluster: false,
                ..one
            }
        } else {
            self
        }
    }

    /// Parses
    /// `HM,WARPS,PARTS,QREG,STAGES[,MINBLOCKS[,FUSED[,TMA[,CLUSTER[,WGMMA[,TEAMS]]]]]]`
    /// (QREG, FUSED, CLUSTER and WGMMA 0 or 1; TMA the number of producer warps, 0 for
    /// none; MINBLOCKS and TEAMS default to 1, the others to 0), or the same fields named
    /// ([`DecodeCfg::FIELDS`]: `heads=16,warps=4,parts=1,stages=4,tma=4,cluster=1,teams=2`, any
    /// order; heads, warps and stages required, parts 1 and the others as above when left out).
    /// CLUSTER 1 merges the splits through a thread-block cluster of `splits` blocks where
    /// [`DecodeCfg::cluster_size`] allows, and needs TMA ≥ 1. WGMMA 1 is the warpgroup-MMA block
    /// and needs `64,8,P,0,2,1,0,0,0,1` (P is unused). TEAMS > 1 needs TMA ≥ 1, FUSED 0 and TEAMS
    /// dividing 2·STAGES with STAGES ≥ TEAMS, MINBLOCKS 1, and is at most 2. docs/kernels.md is
    /// the reference.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the string and the field when it does not parse
    /// ([`cfg_fields::parse_fields`]) or the configuration does not tile (see
    /// `fast_decode.cu`'s header).
    pub fn parse(s: &str) -> Result<Self> {
        let v = cfg_fields::parse_fields(s, &Self::FIELDS)
            .map_err(|e| Error::Usage(format!("decode configuration `{s}`: {e}")))?;
        let c = DecodeCfg {
            heads: v[0],
            warps: v[1],
            parts: v[2],
            q_in_registers: v[3] != 0,
            stages: v[4],
            min_blocks: v[5],
            fused: v[6] != 0,
            producers: v[7],
            cluster: v[8] != 0,
            wgmma: v[9] != 0,
            teams: v[10],
        };
        for (name, x) in [("qreg", v[3]), ("fused", v[6]), ("cluster", v[8]), ("wgmma", v[9])] {
            if x > 1 {
                return Err(Error::Usage(format!(
                    "decode configuration `{s}`: field `{name}` is {x}: must be 0 or 1"
                )));
            }
        }
        if let Some(rule) = c.broken_rule() {
            return Err(Error::Usage(format!("decode configuration `{s}`: {rule}")));
        }
        Ok(c)
    }

    /// [`DecodeCfg::parse`] of `s` read from the environment variable `var` (the CUDA backend
    /// parses `MLA_DIFF_DECODE_CFG` this way when it is created, `mla-diff bench` each
    /// `MLA_DIFF_BENCH_DECODE` entry).
    ///
    /// # Errors
    /// [`DecodeCfg::parse`]'s, prefixed with `var` (one line, e.g. `MLA_DIFF_DECODE_CFG: decode
    /// configuration `…`: …`).
    pub fn parse_named(var: &str, s: &str) -> Result<Self> {
        Self::parse(s).map_err(|e| cfg_fields::env_err(var, e))
    }

    /// The first tiling rule of fast_decode.cu (its static checks and launch limits) that this
    /// configuration breaks, as one message naming the field (docs/kernels.md's names) and its
    /// value, e.g. "field `heads` is 20: must be a multiple of 16 (16 or more)"; `None` when it
    /// tiles.
    fn broken_rule(&self) -> Option<String> {
        let (h, w, t, p) = (self.heads, self.warps, self.teams, self.producers);
        let field = |name: &str, v: usize, rule: String| Some(format!("field `{name}` is {v}: {rule}"));
        if h < 16 || !h.is_multiple_of(16) {
            return field("heads", h, "must be a multiple of 16 (16 or more)".into());
        }
        if w == 0 {
            return field("warps", w, "must be at least 1".into());
        }
        if self.parts == 0 {
            return field("parts", self.parts, "must be at least 1".into());
        }
        if !(2..=6).contains(&self.stages) {
            return field("stages", self.stages, "must be 2 to 6".into());
        }
        if !(1..=4).contains(&self.min_blocks) {
            return field("min_blocks", self.min_blocks, "must be 1 to 4".into());
        }
        if !(1..=2).contains(&t) {
            return field("teams", t, "must be 1 or 2 (more were never run on a GPU)".into());
        }
        if self.wgmma {
            let need = [
                ("heads", h, 64),
                ("warps", w, 8),
                ("stages", self.stages, 2),
                ("min_blocks", self.min_blocks, 1),
                ("qreg", usize::from(self.q_in_registers), 0),
                ("fused", usize::from(self.fused), 0),
                ("tma", p, 0),
                ("cluster", usize::from(self.cluster), 0),
                ("teams", t, 1),
            ];
            if let Some(&(name, v, want)) = need.iter().find(|(_, v, want)| v != want) {
                return field(
                    name,
                    v,
                    format!("wgmma=1 (the warpgroup-MMA block, `64,8,P,0,2,1,0,0,0,1`) needs {want}"),
                );
            }
        }
        if p > 0 && !32usize.is_multiple_of(p) {
            return field("tma", p, "the producer warps must divide 32".into());
        }
        if w * t + p > 32 {
            return field(
                "tma",
                p,
                format!(
                    "with warps·teams = {} consumer warps that makes {} warps, more than 32",
                    w * t,
                    w * t + p
                ),
            );
        }
        if self.cluster && !self.tma() {
            return field(
                "cluster",
                1,
                "the merge through a thread-block cluster needs `tma` 1 or more".into(),
            );
        }
        if t > 1 {
            if !self.tma() {
                return field("teams", t, "more than one team needs `tma` 1 or more".into());
            }
            if self.fused {
                return field("teams", t, "more than one team needs `fused` 0".into());
            }
            if self.min_blocks > 1 {
                return field(
                    "min_blocks",
                    self.min_blocks,
                    format!(
                        "must be 1 with `teams` {t}: one block per SM (more only caps the registers: ptxas spills)"
                    ),
                );
            }
            if !self.team_valid(self.stages) {
                return field(
                    "stages",
                    self.stages,
                    format!("`teams` {t} needs stages ≥ teams and teams dividing 2·stages"),
                );
            }
        }
        let per_part = (h / 16) * self.parts;
        if !w.is_multiple_of(per_part) {
            return field(
                "warps",
                w,
                format!("must be a multiple of heads/16 × parts = {per_part}"),
            );
        }
        if !4usize.is_multiple_of(w / per_part) {
            return field(
                "warps",
                w,
                format!(
                    "warps / (heads/16 × parts) = {} must divide 4 (the key n-tiles of a tile)",
                    w / per_part
                ),
            );
        }
        if h >= w && !h.is_multiple_of(w) {
            return field("heads", h, format!("must be a multiple of `warps` ({w}) or below it"));
        }
        None
    }

    /// True when `stages` stages suit this configuration's teams (see fast_decode.cu's
    /// `FD_TEAMS` check): producers, the unfused softmax, `teams` dividing `2·stages` and
    /// `stages ≥ teams`.
    fn team_valid(&self, stages: usize) -> bool {
        self.tma() && !self.fused && (2 * stages).is_multiple_of(self.teams) && stages >= self.teams
    }

    /// The same with fewer pipeline stages (down to 2, or to the fewest its teams allow) until
    /// its shared memory fits in the 227 KiB a block may use, for cache rows of `width` = L+R;
    /// the wgmma block becomes [`DecodeCfg::MMA64`] where [`DecodeCfg::wgmma_fits`] does not
    /// hold for (`width`, `dv`).
    pub fn fit(mut self, width: usize, dv: usize) -> Self {
        if self.wgmma && !DecodeCfg::wgmma_fits(width, dv) {
            return DecodeCfg::MMA64;
        }
        while self.smem(width) > 227 * 1024 {
            let fewer = (2..self.stages).rev().find(|&s| self.teams == 1 || self.team_valid(s));
            match fewer {
                Some(s) => self.stages = s,
                None => break,
            }
        }
        self
    }

    /// The cluster size the merge of a launch runs through (`FD_CLUSTER`): `splits` when
    /// `cluster` is on with producer warps, `arch` is sm_90 or newer ([`ComputeCapability::has_tma`]), the
    /// merge is fused into the launch (`merged`: `out` not null), `2 <= splits <= 8` and `dv`
    /// is a multiple of `4·splits` (each block of the cluster merges `dv/splits` value columns
    /// in float4s); else 0 (the fused merge through global memory, or none).
    pub fn cluster_size(&self, arch: ComputeCapability, splits: usize, dv: usize, merged: bool) -> usize {
        let on = self.cluster
            && self.tma()
            && arch.has_tma()
            && merged
            && (2..=8).contains(&splits)
            && dv.is_multiple_of(4 * splits);
        if on { splits } else { 0 }
    }

    /// Bytes of the dynamic shared memory before the final sums, for cache rows of `width`:
    /// where a block's partial output, the merge's per-head state and the teams' weighted
    /// partials go after the last tile (fast_decode.cu's `FD_SUMS_AT`).
    fn sums_at(&self, width: usize) -> usize {
        let ld = width + 8;
        let sbuf = 1 + usize::from(self.tma());
        self.heads * ld * 2
            + self.stages * 32 * ld * 2
            + self.teams * (sbuf * self.parts * self.heads * 40 * 4 + self.heads * 40 * 2 + self.heads * 4)
    }

    /// True when a block's partial output `[heads, dv]` f32 (row stride dv+8), the cluster merge's
    /// per-head state for a cluster of `c` (0: no cluster) and, with teams, the other teams'
    /// weighted partials `[teams−1, heads, dv]` fit in the shared memory below its final sums,
    /// for cache rows of `width` = L+R (the `#error` check of fast_decode.cu). At W = 576,
    /// L = 512 this holds for 16 and 64 heads (33 KB of 105 KB; 131 KB of 196 KB with TMA) and
    /// for the teams block (67 KB of 181 KB).
    pub fn cluster_fits(&self, width: usize, dv: usize, c: usize) -> bool {
        let own = if c > 0 {
            (self.heads * (dv + 8) + (2 * c + 3) * self.heads).div_ceil(4) * 4
        } else {
            0
        };
        (own + (self.teams - 1) * self.heads * (dv + 8)) * 4 <= self.sums_at(width)
    }

    /// `-D` defines of this configuration with the fused merge (`FD_CLUSTER=0`).
    pub fn defines(&self) -> Vec<(&'static str, usize)> {
        self.defines_for(0)
    }

    /// `-D` defines of this configuration with the merge through a cluster of `cluster` blocks
    /// (0: the fused merge; see [`DecodeCfg::cluster_size`]).
    pub fn defines_for(&self, cluster: usize) -> Vec<(&'static str, usize)> {
        vec![
            ("FD_HM", self.heads),
            ("FD_WARPS", self.warps),
            ("FD_P", self.parts),
            ("FD_QREG", usize::from(self.q_in_registers)),
            ("FD_STAGES", self.stages),
            ("FD_MINB", self.min_blocks),
            ("FD_FUSED", usize::from(self.fused)),
            ("FD_TMA", self.producers),
            ("FD_WG", usize::from(self.wgmma)),
            ("FD_TEAMS", self.teams),
            ("FD_CLUSTER", cluster),
        ]
    }

    /// Threads per block: the consumer warps of every team and the producer warps.
    pub fn threads(&self) -> usize {
        (self.warps * self.teams + self.producers) * 32
    }

    /// Dynamic shared memory for cache rows of `width` = L+R: Q tile, cache stages, each team's
    /// partial scores (two buffers with producers), P and α, then the final sums (and with teams
    /// the final maxima) of every team (as laid out in fast_decode.cu).
    pub fn smem(&self, width: usize) -> usize {
        if self.wgmma {
            // Q and two stages of 64 rows in 128-byte panels of 64 columns, P [64][64] bf16, α
            // and sums [64] f32, row slots [2][64] i64, and 1 KiB to align the base to 1024.
            let tile = width.div_ceil(64) * 64 * 128;
            return 3 * tile + 64 * 128 + 2 * 64 * 4 + 2 * 64 * 8 + 1024;
        }
        let finals = if self.teams > 1 { 2 } else { 1 };
        self.sums_at(width) + finals * self.teams * self.heads * 4
    }

    /// Short label, e.g. `hm16 w8 p2 qreg s4 fused` (` b2` when two blocks per SM are asked
    /// for, ` fused` for the in-register softmax, ` tma` for one producer warp with bulk copies
    /// and ` tmaN` for N of them, ` tN` for N consumer teams, ` cluster` for the merge through
    /// a thread-block cluster).
    pub fn label(&self) -> String {
        format!(
            "hm{} w{} p{} {} s{}{}{}{}{}{}{}",
            self.heads,
            self.warps,
            self.parts,
            if self.q_in_registers { "qreg" } else { "qsmem" },
            self.stages,
            if self.min_blocks > 1 {
                format!(" b{}", self.min_blocks)
            } else {
                String::new()
            },
            if self.fused { " fused" } else { "" },
            match self.producers {
                0 => String::new(),
                1 => " tma".to_string(),
                p => format!(" tma{p}"),
            },
            if self.teams > 1 {
                format!(" t{}", self.teams)
            } else {
                String::new()
            },
            if self.cluster { " cluster" } else { "" },
            if self.wgmma { " wgmma" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{DecodeCfg, wave_splits};
    use crate::device::ComputeCapability;

    fn sm(s: &str) -> ComputeCapability {
        s.parse().unwrap()
    }

    #[test]
    fn wave_splits_fill_whole_waves() {
        // The bench's shapes on 132 SMs: 64 blocks per split on 264 slots → 4 splits (256
        // blocks, 97 %); 128 blocks on 132 slots → 1 split (97 %).
        assert_eq!(wave_splits(64, 264, 64), 4);
        assert_eq!(wave_splits(128, 132, 64), 1);
        assert_eq!(wave_splits(64, 132, 64), 2);
        // Never more than allowed; the best fill when no count reaches 90 %.
        assert_eq!(wave_splits(64, 264, 1), 1);
        assert_eq!(wave_splits(100, 132, 1), 1);
        assert_eq!(wave_splits(0, 0, 0), 1);
    }

    #[test]
    fn named_fields_give_the_positional_configurations() {
        let p = |s: &str| DecodeCfg::parse(s).unwrap();
        assert_eq!(
            p("heads=16,warps=4,parts=1,stages=4,tma=4,cluster=1,teams=2"),
            DecodeCfg::TEAMS
        );
        assert_eq!(p("wgmma=1, heads=64, warps=8, stages=2"), DecodeCfg::WGMMA);
        assert_eq!(
            p("heads=16,warps=8,parts=2,stages=2,min_blocks=2,tma=1"),
            DecodeCfg::TMA16
        );
        assert_eq!(p("heads=64,warps=8,parts=2,stages=2"), p("64,8,2,0,2"));
        for (bad, why) in [
            ("heads=16,warps=4,stage=4", "unknown field `stage`"),
            ("heads=16,warps=4,stages=4,qreg=2", "field `qreg` is 2: must be 0 or 1"),
            ("heads=16,warps=4", "missing field `stages`"),
            (
                "heads=16,warps=4,stages=4,teams=3,tma=4",
                "field `teams` is 3: must be 1 or 2",
            ),
        ] {
            let e = DecodeCfg::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn decode_cfg_parse_and_check() {
        let c = DecodeCfg::parse("16,8,2,0,2,2,0,1").unwrap();
        assert_eq!(c, DecodeCfg::TMA16);
        assert_eq!(
            DecodeCfg::parse("16,8,2,0,2,2,0,1,1").unwrap(),
            DecodeCfg { cluster: true, ..c }
        );
        assert!(c.tma() && !DecodeCfg::parse("16,8,2,0,2,2").unwrap().tma());
        assert!(!c.for_arch(sm("sm_80")).tma() && c.for_arch(sm("sm_90")).tma() && c.for_arch(sm("sm_90a")).tma());
        assert_eq!(c.threads(), 288);
        assert!(DecodeCfg::parse("16,32,8,0,2").is_ok() && DecodeCfg::parse("16,32,8,0,2,1,0,1").is_err());
        assert_eq!(DecodeCfg::parse("64,8,2,0,2").unwrap(), DecodeCfg::MMA64);
        assert_eq!(
            DecodeCfg::parse("64,8,1,0,2,1,0,0,0,1").unwrap(),
            DecodeCfg::for_heads(128)
        );
        assert!(DecodeCfg::parse("16,8,2,1,4,1,1").unwrap().fused);
        // Each broken range rule is its own message naming the field and its value.
        let e = |s: &str| DecodeCfg::parse(s).unwrap_err().to_string();
        // 16-head blocks of 8 warps with 3 k-parts do not tile the 4 key n-tiles.
        assert_eq!(
            e("16,8,3,0,2"),
            "decode configuration `16,8,3,0,2`: field `warps` is 8: must be a multiple of heads/16 × parts = 3"
        );
        assert_eq!(
            e("16,8,2,0,1"),
            "decode configuration `16,8,2,0,1`: field `stages` is 1: must be 2 to 6"
        );
        assert_eq!(
            e("heads=20,warps=8,stages=2"),
            "decode configuration `heads=20,warps=8,stages=2`: field `heads` is 20: must be a multiple of 16 (16 or more)"
        );
        assert!(e("16,8,2,0,2,5").contains("field `min_blocks` is 5: must be 1 to 4"));
        assert!(e("16,16,1,0,2").contains("field `warps` is 16: warps / (heads/16 × parts) = 16 must divide 4"));
        assert!(!e("24,8,2,0,2").contains("DecodeCfg"));
        assert!(DecodeCfg::parse("16,8,2").is_err());
        // Shared memory of the one-team block at W = 576 leaves room for two blocks per SM
        // (228 KiB).
        assert!(2 * (DecodeCfg::TMA16.smem(576) + 1536) <= 228 * 1024);
        // fit() drops stages until a block fits.
        let big = DecodeCfg::parse("16,8,2,0,6").unwrap().fit(1152, 512);
        assert!(big.smem(1152) <= 227 * 1024 || big.stages == 2);
    }

    #[test]
    fn decode_cfg_cluster_field() {
        // The 9th field; 0 and absent are the fused merge.
        let on = DecodeCfg::parse("16,8,2,0,2,2,0,1,1").unwrap();
        assert!(on.cluster && on.tma());
        assert!(!DecodeCfg::parse("16,8,2,0,2,2,0,1,0").unwrap().cluster);
        assert!(!DecodeCfg::parse("16,8,2,0,2,2,0,1").unwrap().cluster);
        assert!(DecodeCfg::parse("64,8,2,0,2,1,0,1,1").unwrap().cluster);
        // A cluster needs the TMA producer warp; the wgmma field with a cluster is refused.
        let e = DecodeCfg::parse("16,8,2,0,2,2,0,0,1").unwrap_err().to_string();
        assert!(
            e.contains("field `cluster` is 1: the merge through a thread-block cluster needs `tma` 1 or more"),
            "{e}"
        );
        assert!(DecodeCfg::parse("16,8,2,0,2,2,0,1,1,1").is_err());
        assert!(DecodeCfg::parse("64,8,2,0,2,1,0,0,0,1,1").is_ok());
        assert!(DecodeCfg::parse("64,8,2,0,2,1,0,0,0,1,2").is_err());
        // The wgmma default does not merge through a cluster (4 splits of 64 heads: two
        // waves on the H200); the teams default does (2 splits at one block per SM).
        assert!(!DecodeCfg::for_heads(128).cluster && DecodeCfg::for_heads(16).cluster);
        // Below sm_90 no TMA and no cluster: the one-team block, copying.
        let old = DecodeCfg::for_heads(16).for_arch(sm("sm_80"));
        assert!(!old.tma() && !old.cluster && old.teams == 1);
        assert_eq!(
            old,
            DecodeCfg {
                producers: 0,
                ..DecodeCfg::TMA16
            }
        );
        assert_eq!(DecodeCfg::for_heads(16).for_arch(sm("sm_90")), DecodeCfg::for_heads(16));
        assert!(on.label().ends_with(" tma cluster"), "{}", on.label());
    }

    #[test]
    fn decode_cfg_cluster_selection() {
        let off = DecodeCfg::TMA16;
        let on = DecodeCfg { cluster: true, ..off };
        // sm_90+, merged, 2..=8 splits with dv a multiple of 4·splits: the splits.
        assert_eq!(on.cluster_size(sm("sm_90"), 4, 512, true), 4);
        assert_eq!(on.cluster_size(sm("sm_90a"), 2, 512, true), 2);
        assert_eq!(on.cluster_size(sm("sm_100"), 8, 512, true), 8);
        // Else 0 (the fused merge through global memory).
        assert_eq!(on.cluster_size(sm("sm_90"), 1, 512, true), 0);
        assert_eq!(on.cluster_size(sm("sm_90"), 16, 512, true), 0);
        assert_eq!(on.cluster_size(sm("sm_90"), 3, 512, true), 0);
        assert_eq!(on.cluster_size(sm("sm_90"), 3, 96, true), 3);
        assert_eq!(on.cluster_size(sm("sm_90"), 4, 512, false), 0);
        assert_eq!(on.cluster_size(sm("sm_80"), 4, 512, true), 0);
        assert_eq!(on.cluster_size(sm("sm_89"), 4, 512, true), 0);
        assert_eq!(off.cluster_size(sm("sm_90"), 4, 512, true), 0);
        let no_tma = DecodeCfg { producers: 0, ..on };
        assert_eq!(no_tma.cluster_size(sm("sm_90"), 4, 512, true), 0);
    }

    #[test]
    fn decode_cfg_cluster_defines_and_fit() {
        let on = DecodeCfg {
            cluster: true,
            ..DecodeCfg::TMA16
        };
        let d = on.defines_for(4);
        assert_eq!(d.last(), Some(&("FD_CLUSTER", 4)));
        assert!(d.contains(&("FD_TMA", 1)) && d.contains(&("FD_HM", 16)) && d.contains(&("FD_MINB", 2)));
        assert_eq!(on.defines().last(), Some(&("FD_CLUSTER", 0)));
        assert_eq!(on.defines()[..8], d[..8]);
        // DeepSeek's W = 576, L = 512: 16 heads need 33 KB (of 105 KB), 64 heads with TMA 133 KB
        // (of 196 KB); 128 heads at W = L = 512 (266 KB of partials in 252 KB) cannot.
        assert_eq!(on.smem(576), 105_088);
        assert!(on.cluster_fits(576, 512, 8));
        let hm64 = DecodeCfg::parse("64,8,2,0,2,1,0,1,1").unwrap();
        assert_eq!(hm64.smem(576), 196_096);
        assert!(hm64.cluster_fits(576, 512, 8));
        let hm128 = DecodeCfg::parse("128,8,1,0,2,1,0,1,1").unwrap();
        assert!(!hm128.cluster_fits(512, 512, 2));
    }

    #[test]
    fn decode_cfg_teams_and_producers() {
        // The N < 64 default: two teams of 4 warps, 4 producer warps, 4 stages, cluster merge.
        let t = DecodeCfg::parse("16,4,1,0,4,1,0,4,1,0,2").unwrap();
        assert_eq!(t, DecodeCfg::TEAMS);
        assert_eq!(DecodeCfg::for_heads(16), t);
        assert_eq!(DecodeCfg::for_heads(63), t);
        assert_eq!((t.teams, t.producers), (2, 4));
        assert_eq!(t.threads(), 384);
        assert_eq!(t.label(), "hm16 w4 p1 qsmem s4 tma4 t2 cluster");
        let d = t.defines_for(2);
        for x in [("FD_TMA", 4), ("FD_TEAMS", 2), ("FD_WARPS", 4), ("FD_CLUSTER", 2)] {
            assert!(d.contains(&x), "{x:?} not in {d:?}");
        }
        // W = 576: Q 18 688 + 4 stages 149 504 + 2 teams' scores, P and α 12 928 + final sums and
        // maxima 256 bytes (fast_decode.cu's layout); 5 stages 218 752, within the 227 KiB of one
        // block; 6 do not fit.
        assert_eq!(t.smem(576), 181_376);
        let s5 = DecodeCfg { stages: 5, ..t };
        assert_eq!(s5.smem(576), 218_752);
        assert!(s5.smem(576) <= 227 * 1024 && s5.fit(576, 512) == s5 && t.fit(576, 512) == t);
        assert_eq!(DecodeCfg { stages: 6, ..t }.fit(576, 512), s5);
        // The cluster merge's partial, its state and team 1's weighted partial fit below the sums.
        assert!(t.cluster_fits(576, 512, 2) && t.cluster_fits(576, 512, 0));
        assert_eq!(t.cluster_size(sm("sm_90"), 2, 512, true), 2);
        // Parity rules: TEAMS divides 2·STAGES, STAGES >= TEAMS; teams need producers and the
        // unfused softmax; producers divide 32; at most 32 warps; 11 fields at most.
        for (bad, why) in [
            ("16,4,1,0,5,1,0,4,1,0,3", "field `teams` is 3: must be 1 or 2"),
            ("16,4,1,0,2,1,0,4,1,0,4", "field `teams` is 4: must be 1 or 2"),
            (
                "16,4,1,0,5,1,0,0,0,0,2",
                "field `teams` is 2: more than one team needs `tma` 1",
            ),
            (
                "16,4,1,0,5,1,1,4,1,0,2",
                "field `teams` is 2: more than one team needs `fused` 0",
            ),
            (
                "16,4,1,0,5,1,0,3,1,0,2",
                "field `tma` is 3: the producer warps must divide 32",
            ),
            (
                "16,4,1,0,4,2,0,4,1,0,2",
                "field `min_blocks` is 2: must be 1 with `teams` 2",
            ),
            (
                "16,8,2,0,4,1,0,32,1,0,2",
                "field `tma` is 32: with warps·teams = 16 consumer warps that makes 48",
            ),
            ("16,4,1,0,5,1,0,4,1,0,2,0", "expected 5 to 11"),
        ] {
            let e = DecodeCfg::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!(DecodeCfg::parse("16,4,1,0,4,1,0,2,0,0,2").is_ok());
        // fit() drops stages within the teams' parity rule: W = 1152 leaves 2 for two teams.
        assert_eq!(t.fit(1152, 512).stages, 2);
        // Below sm_90 (no bulk copies): the one-team block, copying with cp.async.
        let old = t.for_arch(sm("sm_80"));
        assert_eq!(
            old,
            DecodeCfg {
                producers: 0,
                ..DecodeCfg::TMA16
            }
        );
        assert_eq!(old.threads(), 256);
        assert_eq!(t.for_arch(sm("sm_90a")), t);
    }

    #[test]
    fn decode_cfg_wgmma_selection() {
        let wg = DecodeCfg::WGMMA;
        // The N >= 64 default; its label, defines and NVRTC target.
        assert!(DecodeCfg::for_heads(64).wgmma && !DecodeCfg::for_heads(63).wgmma);
        assert!(wg.label().ends_with(" wgmma"), "{}", wg.label());
        assert!(wg.defines().contains(&("FD_WG", 1)));
        assert!(DecodeCfg::MMA64.defines().contains(&("FD_WG", 0)));
        assert_eq!(sm("sm_90").target_for(&wg.defines()), sm("sm_90a"));
        assert_eq!(sm("sm_90").target_for(&DecodeCfg::MMA64.defines()), sm("sm_90"));
        assert_eq!(sm("sm_80").target_for(&wg.defines()), sm("sm_80"));
        // Only sm_90 runs wgmma; elsewhere the 64-head mma.sync block.
        assert_eq!(wg.for_arch(sm("sm_90")), wg);
        assert_eq!(wg.for_arch(sm("sm_80")), DecodeCfg::MMA64);
        assert_eq!(wg.for_arch(sm("sm_100")), DecodeCfg::MMA64);
        // DeepSeek's W = 576, L = 512: Q and two 64-row stages in 73 728-byte swizzled tiles, P,
        // α, sums, slots and the alignment slack: 231 936 bytes, within 227 KiB (232 448).
        assert_eq!(wg.smem(576), 231_936);
        assert!(DecodeCfg::wgmma_fits(576, 512) && DecodeCfg::wgmma_fits(192, 128));
        // L not a multiple of 128, L > L+R, or a row too wide for the shared memory: mma.sync.
        assert!(!DecodeCfg::wgmma_fits(96, 64) && !DecodeCfg::wgmma_fits(128, 256));
        assert!(!DecodeCfg::wgmma_fits(640, 512));
        assert_eq!(wg.fit(576, 512), wg);
        assert_eq!(wg.fit(96, 64), DecodeCfg::MMA64);
        // WGMMA 1 needs the 64-head two-warpgroup block.
        let e = DecodeCfg::parse("16,8,2,0,2,1,0,0,0,1").unwrap_err().to_string();
        assert!(
            e.contains("field `heads` is 16: wgmma=1 (the warpgroup-MMA block, `64,8,P,0,2,1,0,0,0,1`) needs 64"),
            "{e}"
        );
        assert!(DecodeCfg::parse("64,8,1,0,2,1,0,1,0,1").is_err());
        // From the environment, the error names the variable too.
        let e = DecodeCfg::parse_named("MLA_DIFF_DECODE_CFG", "16,8,2,0,2,1,0,0,0,1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("MLA_DIFF_DECODE_CFG: decode configuration `16,8,2,0,2,1,0,0,0,1`"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        assert_eq!(
            DecodeCfg::parse_named("X", "64,8,1,0,2,1,0,0,0,1").unwrap(),
            DecodeCfg::WGMMA
        );
    }
}
