//! Launch configurations of the tensor-core MHA prefill kernel (`kernels/fast_prefill.cu`).
//!
//! The prefill kernel is compiled per configuration (warps per block, keys per K/V tile,
//! pipeline depth, where Q's fragments live, blocks per SM), because those choices set its
//! register and shared-memory budget and so how many warps an SM keeps in flight, which is what
//! decides its speed on a given GPU. This module names a configuration, checks it, gives its
//! `-D` defines, its shared memory and its query-tile height, and parses the text of
//! `MLA_DIFF_PREFILL_CFG` (engine) or `MLA_DIFF_BENCH_PREFILL` (extra benchmark variants).
//! The kernel's arithmetic is the same in every configuration (FlashAttention-2, Dao 2023): only
//! the order of the online-softmax updates over key tiles changes with the tile width.

use crate::backend::cfg_fields::{self, Field};
use crate::core::error::{Error, Result};

/// Largest dynamic shared memory one block may use on sm_80/sm_90 (227 KiB).
const MAX_SMEM: usize = 227 * 1024;

/// One compile-time configuration of `flash_prefill_mma`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefillCfg {
    /// Warps per block (1..=16).
    pub warps: usize,
    /// 16-row m-tiles per warp (1 or 2): a block holds `16·mt·warps` query rows, and every K/V
    /// fragment read from shared memory feeds `mt` MMAs. 2 needs Q in shared memory.
    pub mt: usize,
    /// Keys per K/V tile: 32 or 64.
    pub bk: usize,
    /// K/V tiles in the cp.async pipeline (2..=4).
    pub stages: usize,
    /// Q's A fragments in registers, loaded once from global memory (no Q tile in shared
    /// memory); false: Q in shared memory, read with `ldmatrix` at every tile.
    pub q_in_registers: bool,
    /// Blocks per SM the register allocation must allow (`__launch_bounds__`, 1..=4).
    pub min_blocks: usize,
}

impl Default for PrefillCfg {
    /// The configuration the engine and the benchmark run unless told otherwise: 4 warps (64
    /// query rows), 64-key tiles, double-buffered, Q in shared memory (221 registers, no
    /// spills; two blocks per SM by registers and by shared memory), the fastest of the nine
    /// measured on the H200 (BENCHMARKS.md, "Prefill configurations").
    fn default() -> Self {
        PrefillCfg {
            warps: 4,
            mt: 1,
            bk: 64,
            stages: 2,
            q_in_registers: false,
            min_blocks: 1,
        }
    }
}

impl PrefillCfg {
    /// The fields of the configuration string, in positional order, with their names and their
    /// values when left out ([`PrefillCfg::parse`]).
    pub const FIELDS: [Field; 6] = [
        Field::required("warps"),
        Field::required("bk"),
        Field::required("stages"),
        Field::required("qreg"),
        Field::required("min_blocks"),
        Field::optional("mt", 1),
    ];

    /// Parses `WARPS,BK,STAGES,QREG,MINBLOCKS[,MT]` (QREG 0 or 1; MT 1 when left out), e.g.
    /// `4,32,3,0,3` or `4,32,2,0,1,2`, or the same fields named ([`PrefillCfg::FIELDS`]:
    /// `warps=4,bk=32,stages=3,qreg=0,min_blocks=3`, any order). docs/kernels.md is the
    /// reference.
    ///
    /// Errors: [`Error::Usage`] naming the string and the field when a field is missing, unknown
    /// or not a number, or when the configuration fails [`PrefillCfg::check`].
    pub fn parse(s: &str) -> Result<Self> {
        let v = cfg_fields::parse_fields(s, &Self::FIELDS)
            .map_err(|e| Error::Usage(format!("prefill configuration `{s}`: {e}")))?;
        let (warps, bk, stages, qreg, min_blocks, mt) = (v[0], v[1], v[2], v[3], v[4], v[5]);
        if qreg > 1 {
            return Err(Error::Usage(format!(
                "prefill configuration `{s}`: field `qreg` is {qreg}: must be 0 or 1"
            )));
        }
        let c = PrefillCfg {
            warps,
            mt,
            bk,
            stages,
            q_in_registers: qreg == 1,
            min_blocks,
        };
        if let Some(rule) = c.broken_rule() {
            return Err(Error::Usage(format!("prefill configuration `{s}`: {rule}")));
        }
        Ok(c)
    }

    /// [`PrefillCfg::parse`] of `s` read from the environment variable `var` (the CUDA backend
    /// parses `MLA_DIFF_PREFILL_CFG` this way when it is created).
    ///
    /// Errors: [`PrefillCfg::parse`]'s, prefixed with `var` (one line, e.g.
    /// `MLA_DIFF_PREFILL_CFG: prefill configuration `…`: …`).
    pub fn parse_named(var: &str, s: &str) -> Result<Self> {
        Self::parse(s).map_err(|e| cfg_fields::env_err(var, e))
    }

