//! The dedicated `LISTEN` connection (SPEC §5 "Idle", §10; STACK-NOTES: a pooled connection
//! would leak notifications to the next borrower, and a tokio-postgres `Connection` spawned as a
//! plain future drops them, so this drives it with `poll_message`).
//!
//! Protocol on any error (connect, LISTEN, liveness probe, connection closed): reconnect with
//! exponential backoff (100 ms .. 5 s), `LISTEN` every channel, THEN emit
//! [`ListenerEvent::Resync`] so the consumer rescans (a claim pass, or every SSE client
//! re-reading the journal). Every step on the connection — connect, the `SET`/`LISTEN` batch and
//! each `SELECT 1` liveness probe (one every `probe_interval`) — must answer within the step
//! timeout (half the probe interval, at least 1 s), so a half-open connection is detected
//! wherever it goes silent, including right at `LISTEN` after a reconnect. The backoff starts
//! again from 100 ms once a session has answered a liveness probe (it stayed up a whole probe
//! interval), so isolated incidents hours apart never wait the 5 s ceiling. Notifications are
//! drained from the socket into an unbounded local queue at once and coalesced: when the
//! consumer's bounded channel is full, the overflow is replaced by one `Resync`.

use std::time::Duration;

use futures_util::future::poll_fn;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};
use tokio_util::sync::CancellationToken;

/// What the listener delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenerEvent {
    /// A notification on one of the channels.
    Notification { channel: String, payload: String },
    /// The listener (re)connected, or notifications were coalesced: rescan from the database.
    Resync,
}

/// Capacity of the consumer channel before notifications are coalesced into a `Resync`.
const CONSUMER_CAPACITY: usize = 4096;

/// First reconnect delay, and the delay again after a healthy session.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest reconnect delay.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How long any one step on the listener connection (connect, `SET`/`LISTEN`, a probe) may take
/// before the connection counts as dead: half the probe interval, at least 1 s.
pub fn step_timeout(probe_interval: Duration) -> Duration {
    (probe_interval / 2).max(Duration::from_secs(1))
}

/// How a session ended with an error.
struct SessionError {
    error: anyhow::Error,
    /// The session had answered at least one liveness probe (the backoff restarts).
    healthy: bool,
}

/// Spawns the listener task for `channels` on `database_url`; it runs until `shutdown` fires.
/// The first event after every (re)connect is `Resync`. `probe_interval` is the liveness probe
/// period; see [`step_timeout`] for the per-step deadline derived from it. The connection reports
/// `application_name` (visible in `pg_stat_activity`, e.g. `agentloop-worker-listener`).
pub fn spawn(
    database_url: String,
    application_name: &str,
    channels: Vec<&'static str>,
    probe_interval: Duration,
    shutdown: CancellationToken,
) -> mpsc::Receiver<ListenerEvent> {
    let (tx, rx) = mpsc::channel(CONSUMER_CAPACITY);
    let application_name = application_name.replace('\'', "");
    tokio::spawn(async move {
        let mut backoff = BACKOFF_MIN;
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            match session(&database_url, &application_name, &channels, probe_interval, &tx, &shutdown).await {
                Ok(()) => return,
                Err(SessionError { error, healthy }) => {
                    metrics::gauge!("agentloop_listener_connected", "listener" => application_name.clone()).set(0.0);
                    metrics::counter!("agentloop_listener_reconnects_total", "listener" => application_name.clone()).increment(1);
                    if healthy {
                        backoff = BACKOFF_MIN;
                    }
                    tracing::warn!(error = %format!("{error:#}"), backoff_ms = backoff.as_millis() as u64, "listener connection lost; reconnecting");
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    });
    rx
}

/// One connection's lifetime. `Ok` only on shutdown or when the consumer is gone.
async fn session(
    database_url: &str,
    application_name: &str,
    channels: &[&'static str],
    probe_interval: Duration,
    tx: &mpsc::Sender<ListenerEvent>,
    shutdown: &CancellationToken,
) -> Result<(), SessionError> {
    let step = step_timeout(probe_interval);
    let (client, mut connection) = match tokio::time::timeout(step, tokio_postgres::connect(database_url, NoTls)).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => return Err(SessionError { error: e.into(), healthy: false }),
        Err(_) => return Err(SessionError { error: anyhow::anyhow!("listener connect timed out after {step:?}"), healthy: false }),
    };
    let (note_tx, mut note_rx) = mpsc::unbounded_channel();
    let mut driver = tokio::spawn(async move {
        loop {
            match poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    let _ = note_tx.send((n.channel().to_owned(), n.payload().to_owned()));
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return anyhow::Error::from(e),
                None => return anyhow::anyhow!("listener connection closed"),
            }
        }
    });
    let mut healthy = false;
    let result = async {
        let listen: String = std::iter::once(format!("SET application_name = '{application_name}';"))
            .chain(channels.iter().map(|c| format!("LISTEN {c};")))
            .collect();
        tokio::select! {
            // The driver must keep running meanwhile; if it fails first, that is the error.
            error = &mut driver => return Err(error.unwrap_or_else(|e| anyhow::anyhow!(e))),
            done = tokio::time::timeout(step, client.batch_execute(&listen)) => {
                done.map_err(|_| anyhow::anyhow!("listener LISTEN timed out after {step:?}"))??;
            }
        }
        tracing::info!(channels = ?channels, "listening");
        metrics::gauge!("agentloop_listener_connected", "listener" => application_name.to_owned()).set(1.0);
        let last_notification = metrics::gauge!("agentloop_listener_last_notification_timestamp_seconds", "listener" => application_name.to_owned());
        let mut overflowed = true; // the first event after LISTEN is a Resync
        let mut probe = tokio::time::interval(probe_interval);
        probe.tick().await;
        loop {
            if overflowed {
                match tx.try_send(ListenerEvent::Resync) {
                    Ok(()) => overflowed = false,
                    Err(mpsc::error::TrySendError::Closed(_)) => return Ok(()),
                    Err(mpsc::error::TrySendError::Full(_)) => {}
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                error = &mut driver => return Err(error.unwrap_or_else(|e| anyhow::anyhow!(e))),
                note = note_rx.recv() => {
                    let Some((channel, payload)) = note else { anyhow::bail!("listener driver ended") };
                    last_notification.set(crate::telemetry::metrics::unix_now());
                    if !overflowed {
                        match tx.try_send(ListenerEvent::Notification { channel, payload }) {
                            Ok(()) => {}
                            Err(mpsc::error::TrySendError::Full(_)) => overflowed = true,
                            Err(mpsc::error::TrySendError::Closed(_)) => return Ok(()),
                        }
                    }
                }
                _ = probe.tick() => {
                    tokio::time::timeout(step, client.simple_query("SELECT 1"))
                        .await
                        .map_err(|_| anyhow::anyhow!("listener liveness probe timed out after {step:?}"))??;
                    healthy = true;
                    if overflowed && tx.is_closed() {
                        return Ok(());
                    }
                }
            }
        }
    }
    .await;
    driver.abort();
    result.map_err(|error| SessionError { error, healthy })
}
