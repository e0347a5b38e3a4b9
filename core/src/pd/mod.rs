//! The prefill-to-decode KV transfer protocol (DESIGN.md section 3, "pd"), one state machine per
//! side: the router (`router.rs`), the prefill side (`prefill.rs`) and the decode side (`decode.rs`).
//!
//! ## Flow
//!
//! ```text
//! router ──Reserve──▶ decode: match the prefix cache, allocate and pin the missing pages
//!                     decode ──Prepare(pages)──▶ prefill
//!          prefill ──Heartbeat(seq)──▶ decode ──LeaseGrant(seq)──▶ prefill      (repeats)
//!                     decode ──TransferLive──▶ router   (progress grew; once per interval at most)
//!          prefill ══KvWrite══▶ decode memory (one-sided; lands whatever decode's state)
//!          prefill ──Done(first token)──▶ decode   (only after every write completed)
//!                     decode ──DoneAck──▶ prefill, ──Outcome──▶ router; pages go to the scheduler
//! ```
//!
//! ## Why a page is never freed while a write may land
//!
//! The prefill side writes only under a lease. It asks with `Heartbeat(seq)` at its time `s` and,
//! when `LeaseGrant(seq, L)` comes back, may issue writes until `s + L` on its own clock. The
//! decode side, receiving the heartbeat at `r >= s`, keeps the pages reserved until `r + L + W`,
//! where `W` bounds how long a write issued may take to land or fail (the data plane's transport
//! timeout). Every write is issued before `s + L <= r + L` and so lands before `r + L + W`.
//! Clocks need not agree, only run at the same rate (drift is absorbed in `W`). Before the first
//! grant no write may be issued at all, and the pages are held for `L + W` from `Prepare`.
//!
//! So the decode side releases reserved pages only (1) on `Done`, sent once every write has
//! completed, (2) on the prefill side's `Abort` or `AbortAck`, each sent only once its writes have
//! drained, or (3) when the lease has run out. A restarted prefill worker's writes may still be in
//! flight: its transfers wait for their lease. KV that did not arrive whole is never decoded from:
//! `Done` must report every page written, and nothing reaches the scheduler before `Done`.
//!
//! ## Why a long prompt is not cut off, and a stalled one still ends
//!
//! Each side bounds what it waits for by what it can see. The prefill side's deadline counts
//! from `Prepare` and again from the end of the computation; while computing, it is at least one
//! deadline past the worker's last progress (a step that took some prompt further than it had
//! ever been: recomputing what a preemption lost does not count), so a prompt that waits its turn
//! behind others lives as long as the worker makes progress and ends once it stops or thrashes. The decode side holds the
//! pages while heartbeats come (the lease), and tells the router, at most once per report
//! interval, when a heartbeat says the transfer got further (`TransferLive`). The router gives
//! up on a transfer that it has heard nothing of for its outcome timeout: longer than the prefill
//! side's deadline plus the report interval, so it never gives up on a transfer the workers are
//! still finishing.
//!
//! ## Identity
//!
//! Transfer ids are allocated by the router and never reused; a retry is a new transfer. Every
//! message carries `(transfer, epoch)` and is dropped unless both match. Envelopes name the
//! sender's and the addressee's incarnation: traffic meant for an earlier life of a worker is
//! dropped, and state held for a peer's earlier life is given up (after its lease).

mod decode;
mod peers;
mod prefill;
mod router;

pub use decode::{DecodeConfig, DecodeOutput, DecodeSide};
pub use prefill::{PrefillConfig, PrefillOutput, PrefillSide, Sampled};
pub use router::{Router, RouterConfig, RouterError, RouterOutput};
