//! The host side of a CUDA step, with no device in it: a `StepPlan` and its page tables as the
//! flat arrays the kernels read, the KV cache's layout in device memory, and whether a step
//! replays a captured graph. Every check that can refuse a plan happens here, before any work is
//! queued on the device, with the same errors as the CPU executor's.

use std::ops::Range;

use lockstep_core::kv::PageRef;
use lockstep_core::sched::{Bucket, InputToken, RowPlan, StepPlan};

/// What the arrays are checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub vocab_size: usize,
    pub page_tokens: usize,
    /// Pages of the scheduler's pool; the cache has one more, the scratch page (below).
    pub pages_total: usize,
    /// The model's sliding window, if any: positions before a token's window are never read.
    pub sliding_window: Option<usize>,
}

impl Limits {
    /// The page that padding rows of a captured graph write and read: past the pool's pages, so
    /// no request's KV is ever touched by them.
    pub fn scratch_page(&self) -> usize {
        self.pages_total
    }

    fn window_start(&self, position: usize) -> usize {
        self.sliding_window.map_or(0, |w| (position + 1).saturating_sub(w))
    }
}

/// Whether a row computes one decode token or a chunk of a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    Decode,
    Prefill,
}

/// A step as the kernels read it. Per token (in plan order): `tokens`, `positions`,
/// `token_rows`. Per row: `table_offsets` into `tables` (each row's page table, flattened,
/// covering positions `0..end`), and `kinds`. Per sampling row (in row order): `sample_tokens`
/// (the token whose logits are sampled: the row's last) and `sample_rows` (the plan row).
/// `i32`, as the kernels take them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepArrays {
    pub tokens: Vec<i32>,
    pub positions: Vec<i32>,
    pub token_rows: Vec<i32>,
    pub table_offsets: Vec<i32>,
    pub tables: Vec<i32>,
    pub kinds: Vec<RowKind>,
    pub sample_tokens: Vec<i32>,
    pub sample_rows: Vec<usize>,
}

fn int(value: usize, what: &str) -> Result<i32, String> {
    i32::try_from(value).map_err(|_| format!("{what} {value} does not fit the kernels' i32"))
}

