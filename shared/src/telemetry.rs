//! tracing set-up shared by both binaries.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber: `RUST_LOG` filter (default `info`), text or JSON lines on
/// stderr. Message bodies and secrets are never logged at info (house rule, STYLE.md).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Prometheus metrics (the `metrics` facade with `metrics-exporter-prometheus`).
///
/// Names (all prefixed `agentloop_`): `claims_total`, `slices_total{end}`,
/// `slice_duration_seconds`, `model_calls_total{outcome}`, `model_call_duration_seconds`,
/// `tool_calls_total{tool,error}`, `lease_lost_total`, `runs_enqueued_total{status}`,
/// `live_clients{transport}` (gauge).
pub mod metrics {
    use std::net::SocketAddr;
    use std::sync::OnceLock;

    use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

    /// Installs the global recorder once and returns the handle that renders the text format
    /// (the api serves it at `GET /metrics`).
    pub fn install() -> PrometheusHandle {
        HANDLE
            .get_or_init(|| {
                PrometheusBuilder::new()
                    .install_recorder()
                    .expect("the metrics recorder is installed once per process")
            })
            .clone()
    }

    /// Installs the recorder and serves `/metrics` (any path) on `addr` — the worker's
    /// health/metrics port (`WORKER_METRICS_LISTEN`). Must run inside a tokio runtime.
    pub fn serve(addr: SocketAddr) -> anyhow::Result<()> {
        PrometheusBuilder::new().with_http_listener(addr).install()?;
        Ok(())
    }
}
