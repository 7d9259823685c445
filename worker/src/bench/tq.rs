//! `rlplane bench tq`, and the `rlplane peer tq ...` processes that it and the tests spawn.
//!
//! The benchmark runs a whole step loop with real processes on loopback: producers put a step's
//! synthetic rollouts (ragged `input_ids` i64, `logprobs` f32, `loss_mask` u8, scalar `reward`),
//! the coordinator (this process, owning the controller) claims the step, assigns it to the
//! consumers balancing tokens, each consumer fetches its shard, and the step is acknowledged and
//! cleared. It reports put and get GB/s, put→get latency, claim latency, storage RSS, and the get
//! path's ratio to a raw loopback TCP stream of the same bytes measured in the same run. Every
//! sample's checksum is compared between producer and consumer.
//!
//! Peers are driven over stdin/stdout: one command per line, one JSON reply per line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use rlplane_api::spec::TqPlacement;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::net::{self, JobAuth};
use crate::tq::codec::ErrorCode;
use crate::tq::fanout::{FanoutReceiver, FanoutSender, TcpFanoutFollower, TcpFanoutLeader};
use crate::tq::{
    Batch, BatchMeta, ClientConfig, Column, ControllerConfig, PutOptions, StorageServer, StorageUnit, TqClient,
    TqController, TqError, WriteRole, assign,
};

/// Arguments of `rlplane bench tq`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Samples per step.
    #[arg(long, default_value_t = 1024)]
    pub samples: u32,
    /// Response length range in tokens, `MIN..MAX` (uniform).
    #[arg(long, default_value = "256..4096")]
    pub response_tokens: String,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: u32,
    /// `producer-local` (each producer hosts a unit) or `dedicated` (storage processes).
    #[arg(long, default_value = "producer-local")]
    pub placement: String,
    /// Storage units (and producers: one per unit).
    #[arg(long, default_value_t = 2)]
    pub storage_units: u32,
    /// Consumers (data-parallel leaders).
    #[arg(long, default_value_t = 2)]
    pub consumers: u32,
    /// Ranks per data-parallel shard (the consumer is the shard's leader; the others follow).
    #[arg(long, default_value_t = 1)]
    pub ranks_per_shard: u32,
    /// `leader-broadcast` (the leader fetches and fans out) or `independent` (every rank fetches).
    #[arg(long, default_value = "leader-broadcast")]
    pub fetch: String,
    /// Steps to run; medians are reported (the first step, which opens connections, is skipped
    /// when there are at least three).
    #[arg(long, default_value_t = 5)]
    pub steps: u32,
    /// Capacity of each storage unit in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    pub capacity_bytes: u64,
    /// Samples of the partition used to measure claim latency.
    #[arg(long, default_value_t = 4096)]
    pub claim_partition: u32,
    /// Claims timed per measurement.
    #[arg(long, default_value_t = 400)]
    pub claim_rounds: u32,
    /// Print the report as JSON too.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of a tq peer process.
#[derive(Debug, clap::Args)]
pub struct PeerArgs {
    /// The peer's role.
    #[command(subcommand)]
    pub role: PeerRole,
}

/// Roles of tq peer processes.
#[derive(Debug, clap::Subcommand)]
pub enum PeerRole {
    /// A dedicated storage unit (commands: stats, exit).
    Storage(StorageArgs),
    /// A client: producer, consumer or data-parallel leader, optionally hosting a storage unit
    /// (commands: put, claim, meta, get, ack, writeback, clear, lead, fanout, stats, exit).
    Client(ClientArgs),
    /// A data-parallel follower receiving fanned-out batches.
    Follower(FollowerArgs),
    /// A raw TCP sink: accepts streams one after another, reports bytes and seconds of each.
    RawSink,
    /// A standalone controller (commands: status PARTITION, exit), e.g. for peers in other
    /// languages.
    Controller(ControllerArgs),
}

/// A controller peer.
#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// Listen address (port 0: any free port; the first reply says which).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Job token.
    #[arg(long)]
    pub token: String,
    /// File holding the job key (64 hex characters), e.g. from `openssl rand -hex 32`.
    #[arg(long)]
    pub key_file: PathBuf,
    /// Storage units, `ID=ADDR,ID=ADDR`.
    #[arg(long, default_value = "")]
    pub units: String,
    /// Claim lease in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    pub lease_ms: u64,
}

/// A storage peer.
#[derive(Debug, clap::Args)]
pub struct StorageArgs {
    /// Unit id.
    #[arg(long)]
    pub unit: u32,
    /// Listen address (port 0: any free port; the reply says which).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Job token.
    #[arg(long)]
    pub token: String,
    /// File holding the job key (64 hex characters), e.g. from `openssl rand -hex 32`.
    #[arg(long)]
    pub key_file: PathBuf,
    /// Capacity in bytes.
    #[arg(long)]
    pub capacity: u64,
    /// Put timeout in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub put_timeout_ms: u64,
}

/// A client peer.
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    /// Process name.
    #[arg(long)]
    pub name: String,
    /// Job token.
    #[arg(long)]
    pub token: String,
    /// File holding the job key (64 hex characters), e.g. from `openssl rand -hex 32`.
    #[arg(long)]
    pub key_file: PathBuf,
    /// Controller address.
    #[arg(long)]
    pub controller: String,
    /// Storage units, `ID=ADDR,ID=ADDR`.
    #[arg(long, default_value = "")]
    pub units: String,
    /// `producer-local` or `dedicated`.
    #[arg(long, default_value = "dedicated")]
    pub placement: String,
    /// Host this storage unit in-process (placement producer-local).
    #[arg(long)]
    pub host_unit: Option<u32>,
    /// Listen address of the hosted unit.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Capacity of the hosted unit.
    #[arg(long, default_value_t = 1 << 30)]
    pub capacity: u64,
    /// Put timeout in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub put_timeout_ms: u64,
    /// This process is a data-parallel follower of this leader (its write-backs are refused).
    #[arg(long)]
    pub follower_of: Option<String>,
}

/// A follower peer.
#[derive(Debug, clap::Args)]
pub struct FollowerArgs {
    /// Process name.
    #[arg(long)]
    pub name: String,
    /// Job token.
    #[arg(long)]
    pub token: String,
    /// File holding the job key (64 hex characters), e.g. from `openssl rand -hex 32`.
    #[arg(long)]
    pub key_file: PathBuf,
    /// Leader's fan-out address.
    #[arg(long)]
    pub leader: String,
    /// Batches to receive before exiting.
    #[arg(long, default_value_t = 1)]
    pub batches: u32,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

/// Runs a peer process.
pub fn run_peer(args: PeerArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        match args.role {
            PeerRole::Storage(a) => storage_peer(a).await,
            PeerRole::Client(a) => client_peer(a).await,
            PeerRole::Follower(a) => follower_peer(a).await,
            PeerRole::RawSink => raw_sink_peer().await,
            PeerRole::Controller(a) => controller_peer(a).await,
        }
    })
}

