//! Waits that say what they wait for.
//!
//! A job that waits silently for two minutes and then restarts is the hang users fear most: every
//! wait on a peer here says, at least every [`REPORT_EVERY`], whom it waits for and why — in the
//! log of the rank that waits ([`wait_reporting`]), and for the coordinator's waits on its ranks
//! also as plain data ([`Stall`]) that the coordinator puts into the job's status long before any
//! timeout fires ([`Patience`]).

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

/// How often a wait that goes on says so.
pub const REPORT_EVERY: Duration = Duration::from_secs(5);

/// What a long wait of the coordinator is waiting for: published once the wait has lasted
/// [`REPORT_EVERY`], withdrawn (`None`) when it ends.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Stall {
    /// The phase that waits: "connecting", "set-up", "step 3: train", ….
    pub phase: String,
    /// The ranks it waits for.
    pub waiting_for: Vec<String>,
    /// How long it has waited so far, in seconds.
    pub seconds: f64,
}

impl Stall {
    /// `<phase>: waiting <seconds>s for <ranks>`, as the job's status and `rlplane local` show it.
    pub fn message(&self) -> String {
        format!("{}: waiting {:.0}s for {}", self.phase, self.seconds, self.waiting_for.join(", "))
    }
}

/// Where the coordinator's stalls go (the job's status, through the coordinator's observer):
/// the current stall, `None` while nothing is.
pub type StallSender = watch::Sender<Option<Stall>>;

/// Awaits `fut` until `deadline`, logging a warning every [`REPORT_EVERY`] it is still pending:
/// "still <what()>", which says what is awaited and from whom ("waiting for …", "handshaking with …"). `Err(waited)` when the deadline passed first.
/// One timer at a time, as a plain timeout would be: no cost on waits that end quickly.
pub async fn wait_reporting<F: Future>(
    deadline: Instant,
    what: impl Fn() -> String,
    fut: F,
) -> Result<F::Output, Duration> {
    let start = Instant::now();
    let mut next = start + REPORT_EVERY;
    tokio::pin!(fut);
    loop {
        match tokio::time::timeout_at(next.min(deadline), &mut fut).await {
            Ok(out) => return Ok(out),
            Err(_) if Instant::now() >= deadline => return Err(start.elapsed()),
            Err(_) => {
                let waited = start.elapsed().as_secs();
                let left = deadline.saturating_duration_since(Instant::now()).as_secs();
                tracing::warn!(waited_s = waited, timeout_in_s = left, "still {}", what());
                next += REPORT_EVERY;
            }
        }
    }
}

/// One wait of the coordinator's that reports itself: wake at [`Patience::due`], call
/// [`Patience::report`] with the ranks still awaited and publish what it returns; when the wait
/// ends, [`Patience::finish`] says whether a stall was published (and is to be withdrawn).
pub struct Patience {
    phase: String,
    start: Instant,
    next: Instant,
    reported: bool,
}

impl Patience {
    /// A wait of `phase`, starting now.
    pub fn new(phase: impl Into<String>) -> Patience {
        Patience::since(Instant::now(), phase)
    }

    /// A wait of `phase` that started at `start` (a wait on a hot path makes its `Patience` only
    /// once the first report is due).
    pub fn since(start: Instant, phase: impl Into<String>) -> Patience {
        Patience { phase: phase.into(), start, next: start + REPORT_EVERY, reported: false }
    }

    /// When the next report is due.
    pub fn due(&self) -> Instant {
        self.next
    }

    /// If a report is due: logs the phase and `waiting_for()` and returns the stall to publish.
    pub fn report(&mut self, waiting_for: impl FnOnce() -> Vec<String>) -> Option<Stall> {
        let now = Instant::now();
        if now < self.next {
            return None;
        }
        let stall = Stall {
            phase: self.phase.clone(),
            waiting_for: waiting_for(),
            seconds: now.duration_since(self.start).as_secs_f64(),
        };
        tracing::warn!(
            phase = %stall.phase,
            waited_s = stall.seconds as u64,
            "the coordinator is still waiting for {}",
            stall.waiting_for.join(", ")
        );
        self.reported = true;
        while self.next <= now {
            self.next += REPORT_EVERY;
        }
        Some(stall)
    }

    /// Ends the wait: true when it had reported a stall, which the caller withdraws.
    pub fn finish(self) -> bool {
        if self.reported {
            tracing::info!(phase = %self.phase, waited_s = self.start.elapsed().as_secs_f64(), "the wait is over");
        }
        self.reported
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_long_wait_reports_its_stall_once_a_period() {
        assert_eq!(Patience::new("step 2: train").report(|| unreachable!("nothing is due yet")), None);
        let mut p = Patience::since(Instant::now() - REPORT_EVERY, "step 2: train");
        let stall = p.report(|| vec!["trainer-0".into()]).expect("due");
        assert_eq!(stall.phase, "step 2: train");
        assert_eq!(stall.waiting_for, ["trainer-0"]);
        assert!(stall.seconds >= REPORT_EVERY.as_secs_f64());
        assert!(p.due() > Instant::now(), "the next report is a period later");
        assert_eq!(p.report(|| unreachable!("reported already")), None);
        assert!(p.finish(), "a reported stall is to be withdrawn");
        assert!(!Patience::new("quick").finish());
    }

    #[tokio::test]
    async fn wait_reporting_returns_the_output_or_how_long_it_waited() {
        let deadline = Instant::now() + Duration::from_millis(100);
        let ok = wait_reporting(deadline, || "nothing".into(), async { 7 }).await;
        assert_eq!(ok, Ok(7));
        let never = wait_reporting(deadline, || "a peer that never answers".into(), std::future::pending::<()>()).await;
        assert!(never.is_err_and(|waited| waited >= Duration::from_millis(90)));
    }
}
