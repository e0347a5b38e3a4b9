//! The chained hash that names a full page of tokens in the prefix cache.
//!
//! A page's key is `block_hash(parent, tokens)`, where `parent` is the key of the page before it
//! and the first page's parent is `root_hash(namespace_salt)`. Equal keys therefore mean equal
//! token prefixes under the same namespace (model, adapter, tenant), up to hash collisions, which
//! the pool rules out by comparing the stored tokens and parent on every hit.
//!
//! The function is ours, not std's `DefaultHasher`, because its values must be the same on every
//! build and machine: they cross the wire between workers and appear in traces. It is not meant to
//! resist an adversary; a collision costs a cache miss, never wrong data.

/// Key of the first page of a sequence under a namespace salt.
pub fn root_hash(namespace_salt: u64) -> u64 {
    mix64(namespace_salt ^ 0x6c6f_636b_7374_6570) // "lockstep"
}

/// Key of a page holding `tokens`, following the page whose key is `parent`.
///
/// The tokens are hashed without the parent, and the parent joins in one cheap step: hashing a
/// long prompt's pages then runs in parallel, with only that step on the chain from page to page.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    chain(parent, content_hash(tokens))
}

/// Joins a page's content hash to its parent's key. `content` is already well mixed, so one
/// multiply and rotate keep keys uniform while costing the chain five cycles a page.
fn chain(parent: u64, content: u64) -> u64 {
    (parent ^ content).wrapping_mul(PRIME).rotate_left(29)
}

/// Hash of one page's tokens: four independent lanes take two tokens each per round, so the
/// multiplies overlap.
fn content_hash(tokens: &[u32]) -> u64 {
    let [mut a, mut b, mut c, mut d] = LANE_SEEDS;
    let mut rounds = tokens.chunks_exact(8);
    for r in &mut rounds {
        a = absorb(a, pair_word(r[0], r[1]));
        b = absorb(b, pair_word(r[2], r[3]));
        c = absorb(c, pair_word(r[4], r[5]));
        d = absorb(d, pair_word(r[6], r[7]));
    }
    let mut lanes = [a, b, c, d];
    for (i, &token) in rounds.remainder().iter().enumerate() {
        lanes[i % 4] = absorb(lanes[i % 4], u64::from(token) | 1 << 63);
    }
    let len = tokens.len() as u64;
    let folded =
        lanes[0] ^ lanes[1].rotate_left(19) ^ lanes[2].rotate_left(38) ^ lanes[3].rotate_left(57);
    mix64(folded ^ len.wrapping_mul(PRIME))
}

/// Keys of every full page of `tokens`, in order; a partial last page has no key.
pub fn block_hashes(namespace_salt: u64, tokens: &[u32], page_tokens: usize) -> Vec<u64> {
    let mut parent = root_hash(namespace_salt);
    let mut keys = Vec::with_capacity(tokens.len() / page_tokens.max(1));
    for page in tokens.chunks_exact(page_tokens.max(1)) {
        parent = block_hash(parent, page);
        keys.push(parent);
    }
    keys
}

const PRIME: u64 = 0x9e37_79b9_7f4a_7c15;
const LANE_SEEDS: [u64; 4] =
    [0x243f_6a88_85a3_08d3, 0x1319_8a2e_0370_7344, 0xa409_3822_299f_31d0, 0x082e_fa98_ec4e_6c89];

fn pair_word(a: u32, b: u32) -> u64 {
    u64::from(a) | u64::from(b) << 32
}

fn absorb(lane: u64, word: u64) -> u64 {
    (lane ^ word).wrapping_mul(PRIME).rotate_left(29)
}

/// splitmix64's finalizer: every input bit reaches every output bit.
fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_pinned_across_builds() {
        // These values travel between workers and into traces: changing them is a wire change.
        // They were computed by an independent Python transcription of the function.
        assert_eq!(root_hash(0), 0x8574_94ab_d8fd_accc);
        assert_eq!(block_hash(root_hash(0), &[1, 2, 3, 4, 5, 6, 7, 8, 9]), 0x49cd_13ba_fd32_46ef);
        // A salt whose bits meet the root's constant, and seven tokens past the last full round
        // (they go to the lanes in turn): salt 0 and one token left over pinned neither.
        assert_eq!(root_hash(0xffff), 0x9cc9_499c_4b76_b8fe);
        let tokens: Vec<u32> = (0..15).map(|i| 1000 + i * 7).collect();
        assert_eq!(block_hash(root_hash(0xffff), &tokens), 0xba47_a597_30e9_5427);
    }

    #[test]
    fn every_token_position_and_parent_matters() {
        let base: Vec<u32> = (0..16).collect();
        let key = block_hash(7, &base);
        assert_ne!(key, block_hash(8, &base));
        for i in 0..base.len() {
            let mut changed = base.clone();
            changed[i] ^= 1;
            assert_ne!(key, block_hash(7, &changed), "token {i} did not change the key");
        }
        let mut swapped = base.clone();
        swapped.swap(0, 1);
        assert_ne!(key, block_hash(7, &swapped));
        assert_ne!(block_hash(7, &base[..15]), block_hash(7, &[&base[..15], &[0]].concat()));
    }

    #[test]
    fn chain_depends_on_salt_and_whole_prefix() {
        let tokens: Vec<u32> = (0..40).collect();
        let a = block_hashes(1, &tokens, 8);
        assert_eq!(a.len(), 5);
        assert_ne!(a, block_hashes(2, &tokens, 8));
        let mut other = tokens.clone();
        other[3] = 99;
        let b = block_hashes(1, &other, 8);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "a change in page 0 must change every later key"
        );
        assert_eq!(block_hashes(1, &tokens[..39], 8).len(), 4, "a partial page has no key");
    }
}
