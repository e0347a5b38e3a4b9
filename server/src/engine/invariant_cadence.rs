//! How often an engine run with `--check-invariants` checks its state machines: the incremental
//! check (what changed since the last one, cheap at any pool size) after every input, and the
//! full check every `FULL_CHECK_EVERY` inputs and whenever the engine holds nothing (at
//! quiescence everything must add up, and the full check is cheap then). The full check alone
//! sees what no input touches (waiting requests, the free list, which request lists which page).

/// Inputs between two full checks while the engine holds work.
pub const FULL_CHECK_EVERY: u64 = 64;

#[derive(Debug, Default)]
pub struct InvariantCadence {
    inputs: u64,
}

impl InvariantCadence {
    /// Counts one input; whether this one gets the full check.
    pub fn full_check_now(&mut self, holding_nothing: bool) -> bool {
        self.inputs += 1;
        holding_nothing || self.inputs.is_multiple_of(FULL_CHECK_EVERY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_when_idle_and_every_so_many_inputs() {
        let mut cadence = InvariantCadence::default();
        let busy: Vec<bool> =
            (0..2 * FULL_CHECK_EVERY).map(|_| cadence.full_check_now(false)).collect();
        assert_eq!(busy.iter().filter(|&&f| f).count(), 2);
        assert!(busy[FULL_CHECK_EVERY as usize - 1]);
        assert!(cadence.full_check_now(true));
    }
}
