//! Supervision of rank processes: `rlplane worker --plan` (one pod's ranks) and `rlplane local`
//! (every rank of a job) both start one child process per rank and watch them.
//!
//! - A child announces it is ready by printing `RLPLANE_READY metrics=<addr>` on stdout; its other
//!   output is forwarded line by line, prefixed with its name.
//! - The first child to exit non-zero (or to be killed) ends the run with an error naming its role
//!   and rank and quoting its last lines of stderr; the others are stopped.
//! - Stopping sends SIGTERM, waits a grace period, then SIGKILLs. Children also carry a
//!   parent-death signal ([`crate::proc::supervise`]), so none outlives a supervisor that is
//!   itself killed.

use std::collections::VecDeque;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// Prefix of the readiness line a child prints on stdout.
pub const READY_PREFIX: &str = "RLPLANE_READY";
/// Lines of a child's stderr kept for the error message when it fails.
const TAIL_LINES: usize = 12;

/// Where forwarded child output goes (the terminal, or a progress display that must not be torn).
pub trait OutputSink: Send + Sync + 'static {
    /// Prints one line.
    fn line(&self, line: String);
}

/// Forwards to this process's stderr.
pub struct Stderr;

impl OutputSink for Stderr {
    fn line(&self, line: String) {
        eprintln!("{line}");
    }
}

/// What a child reported when it became ready.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    /// Address of its metrics endpoint, if it serves one.
    pub metrics: Option<String>,
}

/// A child's exit.
#[derive(Debug)]
pub struct Exit {
    /// Index of the child (spawn order).
    pub index: usize,
    /// Its name (e.g. `gen-3`).
    pub name: String,
    /// Its role and rank in words (e.g. `generation rank 3`).
    pub role: String,
    /// Exit status.
    pub status: std::io::Result<ExitStatus>,
    /// Its last lines of stderr.
    pub tail: Vec<String>,
}

impl Exit {
    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        self.status.as_ref().is_ok_and(|s| s.success())
    }

    /// Whether a signal ended it (killed, or crashed) rather than its own exit.
    pub fn signaled(&self) -> bool {
        use std::os::unix::process::ExitStatusExt;
        self.status.as_ref().is_ok_and(|s| s.signal().is_some())
    }

    /// A one-paragraph description of a failure.
    pub fn describe(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        let how = match &self.status {
            Ok(s) if s.code().is_some() => format!("exited with code {}", s.code().unwrap_or_default()),
            Ok(s) => format!("was killed by signal {}", s.signal().unwrap_or_default()),
            Err(e) => format!("could not be waited for: {e}"),
        };
        let mut msg = format!("{} ({}) {how}", self.role, self.name);
        if !self.tail.is_empty() {
            msg.push_str("; its last output:\n  ");
            msg.push_str(&self.tail.join("\n  "));
        }
        msg
    }
}

struct Slot {
    name: String,
    child: Option<Child>,
    /// Signals for the child, delivered by its waiter task while the child is not yet reaped
    /// (a reaped pid may belong to another process by then).
    signals: Option<mpsc::UnboundedSender<libc::c_int>>,
    tail: Arc<Mutex<VecDeque<String>>>,
    ready: Arc<Mutex<Option<Readiness>>>,
}

/// A set of supervised children.
pub struct Supervisor {
    slots: Vec<Slot>,
    roles: Vec<String>,
    sink: Arc<dyn OutputSink>,
    exits: mpsc::UnboundedSender<(usize, std::io::Result<ExitStatus>)>,
    exit_rx: mpsc::UnboundedReceiver<(usize, std::io::Result<ExitStatus>)>,
    ready_tx: mpsc::UnboundedSender<usize>,
    ready_rx: mpsc::UnboundedReceiver<usize>,
    /// Children whose exit has not been reported yet.
    running: usize,
    /// An exit received but not yet returned (see [`Supervisor::next_exit`]).
    pending: Option<((usize, std::io::Result<ExitStatus>), tokio::time::Instant)>,
}