impl StepArrays {
    /// The arrays of `plan`, whose page tables (already updated by the plan) `table` gives by
    /// slot and whose placeholders `resolve` turns into tokens. Refuses, like the CPU executor:
    /// an empty row, a token outside the vocabulary, a position without a page, a page outside
    /// the pool. Table entries before a row's sliding window are never read, so they are not
    /// checked and point at the scratch page.
    pub fn build<'a>(
        plan: &StepPlan,
        table: impl Fn(u32) -> &'a [PageRef],
        resolve: impl Fn(InputToken) -> Result<u32, String>,
        limits: Limits,
    ) -> Result<StepArrays, String> {
        let mut a = StepArrays::default();
        let scratch = int(limits.scratch_page(), "the scratch page")?;
        for (r, row) in plan.rows.iter().enumerate() {
            if row.positions.is_empty() {
                return Err(format!("{}: a row with no position to compute", row.request));
            }
            let end = row.positions.end as usize;
            let pages = table(row.slot);
            let needed = end.div_ceil(limits.page_tokens);
            if pages.len() < needed {
                let last = end - 1;
                return Err(format!(
                    "{}: position {last} has no page (table of {})",
                    row.request,
                    pages.len()
                ));
            }
            let first_read = limits.window_start(row.positions.start as usize) / limits.page_tokens;
            a.table_offsets.push(int(a.tables.len(), "a page-table offset")?);
            for (i, page) in pages[..needed].iter().enumerate() {
                let index = page.index() as usize;
                if i < first_read {
                    a.tables.push(scratch);
                } else if index >= limits.pages_total {
                    return Err(format!(
                        "{}: page {index} is outside the pool of {}",
                        row.request, limits.pages_total
                    ));
                } else {
                    a.tables.push(int(index, "a page")?);
                }
            }
            let inputs = plan.row_inputs(row);
            if inputs.len() != row.positions.len() {
                return Err(format!(
                    "{}: {} inputs for {} positions",
                    row.request,
                    inputs.len(),
                    row.positions.len()
                ));
            }
            for (position, input) in row.positions.clone().zip(inputs) {
                let token = resolve(*input)?;
                if token as usize >= limits.vocab_size {
                    return Err(format!(
                        "{}: token {token} is outside the vocabulary",
                        row.request
                    ));
                }
                a.tokens.push(int(token as usize, "a token")?);
                a.positions.push(int(position as usize, "a position")?);
                a.token_rows.push(int(r, "a row")?);
            }
            a.kinds.push(match row.positions.len() == 1 && row.positions.start > 0 {
                true => RowKind::Decode,
                false => RowKind::Prefill,
            });
            if row.sample {
                a.sample_tokens.push(int(a.tokens.len() - 1, "a token index")?);
                a.sample_rows.push(r);
            }
        }
        Ok(a)
    }

    /// Appends the tokens whose logits score a prompt token to `sample_tokens`, after every
    /// sampled one (`scored(row)`: the row's positions that score, `RequestSampler::
    /// scored_positions`). Returns each row that scores any as (row, first position, count):
    /// their logits come back after the sampled rows', in that order.
    pub fn add_scored(
        &mut self,
        plan: &StepPlan,
        scored: impl Fn(&RowPlan) -> Range<u32>,
    ) -> Result<Vec<(usize, u32, usize)>, String> {
        let mut rows = Vec::new();
        let mut first_token = 0;
        for (r, row) in plan.rows.iter().enumerate() {
            let positions = scored(row);
            for p in positions.clone() {
                let index = first_token + (p - row.positions.start) as usize;
                self.sample_tokens.push(int(index, "a token index")?);
            }
            if !positions.is_empty() {
                rows.push((r, positions.start, positions.len()));
            }
            first_token += row.positions.len();
        }
        Ok(rows)
    }

    pub fn token_count(&self) -> usize {
        self.tokens.len()
    }

    pub fn row_count(&self) -> usize {
        self.table_offsets.len()
    }

    /// Pads a decode-only step to `rows` rows for a captured graph: each padding row is one
    /// token (id 0, position 0) on the scratch page, sampled so that the graph's outputs have a
    /// fixed shape; its outputs are dropped. Real rows keep their indices.
    pub fn pad_to(&mut self, rows: usize, limits: Limits) -> Result<(), String> {
        let scratch = int(limits.scratch_page(), "the scratch page")?;
        while self.row_count() < rows {
            let r = int(self.row_count(), "a row")?;
            self.table_offsets.push(int(self.tables.len(), "a page-table offset")?);
            self.tables.push(scratch);
            self.kinds.push(RowKind::Decode);
            self.tokens.push(0);
            self.positions.push(0);
            self.token_rows.push(r);
            self.sample_tokens.push(int(self.tokens.len() - 1, "a token index")?);
        }
        Ok(())
    }
}

/// The rows a step's captured graph has, or `None` to run it eagerly. A graph runs a fixed
/// shape: only a decode-only step (every row one token, every row sampled) the scheduler put in
/// a graph bucket, and only up to `graph_rows_max`, the largest capture the executor keeps.
pub fn graph_rows(plan: &StepPlan, arrays: &StepArrays, graph_rows_max: usize) -> Option<usize> {
    let Bucket::Graph { padded_rows } = plan.bucket else {
        return None;
    };
    let padded = padded_rows as usize;
    let rows = arrays.row_count();
    let decode_only = arrays.kinds.iter().all(|&k| k == RowKind::Decode)
        && arrays.token_count() == rows
        && arrays.sample_rows.len() == rows
        && arrays.sample_tokens.len() == rows;
    (decode_only && rows <= padded && padded <= graph_rows_max).then_some(padded)
}

/// The KV cache in device memory: one f16 array holding, for each layer, keys then values, each
/// `[page][page_tokens][kv_heads][head_dim]`, over the pool's pages plus the scratch page. A
/// page's bytes for one (layer, part) are contiguous, so a page reads and writes as
/// `2 * layers` copies, in the CPU backend's `PageStore` order (layer, part, position, head,
/// dimension): pages move between CPU and CUDA workers unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    pub layers: usize,
    /// The pool's pages plus the scratch page.
    pub pages: usize,
    pub page_tokens: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Keys = 0,
    Values = 1,
}

