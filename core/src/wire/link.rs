//! Whether two workers may open a link: the decision both ends of a `Hello` exchange make, so
//! that a mismatch refuses the link instead of moving KV the receiver would read wrongly (a page
//! of 16 tokens copied into pages of 32 decodes without an error, into garbage).

use super::messages::{Lane, LinkIdentity, LinkMismatch, Role};

/// The verdict on a peer's `Hello`, from `mine`'s side. Symmetric: both ends reach the same one.
///
/// Roles: the router talks to prefill and decode workers, and prefill to decode; two workers of
/// one role never link. Every link needs the same model (the same prompt means the same tokens
/// and the same KV). Only a prefill–decode link moves KV, so only it needs equal page size and
/// KV layout.
pub fn check_link(mine: &LinkIdentity, theirs: &LinkIdentity) -> Result<(), LinkMismatch> {
    let moves_kv = moves_kv(mine.role, theirs.role)?;
    if mine.model != theirs.model {
        return Err(LinkMismatch::Model);
    }
    if moves_kv && mine.page_tokens != theirs.page_tokens {
        return Err(LinkMismatch::PageTokens);
    }
    if moves_kv && mine.kv_layout != theirs.kv_layout {
        return Err(LinkMismatch::KvLayout);
    }
    Ok(())
}

/// Whether two workers may open a link on `lane`, once `check_link` passed: the KV lane only
/// between a prefill and a decode worker. Symmetric, as `check_link` is.
pub fn check_lane(mine: Role, theirs: Role, lane: Lane) -> Result<(), LinkMismatch> {
    match lane {
        Lane::Control => moves_kv(mine, theirs).map(|_| ()),
        Lane::Kv if moves_kv(mine, theirs)? => Ok(()),
        Lane::Kv => Err(LinkMismatch::Roles),
    }
}

/// Whether a pair of roles moves KV; `Roles` if the two never link.
fn moves_kv(a: Role, b: Role) -> Result<bool, LinkMismatch> {
    match if a <= b { (a, b) } else { (b, a) } {
        (Role::Router, Role::Prefill) | (Role::Router, Role::Decode) => Ok(false),
        (Role::Prefill, Role::Decode) => Ok(true),
        _ => Err(LinkMismatch::Roles),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::KvLayout;

    fn identity(role: Role) -> LinkIdentity {
        LinkIdentity {
            role,
            page_tokens: 16,
            kv_layout: KvLayout { layers: 2, kv_heads: 2, head_dim: 8, element_bytes: 4 },
            model: 7,
        }
    }

    #[test]
    fn the_three_pairs_of_distinct_roles_link_both_ways() {
        for (a, b) in [
            (Role::Router, Role::Prefill),
            (Role::Router, Role::Decode),
            (Role::Prefill, Role::Decode),
        ] {
            assert_eq!(check_link(&identity(a), &identity(b)), Ok(()));
            assert_eq!(check_link(&identity(b), &identity(a)), Ok(()));
        }
    }

    #[test]
    fn two_workers_of_one_role_never_link() {
        for role in [Role::Router, Role::Prefill, Role::Decode] {
            assert_eq!(check_link(&identity(role), &identity(role)), Err(LinkMismatch::Roles));
        }
    }

    #[test]
    fn only_a_prefill_and_a_decode_worker_open_the_kv_lane() {
        assert_eq!(check_lane(Role::Prefill, Role::Decode, Lane::Kv), Ok(()));
        assert_eq!(check_lane(Role::Decode, Role::Prefill, Lane::Kv), Ok(()));
        for other in [Role::Prefill, Role::Decode] {
            assert_eq!(check_lane(Role::Router, other, Lane::Control), Ok(()));
            assert_eq!(check_lane(Role::Router, other, Lane::Kv), Err(LinkMismatch::Roles));
            assert_eq!(check_lane(other, Role::Router, Lane::Kv), Err(LinkMismatch::Roles));
        }
        assert_eq!(check_lane(Role::Decode, Role::Decode, Lane::Control), Err(LinkMismatch::Roles));
    }

    #[test]
    fn a_page_size_layout_or_model_mismatch_refuses_a_kv_link() {
        let prefill = identity(Role::Prefill);
        let decode = identity(Role::Decode);
        let pages = LinkIdentity { page_tokens: 32, ..decode };
        assert_eq!(check_link(&prefill, &pages), Err(LinkMismatch::PageTokens));
        assert_eq!(check_link(&pages, &prefill), Err(LinkMismatch::PageTokens));
        let layout =
            LinkIdentity { kv_layout: KvLayout { head_dim: 16, ..decode.kv_layout }, ..decode };
        assert_eq!(check_link(&prefill, &layout), Err(LinkMismatch::KvLayout));
        let model = LinkIdentity { model: 8, ..decode };
        assert_eq!(check_link(&prefill, &model), Err(LinkMismatch::Model));
    }

    #[test]
    fn the_router_needs_the_model_but_not_the_kv_shape() {
        let router = LinkIdentity {
            page_tokens: 0,
            kv_layout: KvLayout { layers: 0, kv_heads: 0, head_dim: 0, element_bytes: 0 },
            ..identity(Role::Router)
        };
        assert_eq!(check_link(&router, &identity(Role::Decode)), Ok(()));
        let other_model = LinkIdentity { model: 9, ..identity(Role::Prefill) };
        assert_eq!(check_link(&router, &other_model), Err(LinkMismatch::Model));
    }
}