impl Supervisor {
    /// A supervisor forwarding child output to `sink`.
    pub fn new(sink: Arc<dyn OutputSink>) -> Self {
        let (exits, exit_rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = mpsc::unbounded_channel();
        Supervisor {
            slots: Vec::new(),
            roles: Vec::new(),
            sink,
            exits,
            exit_rx,
            ready_tx,
            ready_rx,
            running: 0,
            pending: None,
        }
    }

    /// Number of children spawned.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no child was spawned.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Spawns `cmd` as child `name` (role described as `role`, e.g. "trainer rank 2").
    pub fn spawn(&mut self, name: &str, role: &str, mut cmd: Command) -> std::io::Result<usize> {
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn()?;
        let index = self.slots.len();
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let ready = Arc::new(Mutex::new(None));
        if let Some(out) = child.stdout.take() {
            let (sink, name, ready, ready_tx) =
                (self.sink.clone(), name.to_string(), ready.clone(), self.ready_tx.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Some(rest) = line.strip_prefix(READY_PREFIX) {
                        let metrics =
                            rest.split_whitespace().find_map(|kv| kv.strip_prefix("metrics=")).map(String::from);
                        *ready.lock().expect("ready lock") = Some(Readiness { metrics });
                        let _ = ready_tx.send(index);
                    } else {
                        sink.line(format!("[{name}] {line}"));
                    }
                }
            });
        }
        if let Some(err) = child.stderr.take() {
            let (sink, name, tail) = (self.sink.clone(), name.to_string(), tail.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(err).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    {
                        let mut t = tail.lock().expect("tail lock");
                        if t.len() == TAIL_LINES {
                            t.pop_front();
                        }
                        t.push_back(line.clone());
                    }
                    sink.line(format!("[{name}] {line}"));
                }
            });
        }
        self.slots.push(Slot { name: name.to_string(), child: Some(child), signals: None, tail, ready });
        self.running += 1;
        self.roles.push(role.to_string());
        Ok(index)
    }

    /// Names of the children.
    pub fn names(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.name.clone()).collect()
    }

    /// Readiness of every child that reported it.
    pub fn readiness(&self) -> Vec<Option<Readiness>> {
        self.slots.iter().map(|s| s.ready.lock().expect("ready lock").clone()).collect()
    }

    /// Moves every child into a waiter task, so exits are reported through [`Self::next_exit`].
    pub fn watch(&mut self) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(mut child) = slot.child.take() {
                let tx = self.exits.clone();
                let (sig_tx, mut sig_rx) = mpsc::unbounded_channel::<libc::c_int>();
                slot.signals = Some(sig_tx);
                tokio::spawn(async move {
                    let status = loop {
                        tokio::select! {
                            status = child.wait() => break status,
                            Some(sig) = sig_rx.recv() => {
                                if let Some(pid) = child.id() {
                                    // SAFETY: kill(2) on our child, which is not reaped yet.
                                    unsafe { libc::kill(pid as libc::pid_t, sig); }
                                }
                            }
                        }
                    };
                    let _ = tx.send((i, status));
                });
            }
        }
    }

    /// Waits until every child reported ready, or one exits first (returned as an error), or the
    /// timeout passes.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), ReadyError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut ready = vec![false; self.slots.len()];
        for (i, r) in self.readiness().iter().enumerate() {
            ready[i] = r.is_some();
        }
        while !ready.iter().all(|&r| r) {
            tokio::select! {
                Some(i) = self.ready_rx.recv() => ready[i] = true,
                Some(exit) = self.exit_rx.recv() => {
                    self.running -= 1;
                    return Err(ReadyError::Exited(self.exit_of(exit)));
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let missing: Vec<String> = ready.iter().enumerate().filter(|(_, r)| !**r).map(|(i, _)| self.slots[i].name.clone()).collect();
                    return Err(ReadyError::Timeout(missing));
                }
            }
        }
        Ok(())
    }

    fn exit_of(&self, (index, status): (usize, std::io::Result<ExitStatus>)) -> Exit {
        let slot = &self.slots[index];
        Exit {
            index,
            name: slot.name.clone(),
            role: self.roles[index].clone(),
            status,
            tail: slot.tail.lock().expect("tail lock").iter().cloned().collect(),
        }
    }

    /// The next child exit (after [`Self::watch`]); `None` when every child has been reported.
    ///
    /// Cancel-safe: an exit received while the caller's `select!` picks another branch is kept
    /// and returned by the next call.
    pub async fn next_exit(&mut self) -> Option<Exit> {
        if self.pending.is_none() {
            if self.running == 0 {
                return None;
            }
            let e = self.exit_rx.recv().await?;
            self.running -= 1;
            self.pending = Some((e, tokio::time::Instant::now()));
        }
        // Give the output forwarders a moment to drain the child's last lines before reporting.
        let since = self.pending.as_ref().map(|(_, at)| *at).expect("set above");
        tokio::time::sleep_until(since + Duration::from_millis(50)).await;
        let (e, _) = self.pending.take().expect("set above");
        Some(self.exit_of(e))
    }

    /// Children whose exit has not been reported yet.
    pub fn running(&self) -> usize {
        self.running + usize::from(self.pending.is_some())
    }

    /// Stops every child still running: SIGTERM, then SIGKILL after `grace`. Returns the exits
    /// collected while stopping.
    pub async fn stop(&mut self, grace: Duration) -> Vec<Exit> {
        self.signal_all(libc::SIGTERM);
        let mut exits = Vec::new();
        let deadline = tokio::time::Instant::now() + grace;
        while self.running() > 0 {
            tokio::select! {
                e = self.next_exit() => match e { Some(e) => exits.push(e), None => break },
                _ = tokio::time::sleep_until(deadline) => {
                    self.signal_all(libc::SIGKILL);
                    while self.running() > 0 {
                        match tokio::time::timeout(Duration::from_secs(5), self.next_exit()).await {
                            Ok(Some(e)) => exits.push(e),
                            _ => break,
                        }
                    }
                    break;
                }
            }
        }
        exits
    }
}

impl Supervisor {
    /// Sends `signal` to every child still running.
    fn signal_all(&self, signal: libc::c_int) {
        for s in self.slots.iter().filter_map(|s| s.signals.as_ref()) {
            let _ = s.send(signal);
        }
    }
}

/// Why children did not all become ready.
#[derive(Debug)]
pub enum ReadyError {
    /// A child exited first.
    Exited(Exit),
    /// These children did not report ready in time.
    Timeout(Vec<String>),
}
