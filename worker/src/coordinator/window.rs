//! Which step's generation may go out next: the schedule's one decision, kept pure.
//!
//! A step `j`'s rollouts are generated with the weights the engines hold when its Generate runs.
//! Engines run their commands in order, so that is the version of the last refit queued ahead of
//! it. Step `j` trains on them with a policy lag of `(j − 1) − version`, which the schedule bounds
//! by `k` (`spec.schedule.maxPolicyLag`; 0 is synchronous). It also keeps at most `k` steps
//! generated beyond the one the trainer trains next, so the transfer queue holds at most `k + 1`
//! steps of rollouts.

/// The steps whose Generate went out so far, and the bound they follow.
#[derive(Clone, Debug)]
pub struct GenerationWindow {
    /// The run's first step.
    first: u32,
    /// The next step to generate.
    next: u32,
    /// The last step of the run.
    last: u32,
    /// The policy lag allowed.
    max_lag: u32,
}

impl GenerationWindow {
    /// Steps `first..=last`, generated at most `max_lag` versions behind.
    pub fn new(first: u32, last: u32, max_lag: u32) -> GenerationWindow {
        GenerationWindow { first, next: first, last, max_lag }
    }

    /// The step whose Generate may go out now, when the engines will run it holding `version`
    /// and the trainer trains step `training` next (every earlier step is trained); `None` when
    /// it must wait for a newer version or for the trainer. Takes the step: the caller sends it.
    pub fn take(&mut self, version: u32, training: u32) -> Option<u32> {
        let j = self.next;
        let k = u64::from(self.max_lag);
        let fresh_enough = u64::from(j) <= u64::from(version) + 1 + k;
        let buffered = u64::from(j) <= u64::from(training) + k;
        (j <= self.last && fresh_enough && buffered).then(|| {
            self.next += 1;
            j
        })
    }

    /// The oldest version step `j` may be generated with: `j − 1 − k`, and none older than the
    /// run's first (the initial or restored weights, `first − 1`).
    pub fn min_version(&self, j: u32) -> u64 {
        u64::from(j.saturating_sub(1 + self.max_lag).max(self.first.saturating_sub(1)))
    }

    /// `step` with its [`GenerationWindow::min_version`].
    pub fn with_min(&self, step: Option<u32>) -> Option<(u32, u64)> {
        step.map(|j| (j, self.min_version(j)))
    }

    /// The next step to generate.
    pub fn next(&self) -> u32 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order in which engines run their commands, when generation goes out as soon as the
    /// window allows and each refit goes out once the previous step trained: `G<j>@<version>`
    /// and `R<v>`. Also checks the bound on every step.
    fn engine_order(steps: u32, k: u32) -> Vec<String> {
        let mut w = GenerationWindow::new(1, steps, k);
        let mut queued_version = 0; // the version of the last refit queued on the engines
        let mut order = Vec::new();
        for training in 1..=steps {
            while let Some(j) = w.take(queued_version, training) {
                assert!(j - 1 - queued_version <= k, "step {j} generated {} versions behind", j - 1 - queued_version);
                order.push(format!("G{j}@{queued_version}"));
            }
            // The trainer trains `training` (its Generate went out) and refits.
            assert!(w.next() > training, "step {training} trains before its rollouts were asked for");
            queued_version = training;
            order.push(format!("R{training}"));
        }
        order
    }

    #[test]
    fn lag_zero_is_the_synchronous_schedule() {
        assert_eq!(engine_order(3, 0), ["G1@0", "R1", "G2@1", "R2", "G3@2", "R3"]);
    }

    #[test]
    fn lag_one_generates_the_next_step_while_the_trainer_trains() {
        assert_eq!(engine_order(4, 1), ["G1@0", "G2@0", "R1", "G3@1", "R2", "G4@2", "R3", "R4"]);
    }

    #[test]
    fn lag_two_keeps_two_steps_ahead_and_never_passes_the_last() {
        assert_eq!(engine_order(4, 2), ["G1@0", "G2@0", "G3@0", "R1", "G4@1", "R2", "R3", "R4"]);
        for k in 0..=8 {
            let gens = engine_order(10, k).iter().filter(|c| c.starts_with('G')).count();
            assert_eq!(gens, 10, "k = {k}: every step generated once");
        }
    }

    #[test]
    fn the_oldest_version_a_step_may_use_is_its_lag_behind_and_never_before_the_first() {
        let w = GenerationWindow::new(1, 10, 2);
        assert_eq!((1..=5).map(|j| w.min_version(j)).collect::<Vec<_>>(), [0, 0, 0, 1, 2]);
        let resumed = GenerationWindow::new(5, 10, 2);
        assert_eq!((5..=8).map(|j| resumed.min_version(j)).collect::<Vec<_>>(), [4, 4, 4, 5]);
        assert_eq!(GenerationWindow::new(1, 3, 0).min_version(3), 2);
    }

    #[test]
    fn a_resumed_run_starts_at_its_checkpoint() {
        let mut w = GenerationWindow::new(5, 6, 1);
        assert_eq!(w.take(4, 5), Some(5));
        assert_eq!(w.take(4, 5), Some(6));
        assert_eq!(w.take(4, 5), None, "past the last step");
    }
}
