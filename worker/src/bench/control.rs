//! `rlplane bench control`: the control plane's dispatch latency between real processes, against a
//! raw TCP ping-pong between the same processes measured in the same run.
//!
//! The parent plays the coordinator: it sends `--commands` commands to each of `--ranks` rank
//! processes (one at a time, as a step's phase does) and records, per command, the one-way time
//! (send → the rank has it, on the host's monotonic clock) and the round trip (its answer's way
//! back added, the rank's holding time taken out). Then it runs `--steps` GRPO-step-shaped
//! exchanges (the ranks do no work, so a step's time is all control): the commands of
//! [`crate::coordinator`]'s step, for half the ranks as trainer ranks (each its own data-parallel
//! shard, the first a refit sender) and half as engines (producers and receivers) — once one
//! command round at a time (Generate, Train, Update, Refit, each waited for, as the coordinator
//! did before queuing commands) and twice as the coordinator sends them now (with several shards:
//! the update's seed needs every shard's batch; with one shard or a user's trainer: the update
//! goes with Train). Then each rank answers a raw 32-byte ping-pong on a plain socket: the floor
//! any TCP protocol between two processes of this host pays, against which the step's cost is
//! given. Last, the cost of the authenticated handshake every connection starts with
//! ([`crate::net`]): `--handshakes` loopback connections with it, against the same connections
//! with one plain round trip instead.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::control::{Command, ControlClient, ControlServer, Pending, Reply, Report, percentile_us};
use crate::net::{self, Hello, JobAuth};

/// Arguments of `rlplane bench control`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rank processes.
    #[arg(long, default_value_t = 4)]
    pub ranks: u32,
    /// Commands sent to every rank (and raw ping-pongs per rank).
    #[arg(long, default_value_t = 2000)]
    pub commands: u32,
    /// Loopback connections timed with and without the authenticated handshake.
    #[arg(long, default_value_t = 500)]
    pub handshakes: u32,
    /// Step-shaped exchanges per way of sending a step's commands (needs at least 2 ranks).
    #[arg(long, default_value_t = 600)]
    pub steps: u32,
}

/// Arguments of a control peer process.
#[derive(Debug, clap::Args)]
pub struct PeerArgs {
    /// Coordinator's control address.
    #[arg(long)]
    pub control: String,
    /// Raw ping-pong address.
    #[arg(long)]
    pub raw: String,
    /// This rank's name.
    #[arg(long)]
    pub name: String,
    /// The job key file (64 hex characters).
    #[arg(long)]
    pub key_file: PathBuf,
}

const TOKEN: &str = "bench-control";

/// Runs the benchmark and prints its table.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.ranks == 0 || args.commands == 0 {
        anyhow::bail!("--ranks and --commands must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(bench(args))
}