// -------------------------------------------------------------------------------------------------
// Peer processes.

async fn say(v: Value) -> anyhow::Result<()> {
    let mut out = tokio::io::stdout();
    out.write_all(format!("{v}\n").as_bytes()).await?;
    out.flush().await?;
    Ok(())
}

fn error_json(e: &TqError) -> Value {
    let kind = match e {
        TqError::Net(_) => "Net",
        TqError::Controller { .. } => "Controller",
        TqError::Storage { .. } => "Storage",
        TqError::StorageUnitLost { .. } => "StorageUnitLost",
        TqError::FollowerWriteBack { .. } => "FollowerWriteBack",
        TqError::Input { .. } => "Input",
        TqError::Protocol { .. } => "Protocol",
    };
    let code = e.code().map(code_name);
    json!({"ok": false, "kind": kind, "code": code, "error": e.to_string()})
}

/// Stable name of an error code (for the peers' JSON).
pub fn code_name(c: ErrorCode) -> String {
    format!("{c:?}")
}

/// Resident and peak resident memory of this process, bytes (Linux; 0 elsewhere).
pub fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The authentication of a peer: `token` and the key in `key_file`.
fn peer_auth(token: &str, key_file: &Path) -> anyhow::Result<JobAuth> {
    Ok(JobAuth::load(token, key_file, "(none: pass this peer's --key-file)")?)
}

/// Removes a file when dropped (the benchmark's key file, however the benchmark ends).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn serve_unit(
    unit: Arc<StorageUnit>,
    listen: &str,
    auth: &JobAuth,
    put_timeout: Duration,
) -> anyhow::Result<String> {
    let listener = net::bind(listen, "a transfer-queue storage unit").await?;
    let addr = listener.local_addr()?.to_string();
    let server = StorageServer::new(unit, auth, put_timeout);
    tokio::spawn(async move {
        if let Err(e) = server.serve(listener).await {
            tracing::error!(error = %e, "storage server stopped");
        }
    });
    Ok(addr)
}

async fn storage_peer(a: StorageArgs) -> anyhow::Result<()> {
    let unit = Arc::new(StorageUnit::new(a.unit, a.capacity));
    let auth = peer_auth(&a.token, &a.key_file)?;
    let addr = serve_unit(unit.clone(), &a.listen, &auth, Duration::from_millis(a.put_timeout_ms)).await?;
    say(json!({"ok": true, "listen": addr})).await?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        match line.trim() {
            "stats" => {
                let (rss, hwm) = rss();
                say(json!({"ok": true, "rss": rss, "hwm": hwm, "used": unit.used()})).await?
            }
            "exit" => break,
            other => say(json!({"ok": false, "error": format!("unknown command `{other}`")})).await?,
        }
    }
    Ok(())
}

fn parse_units(s: &str) -> anyhow::Result<BTreeMap<u32, String>> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (id, addr) = p.split_once('=').ok_or_else(|| anyhow!("--units entry `{p}` is not ID=ADDR"))?;
            Ok((id.parse().with_context(|| format!("--units id `{id}`"))?, addr.to_string()))
        })
        .collect()
}

fn parse_placement(s: &str) -> anyhow::Result<TqPlacement> {
    match s {
        "producer-local" => Ok(TqPlacement::ProducerLocal),
        "dedicated" => Ok(TqPlacement::Dedicated),
        other => bail!("--placement `{other}`: use producer-local or dedicated"),
    }
}

/// A cheap deterministic generator (splitmix64) for synthetic rollouts.
struct Mix(u64);
impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Synthetic rollouts of keys `first..first+count` of a step: the columns and the keys.
pub fn synthetic_rollouts(
    first: u32,
    count: u32,
    response: (u32, u32),
    prompt: u32,
    seed: u64,
) -> (Vec<String>, Vec<Column>) {
    let keys: Vec<String> = (first..first + count).map(|i| format!("{}_g{}", i / 8, i % 8)).collect();
    let mut ids: Vec<Vec<i64>> = Vec::with_capacity(count as usize);
    let mut logp: Vec<Vec<f32>> = Vec::with_capacity(count as usize);
    let mut mask: Vec<Vec<u8>> = Vec::with_capacity(count as usize);
    let mut reward = Vec::with_capacity(count as usize);
    for k in &keys {
        let mut m = Mix(seed ^ xxhash_rust::xxh3::xxh3_64(k.as_bytes()));
        let span = (response.1 - response.0) as u64 + 1;
        let resp = response.0 + (m.next() % span) as u32;
        let total = (prompt + resp) as usize;
        ids.push((0..total).map(|_| (m.next() % 151_936) as i64).collect());
        logp.push((0..resp).map(|_| -((m.next() % 10_000) as f32) / 1000.0).collect());
        mask.push((0..total).map(|j| (j >= prompt as usize) as u8).collect());
        reward.push((m.next() % 2) as f32);
    }
    let columns = vec![
        Column::ragged("input_ids", &ids.iter().map(|x| x.as_slice()).collect::<Vec<_>>()),
        Column::ragged("logprobs", &logp.iter().map(|x| x.as_slice()).collect::<Vec<_>>()),
        Column::ragged("loss_mask", &mask.iter().map(|x| x.as_slice()).collect::<Vec<_>>()),
        Column::scalars("reward", &reward),
    ];
    (keys, columns)
}

/// Per-sample checksums: xxh3 of each column's bytes of the sample, in column order.
pub fn sample_checksums(keys: &[String], columns: &[Column]) -> BTreeMap<String, String> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            for c in columns {
                h.update(c.name().as_bytes());
                h.update(&(c.rows(i) as u64).to_le_bytes());
                h.update(&c.sample_bytes(i));
            }
            (k.clone(), format!("{:016x}", h.digest()))
        })
        .collect()
}

/// Checksum of a whole batch: keys, and every column's spec, offsets and values.
pub fn batch_checksum(b: &Batch) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for s in &b.meta {
        h.update(s.key().as_bytes());
        h.update(&s.tokens().to_le_bytes());
    }
    for c in &b.columns {
        h.update(c.name().as_bytes());
        h.update(&[c.spec().dtype.code(), c.spec().ragged as u8]);
        for o in c.offsets() {
            h.update(&o.to_le_bytes());
        }
        h.update(c.values());
    }
    format!("{:016x}", h.digest())
}

fn batch_sample_checksums(b: &Batch) -> BTreeMap<String, String> {
    let keys: Vec<String> = b.meta.keys().map(String::from).collect();
    sample_checksums(&keys, &b.columns)
}

