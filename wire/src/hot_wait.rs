//! Waiting for a message that is due: park until a little before it, then poll for it.
//!
//! A thread parked for a few milliseconds on a virtualized host took 0.1–0.2 ms to run again once
//! its socket had data (the idle vCPU's exit: 185 µs after 35 ms idle, 20 µs when busy, on the
//! H100 hosts; docs/benchmarks.md), and every step of the control loop had such wake-ups on its
//! critical path: a rank idle since its last command reading the next one, the coordinator idle
//! through a phase reading its last reply. Where the waiter can tell when the message is due —
//! the same wait took about as long the last time, as a step's phases do from one step to the
//! next — it parks until shortly before and then polls its socket with non-blocking reads
//! ([`crate::link::FrameLink`]) until the message arrives or the window closes, and parks again
//! after that. The cost is a core kept busy for at most `2 × LEAD_MAX` per wait; waits that are
//! not regular only lose the window. On a machine with few cores the busy core is taken from the
//! work itself (on 2 cores the CPU loop's control went from 1–2 to 5–8 ms per step), so it is on
//! only where at least [`MIN_CORES`] are available to the process (its cgroup's quota counts);
//! `RLPLANE_HOT_WAIT=on` or `off` decides instead.

use std::time::Duration;

use tokio::time::Instant;

/// The window opens this long before the forecast (a tenth of it, within these bounds). The lower
/// bound covers the timer's resolution (1 ms) and a wake-up; the upper one caps the spin.
const LEAD_MIN: Duration = Duration::from_micros(1500);
const LEAD_MAX: Duration = Duration::from_millis(3);

/// Hot waiting is on by default with at least this many cores available.
pub const MIN_CORES: usize = 8;

/// Whether waits poll when their message is due: `RLPLANE_HOT_WAIT` (`on` / `off`), else whether
/// at least [`MIN_CORES`] cores are available.
pub fn enabled() -> bool {
    match std::env::var("RLPLANE_HOT_WAIT").as_deref() {
        Ok("on") => true,
        Ok("off") => false,
        _ => std::thread::available_parallelism().is_ok_and(|n| n.get() >= MIN_CORES),
    }
}

/// What the last wait of one kind took, to forecast the next.
#[derive(Clone, Copy, Debug)]
pub struct Forecast {
    last: Option<Duration>,
    enabled: bool,
}

impl Forecast {
    /// A forecast with nothing learned yet, polling only if hot waiting is [`enabled`].
    pub fn new() -> Forecast {
        Forecast { last: None, enabled: enabled() }
    }

    /// A forecast that polls whatever the machine (tests).
    #[cfg(test)]
    pub(crate) fn polling() -> Forecast {
        Forecast { last: None, enabled: true }
    }

    /// Records how long a wait took (from its start to its message).
    pub fn learn(&mut self, took: Duration) {
        self.last = Some(took);
    }

    /// The window of a wait starting at `start`: poll inside it, park outside.
    pub fn window(&self, start: Instant) -> Window {
        match self.last.filter(|_| self.enabled) {
            Some(due) => {
                let lead = (due / 10).clamp(LEAD_MIN, LEAD_MAX);
                Window { from: start + due.saturating_sub(lead), until: start + due + lead }
            }
            None => Window { from: start, until: start },
        }
    }
}

impl Default for Forecast {
    fn default() -> Forecast {
        Forecast::new()
    }
}

/// When to poll rather than park, in absolute time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    from: Instant,
    until: Instant,
}

/// What a waiter does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Poll again without parking (yielding to other tasks in between).
    Poll,
    /// Park until the socket is readable, or until this instant (the window's opening), if any.
    Park(Option<Instant>),
}

impl Window {
    /// What to do at `now`.
    pub fn next(&self, now: Instant) -> Next {
        if now < self.from {
            Next::Park(Some(self.from))
        } else if now < self.until {
            Next::Poll
        } else {
            Next::Park(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> Forecast {
        Forecast { last: None, enabled: true }
    }

    #[test]
    fn nothing_learned_parks_at_once() {
        let t = Instant::now();
        assert_eq!(on().window(t).next(t), Next::Park(None));
    }

    #[test]
    fn the_window_surrounds_the_last_wait() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut f = on();
        // 40 ms: a tenth is more than the cap, so ±3 ms.
        f.learn(ms(40));
        let w = f.window(t);
        assert_eq!(w.next(t), Next::Park(Some(t + ms(37))));
        assert_eq!(w.next(t + ms(37)), Next::Poll);
        assert_eq!(w.next(t + ms(42)), Next::Poll);
        assert_eq!(w.next(t + ms(43)), Next::Park(None));
        // 6 ms: at least 1.5 ms of lead.
        f.learn(ms(6));
        let w = f.window(t);
        assert_eq!(w.next(t), Next::Park(Some(t + Duration::from_micros(4500))));
        assert_eq!(w.next(t + ms(7)), Next::Poll);
        // 20 ms: a tenth, 2 ms.
        f.learn(ms(20));
        assert_eq!(f.window(t).next(t + ms(17)), Next::Park(Some(t + ms(18))));
        // Shorter than the lead: poll from the start.
        f.learn(Duration::from_micros(200));
        let w = f.window(t);
        assert_eq!(w.next(t), Next::Poll);
        assert_eq!(w.next(t + ms(2)), Next::Park(None));
    }

    #[test]
    fn off_never_polls() {
        let t = Instant::now();
        let mut f = Forecast { last: None, enabled: false };
        f.learn(Duration::from_millis(5));
        assert_eq!(f.window(t).next(t + Duration::from_millis(5)), Next::Park(None));
    }
}
