//! Serving metrics: a rank's own `/metrics` on a loopback port, the merged `/metrics` of a pod
//! (its registries and its children's scraped expositions), and the scraper.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::families::RankMetrics;
use super::merge::merge;
use super::{CONTENT_TYPE, ProcessLabels, SCRAPE_TIMEOUT};

impl RankMetrics {
    /// Serves `registry` on an ephemeral loopback port; the address goes into the readiness line.
    /// Without a port (bind failure) the rank runs on without metrics, saying so.
    pub async fn serve(mut self, registry: Registry) -> RankMetrics {
        match tokio::net::TcpListener::bind(("127.0.0.1", 0)).await {
            Ok(l) => {
                self.addr = l.local_addr().ok();
                let exposition = MergedMetrics::of(vec![Arc::new(registry)]);
                tokio::spawn(async move {
                    let _ = axum::serve(l, router(exposition)).await;
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot bind a loopback port for metrics; this rank exports none"),
        }
        self
    }

    /// Where the rank serves its metrics (for `RLPLANE_READY metrics=<addr>`).
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }
}

/// One `/metrics` made of this process's registries and the expositions of child processes.
#[derive(Debug)]
pub struct MergedMetrics {
    local: Vec<Arc<Registry>>,
    children: RwLock<Vec<(String, String)>>,
    up: Option<Family<ProcessLabels, Gauge>>,
}

impl MergedMetrics {
    /// An exposition of `own` (which gets `rlplane_metrics_source_up{process}` for the
    /// children) followed by `more` registries.
    pub fn new(mut own: Registry, more: Vec<Arc<Registry>>) -> Arc<MergedMetrics> {
        let up = Family::<ProcessLabels, Gauge>::default();
        own.register(
            "metrics_source_up",
            "1 when the child process answered the last scrape of the merged /metrics, 0 when it did not",
            up.clone(),
        );
        let mut local = vec![Arc::new(own)];
        local.extend(more);
        Arc::new(MergedMetrics { local, children: RwLock::new(Vec::new()), up: Some(up) })
    }

    /// An exposition of `registries` only (no children).
    pub fn of(registries: Vec<Arc<Registry>>) -> Arc<MergedMetrics> {
        Arc::new(MergedMetrics { local: registries, children: RwLock::new(Vec::new()), up: None })
    }

    /// Sets the children to scrape: (process name, `host:port` of its metrics).
    pub fn set_children(&self, children: Vec<(String, String)>) {
        if let Some(up) = &self.up {
            for (name, _) in &children {
                let _ = up.get_or_create(&ProcessLabels { process: name.clone() });
            }
        }
        if let Ok(mut c) = self.children.write() {
            *c = children;
        }
    }

    /// Scrapes every child (concurrently, [`SCRAPE_TIMEOUT`] each) and merges their expositions
    /// with the local registries.
    pub async fn render(&self) -> String {
        let children = self.children.read().map(|c| c.clone()).unwrap_or_default();
        let scraped = futures::future::join_all(children.iter().map(|(name, addr)| async move {
            let r = scrape(addr, SCRAPE_TIMEOUT).await;
            if let Err(e) = &r {
                tracing::debug!(process = %name, %addr, error = %e, "cannot scrape a child's metrics");
            }
            (name, r)
        }))
        .await;
        let mut texts = Vec::with_capacity(scraped.len() + self.local.len());
        for (name, r) in scraped {
            if let Some(up) = &self.up {
                up.get_or_create(&ProcessLabels { process: name.clone() }).set(r.is_ok() as i64);
            }
            if let Ok(t) = r {
                texts.push(t);
            }
        }
        let mut own = Vec::with_capacity(self.local.len());
        for registry in &self.local {
            let mut s = String::new();
            if prometheus_client::encoding::text::encode(&mut s, registry).is_ok() {
                own.push(s);
            }
        }
        // This process's series first, then the children's.
        merge(own.iter().chain(texts.iter()).map(String::as_str))
    }
}

/// The router serving `/metrics` from `metrics`.
pub fn router(metrics: Arc<MergedMetrics>) -> axum::Router {
    use axum::http::header;
    use axum::routing::get;
    axum::Router::new().route(
        "/metrics",
        get(move || {
            let metrics = metrics.clone();
            async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render().await) }
        }),
    )
}

/// GETs `http://<addr>/metrics` and returns the body.
pub async fn scrape(addr: &str, timeout: Duration) -> anyhow::Result<String> {
    use anyhow::Context;
    use http_body_util::{BodyExt, Empty};
    use hyper::header;
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        let driver = tokio::spawn(conn);
        let request = hyper::Request::get("/metrics")
            .header(header::HOST, addr)
            .header(header::ACCEPT, "application/openmetrics-text")
            .body(Empty::<bytes::Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        driver.abort();
        anyhow::ensure!(status.is_success(), "{addr}/metrics answered {status}");
        String::from_utf8(body.to_vec()).with_context(|| format!("{addr}/metrics is not UTF-8"))
    };
    tokio::time::timeout(timeout, fetch).await.with_context(|| format!("{addr}/metrics took over {timeout:?}"))?
}
