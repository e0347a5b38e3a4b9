//! The narrow view of an executor's KV store that the transfer data plane needs: the bytes of one
//! page, read for sending and written on arrival. A one-sided write lands through `write_page`
//! whatever the receiving state machines think (as an RDMA write does); whether it may land is
//! the data plane's check, not the store's.

use super::ExecError;

pub trait PageStore {
    /// Bytes of one page's KV: every layer, head and position of the page.
    fn page_bytes(&self) -> usize;

    /// Appends page `page`'s KV to `out`.
    fn read_page(&self, page: u32, out: &mut Vec<u8>) -> Result<(), ExecError>;

    /// Replaces page `page`'s KV with `data`, exactly `page_bytes()` long.
    fn write_page(&mut self, page: u32, data: &[u8]) -> Result<(), ExecError>;
}
