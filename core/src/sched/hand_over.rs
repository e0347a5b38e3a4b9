//! Requests whose KV moves between workers, as the scheduler sees them (DESIGN.md section 3).
//!
//! Prefill side: `submit_keeping_pages` runs the prompt like any request, and when it ends its
//! pages are kept rather than released (`SchedEvent::PagesKept`), until the transfer that sends
//! them has pinned them and the caller takes the references with `take_kept_pages`. Without
//! that, the step that samples the first token would free the prompt's pages before the
//! transfer could read them.
//!
//! Decode side: `reserve` holds a batch slot for a request whose KV is on its way, so that the
//! hand-over never finds the batch full; `hand_over` then makes it a running request holding the
//! transferred pages, the prompt computed and the first token (sampled by the prefill side)
//! appended; `cancel_reservation` forgets one whose transfer failed.

use std::fmt;

use super::request::{AdmissionError, NewRequest, Phase, Request, RequestId};
use super::scheduler::{SchedEvent, Scheduler};
use crate::Time;
use crate::kv::PageRef;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandOverError {
    /// No reservation of this request is held.
    NotReserved(RequestId),
    /// The pages do not cover the prompt exactly: the KV did not arrive whole.
    WrongPageCount { request: RequestId, expected: usize, got: usize },
    /// More pages said to come from this side's prefix cache than were handed over.
    TooManyCachedPages { request: RequestId, cached: u32, pages: usize },
}

impl fmt::Display for HandOverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandOverError::NotReserved(id) => write!(f, "{id} holds no reservation"),
            HandOverError::WrongPageCount { request, expected, got } => {
                write!(f, "{request}: {got} pages handed over for a prompt of {expected}")
            }
            HandOverError::TooManyCachedPages { request, cached, pages } => {
                write!(f, "{request}: {cached} cached pages of {pages}")
            }
        }
    }
}

impl std::error::Error for HandOverError {}

impl Scheduler {
    /// Prefill side: accepts a request like `submit`, whose pages are kept when it ends.
    pub fn submit_keeping_pages(
        &mut self,
        req: NewRequest,
        now: Time,
    ) -> Result<(), AdmissionError> {
        let id = req.id;
        self.submit(req, now)?;
        let entry = self.by_id[&id];
        self.entry_mut(entry).keeps_pages = true;
        Ok(())
    }

    /// The pages a request submitted with `submit_keeping_pages` held when it ended, in position
    /// order. The references move to the caller, who releases them into `pool_mut()`.
    pub fn take_kept_pages(&mut self, id: RequestId) -> Option<Vec<PageRef>> {
        self.kept.remove(&id)
    }

    /// Decode side: holds a batch slot for `req`, whose prompt's KV a transfer brings; refused,
    /// leaving no trace, when no slot is free or the request could never run here.
    pub fn reserve(&mut self, req: NewRequest, now: Time) -> Result<(), AdmissionError> {
        self.check_request(&req)?;
        let Some(slot) = self.free_slots.pop() else {
            return Err(AdmissionError::NoSlot { running_max: self.config.running_max });
        };
        let entry = self
            .free_entries
            .pop()
            .expect("entries are sized for every request the queue and the slots bound");
        let id = req.id;
        let mut request = Request::new(req, now);
        request.phase = Phase::Reserved { slot };
        self.entries[entry as usize] = Some(request);
        self.by_id.insert(id, entry);
        Ok(())
    }

    /// Forgets a reservation whose transfer ended without KV. No event: the request never ran.
    pub fn cancel_reservation(&mut self, id: RequestId) -> Result<(), HandOverError> {
        let entry = self.reserved_entry(id)?;
        let Phase::Reserved { slot } = self.entry(entry).phase else { unreachable!() };
        self.free_slots.push(slot);
        self.entries[entry as usize] = None;
        self.by_id.remove(&id);
        self.free_entries.push(entry);
        Ok(())
    }

    /// The transfer brought the whole prompt's KV: the request runs, holding `pages` (the
    /// references move here), the first `cached_pages` of which came from this side's prefix
    /// cache, with `first_token` as its first output token (reported as a `Token` event; it may
    /// end the request at once).
    pub fn hand_over(
        &mut self,
        id: RequestId,
        pages: Vec<PageRef>,
        cached_pages: u32,
        first_token: u32,
        _now: Time,
    ) -> Result<(), HandOverError> {
        let entry = self.reserved_entry(id)?;
        let page_tokens = self.pool.page_tokens();
        let r = self.entry(entry);
        let expected = r.prompt_len.div_ceil(page_tokens) as usize;
        if pages.len() != expected {
            return Err(HandOverError::WrongPageCount { request: id, expected, got: pages.len() });
        }
        if cached_pages as usize > pages.len() || cached_pages * page_tokens > r.prompt_len {
            return Err(HandOverError::TooManyCachedPages {
                request: id,
                cached: cached_pages,
                pages: pages.len(),
            });
        }
        let Phase::Reserved { slot } = r.phase else { unreachable!() };
        let r = self.entry_mut(entry);
        r.computed = r.prompt_len;
        r.computed_high = r.computed_high.max(r.computed);
        r.pages = pages;
        // Pages found in this side's cache are in it already; the rest are offered once full,
        // as any computed page is.
        r.pages_cached = cached_pages;
        r.phase = Phase::Running { slot };
        let key = (r.order, entry);
        let at = self.running.binary_search(&key).expect_err("a reserved request is not running");
        self.running.insert(at, key);
        let r = self.entry_mut(entry);
        r.tokens.push(first_token);
        self.events.push_back(SchedEvent::Token { request: id, token: first_token });
        if let Some(reason) = self.stop_reason(entry, first_token) {
            self.finish(entry, reason);
        }
        Ok(())
    }

    fn reserved_entry(&self, id: RequestId) -> Result<u32, HandOverError> {
        match self.by_id.get(&id) {
            Some(&entry) if matches!(self.entry(entry).phase, Phase::Reserved { .. }) => Ok(entry),
            _ => Err(HandOverError::NotReserved(id)),
        }
    }
}
