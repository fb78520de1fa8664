//! Engine dumps: what an external engine computed, read into our sites and layouts.
//!
//! People debug their own engine (vLLM, SGLang, llama.cpp, HF transformers, their own), not ours.
//! This module reads the safetensors dump that a hook script wrote (docs/dump-format.md), applies
//! a [`Map`] (renames from engine tensor names, HF's `[even|odd]` rope order, head-major shapes,
//! a `[rope | latent]` kv_a row) so that known layout differences are undone instead of reported
//! as bugs, validates every site's dtype and shape against the model's configuration, and returns
//! one [`Trace`](crate::core::trace::Trace) per dumped layer plus the batch (sequence lengths,
//! positions) and the tokens. Comparing it with the reference is
//! [`compare_dump`](crate::jobs::compare::compare_dump)'s job.
//!
//! The dump contract has one file per concern, and this module is its public surface (every
//! public item is re-exported here, so callers name `crate::model::dump::…` only):
//! - `header`: the format strings, format 2's header (model identity, steps, conventions) and
//!   its checks;
//! - `map`: name maps from an engine's tensor names to our sites, and their rename rules;
//! - `conventions`: the layout conventions a dump declares (rope order, axis order, kv_a column
//!   order, engine dtype) and how they are told from the map and the metadata;
//! - `layout`: each site's expected shape and the conversions that bring a dumped tensor to it;
//! - `read`: reading a file of either format into [`Dump`]s;
//! - `sites`: the site vocabulary a dump is written in, as `mla-diff sites` prints it.

mod conventions;
mod header;
mod layout;
mod map;
mod read;
mod sites;

use std::path::Path;

use crate::core::error::Error;

pub use conventions::{EngineDtype, KvAOrder, Layout, RopeOrder, map_from_metadata};
pub use header::{
    ActQuantDecl, Conventions, DumpHeader, FORMAT1, FORMAT2, HF_SAFETENSORS, IndexerQuant, KvCacheQuantDecl,
    KvQueryDecl, MAX_CONTEXT_CHUNKS, MAX_NUM_KV_SPLITS, MAX_PAGE_SIZE, MAX_QUANT_BLOCK, ModelIdentity, Patch,
    PrefixHit, SeqKernel, Software, StepSeq, StepSpec, TpInfo, check_identity, header_from_metadata, heads_config,
    is_per_head, peek_header,
};
pub use layout::{expected_shape, expected_shape_keys};
pub use map::{Condition, Map, Rename};
pub use read::{Dump, DumpFile, StepPaging, StepsDump, load, load_bytes, read};
pub use sites::{SHAPE_DIMS, SiteTemplates, SiteVocabulary, StageRow, stage_inputs, stage_row};

/// An input error in the dump `path`: `what` names the tensor or metadata key, `reason` says
/// what is wrong with it (exit 2).
fn dump_error(path: &Path, what: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        what: what.into(),
        reason: reason.into(),
    }
}
