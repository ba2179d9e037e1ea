//! tracing set-up shared by both binaries: log lines on stderr, and OpenTelemetry traces
//! exported by OTLP (HTTP/protobuf) when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set. Without it no exporter, no OpenTelemetry layer
//! and no thread exist: spans cost what tracing spans cost.
//!
//! Trace context crosses the database: the api stores the W3C `traceparent` of the request
//! that created a run on the run (`runs.traceparent`, see [`traceparent`] and
//! `migrations/2026-12-02-000012_trace_context`), and the worker makes it the remote parent of
//! each slice span ([`set_remote_parent`]), so one chat turn is one trace across processes.
//! Spans (README "Traces"): `request` (api, per HTTP request, named `METHOD /route`), `slice`
//! (worker), `chat {model}` (every model call, GenAI semantic-convention attributes, never
//! message bodies) and `execute_tool {name}` (never arguments or results).

use std::collections::HashMap;
use std::sync::OnceLock;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogFormat;

/// Set once when traces are exported (the OpenTelemetry layer is installed).
static EXPORTING: OnceLock<()> = OnceLock::new();

tokio::task_local! {
    /// The valid W3C `traceparent` header of the request being served, for processes that do
    /// not export traces themselves (the run still carries the caller's context to workers).
    static INCOMING: Option<String>;
}

/// Installs the global subscriber: `RUST_LOG` filter (default `info`), text or JSON lines on
/// stderr. Message bodies and secrets are never logged at info (house rule, STYLE.md). No
/// traces are exported (admin verbs).
pub fn init(format: LogFormat) {
    let _ = tracing_subscriber::registry().with(fmt_layer(format)).with(filter()).try_init();
}

/// [`init`] plus, when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
/// is set (and `OTEL_SDK_DISABLED` is not `true`), an OpenTelemetry layer whose batch
/// processor exports spans by OTLP/HTTP protobuf. The service name is `OTEL_SERVICE_NAME`
/// (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`), else `default_service`. The SDK reads
/// the other standard variables itself: `OTEL_EXPORTER_OTLP_HEADERS`, `..._TIMEOUT`,
/// `OTEL_BSP_SCHEDULE_DELAY` and the other `OTEL_BSP_*`, `OTEL_TRACES_SAMPLER(_ARG)`,
/// `OTEL_RESOURCE_ATTRIBUTES`. Keep the returned guard until exit: dropping it flushes and
/// stops the exporter.
pub fn init_with_traces(format: LogFormat, default_service: &'static str) -> TracesGuard {
    let provider = match tracer_provider(default_service) {
        Ok(provider) => provider,
        Err(error) => {
            init(format);
            if let Some(error) = error {
                tracing::error!(%error, "OpenTelemetry traces are off: the OTLP exporter could not be built");
            }
            return TracesGuard(None);
        }
    };
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("agentloop")).with_location(false).with_threads(false);
    let installed = tracing_subscriber::registry().with(fmt_layer(format)).with(layer).with(filter()).try_init().is_ok();
    if installed {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let _ = EXPORTING.set(());
        tracing::info!(service.name = %service_name(default_service), "exporting OpenTelemetry traces by OTLP/HTTP");
    }
    TracesGuard(Some(provider))
}

/// Flushes and stops the trace exporter when dropped.
#[must_use = "dropping the guard stops exporting traces"]
pub struct TracesGuard(Option<SdkTracerProvider>);

impl Drop for TracesGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("flushing OpenTelemetry traces at exit failed: {error}");
        }
    }
}

fn filter() -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
}

fn fmt_layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => layer.boxed(),
        LogFormat::Json => layer.json().flatten_event(true).boxed(),
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

fn service_name(default_service: &'static str) -> String {
    env("OTEL_SERVICE_NAME")
        .or_else(|| {
            env("OTEL_RESOURCE_ATTRIBUTES")?
                .split(',')
                .find_map(|kv| kv.split_once('=').filter(|(k, _)| k.trim() == "service.name").map(|(_, v)| v.trim().to_owned()))
        })
        .unwrap_or_else(|| default_service.to_owned())
}

