//! Logs and traces of the `rlplane` binary.
//!
//! - **Logs** go to stderr (`RLPLANE_LOG` filters them, default `info`). A line logged inside a
//!   span ends with `trace_id=<32 hex> span_id=<16 hex>`: the OpenTelemetry ids of that span.
//! - **Traces**: spans of the `rlplane` crate (a step and its phases at the coordinator; every
//!   command, transfer-queue operation and refit at the ranks) are exported over OTLP/gRPC when
//!   an endpoint is set: `spec.observability.otlpEndpoint` (in the plan, or in the manifest for
//!   `rlplane local`) first, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
//!   `OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SDK_DISABLED=true` turns export off. Without an
//!   endpoint nothing is exported, but spans still get ids (sampled out, so recording costs
//!   nothing), so the trace ids in log lines still correlate processes.
//! - **One trace per step across processes**: the control plane carries no trace context, so
//!   every process derives the same parent for step `s` from the job token and `s`
//!   ([`step_context`]): the coordinator's `step` span and every rank's command spans of that
//!   step share one trace id. The derived parent span itself is never exported (trace viewers show
//!   the coordinator's `step` span and the ranks' command spans side by side under a missing root).
//!
//! The exporter runs on a small runtime of its own (tonic needs Tokio; the SDK's batch processor
//! exports from its own thread), so it works whatever runtime the command builds. Spans are
//! flushed when the [`Telemetry`] guard drops.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing::dispatcher::WeakDispatch;
use tracing::{Dispatch, Event, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::fmt::format::{Format, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;

/// Environment variable filtering log lines (`tracing_subscriber::EnvFilter` syntax).
pub const LOG_ENV: &str = "RLPLANE_LOG";

/// How long the exporter waits for the collector per batch.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// What to set telemetry up with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// OTLP/gRPC endpoint (e.g. `http://otel-collector:4317`); no export when None.
    pub endpoint: Option<String>,
    /// Where the endpoint came from (a spec field or an environment variable), for messages.
    pub endpoint_source: Option<&'static str>,
    /// This process in the job: a rank's name (`gen-0`), `coordinator`, `supervisor`, `local`.
    pub process: String,
    /// The RLJob's name, when known.
    pub job: Option<String>,
    /// The RLJob's namespace, when known.
    pub namespace: Option<String>,
}

impl Settings {
    /// Settings for `process` with the spec's endpoint (`spec` wins over the environment, read
    /// through `env`).
    pub fn resolve(process: &str, spec_endpoint: Option<&str>, env: impl Fn(&str) -> Option<String>) -> Settings {
        let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let non_empty = |v: Option<String>| v.filter(|v| !v.trim().is_empty());
        let (endpoint, endpoint_source) = if disabled {
            (None, None)
        } else if let Some(e) = spec_endpoint.filter(|e| !e.trim().is_empty()) {
            (Some(e.to_string()), Some("spec.observability.otlpEndpoint"))
        } else if let Some(e) = non_empty(env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) {
            (Some(e), Some("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        } else if let Some(e) = non_empty(env("OTEL_EXPORTER_OTLP_ENDPOINT")) {
            (Some(e), Some("OTEL_EXPORTER_OTLP_ENDPOINT"))
        } else {
            (None, None)
        };
        Settings { endpoint, endpoint_source, process: process.to_string(), job: None, namespace: None }
    }

    /// Settings of `rlplane worker --plan PLAN [--process NAME]`. An unreadable plan gives the
    /// environment's settings (the command itself reports the plan's problem).
    pub fn for_plan(plan: &std::path::Path, process: Option<&str>) -> Settings {
        let process = process.unwrap_or("supervisor");
        match rlplane_api::plan::WorkerPlan::load(&plan.display().to_string()) {
            Ok(p) => Settings {
                job: Some(p.job.name.clone()),
                namespace: Some(p.job.namespace.clone()),
                ..Settings::resolve(process, p.observability.otlp_endpoint.as_deref(), env_var)
            },
            Err(_) => Settings::resolve(process, None, env_var),
        }
    }

    /// Settings of `rlplane local MANIFEST`; an unreadable manifest gives the environment's.
    pub fn for_manifest(manifest: &std::path::Path) -> Settings {
        let job = std::fs::read_to_string(manifest).ok().and_then(|t| rlplane_api::load_rljob(&t).ok());
        match job {
            Some(j) => Settings {
                job: j.metadata.name.clone(),
                ..Settings::resolve("local", j.spec.observability.otlp_endpoint.as_deref(), env_var)
            },
            None => Settings::resolve("local", None, env_var),
        }
    }

    /// Settings from the environment only.
    pub fn from_env(process: &str) -> Settings {
        Settings::resolve(process, None, env_var)
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Keeps telemetry running; flushes and stops the exporter when dropped.
pub struct Telemetry {
    provider: SdkTracerProvider,
    exporting: bool,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.exporting
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if self.exporting {
            // Flushes the batch; the exporter's runtime is still alive here.
            let _ = self.provider.shutdown();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Why telemetry could not be set up as asked.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter refused the endpoint.
    #[error(
        "cannot export traces to {endpoint} (from {source_name}): {message}; set it to the collector's OTLP/gRPC address, e.g. http://otel-collector:4317"
    )]
    Exporter {
        /// The endpoint.
        endpoint: String,
        /// Where it came from.
        source_name: &'static str,
        /// The exporter's error.
        message: String,
    },
    /// The exporter's runtime could not start.
    #[error("cannot start the trace exporter's runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

fn resource(settings: &Settings) -> Resource {
    let mut attributes = vec![
        KeyValue::new("service.instance.id", settings.process.clone()),
        KeyValue::new("rlplane.process", settings.process.clone()),
    ];
    if let Some(j) = &settings.job {
        attributes.push(KeyValue::new("rlplane.rljob", j.clone()));
    }
    if let Some(n) = &settings.namespace {
        attributes.push(KeyValue::new("k8s.namespace.name", n.clone()));
    }
    if let Ok(pod) = std::env::var("RLPLANE_POD") {
        attributes.push(KeyValue::new("k8s.pod.name", pod));
    }
    Resource::builder().with_service_name("rlplane").with_attributes(attributes).build()
}

/// The tracer provider for `settings`: exporting over OTLP/gRPC, or sampling everything out.
pub fn provider(settings: &Settings) -> Result<(SdkTracerProvider, Option<tokio::runtime::Runtime>), TelemetryError> {
    let Some(endpoint) = &settings.endpoint else {
        let provider =
            SdkTracerProvider::builder().with_sampler(Sampler::AlwaysOff).with_resource(resource(settings)).build();
        return Ok((provider, None));
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rlplane-otlp")
        .enable_all()
        .build()?;
    let exporter = {
        let _entered = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TelemetryError::Exporter {
                endpoint: endpoint.clone(),
                source_name: settings.endpoint_source.unwrap_or("the environment"),
                message: e.to_string(),
            })?
    };
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource(settings)).build();
    Ok((provider, Some(runtime)))
}

/// Sets up logging and tracing for this process (the process-wide `tracing` dispatcher is
/// installed here, once). A trace endpoint the exporter refuses is reported on stderr and traces
/// stay off: telemetry never stops a job.
pub fn init(settings: &Settings) -> Telemetry {
    let (provider, runtime, exporting) = match provider(settings) {
        Ok((p, rt)) => {
            let exporting = rt.is_some();
            (p, rt, exporting)
        }
        Err(e) => {
            eprintln!("warning: {e}; traces are not exported");
            let (p, _) = provider(&Settings { endpoint: None, ..settings.clone() }).expect("a provider without export");
            (p, None, false)
        }
    };
    let filter = EnvFilter::try_from_env(LOG_ENV).unwrap_or_else(|_| EnvFilter::new("info"));
    let (subscriber, slot) = subscriber(&provider, filter, std::io::stderr);
    let dispatch = Dispatch::new(subscriber);
    let _ = slot.set(dispatch.downgrade());
    if tracing::dispatcher::set_global_default(dispatch).is_err() {
        eprintln!("warning: a tracing subscriber was already installed; rlplane's is not used");
    }
    if exporting {
        tracing::info!(
            endpoint = settings.endpoint.as_deref().unwrap_or_default(),
            from = settings.endpoint_source.unwrap_or_default(),
            "exporting traces over OTLP"
        );
    }
    Telemetry { provider, exporting, runtime }
}

/// The subscriber: log lines filtered by `filter` written to `writer` (with trace ids), and the
/// `rlplane` crate's spans down to debug level sent to `provider`. Returns it with the slot to
/// put its own dispatcher into once it has one (the log formatter looks trace ids up through it).
pub fn subscriber<W>(
    provider: &SdkTracerProvider,
    filter: EnvFilter,
    writer: W,
) -> (impl Subscriber + Send + Sync + 'static, Arc<OnceLock<WeakDispatch>>)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use std::io::IsTerminal;
    let slot = Arc::new(OnceLock::new());
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("rlplane"))
        .with_filter(Targets::new().with_target("rlplane", tracing::Level::DEBUG));
    let ansi = std::io::stderr().is_terminal();
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi)
        .event_format(TraceIds { inner: Format::default().with_ansi(ansi), dispatch: slot.clone() })
        .with_filter(filter);
    (tracing_subscriber::registry().with(otel).with(fmt), slot)
}

/// An event formatter that appends the current span's trace and span ids to the line.
pub struct TraceIds<F> {
    inner: F,
    dispatch: Arc<OnceLock<WeakDispatch>>,
}

impl<S, N, F> FormatEvent<S, N> for TraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let ids = ctx.parent_span().and_then(|span| {
            let dispatch = self.dispatch.get()?.upgrade()?;
            let cx = tracing_opentelemetry::get_otel_context(&span.id(), &dispatch)?;
            let sc = cx.span().span_context().clone();
            sc.is_valid().then(|| (sc.trace_id(), sc.span_id()))
        });
        let Some((trace, span)) = ids else { return self.inner.format_event(ctx, writer, event) };
        let mut line = String::new();
        self.inner.format_event(ctx, Writer::new(&mut line), event)?;
        let body = line.strip_suffix('\n').unwrap_or(&line);
        writeln!(writer, "{body} trace_id={trace} span_id={span}")
    }
}