struct ClientState {
    client: TqClient,
    hosted: Option<Arc<StorageUnit>>,
    claim: Option<crate::tq::Claim>,
    meta: Option<BatchMeta>,
    batch: Option<Batch>,
    accepting: Option<tokio::task::JoinHandle<Result<TcpFanoutLeader, TqError>>>,
    leader: Option<TcpFanoutLeader>,
    auth: JobAuth,
}

async fn client_peer(a: ClientArgs) -> anyhow::Result<()> {
    let put_timeout = Duration::from_millis(a.put_timeout_ms);
    let mut units = parse_units(&a.units)?;
    let placement = parse_placement(&a.placement)?;
    let auth = peer_auth(&a.token, &a.key_file)?;
    let hosted = match a.host_unit {
        Some(id) => {
            let unit = Arc::new(StorageUnit::new(id, a.capacity));
            let addr = serve_unit(unit.clone(), &a.listen, &auth, put_timeout).await?;
            units.insert(id, addr.clone());
            say(json!({"ok": true, "listen": addr})).await?;
            Some(unit)
        }
        None => None,
    };
    let config = ClientConfig {
        auth: auth.clone(),
        name: a.name.clone(),
        controller: a.controller.clone(),
        units,
        placement,
        home_unit: a.host_unit,
        put_timeout,
        connect_timeout: Duration::from_secs(10),
        role: match &a.follower_of {
            Some(l) => WriteRole::Follower { leader: l.clone() },
            None => WriteRole::Writer,
        },
    };
    let client = TqClient::new(config, hosted.clone())?;
    let mut st =
        ClientState { client, hosted, claim: None, meta: None, batch: None, accepting: None, leader: None, auth };
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let line = line.trim().to_string();
        if line == "exit" {
            break;
        }
        let reply = match client_command(&mut st, &line).await {
            Ok(v) => v,
            Err(e) => match e.downcast::<TqError>() {
                Ok(e) => error_json(&e),
                Err(e) => json!({"ok": false, "kind": "Command", "error": format!("{e:#}")}),
            },
        };
        say(reply).await?;
    }
    Ok(())
}

fn fields_arg(s: Option<&str>) -> Vec<String> {
    match s {
        None | Some("-") => vec![],
        Some(s) => s.split(',').filter(|f| !f.is_empty()).map(String::from).collect(),
    }
}

async fn client_command(st: &mut ClientState, line: &str) -> anyhow::Result<Value> {
    let (cmd, rest) = line.split_once(' ').unwrap_or((line, ""));
    let args: Vec<&str> = rest.split_whitespace().collect();
    let arg = |i: usize, name: &str| -> anyhow::Result<&str> {
        args.get(i).copied().ok_or_else(|| anyhow!("`{cmd}` needs argument {} ({name})", i + 1))
    };
    match cmd {
        // put PARTITION FIRST COUNT MIN_TOKENS MAX_TOKENS PROMPT_TOKENS SEED
        "put" => {
            let n = |i: usize, name: &str| -> anyhow::Result<u64> {
                arg(i, name)?.parse().with_context(|| format!("`put` argument {name}"))
            };
            let (keys, columns) = synthetic_rollouts(
                n(1, "first")? as u32,
                n(2, "count")? as u32,
                (n(3, "min tokens")? as u32, n(4, "max tokens")? as u32),
                n(5, "prompt tokens")? as u32,
                n(6, "seed")?,
            );
            let sums = sample_checksums(&keys, &columns);
            let t = Instant::now();
            let r = st.client.put_with(arg(0, "partition")?, &keys, &columns, &PutOptions::default()).await?;
            let secs = t.elapsed().as_secs_f64();
            Ok(json!({"ok": true, "bytes": r.bytes, "secs": secs, "checksums": sums}))
        }
        // claim PARTITION GROUP N MIN FIELDS|-
        "claim" => {
            let required = fields_arg(args.get(4).copied());
            let req: Vec<&str> = required.iter().map(|s| s.as_str()).collect();
            let n: usize = arg(2, "n")?.parse()?;
            let min: usize = arg(3, "min")?.parse()?;
            let t = Instant::now();
            let c = st.client.claim_min(arg(0, "partition")?, arg(1, "group")?, n, min, &req).await?;
            let secs = t.elapsed().as_secs_f64();
            let keys: Vec<&str> = c.meta.keys().collect();
            let v = json!({"ok": true, "claim_id": c.claim_id, "keys": keys, "secs": secs});
            st.meta = Some(c.meta.clone());
            st.claim = Some(c);
            Ok(v)
        }
        // meta JSON: the shard the coordinator assigned.
        "meta" => {
            let m: BatchMeta = serde_json::from_str(rest).context("`meta` takes a BatchMeta as JSON")?;
            let n = m.len();
            st.meta = Some(m);
            Ok(json!({"ok": true, "samples": n}))
        }
        // get FIELDS
        "get" => {
            let meta = st.meta.as_ref().ok_or_else(|| anyhow!("`get` before `claim` or `meta`"))?;
            let fields = fields_arg(args.first().copied());
            let f: Vec<&str> = fields.iter().map(|s| s.as_str()).collect();
            let t = Instant::now();
            let b = st.client.get(meta, &f).await?;
            let secs = t.elapsed().as_secs_f64();
            let v = json!({
                "ok": true, "bytes": b.nbytes(), "secs": secs,
                "checksums": batch_sample_checksums(&b), "batch": batch_checksum(&b),
            });
            st.batch = Some(b);
            Ok(v)
        }
        "ack" => {
            let c = st.claim.as_ref().ok_or_else(|| anyhow!("`ack` before `claim`"))?;
            let r = st.client.ack(c).await?;
            Ok(json!({"ok": true, "acked": r.acked, "stale": r.stale}))
        }
        // writeback FIELD: per-token f32 derived from input_ids, for the current batch's samples.
        "writeback" => {
            let b = st.batch.as_ref().ok_or_else(|| anyhow!("`writeback` before `get`"))?;
            let field = arg(0, "field")?;
            let ids = b.column("input_ids").ok_or_else(|| anyhow!("`writeback` needs input_ids fetched"))?;
            let vals: Vec<Vec<f32>> = (0..ids.len())
                .map(|i| ids.sample_as::<i64>(i).map(|v| v.iter().map(|&x| (x % 1000) as f32 * -0.001).collect()))
                .collect::<Result<_, _>>()?;
            let col = Column::ragged(field, &vals.iter().map(|v| v.as_slice()).collect::<Vec<_>>());
            let keys: Vec<String> = b.meta.keys().map(String::from).collect();
            let sums = sample_checksums(&keys, std::slice::from_ref(&col));
            st.client.write_back(&b.meta, field, &col).await?;
            Ok(json!({"ok": true, "checksums": sums}))
        }
        "clear" => {
            let r = st.client.clear(arg(0, "partition")?).await?;
            Ok(json!({"ok": true, "freed": r.freed, "units": r.units}))
        }
        // lead NAME,NAME: bind a fan-out port and accept these followers in the background.
        "lead" => {
            let names = fields_arg(args.first().copied());
            let listener = net::bind("127.0.0.1:0", "the fan-out group").await?;
            let addr = listener.local_addr()?.to_string();
            let auth = st.auth.clone();
            st.accepting = Some(tokio::spawn(async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                TcpFanoutLeader::accept(&listener, &auth, &names, deadline).await
            }));
            Ok(json!({"ok": true, "listen": addr}))
        }
        // fanout: broadcast the current batch to the accepted followers.
        "fanout" => {
            let b = st.batch.as_ref().ok_or_else(|| anyhow!("`fanout` before `get`"))?;
            if let Some(handle) = st.accepting.take() {
                st.leader = Some(handle.await??);
            }
            let leader = st.leader.as_mut().ok_or_else(|| anyhow!("`fanout` before `lead`"))?;
            let t = Instant::now();
            leader.broadcast(b).await?;
            let secs = t.elapsed().as_secs_f64();
            Ok(json!({"ok": true, "batch": batch_checksum(b), "followers": leader.followers(), "secs": secs}))
        }
        "stats" => {
            let (rss, hwm) = rss();
            let used = st.hosted.as_ref().map(|u| u.used()).unwrap_or(0);
            Ok(json!({"ok": true, "rss": rss, "hwm": hwm, "used": used}))
        }
        other => bail!("unknown command `{other}`"),
    }
}

