//! `rlplane bench control`: the control plane's dispatch latency between real processes, against a
//! raw TCP ping-pong between the same processes measured in the same run.
//!
//! The parent plays the coordinator: it sends `--commands` commands to each of `--ranks` rank
//! processes (one at a time, as a step's phase does) and records, per command, the one-way time
//! (send → the rank has it, on the host's monotonic clock) and the round trip to the rank's
//! answer (the rank's holding time taken out). Then each rank answers a raw 32-byte ping-pong on
//! a plain socket: the floor any TCP protocol between two processes of this host pays. Last, the
//! cost of the authenticated handshake every connection starts with ([`crate::net`]):
//! `--handshakes` loopback connections with it, against the same connections with one plain
//! round trip instead.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::control::{Command, ControlClient, ControlServer, Reply, Report, percentile_us};
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
    let key = JobAuth::generate_key()?;
    let key_file = std::env::temp_dir().join(format!("rlplane-bench-control-{}.key", std::process::id()));
    let _ = std::fs::remove_file(&key_file);
    net::write_key_file(&key_file, &key).with_context(|| format!("writing {}", key_file.display()))?;
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
    let server = ControlServer::accept_all(&control, &names, &auth, deadline).await;
    let _ = std::fs::remove_file(&key_file);
    let mut server = server?;
    server.wait_ready(deadline).await?;
    let t = Instant::now();
    for i in 0..args.commands {
        server.run(&names, Command::Generate { step: i }, Instant::now() + Duration::from_secs(10)).await?;
    }
    let per_phase = t.elapsed() / args.commands;
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