    /// Checks the ranges the kernel supports (its `#error` line and the launch limits).
    ///
    /// Errors: [`Error::Usage`] naming the first field out of range and its value.
    pub fn check(&self) -> Result<()> {
        self.broken_rule().map_or(Ok(()), |rule| Err(Error::Usage(rule)))
    }

    /// The first range rule this configuration breaks, as one message naming the field
    /// (docs/kernels.md's names) and its value, e.g. "field `bk` is 48: must be 32 or 64";
    /// `None` when every field is in range.
    fn broken_rule(&self) -> Option<String> {
        let field = |name: &str, v: usize, rule: &str| Some(format!("field `{name}` is {v}: {rule}"));
        if !(1..=16).contains(&self.warps) {
            return field("warps", self.warps, "must be 1 to 16");
        }
        if !matches!(self.mt, 1 | 2) {
            return field("mt", self.mt, "must be 1 or 2");
        }
        if self.q_in_registers && self.mt > 1 {
            return field("mt", self.mt, "must be 1 with `qreg` 1");
        }
        if !matches!(self.bk, 32 | 64) {
            return field("bk", self.bk, "must be 32 or 64");
        }
        if !(2..=4).contains(&self.stages) {
            return field("stages", self.stages, "must be 2 to 4");
        }
        if !(1..=4).contains(&self.min_blocks) {
            return field("min_blocks", self.min_blocks, "must be 1 to 4");
        }
        None
    }

    /// Query rows per block (`16·mt·warps`): the step of the `(segment, first row)` tile list.
    pub fn rows(&self) -> usize {
        16 * self.mt * self.warps
    }

    /// Threads per block.
    pub fn threads(&self) -> usize {
        32 * self.warps
    }

    /// Dynamic shared memory in bytes for head widths `dqk` = P+R and `dv` = V: the K/V stages
    /// (bf16 rows padded by 8 elements) and, without `qreg`, the Q tile.
    pub fn smem(&self, dqk: usize, dv: usize) -> usize {
        let stage = self.bk * ((dqk + 8) + (dv + 8));
        let q = if self.q_in_registers {
            0
        } else {
            self.rows() * (dqk + 8)
        };
        (self.stages * stage + q) * 2
    }

    /// This configuration if its shared memory fits one block (227 KiB) at `dqk`, `dv`;
    /// otherwise the same with fewer stages, then 32-key tiles, then Q in registers, until it
    /// fits (the smallest, 2 stages of 32 keys with Q in registers, holds head widths up to
    /// ~1700).
    pub fn fit(mut self, dqk: usize, dv: usize) -> Self {
        while self.smem(dqk, dv) > MAX_SMEM {
            if self.stages > 2 {
                self.stages -= 1;
            } else if self.bk > 32 {
                self.bk = 32;
            } else if !self.q_in_registers && self.mt == 1 {
                self.q_in_registers = true;
            } else {
                break;
            }
        }
        self
    }

    /// This configuration as it runs at head widths `dqk`, `dv`: Q moves to shared memory when
    /// `dqk` > 256 (Q in registers would take `dqk/4` registers per thread and spill), then
    /// [`PrefillCfg::fit`].
    pub fn for_shape(self, dqk: usize, dv: usize) -> Self {
        let c = if self.q_in_registers && dqk > 256 {
            PrefillCfg {
                q_in_registers: false,
                ..self
            }
        } else {
            self
        };
        c.fit(dqk, dv)
    }

    /// `-D` defines of this configuration (the names in fast_prefill.cu's header).
    pub fn defines(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("FP_WARPS", self.warps),
            ("FP_MT", self.mt),
            ("FP_BK", self.bk),
            ("FP_STAGES", self.stages),
            ("FP_QREG", usize::from(self.q_in_registers)),
            ("FP_MINB", self.min_blocks),
        ]
    }

    /// Short label, e.g. `w4 k64 s2 qreg` (` m2` for two m-tiles per warp, ` b2` when two
    /// blocks per SM are asked for).
    pub fn label(&self) -> String {
        format!(
            "w{}{} k{} s{} {}{}",
            self.warps,
            if self.mt > 1 {
                format!(" m{}", self.mt)
            } else {
                String::new()
            },
            self.bk,
            self.stages,
            if self.q_in_registers { "qreg" } else { "qsmem" },
            if self.min_blocks > 1 {
                format!(" b{}", self.min_blocks)
            } else {
                String::new()
            }
        )
    }
}

