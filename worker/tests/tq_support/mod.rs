//! Shared harness of the transfer-queue tests: a controller in the test process, storage units
//! and clients as real `rlplane peer tq ...` processes on loopback.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use rlplane::bench::tq::PeerProcess;
use rlplane::net::JobAuth;
use rlplane::tq::{ControllerConfig, TqController};
use serde_json::Value;

/// Reply timeout for peer commands.
pub const T: Duration = Duration::from_secs(20);

/// The job token of the tests.
pub const TOKEN: &str = "e0-0123456789abcdef";

/// The job key of the tests.
pub const KEY: [u8; 32] = [0x5a; 32];

/// The tests' token and key.
pub fn auth() -> JobAuth {
    JobAuth::new(TOKEN, &KEY)
}

/// A key file holding `key`, written once per test process.
pub fn key_file_of(key: [u8; 32]) -> String {
    let path = std::env::temp_dir().join(format!("rlplane-test-{}-{:02x}.key", std::process::id(), key[0]));
    if !path.exists() {
        // Racing tests of one process may both try; the first one's file is the same key.
        let _ = rlplane::net::write_key_file(&path, &key);
    }
    path.display().to_string()
}

/// The file holding [`KEY`].
pub fn key_file() -> &'static str {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| PathBuf::from(key_file_of(KEY))).to_str().expect("a UTF-8 temp dir")
}

pub fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_rlplane"))
}

/// A controller served on loopback plus dedicated storage peers.
pub struct Cluster {
    pub controller: TqController,
    pub ctl_addr: String,
    pub units: BTreeMap<u32, String>,
    pub storage: Vec<PeerProcess>,
}

impl Cluster {
    pub async fn start(n_units: u32, capacity: u64, lease: Duration, put_timeout_ms: u64) -> Cluster {
        let mut storage = Vec::new();
        let mut units = BTreeMap::new();
        for u in 0..n_units {
            let mut p = PeerProcess::spawn(
                exe(),
                &format!("tq-{u}"),
                &[
                    "storage".into(),
                    "--unit".into(),
                    u.to_string(),
                    "--token".into(),
                    TOKEN.into(),
                    "--key-file".into(),
                    key_file().into(),
                    "--capacity".into(),
                    capacity.to_string(),
                    "--put-timeout-ms".into(),
                    put_timeout_ms.to_string(),
                ],
            )
            .unwrap();
            let v = p.recv(T).await.unwrap();
            units.insert(u, v["listen"].as_str().unwrap().to_string());
            storage.push(p);
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ctl_addr = listener.local_addr().unwrap().to_string();
        let controller = TqController::new(ControllerConfig { auth: auth(), lease, units: units.clone() });
        tokio::spawn(controller.clone().serve(listener));
        Cluster { controller, ctl_addr, units, storage }
    }

    pub fn units_arg(&self) -> String {
        self.units.iter().map(|(u, a)| format!("{u}={a}")).collect::<Vec<_>>().join(",")
    }

    /// A client peer (dedicated placement) with extra arguments.
    pub fn client(&self, name: &str, extra: &[&str]) -> PeerProcess {
        self.client_with(name, TOKEN, key_file(), extra)
    }

    /// A client peer presenting `token` and the key in `key_file`.
    pub fn client_with(&self, name: &str, token: &str, key_file: &str, extra: &[&str]) -> PeerProcess {
        let mut args: Vec<String> = vec![
            "client".into(),
            "--name".into(),
            name.into(),
            "--token".into(),
            token.into(),
            "--key-file".into(),
            key_file.into(),
            "--controller".into(),
            self.ctl_addr.clone(),
            "--units".into(),
            self.units_arg(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        PeerProcess::spawn(exe(), name, &args).unwrap()
    }
}

/// The `checksums` object of a reply as a map.
pub fn sums(v: &Value) -> BTreeMap<String, String> {
    v["checksums"]
        .as_object()
        .unwrap_or_else(|| panic!("no checksums in {v}"))
        .iter()
        .map(|(k, s)| (k.clone(), s.as_str().unwrap().to_string()))
        .collect()
}

/// The `keys` array of a reply.
pub fn keys(v: &Value) -> Vec<String> {
    v["keys"]
        .as_array()
        .unwrap_or_else(|| panic!("no keys in {v}"))
        .iter()
        .map(|k| k.as_str().unwrap().into())
        .collect()
}