async fn bench(args: Args) -> anyhow::Result<()> {
    let control = TcpListener::bind("127.0.0.1:0").await?;
    let raw = TcpListener::bind("127.0.0.1:0").await?;
    let names: Vec<String> = (0..args.ranks).map(|i| format!("rank-{i}")).collect();
    let key_file = std::env::temp_dir().join(format!("rlplane-bench-control-{}.key", std::process::id()));
    let key = net::issue_key_file(&key_file).with_context(|| format!("writing {}", key_file.display()))?;
    let auth = JobAuth::new(TOKEN, &key);
    let mut children = Vec::new();
    for n in &names {
        let mut cmd = crate::proc::self_command([
            "peer",
            "control",
            "--control",
            &control.local_addr()?.to_string(),
            "--raw",
            &raw.local_addr()?.to_string(),
            "--name",
            n,
            "--key-file",
            &key_file.display().to_string(),
        ])?;
        children.push(cmd.spawn().context("starting a control peer")?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let server = ControlServer::accept_all(&control, &names, &auth, deadline, None).await;
    let _ = std::fs::remove_file(&key_file);
    let mut server = server?;
    server.wait_ready(deadline).await?;
    let t = Instant::now();
    for i in 0..args.commands {
        server
            .run(&names, Command::Generate { step: i, min_version: 0 }, Instant::now() + Duration::from_secs(10))
            .await?;
    }
    let per_phase = t.elapsed() / args.commands;
    let steps = if args.ranks >= 2 && args.steps > 0 {
        step_exchanges(&mut server, &names, args.steps).await?
    } else {
        Vec::new()
    };
    server.shutdown_all().await;

    // The raw floor: every rank connects once and answers 32-byte pings.
    let mut raw_rtt = Vec::new();
    for _ in &names {
        let (mut s, _) = raw.accept().await?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 32];
        for _ in 0..args.commands {
            let t = Instant::now();
            s.write_all(&buf).await?;
            s.read_exact(&mut buf).await?;
            raw_rtt.push(t.elapsed());
        }
    }
    for mut c in children {
        let _ = c.wait().await;
    }
    let p = |v: &[Duration], q| percentile_us(v, q);
    let raw50 = p(&raw_rtt, 50.0);
    println!("{} rank processes, {} commands each", args.ranks, args.commands);
    println!("{:<44} {:>10} {:>10}", "", "p50 µs", "p99 µs");
    println!(
        "{:<44} {:>10.1} {:>10.1}",
        "dispatch, one way (send → rank has it)",
        p(&server.one_way, 50.0),
        p(&server.one_way, 99.0)
    );
    println!(
        "{:<44} {:>10.1} {:>10.1}",
        "dispatch, round trip (there and back)",
        p(&server.dispatch, 50.0),
        p(&server.dispatch, 99.0)
    );
    println!("{:<44} {:>10.1} {:>10.1}", "raw TCP ping-pong, same processes", raw50, p(&raw_rtt, 99.0));
    println!("round trip ÷ raw ping-pong (p50): {:.2}", p(&server.dispatch, 50.0) / raw50);
    println!("one command to all {} ranks and back, done: {:.1} µs", args.ranks, per_phase.as_secs_f64() * 1e6);
    if !steps.is_empty() {
        let (t, g) = (args.ranks.div_ceil(2), args.ranks / 2);
        println!(
            "GRPO-step-shaped exchange, no work ({t} trainer ranks, {g} engines; {} steps each): control per step",
            args.steps
        );
        println!("{:<44} {:>10} {:>10} {:>14}", "", "p50 µs", "p99 µs", "p50 ÷ raw p50");
        for (way, times) in &steps {
            let s50 = p(times, 50.0);
            println!("{:<44} {:>10.1} {:>10.1} {:>14.2}", way.label(), s50, p(times, 99.0), s50 / raw50);
        }
    }
    if args.handshakes > 0 {
        let (authed, plain) = handshake_cost(&auth, args.handshakes).await?;
        println!("{:<44} {:>10.1} {:>10.1}", "connect + authenticated handshake", p(&authed, 50.0), p(&authed, 99.0));
        println!("{:<44} {:>10.1} {:>10.1}", "connect + one plain round trip", p(&plain, 50.0), p(&plain, 99.0));
        println!(
            "authenticated handshake costs {:.1} µs more per connection (p50, once per connection)",
            p(&authed, 50.0) - p(&plain, 50.0)
        );
    }
    Ok(())
}

/// A way of sending a step's commands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    /// One command round at a time, each waited for: Generate, Train, Update, Refit.
    Rounds,
    /// As the coordinator does now with several data-parallel shards: Train; then Update with
    /// the sender's Refit behind it; the receivers' Refit once the sender's update is in, with the
    /// producers' next Generate behind it.
    Queued,
    /// As the coordinator does now with one shard (or a user's trainer): Train with Update and
    /// the sender's Refit behind it; then as above.
    QueuedWithTrain,
}

impl Way {
    fn label(self) -> &'static str {
        match self {
            Way::Rounds => "one round at a time (4 round trips)",
            Way::Queued => "queued, several shards (3 round trips)",
            Way::QueuedWithTrain => "queued, one shard or user's trainer (2 round trips)",
        }
    }
}

/// Runs `steps` step-shaped exchanges for every [`Way`], interleaved in blocks so that load
/// changes on the host hit each alike; returns each way's per-step times. The first half of
/// `names` are trainer ranks (the first one sends the refit), the rest engines.
async fn step_exchanges(
    server: &mut ControlServer,
    names: &[String],
    steps: u32,
) -> anyhow::Result<Vec<(Way, Vec<Duration>)>> {
    let split = names.len().div_ceil(2);
    let (trainers, engines) = names.split_at(split);
    let sender = &trainers[0];
    let timeout = Duration::from_secs(10);
    let ways = [Way::Rounds, Way::Queued, Way::QueuedWithTrain];
    let mut times: Vec<(Way, Vec<Duration>)> = ways.iter().map(|&w| (w, Vec::with_capacity(steps as usize))).collect();
    const BLOCK: u32 = 50;
    let mut step = 0u32;
    let mut done = 0;
    while done < steps {
        let n = BLOCK.min(steps - done);
        for (way, times) in &mut times {
            // Each block starts with nothing queued; its first step's Generate goes out as the step
            // begins, like step 1 of a run.
            let mut ahead = None;
            for i in 0..n {
                step += 1;
                let last = i + 1 == n;
                let t = Instant::now();
                ahead = one_step(server, *way, step, trainers, sender, engines, ahead, last, timeout).await?;
                times.push(t.elapsed());
            }
        }
        done += n;
    }
    Ok(times)
}

