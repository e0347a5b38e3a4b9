//! An intrusive doubly linked list over page numbers: the eviction order of cached pages that
//! nobody references. Links live in two arrays sized once, so push, remove and pop are O(1) and
//! never allocate. Head is least recently used.

pub(crate) const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    pub(crate) fn new(pages_total: usize) -> LruList {
        LruList {
            prev: vec![NIL; pages_total],
            next: vec![NIL; pages_total],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `page` as most recently used. The caller guarantees it is not in the list.
    pub(crate) fn push_back(&mut self, page: u32) {
        let i = page as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = page;
        } else {
            self.next[self.tail as usize] = page;
        }
        self.tail = page;
        self.len += 1;
    }

    /// Unlinks `page`. The caller guarantees it is in the list.
    pub(crate) fn remove(&mut self, page: u32) {
        let i = page as usize;
        let (prev, next) = (self.prev[i], self.next[i]);
        if prev == NIL {
            self.head = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.prev[next as usize] = prev;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.len -= 1;
    }

    /// Removes and returns the least recently used page.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let head = self.head;
        if head == NIL {
            return None;
        }
        self.remove(head);
        Some(head)
    }

    /// Whether `page` is in the list, with its links checked both ways: its neighbours (or the
    /// head and tail, at the ends) point back at it, or it has no links and is neither end. O(1):
    /// for the pool's incremental check, which looks at the pages it changed and no others.
    pub(crate) fn linked(&self, page: u32) -> Result<bool, String> {
        let i = page as usize;
        let (Some(&prev), Some(&next)) = (self.prev.get(i), self.next.get(i)) else {
            return Err(format!("lru page {page} is beyond the list's {} pages", self.prev.len()));
        };
        let back_from_prev = if prev == NIL {
            self.head == page
        } else {
            self.next.get(prev as usize) == Some(&page)
        };
        let back_from_next = if next == NIL {
            self.tail == page
        } else {
            self.prev.get(next as usize) == Some(&page)
        };
        match (back_from_prev, back_from_next) {
            (true, true) => Ok(true),
            (false, false) if prev == NIL && next == NIL => Ok(false),
            _ => Err(format!("lru page {page}: its links {prev} and {next} do not both lead back")),
        }
    }

    /// The pages from least to most recently used, with the links checked both ways.
    /// For invariant checks only; stops at `len + 1` steps so a cycle cannot hang it.
    pub(crate) fn walk(&self) -> Result<Vec<u32>, String> {
        let mut order = Vec::with_capacity(self.len);
        let mut prev = NIL;
        let mut page = self.head;
        while page != NIL {
            if order.len() > self.len {
                return Err(format!("lru list longer than its length {} (a cycle?)", self.len));
            }
            let Some(&back) = self.prev.get(page as usize) else {
                return Err(format!(
                    "lru link to page {page}, beyond the list's {} pages",
                    self.prev.len()
                ));
            };
            if back != prev {
                return Err(format!("lru page {page}: back link {back} but came from {prev}"));
            }
            order.push(page);
            prev = page;
            page = self.next[page as usize];
        }
        if prev != self.tail {
            return Err(format!("lru tail is {} but the walk ended at {prev}", self.tail));
        }
        if order.len() != self.len {
            return Err(format!("lru holds {} pages but says {}", order.len(), self.len));
        }
        Ok(order)
    }
}

#[cfg(test)]
mod invariant_tests;
