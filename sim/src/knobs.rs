//! What a seed decides besides faults (swarm testing: each seed draws its own configuration, so
//! that a bug needing small pools, overlap scheduling or a short lease is reached by some seeds):
//! the topology's sizes and the servers' settings, drawn within what the trace needs.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use lockstep_server::roles::launch::DataPlaneTiming;

use crate::rng::SimRng;

/// Which processes run: one server, or a router with prefill and decode workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    Single,
    OneP1D,
    TwoP2D,
}

impl Topology {
    pub fn workers(self) -> (u32, u32) {
        match self {
            Topology::Single => (0, 0),
            Topology::OneP1D => (1, 1),
            Topology::TwoP2D => (2, 2),
        }
    }
}

impl FromStr for Topology {
    type Err = String;
    fn from_str(s: &str) -> Result<Topology, String> {
        match s {
            "single" => Ok(Topology::Single),
            "1p1d" => Ok(Topology::OneP1D),
            "2p2d" => Ok(Topology::TwoP2D),
            other => Err(format!("topology {other:?} is not single, 1p1d or 2p2d")),
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Topology::Single => "single",
            Topology::OneP1D => "1p1d",
            Topology::TwoP2D => "2p2d",
        })
    }
}

/// The servers' settings for one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Knobs {
    pub overlap: bool,
    pub page_tokens: u32,
    /// Pages in each worker's pool: from barely the largest request (pressure, preemption) to
    /// plenty.
    pub kv_pages: u32,
    /// Pages in each prefill worker's pool (its own `--kv-pages`): half the seeds the decode
    /// side's, the others one to one and a half requests' worth. Decode reserves a prompt's pages
    /// before prefill computes it, so with equal pools the prefill side is never the one
    /// squeezed, and a prompt is never preempted there.
    pub prefill_kv_pages: u32,
    pub max_running: u32,
    pub max_waiting: u32,
    /// The chunked-prefill budget: prompt tokens one step computes at most.
    pub step_tokens: u32,
    /// Prompt tokens of one request in one step: below `step_tokens`, a short prompt runs beside
    /// a long one's chunks, and the long one's next chunk can preempt it (prefill preemption).
    pub prefill_chunk_tokens: u32,
    /// Prompt positions one step scores (`echo` with `logprobs`), all requests together: small,
    /// a scored prompt is computed in many short chunks beside the others.
    pub scored_tokens: u32,
    pub capture_sizes: Vec<u32>,
    pub prefix_cache: bool,
    pub prefill_slots: u32,
    pub timing: DataPlaneTiming,
    /// Prompt plus output tokens of one request, at most: the trace's largest.
    pub context_tokens: u32,
}

impl Knobs {
    /// The production defaults, sized for `context_tokens`: what the C=1 reference runs with.
    pub fn plain(context_tokens: u32, requests: usize) -> Knobs {
        let page_tokens = 16;
        Knobs {
            overlap: false,
            page_tokens,
            kv_pages: context_tokens.div_ceil(page_tokens) * 8,
            prefill_kv_pages: context_tokens.div_ceil(page_tokens) * 8,
            max_running: 8,
            max_waiting: waiting_for(requests),
            step_tokens: 512,
            prefill_chunk_tokens: 512,
            scored_tokens: 256,
            capture_sizes: vec![1, 2, 4, 8, 16, 32],
            prefix_cache: true,
            prefill_slots: 2,
            timing: DataPlaneTiming::default(),
            context_tokens,
        }
    }