/// One step's commands sent `way`; returns the next step's Generate when it went out queued.
#[allow(clippy::too_many_arguments)]
async fn one_step(
    server: &mut ControlServer,
    way: Way,
    step: u32,
    trainers: &[String],
    sender: &String,
    engines: &[String],
    ahead: Option<Pending>,
    last: bool,
    timeout: Duration,
) -> anyhow::Result<Option<Pending>> {
    let deadline = || Instant::now() + timeout;
    let version = step as u64;
    let generate = |s| engines.iter().map(move |e| (e.clone(), Command::Generate { step: s, min_version: 0 }));
    let train = trainers.iter().map(|t| (t.clone(), Command::Train { step, batch: None }));
    let update = |seed| trainers.iter().map(move |t| (t.clone(), Command::Update { step, seed }));
    let receive = engines.iter().map(|e| (e.clone(), Command::Refit { version, expected: 0 }));
    let send = [(sender.clone(), Command::Refit { version, expected: 0 })];
    if way == Way::Rounds {
        server.run_each(generate(step).collect(), deadline()).await?;
        server.run_each(train.collect(), deadline()).await?;
        server.run_each(update(Some(step as u64)).collect(), deadline()).await?;
        server.run_each(send.into_iter().chain(receive).collect(), deadline()).await?;
        return Ok(None);
    }
    let generated = match ahead {
        Some(p) => p,
        None => server.dispatch(generate(step)).await?,
    };
    server.wait(generated, deadline()).await?;
    let updates = if way == Way::QueuedWithTrain {
        let sent = server.dispatch(train.chain(update(None)).chain(send)).await?;
        let (train, updates) = server.split(sent, |c, _| c == "train");
        server.wait(train, deadline()).await?;
        updates
    } else {
        server.run_each(train.collect(), deadline()).await?;
        server.dispatch(update(Some(step as u64)).chain(send)).await?
    };
    let (updates, sent) = server.split(updates, |c, _| c == "update");
    let (first, others) = server.split(updates, |_, r| r == sender);
    server.wait(first, deadline()).await?;
    let next = (!last).then(|| generate(step + 1)).into_iter().flatten();
    let received = server.dispatch(receive.chain(next)).await?;
    let (next, received) = server.split(received, |c, _| c == "generate");
    server.wait(others, deadline()).await?;
    server.wait(sent.merge(received), deadline()).await?;
    Ok((!next.is_empty()).then_some(next))
}

/// Times `n` loopback connections that run the authenticated handshake, and `n` that make one
/// plain 1-byte round trip instead (the floor of any handshake), each from connect to done.
async fn handshake_cost(auth: &JobAuth, n: u32) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let server_auth = auth.clone();
    let server = tokio::spawn(async move {
        for i in 0..2 * n {
            let (mut s, _) = listener.accept().await?;
            s.set_nodelay(true)?;
            let deadline = Instant::now() + Duration::from_secs(10);
            if i < n {
                net::accept_hello(&mut s, &server_auth, *b"BNCH", 1, deadline, |_| Ok(())).await?;
            } else {
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await?;
                s.write_all(&b).await?;
            }
        }
        anyhow::Ok(())
    });
    let hello = Hello { magic: *b"BNCH", version: 1, peer: "bench".into(), extra: vec![] };
    let (mut authed, mut plain) = (Vec::with_capacity(n as usize), Vec::with_capacity(n as usize));
    for _ in 0..n {
        let t = Instant::now();
        let mut s = TcpStream::connect(&addr).await?;
        s.set_nodelay(true)?;
        net::send_hello(&mut s, auth, &hello, Instant::now() + Duration::from_secs(10), &addr).await?;
        authed.push(t.elapsed());
    }
    for _ in 0..n {
        let t = Instant::now();
        let mut s = TcpStream::connect(&addr).await?;
        s.set_nodelay(true)?;
        let mut b = [1u8; 1];
        s.write_all(&b).await?;
        s.read_exact(&mut b).await?;
        plain.push(t.elapsed());
    }
    server.await??;
    Ok((authed, plain))
}

/// Runs a control peer: answers commands until Shutdown, then the raw ping-pong.
pub fn run_peer(args: PeerArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        let auth = JobAuth::load(TOKEN, &args.key_file, "(none: a benchmark peer)")?;
        let mut c = ControlClient::connect(&args.control, &auth, &args.name, deadline).await?;
        c.reply(&Reply::Ready).await?;
        while let Some(env) = c.next().await? {
            if env.command == Command::Shutdown {
                break;
            }
            c.done(env.seq, Report::default()).await?;
        }
        let mut s = TcpStream::connect(&args.raw).await?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 32];
        while s.read_exact(&mut buf).await.is_ok() {
            s.write_all(&buf).await?;
        }
        anyhow::Ok(())
    })
}
