//! The CPU executor's KV as pages of bytes, for the transfer data plane (`PageStore`), and the
//! layout a link handshake compares (`KvLayout`).
//!
//! A page's bytes are independent of how many threads hold the KV, so executors on different
//! thread counts exchange pages. In order, with `page_tokens` positions `t` of the page:
//!
//! ```text
//! for layer in 0..layers
//!   for part in [keys, values]
//!     for t in 0..page_tokens
//!       for kv_head in 0..kv_heads
//!         head_dim elements, each an IEEE half (f16), little-endian
//! ```
//!
//! so `page_bytes = layers * 2 * page_tokens * kv_heads * head_dim * 2`. Keys are stored after
//! the bias and RoPE at their position, as attention reads them. The cache holds these f16 bits
//! themselves, so a page reads back as the bytes written (NaN payloads included).
//!
//! Ordering with steps: `execute` runs a step on a scoped team that has joined, its KV writes
//! done and its shard locks released, before `execute` returns, and it borrows the executor
//! mutably; `read_page` borrows it shared and `write_page` mutably. So no step is in flight
//! while a page is read or written, and a page read after a step's `execute` returned sees that
//! step's writes (the lock the member released is the lock `read_page` takes). The executor has
//! no queue of its own: a runner that moves it to a thread (the server's `ThreadRunner`) must
//! send page reads and writes as jobs on the same queue as its steps to keep this order.

use lockstep_core::model::{ExecError, PageStore};
use lockstep_core::wire::KvLayout;

use super::{CpuExecutor, KvShard};

impl CpuExecutor {
    /// How this executor lays out a page's KV (the module's order, f16 elements), for the link
    /// handshake: two workers exchange pages only if theirs are equal.
    pub fn kv_layout(&self) -> KvLayout {
        let c = &self.weights.config;
        KvLayout {
            layers: c.layers as u32,
            kv_heads: c.kv_heads as u32,
            head_dim: c.head_dim as u32,
            element_bytes: 2,
        }
    }

    fn check_page(&self, page: u32) -> Result<usize, ExecError> {
        let page = page as usize;
        if page >= self.pages {
            return Err(ExecError(format!("page {page} is outside the pool of {}", self.pages)));
        }
        Ok(page)
    }

    fn shape(&self) -> PageShape {
        let c = &self.weights.config;
        PageShape {
            layers: c.layers,
            page_tokens: self.page_tokens,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        }
    }
}

#[derive(Clone, Copy)]
struct PageShape {
    layers: usize,
    page_tokens: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl PageShape {
    fn bytes(self) -> usize {
        self.layers * 2 * self.page_tokens * self.kv_heads * self.head_dim * 2
    }

    /// Calls `each(shard, part, layer, at)` for every run of `head_dim` elements of page `page`,
    /// in the module's order: the shard holding the run (`widths[shard]` elements a position),
    /// `part` 0 for keys and 1 for values, the layer, and where the run starts in that layer's
    /// vector of the shard.
    fn runs(self, page: usize, widths: &[usize], mut each: impl FnMut(usize, usize, usize, usize)) {
        let members = widths.len();
        for layer in 0..self.layers {
            for part in 0..2 {
                for t in 0..self.page_tokens {
                    let position = page * self.page_tokens + t;
                    for head in 0..self.kv_heads {
                        // `with_threads` gives head `h` to shard `h % members`, ascending, so it
                        // is that shard's head number `h / members`.
                        let (shard, j) = (head % members, head / members);
                        each(shard, part, layer, position * widths[shard] + j * self.head_dim);
                    }
                }
            }
        }
    }
}

fn poisoned<T>(_: T) -> ExecError {
    ExecError("a KV shard was poisoned by a step that panicked".into())
}

impl PageStore for CpuExecutor {
    fn page_bytes(&self) -> usize {
        self.shape().bytes()
    }

    fn read_page(&self, page: u32, out: &mut Vec<u8>) -> Result<(), ExecError> {
        let page = self.check_page(page)?;
        let shape = self.shape();
        let shards =
            self.kv.iter().map(|m| m.read().map_err(poisoned)).collect::<Result<Vec<_>, _>>()?;
        let widths: Vec<usize> = shards.iter().map(|s| s.width).collect();
        out.reserve(shape.bytes());
        shape.runs(page, &widths, |shard, part, layer, at| {
            let s = &shards[shard];
            let store = if part == 0 { &s.keys[layer] } else { &s.values[layer] };
            for &x in &store[at..at + shape.head_dim] {
                out.extend_from_slice(&x.to_le_bytes());
            }
        });
        Ok(())
    }

    fn write_page(&mut self, page: u32, data: &[u8]) -> Result<(), ExecError> {
        let page = self.check_page(page)?;
        let shape = self.shape();
        if data.len() != shape.bytes() {
            return Err(ExecError(format!(
                "{} bytes written to a page of {}",
                data.len(),
                shape.bytes()
            )));
        }
        let mut shards = self
            .kv
            .iter_mut()
            .map(|m| m.get_mut().map_err(poisoned))
            .collect::<Result<Vec<&mut KvShard>, _>>()?;
        let widths: Vec<usize> = shards.iter().map(|s| s.width).collect();
        let mut elements = data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        shape.runs(page, &widths, |shard, part, layer, at| {
            let s = &mut *shards[shard];
            let store = if part == 0 { &mut s.keys[layer] } else { &mut s.values[layer] };
            for (o, x) in store[at..at + shape.head_dim].iter_mut().zip(&mut elements) {
                *o = x;
            }
        });
        Ok(())
    }
}