/// The provider, or `Err(None)` when traces are not configured, `Err(Some(_))` when the
/// exporter could not be built.
fn tracer_provider(default_service: &'static str) -> Result<SdkTracerProvider, Option<String>> {
    if env("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() && env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none() {
        return Err(None);
    }
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return Err(None);
    }
    if let Some(protocol) = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
        && protocol != "http/protobuf"
    {
        eprintln!("OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not supported; exporting with http/protobuf");
    }
    // reqwest is built without a default TLS provider: its client builder needs one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build().map_err(|e| Some(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service_name(default_service)).build();
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
}

/// Whether this process exports traces.
pub fn exporting() -> bool {
    EXPORTING.get().is_some()
}

/// `value` when it is a well-formed W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`, ids not
/// all zero; other versions are accepted with at least these fields, as the spec says).
pub fn valid_traceparent(value: &str) -> Option<&str> {
    let value = value.trim();
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let ok = parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && (parts[0] != "00" || parts.len() == 4)
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2);
    ok.then_some(value)
}

fn extract(traceparent: &str) -> opentelemetry::Context {
    let carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    TraceContextPropagator::new().extract(&carrier)
}

/// Makes the W3C `traceparent` (a request header, or the one stored on a run) the remote
/// parent of `span`. Call before the span is first entered. A no-op when this process does
/// not export traces or the value is not a valid `traceparent`.
pub fn set_remote_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if !exporting() {
        return;
    }
    let Some(value) = traceparent.and_then(valid_traceparent) else { return };
    let cx = extract(value);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Runs `future` (the api's handling of one request) with the request's incoming
/// `traceparent` header known to [`traceparent`] even when this process exports nothing.
pub async fn with_incoming<F: std::future::Future>(incoming: Option<String>, future: F) -> F::Output {
    INCOMING.scope(incoming, future).await
}

/// The W3C `traceparent` to store on a run created now: the current span's context when this
/// process exports traces (the api's request span, itself a child of the caller's
/// `traceparent`), else the caller's valid `traceparent` header, if any.
pub fn traceparent() -> Option<String> {
    if exporting() {
        let cx = tracing::Span::current().context();
        if cx.span().span_context().is_valid() {
            let mut carrier = HashMap::new();
            TraceContextPropagator::new().inject_context(&cx, &mut carrier);
            if let Some(value) = carrier.remove("traceparent") {
                return Some(value);
            }
        }
    }
    INCOMING.try_with(Clone::clone).ok().flatten()
}

/// Sets an array-valued OpenTelemetry attribute on `span` (tracing fields are scalars), e.g.
/// `gen_ai.response.finish_reasons`. A no-op when this process does not export traces.
pub fn set_string_array(span: &tracing::Span, key: &'static str, values: Vec<String>) {
    if exporting() {
        let values = values.into_iter().map(opentelemetry::StringValue::from).collect();
        span.set_attribute(key, opentelemetry::Value::Array(opentelemetry::Array::String(values)));
    }
}

/// Prometheus metrics (the `metrics` facade with `metrics-exporter-prometheus`): the api serves
/// them at `GET /metrics`, the worker on `WORKER_METRICS_LISTEN`. Every `_seconds` metric is a
/// histogram with the buckets [`metrics::LATENCY_BUCKETS`] (so p99 aggregates across
/// processes). The alert rules and the dashboard that read them are in `deploy/observability/`;
/// the list with units is README's "Metrics".
///
/// Worker: `agentloop_claims_total`, `agentloop_claim_duration_seconds` (one claim statement),
/// `agentloop_slices_total{end}` (completed, requeued, interrupted, handback, failed, cancelled,
/// waiting_approval, blocked, lease_lost, unrecorded), `agentloop_slice_duration_seconds`,
/// `agentloop_commit_duration_seconds`, `agentloop_lease_lost_total` (only leases actually lost),
/// `agentloop_lease_renew_failures_total`, `agentloop_model_calls_total{model,outcome}`,
/// `agentloop_model_call_duration_seconds{model,outcome}`, `agentloop_model_tokens_total{model,kind}`
/// (kind `prompt` | `completion`, as the provider reports usage),
/// `agentloop_tool_calls_total{tool,outcome}` and `agentloop_tool_call_duration_seconds{tool,outcome}`
/// (outcome `ok` | `error` | `uncertain`), `agentloop_stream_flushes_total`,
/// `agentloop_store_faults_total{function,fault}`, the queue gauges sampled every 15 s
/// (`agentloop_runs{status}` for pending, queued, running, expired, waiting_approval, blocked;
/// `agentloop_oldest_queued_run_age_seconds`; `agentloop_notification_queue_usage_ratio`, 0..1),
/// and retention (`agentloop_maintenance_rows_deleted_total{task}`,
/// `agentloop_maintenance_batch_duration_seconds{task}`,
/// `agentloop_maintenance_last_pass_timestamp_seconds{task}`: Unix time of the last pass that
/// reached the end of its table).
///
/// Api: `agentloop_runs_enqueued_total{status}`, `agentloop_live_clients{transport}` (gauge: SSE
/// streams and long-polls open now), `agentloop_tool_approvals_decided_total{decision}`,
/// `agentloop_operations_resolved_total{outcome}`, `agentloop_draining` (1 from SIGTERM until
/// exit).
///
/// Both: `agentloop_listener_reconnects_total{listener}`, `agentloop_listener_connected{listener}`
/// (0/1), `agentloop_listener_last_notification_timestamp_seconds{listener}` (Unix time).
///
/// Webhooks (emitted by the webhook dispatcher): `agentloop_webhook_deliveries_total{outcome}`
/// (`delivered` | `failed` | `retrying` | `abandoned`), `agentloop_webhook_delivery_duration_seconds`,
/// `agentloop_webhook_backlog` (gauge: deliveries waiting).
pub mod metrics {
    use std::net::SocketAddr;
    use std::sync::OnceLock;

    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

    /// Histogram buckets of every `*_seconds` metric (seconds): 1 ms to 2 min.
    pub const LATENCY_BUCKETS: &[f64] =
        &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

    fn builder() -> PrometheusBuilder {
        PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .expect("non-empty buckets")
    }

    /// Installs the global recorder once and returns the handle that renders the text format
    /// (the api serves it at `GET /metrics`).
    pub fn install() -> PrometheusHandle {
        HANDLE
            .get_or_init(|| builder().install_recorder().expect("the metrics recorder is installed once per process"))
            .clone()
    }

    /// Installs the recorder and serves `/metrics` (any path) on `addr` — the worker's
    /// health/metrics port (`WORKER_METRICS_LISTEN`). Must run inside a tokio runtime.
    pub fn serve(addr: SocketAddr) -> anyhow::Result<()> {
        builder().with_http_listener(addr).install()?;
        Ok(())
    }

    /// Creates `counters` (name, labels) at 0, so that they are in `/metrics` from the start:
    /// a counter appears only once touched, and a dashboard or a rule over one that never moved
    /// showed "no data" instead of 0 (acceptance probe J). Call after the recorder is installed.
    pub fn zero_counters(counters: &[(&'static str, &[(&'static str, &'static str)])]) {
        for (name, labels) in counters {
            let labels: Vec<metrics::Label> = labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)).collect();
            metrics::counter!(*name, labels).increment(0);
        }
    }

    /// Seconds since the Unix epoch, for `*_timestamp_seconds` gauges.
    pub fn unix_now() -> f64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::valid_traceparent;

    #[test]
    fn traceparent_headers_are_validated() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(valid_traceparent(good), Some(good));
        assert_eq!(valid_traceparent(" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00 ").map(str::len), Some(55));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(valid_traceparent(bad), None, "{bad}");
        }
        assert!(valid_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra").is_some());
    }
}
