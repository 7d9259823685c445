//! A rank that serves two lanes of commands at once: an asynchronous job's engine receives the
//! next weights (its refit lane) while it generates (its producer lane). Each lane runs its own
//! commands in the order they came; a command waits only for the earlier ones of its lane. The
//! commands' answers go back as each finishes.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;

use tracing::Instrument;

use super::{COORDINATOR_GONE, Rank, command_step};
use crate::control::{Command, ControlClient, Envelope, Reply, Report};

/// A lane's command under way: it gives the lane's rank back with the command's sequence number,
/// name and outcome.
type Running<R> = Pin<Box<dyn Future<Output = (R, u64, &'static str, anyhow::Result<Report>)>>>;

/// One lane: its rank (while idle), the command under way, and the commands waiting.
struct Lane<R> {
    idle: Option<R>,
    running: Option<Running<R>>,
    waiting: VecDeque<Envelope>,
}

impl<R: Rank + 'static> Lane<R> {
    fn new(rank: R) -> Lane<R> {
        Lane { idle: Some(rank), running: None, waiting: VecDeque::new() }
    }

    /// Starts the next waiting command when the lane is idle.
    fn start(&mut self, token: &str) {
        if self.running.is_some() || self.idle.is_none() || self.waiting.is_empty() {
            return;
        }
        let (Some(mut rank), Some(env)) = (self.idle.take(), self.waiting.pop_front()) else { return };
        let Envelope { seq, command, .. } = env;
        let name = command.name();
        let span = tracing::info_span!("command", otel.name = name, step = command_step(&command));
        if let Some(step) = command_step(&command) {
            crate::telemetry::join_step(&span, token, step);
        }
        self.running = Some(Box::pin(async move {
            let r = rank.execute(command).instrument(span).await;
            (rank, seq, name, r)
        }));
    }

    /// Waits for the command under way (never resolves while none is).
    async fn finished(&mut self) -> (u64, &'static str, anyhow::Result<Report>) {
        let Some(running) = self.running.as_mut() else { return std::future::pending().await };
        let (rank, seq, name, r) = running.await;
        self.running = None;
        self.idle = Some(rank);
        (seq, name, r)
    }
}

/// The command loop of a rank with two lanes: commands for which `to_b` holds run on `b`, the
/// others on `a`. Answers Done or Failed for each; ends at Shutdown, at a failed command (the
/// rank's state is then unknown), or when the coordinator goes away.
pub async fn serve_two_lanes<A: Rank + 'static, B: Rank + 'static>(
    control: &mut ControlClient,
    a: A,
    b: B,
    to_b: fn(&Command) -> bool,
    token: &str,
) -> anyhow::Result<()> {
    control.reply(&Reply::Ready).await?;
    let (mut a, mut b) = (Lane::new(a), Lane::new(b));
    loop {
        a.start(token);
        b.start(token);
        // Reading a command is cancel-safe: the frame link keeps partial frames in its buffer.
        let (seq, name, outcome) = tokio::select! {
            next = control.next() => {
                let Some(env) = next? else { anyhow::bail!("{COORDINATOR_GONE}") };
                if env.command == Command::Shutdown {
                    return Ok(());
                }
                if to_b(&env.command) { b.waiting.push_back(env) } else { a.waiting.push_back(env) }
                continue;
            }
            done = a.finished() => done,
            done = b.finished() => done,
        };
        match outcome {
            Ok(report) => control.done(seq, report).await?,
            Err(e) => {
                let error = format!("{e:#}");
                control.failed(seq, error.clone()).await?;
                anyhow::bail!("{name} failed: {error}");
            }
        }
    }
}
