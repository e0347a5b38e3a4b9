//! What one step computes (the plan the scheduler hands the executor) and what it produced (the
//! outputs the executor hands back).
//!
//! A plan is laid out flat, as a GPU engine's input buffers are: one array of input tokens and one
//! of page-table updates, with each row naming its ranges in them. Page tables travel as deltas:
//! the executor keeps one table per batch slot (see `PageTables`) and each row says from which
//! index its table is replaced by the row's pages. A row for a request new to its slot replaces
//! from index 0. This keeps a step over 1,024 long sequences from copying 64k page numbers.

use std::ops::Range;

use super::RequestId;
use crate::kv::PageRef;
use crate::model::TokenLogprobs;

/// Names a step. Increases by one per planned step, never reused.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct StepId(pub u64);

/// One input token of a row.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum InputToken {
    Known(u32),
    /// Overlap mode: the token that row `row` of step `step` samples, not known when this plan
    /// was made. The executor takes it from that step's outputs.
    FromStep {
        step: StepId,
        row: u32,
    },
}

/// Whether the step runs in a captured graph or eagerly, as CUDA engines choose.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Bucket {
    /// Decode-only step padded to the smallest capture size that holds its rows.
    Graph { padded_rows: u32 },
    /// Mixed prefill, or more rows than the largest capture size.
    Eager,
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RowPlan {
    pub request: RequestId,
    /// The request's batch slot: its page table's home in the executor.
    pub slot: u32,
    /// Positions in the sequence whose KV this step computes.
    pub positions: Range<u32>,
    /// This row's entries in `StepPlan::input_tokens`, one per position.
    pub inputs: Range<u32>,
    /// The slot's page table is cut to this length, then `page_updates` is appended.
    pub page_table_from: u32,
    /// This row's entries in `StepPlan::page_updates`.
    pub page_updates: Range<u32>,
    /// Whether the last position's logits are sampled into a token (false for a prefill chunk
    /// that does not end the prompt).
    pub sample: bool,
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub struct StepPlan {
    pub step: StepId,
    /// Decode rows first, then prefill chunks, each in request order.
    pub rows: Vec<RowPlan>,
    pub input_tokens: Vec<InputToken>,
    pub page_updates: Vec<PageRef>,
    pub bucket: Bucket,
}

impl StepPlan {
    pub fn tokens_total(&self) -> u32 {
        self.input_tokens.len() as u32
    }

    pub fn row_inputs(&self, row: &RowPlan) -> &[InputToken] {
        &self.input_tokens[row.inputs.start as usize..row.inputs.end as usize]
    }

    pub fn row_page_updates(&self, row: &RowPlan) -> &[PageRef] {
        &self.page_updates[row.page_updates.start as usize..row.page_updates.end as usize]
    }

    /// Rows whose logits are sampled, in order: `StepOutputs::sampled` has one token each.
    pub fn sampling_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.sample).count()
    }
}

/// What the executor hands back for a step.
#[derive(Clone, PartialEq, Debug)]
pub struct StepOutputs {
    pub step: StepId,
    /// One token per sampling row, in row order.
    pub sampled: Vec<u32>,
    /// Empty when no sampling row's request asked for log-probabilities; else one entry per
    /// sampling row, `Some` for the rows whose request asked.
    pub logprobs: Vec<Option<TokenLogprobs>>,
    /// The prompt tokens this step's positions scored, for the requests that asked
    /// (`SamplingSpec::prompt_logprobs`): one entry a row that scored any, in row order.
    pub prompt_logprobs: Vec<PromptLogprobs>,
}

impl StepOutputs {
    /// Outputs with tokens only.
    pub fn tokens(step: StepId, sampled: Vec<u32>) -> StepOutputs {
        StepOutputs { step, sampled, logprobs: Vec::new(), prompt_logprobs: Vec::new() }
    }
}

/// A row's log-probabilities of prompt tokens: `logprobs[i]` is of the token at position
/// `from + i`, under the logits of the position before it. A recomputed position scores its
/// token again; whoever reports them keeps the first.
#[derive(Clone, PartialEq, Debug)]
pub struct PromptLogprobs {
    pub request: RequestId,
    pub from: u32,
    pub logprobs: Vec<TokenLogprobs>,
}

impl PromptLogprobs {
    /// The scores of positions `next` on, for a reader that has every position before `next`
    /// and none after: empty if these are all before it (a recomputed position's repeat);
    /// `None` if they start past it, a gap that would misplace every later one (a prompt is
    /// computed in order, so never).
    pub fn from_position(&self, next: u32) -> Option<&[TokenLogprobs]> {
        let skip = next.checked_sub(self.from)? as usize;
        Some(self.logprobs.get(skip..).unwrap_or_default())
    }
}

/// The executor's side of the page-table deltas: one table per slot. The CPU and CUDA backends
/// and the simulator keep one and apply every plan to it in step order.
#[derive(Clone, Debug, Default)]
pub struct PageTables {
    tables: Vec<Vec<PageRef>>,
}

impl PageTables {
    pub fn new(slots: u32) -> PageTables {
        PageTables { tables: vec![Vec::new(); slots as usize] }
    }

    /// Applies the plan's page-table updates. Refuses a plan that names a slot it does not have
    /// or a cut beyond a table's end, leaving the tables as they were.
    pub fn apply(&mut self, plan: &StepPlan) -> Result<(), String> {
        for row in &plan.rows {
            let Some(table) = self.tables.get(row.slot as usize) else {
                return Err(format!("{}: slot {} out of range", row.request, row.slot));
            };
            if row.page_table_from as usize > table.len() {
                return Err(format!(
                    "{}: cut at {} beyond table length {}",
                    row.request,
                    row.page_table_from,
                    table.len()
                ));
            }
        }
        for row in &plan.rows {
            let table = &mut self.tables[row.slot as usize];
            table.truncate(row.page_table_from as usize);
            table.extend_from_slice(plan.row_page_updates(row));
        }
        Ok(())
    }

    pub fn table(&self, slot: u32) -> &[PageRef] {
        self.tables.get(slot as usize).map_or(&[], Vec::as_slice)
    }
}

/// The executor's side of overlap-mode placeholders: what the last few steps sampled, by row,
/// so an input `FromStep { step, row }` can be resolved when its step runs.
#[derive(Clone, Debug, Default)]
pub struct RecentSamples {
    steps: std::collections::VecDeque<(StepId, Vec<Option<u32>>)>,
}

impl RecentSamples {
    /// How many steps back a placeholder may point (overlap mode needs one).
    const STEPS_MAX: usize = 4;

    pub fn resolve(&self, input: InputToken) -> Result<u32, String> {
        match input {
            InputToken::Known(token) => Ok(token),
            InputToken::FromStep { step, row } => self
                .steps
                .iter()
                .find(|(s, _)| *s == step)
                .and_then(|(_, rows)| rows.get(row as usize).copied().flatten())
                .ok_or_else(|| {
                    format!("placeholder names {step:?} row {row}, which sampled nothing known")
                }),
        }
    }

    /// Records what `step` sampled: `Some(token)` for each sampling row, `None` for the others.
    pub fn record(&mut self, step: StepId, by_row: Vec<Option<u32>>) {
        if self.steps.len() == Self::STEPS_MAX {
            self.steps.pop_front();
        }
        self.steps.push_back((step, by_row));
    }
}