impl KvCacheLayout {
    pub fn new(
        layers: usize,
        pages_total: usize,
        page_tokens: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> KvCacheLayout {
        KvCacheLayout { layers, pages: pages_total + 1, page_tokens, kv_heads, head_dim }
    }

    /// Elements of one page of one (layer, part).
    pub fn page_elements(&self) -> usize {
        self.page_tokens * self.kv_heads * self.head_dim
    }

    /// Elements of one (layer, part): every page.
    pub fn part_elements(&self) -> usize {
        self.pages * self.page_elements()
    }

    pub fn total_elements(&self) -> usize {
        self.layers * 2 * self.part_elements()
    }

    pub fn total_bytes(&self) -> usize {
        self.total_elements() * 2
    }

    /// Where (layer, part) starts, in elements.
    pub fn part_offset(&self, layer: usize, part: Part) -> usize {
        (layer * 2 + part as usize) * self.part_elements()
    }

    /// Where `page` of (layer, part) starts, in elements.
    pub fn page_offset(&self, layer: usize, part: Part, page: usize) -> usize {
        self.part_offset(layer, part) + page * self.page_elements()
    }

    /// Where position `slot` of `page`, KV head `head`, starts within (layer, part).
    pub fn element(&self, page: usize, slot: usize, head: usize) -> usize {
        ((page * self.page_tokens + slot) * self.kv_heads + head) * self.head_dim
    }

    /// Bytes of one pool page in transfer order: every layer's keys and values (as the CPU
    /// backend's `PageStore`).
    pub fn page_bytes(&self) -> usize {
        self.layers * 2 * self.page_elements() * 2
    }
}

#[cfg(test)]
mod tests {
    use lockstep_core::sched::{RequestId, RowPlan, StepId};

    use super::*;

    const LIMITS: Limits =
        Limits { vocab_size: 100, page_tokens: 4, pages_total: 10, sliding_window: None };

    fn page(index: u32) -> PageRef {
        PageRef::from_parts(index, 0)
    }

    /// A decode row (request 1, slot 0, position 5) and a prefill chunk (request 2, slot 1,
    /// positions 4..7, sampled), as the scheduler lays them out.
    fn plan() -> StepPlan {
        let row = |request, slot, positions: std::ops::Range<u32>, inputs, sample| RowPlan {
            request: RequestId(request),
            slot,
            positions,
            inputs,
            page_table_from: 0,
            page_updates: 0..0,
            sample,
        };
        StepPlan {
            step: StepId(7),
            rows: vec![row(1, 0, 5..6, 0..1, true), row(2, 1, 4..7, 1..4, true)],
            input_tokens: [11, 20, 21, 22].map(InputToken::Known).to_vec(),
            page_updates: Vec::new(),
            bucket: Bucket::Eager,
        }
    }

    /// Slot 0's table is pages 3 and 8, slot 1's pages 1 and 6.
    fn tables(slot: u32) -> &'static [PageRef] {
        static TABLES: std::sync::LazyLock<[Vec<PageRef>; 2]> =
            std::sync::LazyLock::new(|| [vec![page(3), page(8)], vec![page(1), page(6)]]);
        TABLES.get(slot as usize).map_or(&[], Vec::as_slice)
    }

    fn known(input: InputToken) -> Result<u32, String> {
        match input {
            InputToken::Known(t) => Ok(t),
            other => Err(format!("unresolved {other:?}")),
        }
    }

    #[test]
    fn a_mixed_step_flattens_to_the_kernels_arrays() {
        let a = StepArrays::build(&plan(), tables, known, LIMITS).unwrap();
        assert_eq!(a.tokens, [11, 20, 21, 22]);
        assert_eq!(a.positions, [5, 4, 5, 6]);
        assert_eq!(a.token_rows, [0, 1, 1, 1]);
        // Positions 0..6 need two pages of 4, and 0..7 two as well.
        assert_eq!(a.table_offsets, [0, 2]);
        assert_eq!(a.tables, [3, 8, 1, 6]);
        assert_eq!(a.kinds, [RowKind::Decode, RowKind::Prefill]);
        assert_eq!(a.sample_tokens, [0, 3]);
        assert_eq!(a.sample_rows, [0, 1]);
    }

    #[test]
    fn a_chunk_that_does_not_end_its_prompt_is_not_sampled() {
        let mut p = plan();
        p.rows[1].sample = false;
        let a = StepArrays::build(&p, tables, known, LIMITS).unwrap();
        assert_eq!((a.sample_tokens, a.sample_rows), (vec![0], vec![0]));
    }