async fn follower_peer(a: FollowerArgs) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let auth = peer_auth(&a.token, &a.key_file)?;
    let mut f = match TcpFanoutFollower::connect(&a.leader, &auth, &a.name, deadline).await {
        Ok(f) => f,
        Err(e) => return say(error_json(&e)).await,
    };
    for _ in 0..a.batches {
        match f.receive().await {
            Ok(b) => say(json!({"ok": true, "batch": batch_checksum(&b), "samples": b.meta.len()})).await?,
            Err(e) => return say(error_json(&e)).await,
        }
    }
    Ok(())
}

async fn controller_peer(a: ControllerArgs) -> anyhow::Result<()> {
    let units = parse_units(&a.units)?;
    let auth = peer_auth(&a.token, &a.key_file)?;
    let controller = TqController::new(ControllerConfig { auth, lease: Duration::from_millis(a.lease_ms), units });
    let listener = net::bind(&a.listen, "the transfer-queue controller").await?;
    say(json!({"ok": true, "listen": listener.local_addr()?.to_string()})).await?;
    tokio::spawn(controller.clone().serve(listener));
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let (cmd, arg) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
        match cmd {
            "status" => match controller.status(arg) {
                Some(st) => {
                    say(json!({
                        "ok": true, "samples": st.samples, "fields": st.fields, "units": st.units,
                        "lost": st.lost.map(|(u, r)| json!({"unit": u, "reason": r})),
                        "groups": st.groups.iter().map(|g| json!({"group": g.group, "claimed": g.claimed, "acked": g.acked})).collect::<Vec<_>>(),
                    }))
                    .await?
                }
                None => say(json!({"ok": true, "samples": 0})).await?,
            },
            "exit" => break,
            other => say(json!({"ok": false, "error": format!("unknown command `{other}`")})).await?,
        }
    }
    Ok(())
}

async fn raw_sink_peer() -> anyhow::Result<()> {
    let listener = net::bind("127.0.0.1:0", "the raw sink").await?;
    say(json!({"ok": true, "listen": listener.local_addr()?.to_string()})).await?;
    // One stream after another: a u64 length, then that many bytes, received into a fresh buffer
    // of that size — where a consumer's bytes land too (a reused small buffer would stay in cache
    // and never fault, which no real consumer gets). Reports bytes and seconds from the first
    // byte to the last. A length with its top bit set announces tagged records instead (timed
    // from the length on), read and checked as a consumer's buffers are; with the next bit, the
    // same records untagged, read one at a time.
    let (mut tags, macs) = (net::Session::fixed_pair(1).1, net::MacPool::new("sink", 2));
    loop {
        let (mut s, _) = listener.accept().await?;
        net::tune(&s);
        let len = s.read_u64_le().await?;
        if len & (TAGGED | CHUNKED) != 0 {
            let mut buf = crate::tq::codec::receive_buffer((len & !(TAGGED | CHUNKED)) as usize);
            let start = Instant::now();
            if len & TAGGED != 0 {
                // SAFETY: `buf` belongs to this loop and outlives the call, which checks every record.
                unsafe { net::read_records(&mut s, &mut tags.recv, &macs, &mut buf) }.await?;
            } else {
                for record in buf.chunks_mut(net::RECORD_BYTES) {
                    s.read_exact(record).await?;
                }
            }
            let secs = start.elapsed().as_secs_f64();
            std::hint::black_box(&buf);
            say(json!({"ok": true, "bytes": buf.len(), "secs": secs})).await?;
            continue;
        }
        let len = len as usize;
        let mut buf = crate::tq::codec::receive_buffer(len);
        let mut got = 0usize;
        let mut start = None;
        while got < len {
            let n = s.read(&mut buf[got..]).await?;
            if n == 0 {
                bail!("the raw stream ended after {got} of {len} bytes");
            }
            start.get_or_insert_with(Instant::now);
            got += n;
        }
        let secs = start.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
        std::hint::black_box(&buf);
        say(json!({"ok": true, "bytes": got, "secs": secs})).await?;
    }
}

/// The raw sink's length bit that announces tagged records.
const TAGGED: u64 = 1 << 63;
/// The raw sink's length bit that announces untagged records (the tagged stream's reference).
const CHUNKED: u64 = 1 << 62;

/// How the raw sink's stream is sent.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RawMode {
    /// One write of all the bytes.
    Raw,
    /// Writes of one record each, untagged.
    Chunked,
    /// Tagged records.
    Tagged,
}

/// The sending side of the raw sink's tagged streams: its keys and helper threads.
struct TaggedSender {
    tags: net::Session,
    macs: net::MacPool,
}

