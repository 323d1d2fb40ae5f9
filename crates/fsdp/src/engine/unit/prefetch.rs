//! When units are gathered ahead of their use: the one place prefetch is decided.

use super::ShardedState;
use crate::config::BackwardPrefetch;

/// When units are gathered ahead of their use.
#[derive(Debug, Clone)]
pub(crate) struct Prefetch {
    /// Gather the next unit (in the previous step's forward order) while one runs forward.
    pub forward: bool,
    /// Gather the next unit in backward order after a refill (BACKWARD_PRE) or after a
    /// unit's reduction is issued (BACKWARD_POST).
    pub backward: BackwardPrefetch,
    /// Units in the order the previous step's forward used them (plan order at first).
    pub forward_order: Vec<usize>,
}

/// A point in a unit's lifecycle after which another unit may be prefetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moment {
    /// The unit was gathered for its forward.
    Gathered,
    /// The unit was refilled for its backward.
    Refilled,
    /// The unit's reduction was issued.
    Reduced,
}

impl Prefetch {
    /// The unit to gather next after `moment` of unit `u`, and the state it must be waiting
    /// in; `backward_order` is this step's order of units in backward.
    pub fn after(
        &self,
        moment: Moment,
        u: usize,
        backward_order: &[usize],
    ) -> Option<(usize, ShardedState)> {
        let next_in = |order: &[usize]| {
            let at = order.iter().position(|&x| x == u)?;
            order.get(at + 1).copied()
        };
        match moment {
            Moment::Gathered if self.forward => {
                next_in(&self.forward_order).map(|n| (n, ShardedState::Sharded))
            }
            Moment::Refilled if self.backward == BackwardPrefetch::BackwardPre => {
                next_in(backward_order).map(|n| (n, ShardedState::ReleasedAfterForward))
            }
            Moment::Reduced if self.backward == BackwardPrefetch::BackwardPost => {
                next_in(backward_order).map(|n| (n, ShardedState::ReleasedAfterForward))
            }
            _ => None,
        }
    }
}
