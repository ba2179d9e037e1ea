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