/// Streams the first `bytes` of `buf` to the raw sink at `addr` as `mode` says (tagged with
/// `tagger`'s keys) and returns the sink's GB/s.
async fn raw_stream(
    sink: &mut PeerProcess,
    addr: &str,
    bytes: u64,
    buf: &Bytes,
    mode: RawMode,
    tagger: &mut TaggedSender,
) -> anyhow::Result<f64> {
    let mut s = net::connect_retry(addr, tokio::time::Instant::now() + T, "the raw sink").await?;
    let n = (bytes as usize).min(buf.len());
    match mode {
        RawMode::Tagged => {
            s.write_u64_le(n as u64 | TAGGED).await?;
            net::write_records(&mut s, &mut tagger.tags.send, &tagger.macs, &[buf.slice(..n)]).await?;
        }
        RawMode::Chunked => {
            s.write_u64_le(n as u64 | CHUNKED).await?;
            for record in buf[..n].chunks(net::RECORD_BYTES) {
                s.write_all(record).await?;
            }
        }
        RawMode::Raw => {
            s.write_u64_le(n as u64).await?;
            s.write_all(&buf[..n]).await?;
        }
    }
    s.shutdown().await?;
    let v = sink.recv(T).await?;
    Ok(v["bytes"].as_f64().unwrap_or(0.0) / v["secs"].as_f64().unwrap_or(f64::INFINITY) / 1e9)
}

// -------------------------------------------------------------------------------------------------
// Driving peers (benchmark and tests).

/// A peer process driven over stdin/stdout, killed when dropped.
#[derive(Debug)]
pub struct PeerProcess {
    name: String,
    child: Child,
    stdin: ChildStdin,
    lines: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl PeerProcess {
    /// Spawns `exe peer tq ARGS...`, supervised (it dies with this process), with piped stdin
    /// and stdout for commands and replies.
    pub fn spawn(exe: &Path, name: &str, args: &[String]) -> anyhow::Result<PeerProcess> {
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("peer").arg("tq").args(args);
        crate::proc::supervise(&mut cmd);
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit());
        if std::env::var_os("RLPLANE_LOG").is_none() {
            cmd.env("RLPLANE_LOG", "warn");
        }
        let mut child = cmd.spawn().with_context(|| format!("spawning peer {name} ({})", exe.display()))?;
        let stdin = child.stdin.take().ok_or_else(|| anyhow!("peer {name} has no stdin"))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("peer {name} has no stdout"))?;
        Ok(PeerProcess { name: name.into(), child, stdin, lines: BufReader::new(stdout).lines() })
    }

    /// The peer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sends one command line.
    pub async fn send(&mut self, line: &str) -> anyhow::Result<()> {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .with_context(|| format!("sending `{line}` to peer {}", self.name))?;
        self.stdin.flush().await?;
        Ok(())
    }

    /// Reads the next JSON reply, waiting at most `timeout`.
    pub async fn recv(&mut self, timeout: Duration) -> anyhow::Result<Value> {
        let line = tokio::time::timeout(timeout, self.lines.next_line())
            .await
            .with_context(|| format!("peer {} did not answer within {timeout:?}", self.name))??
            .ok_or_else(|| anyhow!("peer {} exited without answering", self.name))?;
        serde_json::from_str(&line).with_context(|| format!("peer {} answered `{line}`", self.name))
    }

    /// Sends a command and reads its reply.
    pub async fn call(&mut self, line: &str, timeout: Duration) -> anyhow::Result<Value> {
        self.send(line).await?;
        self.recv(timeout).await
    }

    /// Like [`PeerProcess::call`], failing unless the reply says `"ok": true`.
    pub async fn call_ok(&mut self, line: &str, timeout: Duration) -> anyhow::Result<Value> {
        let v = self.call(line, timeout).await?;
        if v["ok"] != json!(true) {
            bail!("peer {}: `{}` failed: {v}", self.name, line.chars().take(80).collect::<String>());
        }
        Ok(v)
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

// -------------------------------------------------------------------------------------------------
// The benchmark.

fn parse_range(s: &str) -> anyhow::Result<(u32, u32)> {
    let (a, b) = s.split_once("..").ok_or_else(|| anyhow!("--response-tokens `{s}`: use MIN..MAX, e.g. 256..4096"))?;
    let (a, b): (u32, u32) = (a.trim().parse()?, b.trim().parse()?);
    if a == 0 || a > b {
        bail!("--response-tokens `{s}`: need 1 <= MIN <= MAX");
    }
    Ok((a, b))
}

/// `rounds` round trips on a plain loopback socket within this process, each a 1-byte request
/// answered by `reply` bytes (µs each): what any TCP protocol pays to move a reply of that size.
async fn raw_round_trips(reply: usize, rounds: u32) -> anyhow::Result<Vec<f64>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let out = vec![7u8; reply];
        let mut req = [0u8; 1];
        while s.read_exact(&mut req).await.is_ok() {
            s.write_all(&out).await?;
        }
        anyhow::Ok(())
    });
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    c.set_nodelay(true)?;
    let mut buf = vec![0u8; reply];
    let mut times = Vec::with_capacity(rounds as usize);
    for _ in 0..rounds {
        let t = Instant::now();
        c.write_all(&[1]).await?;
        c.read_exact(&mut buf).await?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(c);
    server.await??;
    Ok(times)
}

/// How many of `times` (µs) exceed 1 ms: the calls a scheduler time slice caught.
fn over_1ms(times: &[f64]) -> usize {
    times.iter().filter(|&&t| t > 1000.0).count()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    percentile(&s, 0.5)
}

const T: Duration = Duration::from_secs(120);

/// Runs the benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    runtime()?.block_on(bench(args))
}