    #[test]
    fn pages_before_the_window_point_at_scratch_and_are_not_checked() {
        let limits = Limits { sliding_window: Some(2), ..LIMITS };
        let table = [page(99), page(2), page(5)];
        let far = |_| table.as_slice();
        let mut p = plan();
        p.rows.truncate(1);
        p.rows[0].positions = 9..10;
        let a = StepArrays::build(&p, far, known, limits).unwrap();
        // Position 9 sees 8..=9: page 2 of the table only; pages 0 and 1 are never read.
        assert_eq!(a.tables, [10, 10, 5]);
        let err = StepArrays::build(&p, far, known, LIMITS).unwrap_err();
        assert!(err.contains("page 99 is outside the pool of 10"), "{err}");
    }

    #[test]
    fn bad_plans_are_refused_with_the_cpu_executor_s_reasons() {
        let build = |p: &StepPlan| StepArrays::build(p, tables, known, LIMITS).unwrap_err();
        let mut p = plan();
        p.rows[1].positions = 4..9;
        p.input_tokens.push(InputToken::Known(1));
        p.input_tokens.push(InputToken::Known(1));
        p.rows[1].inputs = 1..6;
        assert!(build(&p).contains("position 8 has no page (table of 2)"));
        let mut p = plan();
        p.input_tokens[2] = InputToken::Known(100);
        assert!(build(&p).contains("token 100 is outside the vocabulary"));
        let mut p = plan();
        p.rows[0].positions = 5..5;
        assert!(build(&p).contains("no position to compute"));
        let mut p = plan();
        p.input_tokens[0] = InputToken::FromStep { step: StepId(6), row: 0 };
        assert!(build(&p).contains("unresolved"));
    }

    #[test]
    fn padding_rows_sit_on_the_scratch_page_and_graphs_take_decode_steps_only() {
        let mut p = plan();
        p.rows.truncate(1);
        p.input_tokens.truncate(1);
        p.bucket = Bucket::Graph { padded_rows: 4 };
        let mut a = StepArrays::build(&p, tables, known, LIMITS).unwrap();
        assert_eq!(graph_rows(&p, &a, 8), Some(4));
        assert_eq!(graph_rows(&p, &a, 2), None, "past the largest captured size");
        a.pad_to(4, LIMITS).unwrap();
        assert_eq!(a.tokens, [11, 0, 0, 0]);
        assert_eq!(a.positions, [5, 0, 0, 0]);
        assert_eq!(a.token_rows, [0, 1, 2, 3]);
        assert_eq!(a.table_offsets, [0, 2, 3, 4]);
        assert_eq!(a.tables, [3, 8, 10, 10, 10]);
        assert_eq!(a.sample_tokens, [0, 1, 2, 3]);
        assert_eq!(a.sample_rows, [0], "padding rows hand back nothing");
        // A prefill chunk in the step, or the scheduler's eager choice: no graph.
        let mut mixed = plan();
        mixed.bucket = Bucket::Graph { padded_rows: 4 };
        let b = StepArrays::build(&mixed, tables, known, LIMITS).unwrap();
        assert_eq!(graph_rows(&mixed, &b, 8), None);
        p.bucket = Bucket::Eager;
        assert_eq!(graph_rows(&p, &StepArrays::build(&p, tables, known, LIMITS).unwrap(), 8), None);
    }

    #[test]
    fn the_kv_cache_holds_each_page_of_each_layer_and_part_contiguously() {
        // 2 layers, 3 pool pages (+ scratch), 4 positions a page, 2 KV heads of 8.
        let l = KvCacheLayout::new(2, 3, 4, 2, 8);
        assert_eq!((l.pages, l.page_elements(), l.part_elements()), (4, 64, 256));
        assert_eq!(l.total_elements(), 2 * 2 * 256);
        assert_eq!(l.total_bytes(), 2048);
        assert_eq!(l.part_offset(1, Part::Values), 3 * 256);
        assert_eq!(l.page_offset(1, Part::Keys, 2), 2 * 256 + 2 * 64);
        assert_eq!(l.element(2, 3, 1), ((2 * 4 + 3) * 2 + 1) * 8);
        // The CPU backend's page: layers * 2 parts * 4 positions * 2 heads * 8 dims * 2 bytes.
        assert_eq!(l.page_bytes(), 2 * 2 * 4 * 2 * 8 * 2);
    }
}
