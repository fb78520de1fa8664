//! The paged latent cache as one step's attention used it: which rows were written to which
//! slots, through which block tables the queries read them, and what each query row read
//! through the cache.
//!
//! A decode kernel never sees the latent rows in token order: it reads slot
//! `block_table[seq][pos / page_size] · page_size + pos % page_size`, which a step's
//! `concat_and_cache_mla` filled at the slots of its `slot_mapping`. A page size one side
//! ignores, a block table read one entry off, or a slot mapping one slot off leaves every input
//! right and the attention wrong. [`PagedStep`] is what a replay of those mechanisms needs:
//! the engine's metadata (page size, block tables, recorded slots), the order of the writes and
//! each query's reads. mla-diff's own paths describe theirs (`engine::paged_step`); `compare`
//! builds one from a format-2 dump's step header and tensors.

/// One step's paged latent cache, as the `paged-kv` replays read it. Positions are per
/// sequence (0-based); sequences are those of the judged batch, in its order.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedStep {
    /// Tokens per block the cache was written with (vLLM `block_size`); `None`: not recorded.
    pub page_size: Option<usize>,
    /// Per sequence, its block ids as the engine's metadata held them, in position order,
    /// padding included; `None`: not recorded.
    pub block_tables: Option<Vec<Vec<i64>>>,
    /// The block id a read past the end of a table row gets: `Some(0)` where the engine pads its
    /// block tables with block 0 (vLLM, mla-diff's paths); `None` when unknown (such a read is
    /// not replayed).
    pub pad_block: Option<i64>,
    /// Per sequence: its first key row and its number of positions the step may read.
    pub seqs: Vec<PagedSeq>,
    /// The cache writes of this step and the earlier steps it reads, in the order the engine
    /// made them (a later write to a slot replaces an earlier one).
    pub writes: Vec<CacheWrite>,
    /// Per row of the judged trace (packed token order): how it attended.
    pub queries: Vec<PagedQuery>,
    /// The latent rows `[K, L+R]` (`kv_c_normed ‖ k_pe_roped`, f64) the key rows of
    /// [`PagedSeq::key_off`] index, gathered from every step a dump holds; `None`: the judged
    /// trace's own `kv_c_normed` and `k_pe_roped` rows, key row = packed token row (mla-diff's
    /// paths, whose traces hold every position).
    pub keys: Option<Vec<f64>>,
    /// Whether a slot no write reached reads as a zero row for certain (mla-diff's paths zero
    /// their cache; an engine's may hold an earlier request's rows).
    pub zero_filled: bool,
    /// The fp8 format the cache stores its rows in (the replays read keys back rounded so, and
    /// a decode row's query rounded when the kernel takes an fp8 one); `None`: the values as
    /// computed.
    pub cache_quant: Option<crate::core::fp8::KvCacheQuant>,
}

/// One sequence of a [`PagedStep`]: position `j` is key row `key_off + j`, for `j < len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedSeq {
    /// The key row of position 0.
    pub key_off: usize,
    /// Positions known (cached by earlier steps, and this step's new ones).
    pub len: usize,
}

/// One cache write: position `pos` of sequence `seq`, at the slot the engine recorded, or
/// (`None`) at the slot its block table gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheWrite {
    /// The sequence.
    pub seq: usize,
    /// Its position.
    pub pos: usize,
    /// The slot a dump's `slot_mapping` recorded (−1: not written); `None`: not recorded.
    pub slot: Option<i64>,
}

/// How one query row attended: positions `0..cached` of its sequence read through the paged
/// cache, positions `cached..upto` directly from the step's own rows (a prefill's new tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedQuery {
    /// The sequence.
    pub seq: usize,
    /// Positions read through the cache.
    pub cached: usize,
    /// One past the last position it attends to.
    pub upto: usize,
}

/// The cache slot of position `pos` through block-table row `row` with `page` tokens per block:
/// `row[pos / page] · page + pos % page`; past the row's end the block is `pad` (`None`: no
/// slot); a negative block id (padding) has none either.
pub fn table_slot(row: &[i64], pad: Option<i64>, page: usize, pos: usize) -> Option<i64> {
    let page = page.max(1);
    let block = row.get(pos / page).copied().or(pad)?;
    (block >= 0).then(|| block.checked_mul(page as i64)?.checked_add((pos % page) as i64))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_the_block_times_the_page_plus_the_offset() {
        let row = [3, 0, 7];
        assert_eq!(table_slot(&row, None, 4, 0), Some(12));
        assert_eq!(table_slot(&row, None, 4, 5), Some(1));
        assert_eq!(table_slot(&row, None, 4, 11), Some(31));
        // Past the row: the padding block, or nothing.
        assert_eq!(table_slot(&row, Some(0), 4, 13), Some(1));
        assert_eq!(table_slot(&row, None, 4, 13), None);
        assert_eq!(table_slot(&[-1], Some(0), 4, 2), None);
        assert_eq!(table_slot(&[i64::MAX], None, 4, 0), None);
    }
}