/// Extra prefill configurations from `spec`, the text of `MLA_DIFF_BENCH_PREFILL`:
/// `;`-separated `WARPS,BK,STAGES,QREG,MINBLOCKS[,MT]` entries (empty when unset).
///
/// Errors: [`Error::Usage`] naming the first entry that does not parse or check.
pub fn bench_variants(spec: Option<&str>) -> Result<Vec<PrefillCfg>> {
    let Some(spec) = spec else {
        return Ok(Vec::new());
    };
    spec.split(';')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| PrefillCfg::parse_named("MLA_DIFF_BENCH_PREFILL", e))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_fields_give_the_positional_configurations() {
        let p = |s: &str| PrefillCfg::parse(s).unwrap();
        assert_eq!(p("warps=4,bk=64,stages=2,qreg=0,min_blocks=1"), PrefillCfg::default());
        assert_eq!(p("min_blocks=3,qreg=0,stages=3,bk=32,warps=4"), p("4,32,3,0,3"));
        assert_eq!(p("warps=2,bk=32,stages=2,qreg=0,min_blocks=2,mt=2"), p("2,32,2,0,2,2"));
        let e = PrefillCfg::parse("warps=4,bk=64,stages=2,qreg=0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `min_blocks`"), "{e}");
        let e = PrefillCfg::parse_named("MLA_DIFF_PREFILL_CFG", "bk=48,warps=4,stages=2,qreg=0,min_blocks=1")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "MLA_DIFF_PREFILL_CFG: prefill configuration `bk=48,warps=4,stages=2,qreg=0,min_blocks=1`: field `bk` is 48: must be 32 or 64"
        );
    }

    #[test]
    fn parse_round_trips_and_checks() {
        let c = PrefillCfg::parse("8, 32, 3, 0, 2").unwrap();
        assert_eq!(
            c,
            PrefillCfg {
                warps: 8,
                mt: 1,
                bk: 32,
                stages: 3,
                q_in_registers: false,
                min_blocks: 2
            }
        );
        assert_eq!(c.label(), "w8 k32 s3 qsmem b2");
        assert_eq!(c.rows(), 128);
        assert_eq!(c.threads(), 256);
        assert_eq!(
            c.defines(),
            vec![
                ("FP_WARPS", 8),
                ("FP_MT", 1),
                ("FP_BK", 32),
                ("FP_STAGES", 3),
                ("FP_QREG", 0),
                ("FP_MINB", 2)
            ]
        );
        for (bad, why) in [
            ("4,48,2,1,1", "field `bk` is 48: must be 32 or 64"),
            ("4,64,1,1,1", "field `stages` is 1: must be 2 to 4"),
            ("4,64,2,2,1", "field `qreg` is 2: must be 0 or 1"),
            ("0,64,2,1,1", "field `warps` is 0: must be 1 to 16"),
            ("4,64,2,1,1,2", "field `mt` is 2: must be 1 with `qreg` 1"),
            (
                "warps=4,bk=64,stages=2,qreg=0,min_blocks=5",
                "field `min_blocks` is 5: must be 1 to 4",
            ),
            ("4,64,2,1", "expected 5 to 6"),
            ("4,x,2,1,1", "field 2 (bk) is `x`"),
        ] {
            let e = PrefillCfg::parse(bad).unwrap_err().to_string();
            assert_eq!(e.lines().count(), 1, "{bad}: {e}");
            assert!(
                e.starts_with(&format!("prefill configuration `{bad}`: {why}")),
                "{bad}: {e}"
            );
        }
        let wide = PrefillCfg { warps: 17, ..c };
        assert_eq!(
            wide.check().unwrap_err().to_string(),
            "field `warps` is 17: must be 1 to 16"
        );
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout() {
        // V3 dims (P+R = 192, V = 128): a stage of 64 keys is 64·(200 + 136)·2 = 43008 bytes.
        let d = PrefillCfg::default();
        assert_eq!(d.smem(192, 128), 2 * 43008 + 25600, "the Q tile adds 64·200·2 bytes");
        // Two such blocks fit an SM.
        assert!(2 * d.smem(192, 128) <= MAX_SMEM);
        let q = PrefillCfg {
            q_in_registers: true,
            ..d
        };
        assert_eq!(q.smem(192, 128), 2 * 43008);
        // 32-key tiles halve each stage.
        let s3 = PrefillCfg::parse("4,32,3,1,3").unwrap();
        assert_eq!(s3.smem(192, 128), 3 * 21504);
        // Three such blocks fit an SM's 227 KiB.
        assert!(3 * s3.smem(192, 128) <= MAX_SMEM);
    }

    #[test]
    fn fit_shrinks_until_one_block_fits() {
        let big = PrefillCfg::parse("8,64,4,0,1").unwrap();
        assert_eq!(big.fit(192, 128), big, "fits as is: {}", big.smem(192, 128));
        // Head width 576 (an absorbed-style shape): 4 stages of 64 keys need 4·64·(584+520)·2.
        let f = big.fit(576, 512);
        assert!(f.smem(576, 512) <= MAX_SMEM, "{f:?}");
        assert_eq!((f.stages, f.bk), (2, 32));
        // Past 256, Q leaves the registers when shared memory allows it.
        let wide = PrefillCfg::default().for_shape(512, 512);
        assert!(!wide.q_in_registers && wide.smem(512, 512) <= MAX_SMEM, "{wide:?}");
        assert_eq!(PrefillCfg::default().for_shape(192, 128), PrefillCfg::default());
    }
}