async fn bench(a: Args) -> anyhow::Result<()> {
    let response = parse_range(&a.response_tokens)?;
    let placement = parse_placement(&a.placement)?;
    if a.storage_units == 0 || a.consumers == 0 || a.samples == 0 || a.steps == 0 {
        bail!("--storage-units, --consumers, --samples and --steps must be at least 1");
    }
    let exe = crate::proc::self_exe()?;
    let token = "bench-token".to_string();
    // Every peer authenticates with one key, in a file only this user can read.
    let key_path = std::env::temp_dir().join(format!("rlplane-tqbench-{}.key", std::process::id()));
    let key = net::issue_key_file(&key_path).with_context(|| format!("writing {}", key_path.display()))?;
    let _remove_key = RemoveOnDrop(key_path.clone());
    let key_file = key_path.display().to_string();
    let auth = JobAuth::new(&token, &key);
    let s = a.storage_units;
    // The controller's port first: producers and consumers need it.
    let ctl_listener = net::bind("127.0.0.1:0", "the transfer-queue controller").await?;
    let ctl_addr = ctl_listener.local_addr()?.to_string();
    let put_timeout_ms = "30000".to_string();

    // Storage (dedicated processes, or hosted by the producers).
    let mut units = BTreeMap::new();
    let mut storage = Vec::new();
    let mut producers = Vec::new();
    for u in 0..s {
        match placement {
            TqPlacement::Dedicated => {
                let mut p = PeerProcess::spawn(
                    &exe,
                    &format!("tq-{u}"),
                    &[
                        "storage".into(),
                        "--unit".into(),
                        u.to_string(),
                        "--token".into(),
                        token.clone(),
                        "--key-file".into(),
                        key_file.clone(),
                        "--capacity".into(),
                        a.capacity_bytes.to_string(),
                    ],
                )?;
                let v = p.recv(T).await?;
                units.insert(u, v["listen"].as_str().ok_or_else(|| anyhow!("storage peer said {v}"))?.to_string());
                storage.push(p);
            }
            TqPlacement::ProducerLocal => {
                let mut p = PeerProcess::spawn(
                    &exe,
                    &format!("gen-{u}"),
                    &[
                        "client".into(),
                        "--name".into(),
                        format!("gen-{u}"),
                        "--token".into(),
                        token.clone(),
                        "--key-file".into(),
                        key_file.clone(),
                        "--controller".into(),
                        ctl_addr.clone(),
                        "--placement".into(),
                        "producer-local".into(),
                        "--host-unit".into(),
                        u.to_string(),
                        "--capacity".into(),
                        a.capacity_bytes.to_string(),
                        "--put-timeout-ms".into(),
                        put_timeout_ms.clone(),
                    ],
                )?;
                let v = p.recv(T).await?;
                units.insert(u, v["listen"].as_str().ok_or_else(|| anyhow!("producer said {v}"))?.to_string());
                producers.push(p);
            }
        }
    }
    let units_arg = units.iter().map(|(u, a)| format!("{u}={a}")).collect::<Vec<_>>().join(",");
    if placement == TqPlacement::Dedicated {
        for u in 0..s {
            producers.push(PeerProcess::spawn(
                &exe,
                &format!("gen-{u}"),
                &[
                    "client".into(),
                    "--name".into(),
                    format!("gen-{u}"),
                    "--token".into(),
                    token.clone(),
                    "--key-file".into(),
                    key_file.clone(),
                    "--controller".into(),
                    ctl_addr.clone(),
                    "--units".into(),
                    units_arg.clone(),
                    "--placement".into(),
                    "dedicated".into(),
                    "--put-timeout-ms".into(),
                    put_timeout_ms.clone(),
                ],
            )?);
        }
    }
    let mut consumers = Vec::new();
    for c in 0..a.consumers {
        consumers.push(PeerProcess::spawn(
            &exe,
            &format!("trainer-{c}"),
            &[
                "client".into(),
                "--name".into(),
                format!("trainer-{c}"),
                "--token".into(),
                token.clone(),
                "--key-file".into(),
                key_file.clone(),
                "--controller".into(),
                ctl_addr.clone(),
                "--units".into(),
                units_arg.clone(),
            ],
        )?);
    }
    // Followers of each shard: fan-out receivers, or ranks that fetch for themselves.
    let independent = match a.fetch.as_str() {
        "leader-broadcast" => false,
        "independent" => true,
        other => bail!("--fetch `{other}`: use leader-broadcast or independent"),
    };
    let mut followers: Vec<Vec<PeerProcess>> = Vec::new();
    for (c, leader) in consumers.iter_mut().enumerate() {
        let names: Vec<String> = (1..a.ranks_per_shard).map(|r| format!("trainer-{c}-{r}")).collect();
        let mut shard = Vec::new();
        if !names.is_empty() && !independent {
            let v = leader.call_ok(&format!("lead {}", names.join(",")), T).await?;
            let addr = v["listen"].as_str().ok_or_else(|| anyhow!("leader said {v}"))?.to_string();
            for n in &names {
                shard.push(PeerProcess::spawn(
                    &exe,
                    n,
                    &[
                        "follower".into(),
                        "--name".into(),
                        n.clone(),
                        "--token".into(),
                        token.clone(),
                        "--key-file".into(),
                        key_file.clone(),
                        "--leader".into(),
                        addr.clone(),
                        "--batches".into(),
                        a.steps.to_string(),
                    ],
                )?);
            }
        } else {
            for n in &names {
                shard.push(PeerProcess::spawn(
                    &exe,
                    n,
                    &[
                        "client".into(),
                        "--name".into(),
                        n.clone(),
                        "--token".into(),
                        token.clone(),
                        "--key-file".into(),
                        key_file.clone(),
                        "--controller".into(),
                        ctl_addr.clone(),
                        "--units".into(),
                        units_arg.clone(),
                    ],
                )?);
            }
        }
        followers.push(shard);
    }
    let controller = TqController::new(ControllerConfig {
        auth: auth.clone(),
        lease: Duration::from_secs(60),
        units: units.clone(),
    });
    tokio::spawn(controller.clone().serve(ctl_listener));

    // The raw reference: a loopback stream of each step's bytes to another process, right after
    // the step's get, so both see the same machine load.
    let mut sink = PeerProcess::spawn(&exe, "raw-sink", &["raw-sink".into()])?;
    let v = sink.recv(T).await?;
    let sink_addr = v["listen"].as_str().ok_or_else(|| anyhow!("raw sink said {v}"))?.to_string();
    let mut tagged = TaggedSender { tags: net::Session::fixed_pair(1).0, macs: net::MacPool::new("raw", 2) };
    // A step-sized source of distinct bytes (not a small buffer resent from cache), like the
    // stored columns a storage unit sends.
    let step_guess = a.samples as usize * ((response.0 + response.1) as usize / 2 + a.prompt_tokens as usize) * 13 * 2;
    let mut raw_buf = vec![0u8; step_guess];
    let mut m = Mix(1);
    raw_buf.chunks_mut(8).for_each(|c| c.copy_from_slice(&m.next().to_le_bytes()[..c.len()]));
    let raw_buf = Bytes::from(raw_buf);

    // Steps.
    let per_producer = a.samples.div_ceil(s);
    let mut step_rows = Vec::new();
    let mut total_bytes = 0u64;
    for step in 0..a.steps {
        let part = format!("step-{step}");
        let t0 = Instant::now();
        let mut expected = BTreeMap::new();
        let mut put_secs: f64 = 0.0;
        let mut put_bytes = 0u64;
        for (i, p) in producers.iter_mut().enumerate() {
            let first = i as u32 * per_producer;
            let count = per_producer.min(a.samples.saturating_sub(first));
            p.send(&format!(
                "put {part} {first} {count} {} {} {} {}",
                response.0,
                response.1,
                a.prompt_tokens,
                step as u64 * 7919 + 1
            ))
            .await?;
        }
        for p in producers.iter_mut() {
            let v = p.recv(T).await?;
            if v["ok"] != json!(true) {
                bail!("producer {} failed: {v}", p.name());
            }
            put_secs = put_secs.max(v["secs"].as_f64().unwrap_or(0.0));
            put_bytes += v["bytes"].as_u64().unwrap_or(0);
            for (k, sum) in v["checksums"].as_object().into_iter().flatten() {
                expected.insert(k.clone(), sum.as_str().unwrap_or_default().to_string());
            }
        }
        // Coordinator: claim the whole step, balance tokens across consumers.
        let tc = Instant::now();
        let claim = loop {
            let c = controller.claim(&part, "train", a.samples as usize, a.samples as usize, &[])?;
            if !c.meta.is_empty() {
                break c;
            }
            if tc.elapsed() > T {
                bail!("the step's samples never became ready");
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        let assignment = assign(claim.meta.tokens(), consumers.len())?;
        for ((c, idx), shard) in consumers.iter_mut().zip(&assignment.shards).zip(followers.iter_mut()) {
            let line = format!("meta {}", serde_json::to_string(&claim.meta.subset(idx))?);
            c.call_ok(&line, T).await?;
            if independent {
                for f in shard.iter_mut() {
                    f.call_ok(&line, T).await?;
                }
            }
        }
        const FIELDS: &str = "get input_ids,logprobs,loss_mask,reward";
        let tf = Instant::now();
        for (c, shard) in consumers.iter_mut().zip(followers.iter_mut()) {
            c.send(FIELDS).await?;
            if independent {
                for f in shard.iter_mut() {
                    f.send(FIELDS).await?;
                }
            } else if !shard.is_empty() {
                c.send("fanout").await?;
            }
        }
        let mut get_secs: f64 = 0.0;
        let mut get_bytes = 0u64;
        let mut seen = 0usize;
        for (c, shard) in consumers.iter_mut().zip(followers.iter_mut()) {
            let v = c.recv(T).await?;
            if v["ok"] != json!(true) {
                bail!("consumer {} failed: {v}", c.name());
            }
            get_secs = get_secs.max(v["secs"].as_f64().unwrap_or(0.0));
            get_bytes += v["bytes"].as_u64().unwrap_or(0);
            for (k, sum) in v["checksums"].as_object().into_iter().flatten() {
                seen += 1;
                if expected.get(k).map(|s| s.as_str()) != sum.as_str() {
                    bail!("sample {k}: consumer {} got checksum {sum}, producer put {:?}", c.name(), expected.get(k));
                }
            }
            // Every other rank of the shard must end up with the leader's exact batch.
            let want = v["batch"].clone();
            if !independent && !shard.is_empty() {
                let fv = c.recv(T).await?;
                if fv["ok"] != json!(true) {
                    bail!("fan-out from {} failed: {fv}", c.name());
                }
            }
            for f in shard.iter_mut() {
                let fv = f.recv(T).await?;
                if fv["ok"] != json!(true) || fv["batch"] != want {
                    bail!("rank {} of shard {} got {fv}, its leader {want}", f.name(), c.name());
                }
            }
        }
        let shard_fetch_secs = tf.elapsed().as_secs_f64();
        if seen != expected.len() {
            bail!("consumers got {seen} samples of {}", expected.len());
        }
        let put_to_get = t0.elapsed().as_secs_f64();
        let raw_gbps = raw_stream(&mut sink, &sink_addr, get_bytes, &raw_buf, RawMode::Raw, &mut tagged).await?;
        let chunked_gbps =
            raw_stream(&mut sink, &sink_addr, get_bytes, &raw_buf, RawMode::Chunked, &mut tagged).await?;
        let tagged_gbps = raw_stream(&mut sink, &sink_addr, get_bytes, &raw_buf, RawMode::Tagged, &mut tagged).await?;
        let keys: Vec<String> = claim.meta.keys().map(String::from).collect();
        controller.ack(&part, "train", claim.claim_id, &keys)?;
        let mut rss_total = 0u64;
        let mut hwm_total = 0u64;
        for p in storage.iter_mut().chain(producers.iter_mut().filter(|_| placement == TqPlacement::ProducerLocal)) {
            let v = p.call_ok("stats", T).await?;
            rss_total += v["rss"].as_u64().unwrap_or(0);
            hwm_total += v["hwm"].as_u64().unwrap_or(0);
        }
        let cleared = controller.clear(&part).await;
        if !cleared.unreachable.is_empty() || cleared.freed != put_bytes {
            bail!("clear freed {} of {put_bytes} bytes; unreachable: {:?}", cleared.freed, cleared.unreachable);
        }
        total_bytes = get_bytes;
        step_rows.push(json!({
            "step": step, "bytes": get_bytes, "put_secs": put_secs, "get_secs": get_secs,
            "put_gbps": put_bytes as f64 / put_secs / 1e9, "get_gbps": get_bytes as f64 / get_secs / 1e9,
            "put_to_get_ms": put_to_get * 1e3, "imbalance": assignment.imbalance,
            "raw_gbps": raw_gbps, "get_over_raw": get_bytes as f64 / get_secs / 1e9 / raw_gbps,
            "tagged_gbps": tagged_gbps, "tagged_over_raw": tagged_gbps / raw_gbps,
            "chunked_gbps": chunked_gbps, "tagged_over_chunked": tagged_gbps / chunked_gbps,
            "shard_fetch_ms": shard_fetch_secs * 1e3,
            "storage_rss": rss_total, "storage_hwm": hwm_total,
        }));
        eprintln!(
            "step {step}: {:.1} MB, put {:.2} GB/s, get {:.2} GB/s, raw {raw_gbps:.2} GB/s, tagged {tagged_gbps:.2} GB/s, put→get {:.1} ms, imbalance {:.3}",
            get_bytes as f64 / 1e6,
            put_bytes as f64 / put_secs / 1e9,
            get_bytes as f64 / get_secs / 1e9,
            put_to_get * 1e3,
            assignment.imbalance
        );
    }
    let counted: Vec<&Value> =
        if step_rows.len() >= 3 { step_rows[1..].iter().collect() } else { step_rows.iter().collect() };
    let col = |k: &str| counted.iter().map(|r| r[k].as_f64().unwrap_or(0.0)).collect::<Vec<_>>();
    let (put_gbps, get_gbps, p2g) = (median(&col("put_gbps")), median(&col("get_gbps")), median(&col("put_to_get_ms")));
    let rss_peak = step_rows.iter().map(|r| r["storage_hwm"].as_u64().unwrap_or(0)).max().unwrap_or(0);
    let rss_last = step_rows.last().map(|r| r["storage_rss"].as_u64().unwrap_or(0)).unwrap_or(0);

    let raw = median(&col("raw_gbps"));
    let shard_fetch_ms = median(&col("shard_fetch_ms"));
    let ratio = median(&col("get_over_raw"));
    let (tagged_gbps, tagged_ratio) = (median(&col("tagged_gbps")), median(&col("tagged_over_raw")));
    let (chunked_gbps, tagged_chunked) = (median(&col("chunked_gbps")), median(&col("tagged_over_chunked")));

    // Claim latency on a large partition, in-process and over TCP.
    let n = a.claim_partition;
    let cpart = "claim-bench";
    let mut meta = BatchMeta::builder(cpart, vec![crate::tq::FieldSpec::ragged("input_ids", crate::tq::DType::I64)]);
    let untagged = crate::tq::SampleTags::default();
    for i in 0..n {
        meta.push(&format!("{}_g{}", i / 8, i % 8), i % s, 256 + i % 3840, &[256 + i % 3840], &untagged)?;
    }
    controller.register(&meta.finish())?;
    let client = TqClient::new(
        ClientConfig {
            auth: auth.clone(),
            name: "bench".into(),
            controller: ctl_addr.clone(),
            units: units.clone(),
            placement,
            home_unit: None,
            put_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            role: WriteRole::Writer,
        },
        None,
    )?;
    let mut lat = BTreeMap::new();
    for &(label, take, tcp) in &[
        ("tcp_claim_256", 256usize, true),
        ("tcp_claim_all", n as usize, true),
        ("inproc_claim_256", 256, false),
        ("inproc_claim_all", n as usize, false),
    ] {
        let mut times = Vec::with_capacity(a.claim_rounds as usize);
        let mut group = 0u32;
        let mut left = 0usize;
        for _ in 0..a.claim_rounds {
            if left < take {
                group += 1;
                left = n as usize;
            }
            let g = format!("{label}-{group}");
            let t = Instant::now();
            let got = if tcp {
                client.claim(cpart, &g, take, &["input_ids"]).await?.meta.len()
            } else {
                controller.claim(cpart, &g, take, 0, &["input_ids".to_string()])?.meta.len()
            };
            times.push(t.elapsed().as_secs_f64() * 1e6);
            left -= got.min(left);
            if got != take.min(n as usize) {
                bail!("{label}: claimed {got} samples, expected {take}");
            }
        }
        times.sort_by(f64::total_cmp);
        lat.insert(label, (percentile(&times, 0.5), percentile(&times, 0.99), over_1ms(&times)));
    }
    // Reference, same run: a plain loopback round trip moving as many bytes as the whole-partition
    // claim's reply — the floor any TCP protocol pays for it.
    let whole = controller.claim(cpart, "raw-reference", n as usize, 0, &["input_ids".to_string()])?;
    let reply_bytes = 4 + crate::tq::codec::encode(
        &crate::tq::codec::Header {
            version: crate::tq::codec::WIRE_VERSION,
            request_id: 0,
            token: auth.token().into(),
        },
        &crate::tq::codec::Body::Claimed { claim_id: whole.claim_id, lease_ms: 0, meta: whole.meta },
    )
    .len();
    let mut raw_rt = raw_round_trips(reply_bytes, a.claim_rounds).await?;
    raw_rt.sort_by(f64::total_cmp);
    let raw_rt = (percentile(&raw_rt, 0.5), percentile(&raw_rt, 0.99), over_1ms(&raw_rt));
    controller.clear(cpart).await;
    for p in
        storage.iter_mut().chain(producers.iter_mut()).chain(consumers.iter_mut()).chain(followers.iter_mut().flatten())
    {
        let _ = p.send("exit").await;
    }

    let report = json!({
        "samples": a.samples, "response_tokens": a.response_tokens, "placement": a.placement,
        "storage_units": s, "consumers": a.consumers, "steps": a.steps,
        "step_bytes": total_bytes, "put_gbps": put_gbps, "get_gbps": get_gbps, "put_to_get_ms": p2g,
        "raw_gbps": raw, "get_over_raw": ratio, "tagged_gbps": tagged_gbps, "tagged_over_raw": tagged_ratio,
        "chunked_gbps": chunked_gbps, "tagged_over_chunked": tagged_chunked,
        "ranks_per_shard": a.ranks_per_shard, "fetch": a.fetch, "shard_fetch_ms": shard_fetch_ms,
        "claim_reply_bytes": reply_bytes, "raw_claim_round_trip_us": json!({"p50": raw_rt.0, "p99": raw_rt.1, "over_1ms": raw_rt.2}),
        "claim_us": lat.iter().map(|(k, (p50, p99, over))| (k.to_string(), json!({"p50": p50, "p99": p99, "over_1ms": over}))).collect::<serde_json::Map<_, _>>(),
        "claim_rounds": a.claim_rounds,
        "storage_rss_bytes": rss_last, "storage_peak_rss_bytes": rss_peak,
        "steps_detail": step_rows,
    });
    println!(
        "rlplane bench tq — {} samples/step, responses {} tokens (+{} prompt), placement {}, {} storage units, {} consumers",
        a.samples, a.response_tokens, a.prompt_tokens, a.placement, s, a.consumers
    );
    println!("  step bytes            {:>10.1} MB", total_bytes as f64 / 1e6);
    println!("  put                   {:>10.2} GB/s", put_gbps);
    println!("  get                   {:>10.2} GB/s", get_gbps);
    println!("  raw loopback stream   {:>10.2} GB/s", raw);
    println!("  get / raw (per step)  {:>10.2}", ratio);
    println!(
        "  in records            {:>10.2} GB/s   (the raw stream in 256 KiB writes and reads, untagged)",
        chunked_gbps
    );
    println!("  tagged records        {:>10.2} GB/s   (the same, every record tagged and checked)", tagged_gbps);
    println!("  tagged / raw          {:>10.3}", tagged_ratio);
    println!("  tagged / in records   {:>10.3}   (what the tags cost)", tagged_chunked);
    println!("  put→get (step)        {:>10.1} ms", p2g);
    println!(
        "  every rank has its batch {:>7.1} ms   ({} ranks per shard, fetch {})",
        shard_fetch_ms, a.ranks_per_shard, a.fetch
    );
    let rounds = a.claim_rounds;
    for (k, (p50, p99, over)) in &lat {
        println!(
            "  {:<21} p50 {:>8.1} µs   p99 {:>8.1} µs   over 1 ms {over:>3} of {rounds}   ({n}-sample partition)",
            k, p50, p99
        );
    }
    println!(
        "  {:<21} p50 {:>8.1} µs   p99 {:>8.1} µs   over 1 ms {:>3} of {rounds}   (plain socket, {reply_bytes} bytes: the whole claim's reply)",
        "raw_round_trip", raw_rt.0, raw_rt.1, raw_rt.2
    );
    if let Some((p50, ..)) = lat.get("tcp_claim_all") {
        println!("  tcp_claim_all / raw round trip (p50) {:>6.2}", p50 / raw_rt.0);
    }
    println!(
        "  storage RSS (all units) {:>8.1} MB after a step, peak {:.1} MB",
        rss_last as f64 / 1e6,
        rss_peak as f64 / 1e6
    );
    if a.json {
        println!("{report}");
    }
    Ok(())
}