    /// This seed's settings.
    pub fn draw(seed: u64, context_tokens: u32, requests: usize) -> Knobs {
        let mut rng = SimRng::stream(seed, "knobs");
        let page_tokens = rng.pick(&[4, 8, 16, 32]);
        let request_pages = context_tokens.div_ceil(page_tokens);
        // Pressure comes from pools of one to a few requests' worth; plenty from many.
        let factor = rng.pick(&[1.0, 1.5, 2.0, 4.0, 16.0]);
        let max_running = rng.pick(&[1, 2, 4, 8, 16]);
        let lease = rng.pick(&[300, 1000, 2000]);
        // In the order the literal below drew them before prefill_chunk_tokens came: the same
        // seed, the same knobs.
        let overlap = rng.chance(0.5);
        let step_tokens = rng.pick(&[16, 64, 256, 1024]).max(max_running);
        let kv_pages = pool_pages(request_pages, factor);
        // The knobs added later draw from their own stream: each seed keeps the knobs above (and
        // the runs plants.rs records) as they were.
        let mut later = SimRng::stream(seed, "knobs-prefill");
        let prefill_chunk_tokens = if later.chance(0.5) {
            step_tokens
        } else {
            (step_tokens / later.pick(&[2, 4, 8])).max(1)
        };
        let prefill_kv_pages = if later.chance(0.5) {
            kv_pages
        } else {
            pool_pages(request_pages, later.pick(&[1.0, 1.25, 1.5]))
        };
        let scored_tokens = SimRng::stream(seed, "knobs-scored").pick(&[1, 3, 16, 256]);
        Knobs {
            overlap,
            page_tokens,
            kv_pages,
            prefill_kv_pages,
            max_running,
            max_waiting: waiting_for(requests),
            step_tokens,
            prefill_chunk_tokens,
            scored_tokens,
            capture_sizes: rng.pick(&[&[1, 2, 4, 8, 16][..], &[1, 4, 16], &[2, 8], &[]]).to_vec(),
            prefix_cache: rng.chance(0.75),
            prefill_slots: rng.pick(&[1, 2, 4]),
            timing: DataPlaneTiming {
                lease: Duration::from_millis(lease),
                write_flight_max: Duration::from_millis(rng.pick(&[100, 250, 1000]).min(lease / 2)),
                transfer_deadline: Duration::from_secs(rng.pick(&[5, 30, 60])),
            },
            context_tokens,
        }
    }
}

/// A pool of `factor` times the largest request's pages, and always room for it plus one page.
fn pool_pages(request_pages: u32, factor: f64) -> u32 {
    ((f64::from(request_pages) * factor).ceil() as u32).max(request_pages + 1)
}

/// Room to queue every request of the trace: a refusal for a full queue is correct behaviour, but
/// not what the oracles are about.
fn waiting_for(requests: usize) -> u32 {
    (requests as u32).clamp(16, 100_000)
}

impl fmt::Display for Knobs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "overlap={} page_tokens={} kv_pages={} prefill_kv_pages={} max_running={} step_tokens={} prefill_chunk={} capture={:?} \
             prefix_cache={} prefill_slots={} lease={}ms write_flight={}ms transfer_deadline={}s",
            self.overlap,
            self.page_tokens,
            self.kv_pages,
            self.prefill_kv_pages,
            self.max_running,
            self.step_tokens,
            self.prefill_chunk_tokens,
            self.capture_sizes,
            self.prefix_cache,
            self.prefill_slots,
            self.timing.lease.as_millis(),
            self.timing.write_flight_max.as_millis(),
            self.timing.transfer_deadline.as_secs(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_draw_fits_the_largest_request_and_differs_across_seeds() {
        let drawn: Vec<Knobs> = (0..200).map(|s| Knobs::draw(s, 1000, 10)).collect();
        for k in &drawn {
            assert!(k.kv_pages > 1000u32.div_ceil(k.page_tokens), "{k}");
            assert!(k.prefill_kv_pages > 1000u32.div_ceil(k.page_tokens), "{k}");
            assert!(k.step_tokens >= k.max_running);
            assert!((1..=k.step_tokens).contains(&k.prefill_chunk_tokens), "{k}");
            assert!(k.timing.write_flight_max < k.timing.lease);
        }
        assert!(drawn.iter().any(|k| k.overlap) && drawn.iter().any(|k| !k.overlap));
        assert_eq!(Knobs::draw(3, 1000, 10), Knobs::draw(3, 1000, 10));
    }
}
