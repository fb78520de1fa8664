//! The forward computations mla-diff compares: the f64 reference and the engine-style paths.
//!
//! [`reference`](mod@reference) is the judge's yardstick (plain expanded MLA, f64). [`engine`] holds the paths
//! written the way engines write them (fused projections, paged latent cache, split-KV and LSE
//! merges, TP shards), once, against the [`ops::Ops`] trait that a backend implements.
//! [`faults`] injects real bug patterns into those paths; [`indexer`] is the DSA token selection
//! both sides share the definition of. [`collective`] is the TP all-reduce the paths run as
//! per-rank participants. [`paged`] describes a step's paged latent cache for the replays that
//! judge it.

pub mod collective;
pub mod engine;
pub mod faults;
pub mod indexer;
pub mod ops;
pub mod paged;
pub mod path;
pub mod reference;