/// The parent every process gives its spans of step `step` of the job with `token` (see the
/// module docs): a sampled remote span context whose ids derive from the token and the step.
pub fn step_context(token: &str, step: u32) -> Context {
    let seed = format!("rlplane-step\0{token}\0{step}");
    let trace = xxhash_rust::xxh3::xxh3_128(seed.as_bytes()).max(1);
    let span = xxhash_rust::xxh3::xxh3_64_with_seed(seed.as_bytes(), 0x5eed).max(1);
    let sc = SpanContext::new(
        TraceId::from_bytes(trace.to_be_bytes()),
        SpanId::from_bytes(span.to_be_bytes()),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    Context::new().with_remote_span_context(sc)
}

/// The trace id of step `step` (as [`step_context`] derives it), as 32 hex digits.
pub fn step_trace_id(token: &str, step: u32) -> String {
    step_context(token, step).span().span_context().trace_id().to_string()
}

/// Puts `span` into step `step`'s trace (before it is entered). Without the OpenTelemetry layer
/// (tests, other subscribers) it does nothing.
pub fn join_step(span: &tracing::Span, token: &str, step: u32) {
    let _ = span.set_parent(step_context(token, step));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_spec_endpoint_wins_then_the_traces_variable_then_the_generic_one() {
        let both = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
        ]);
        let s = Settings::resolve("gen-0", Some("http://spec:4317"), &both);
        assert_eq!(s.endpoint.as_deref(), Some("http://spec:4317"));
        assert_eq!(s.endpoint_source, Some("spec.observability.otlpEndpoint"));
        let s = Settings::resolve("gen-0", None, &both);
        assert_eq!(s.endpoint.as_deref(), Some("http://traces:4317"));
        let s = Settings::resolve("gen-0", None, env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317")]));
        assert_eq!(
            (s.endpoint.as_deref(), s.endpoint_source),
            (Some("http://generic:4317"), Some("OTEL_EXPORTER_OTLP_ENDPOINT"))
        );
        assert_eq!(Settings::resolve("x", None, env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])).endpoint, None);
        assert_eq!(Settings::resolve("x", None, env(&[])).endpoint, None);
        let off = env(&[("OTEL_SDK_DISABLED", "true"), ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317")]);
        assert_eq!(Settings::resolve("x", Some("http://spec:4317"), off).endpoint, None);
    }

    #[test]
    fn every_process_derives_the_same_trace_for_a_step_and_another_for_the_next() {
        let a = step_context("e0-abc", 3);
        let b = step_context("e0-abc", 3);
        let (a, b) = (a.span().span_context().clone(), b.span().span_context().clone());
        assert!(a.is_valid() && a.is_sampled() && a.is_remote());
        assert_eq!((a.trace_id(), a.span_id()), (b.trace_id(), b.span_id()));
        assert_ne!(step_trace_id("e0-abc", 3), step_trace_id("e0-abc", 4));
        assert_ne!(step_trace_id("e0-abc", 3), step_trace_id("e1-abc", 3), "another epoch, another trace");
        assert_eq!(step_trace_id("e0-abc", 3).len(), 32);
    }

    /// A writer collecting log lines in memory.
    #[derive(Clone, Default)]
    struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Lines {
        type Writer = Lines;
        fn make_writer(&'w self) -> Lines {
            self.clone()
        }
    }

    #[test]
    fn log_lines_inside_a_span_carry_its_trace_id_without_an_exporter() {
        let settings = Settings::resolve("test", None, |_| None);
        let (provider, rt) = provider(&settings).unwrap();
        assert!(rt.is_none(), "no exporter without an endpoint");
        let lines = Lines::default();
        let (subscriber, slot) = subscriber(&provider, EnvFilter::new("info"), lines.clone());
        let dispatch = Dispatch::new(subscriber);
        let _ = slot.set(dispatch.downgrade());
        tracing::dispatcher::with_default(&dispatch, || {
            tracing::info!("outside");
            let span = tracing::info_span!("step", step = 7);
            join_step(&span, "e0-token", 7);
            span.in_scope(|| {
                let inner = tracing::info_span!("tq.get");
                inner.in_scope(|| tracing::info!("inside"));
            });
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let outside = text.lines().find(|l| l.contains("outside")).unwrap();
        assert!(!outside.contains("trace_id="), "{text}");
        let inside = text.lines().find(|l| l.contains("inside")).unwrap();
        let want = format!("trace_id={}", step_trace_id("e0-token", 7));
        assert!(inside.contains(&want), "expected {want} in {inside:?}");
        assert!(inside.contains("step{step=7}:tq.get"), "{inside}");
    }
}
