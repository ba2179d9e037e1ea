//! The dedicated `LISTEN` connection (SPEC §5 "Idle", §10; STACK-NOTES: a pooled connection
//! would leak notifications to the next borrower, and a tokio-postgres `Connection` spawned as a
//! plain future drops them, so this drives it with `poll_message`).
//!
//! Protocol on any error (connect, LISTEN, liveness probe, connection closed): reconnect with
//! exponential backoff (100 ms .. 5 s), `LISTEN` every channel, THEN emit
//! [`ListenerEvent::Resync`] so the consumer rescans (a claim pass, or every SSE client
//! re-reading the journal). A `SELECT 1` every `probe_interval` (with a timeout of the same
//! length) detects half-open connections. Notifications are drained from the socket into an
//! unbounded local queue at once and coalesced: when the consumer's bounded channel is full, the
//! overflow is replaced by one `Resync`.

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

/// Spawns the listener task for `channels` on `database_url`; it runs until `shutdown` fires.
/// The first event after every (re)connect is `Resync`. The connection reports
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
        let mut backoff = Duration::from_millis(100);
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            match session(&database_url, &application_name, &channels, probe_interval, &tx, &shutdown).await {
                Ok(()) => return,
                Err(error) => {
                    tracing::warn!(%error, backoff_ms = backoff.as_millis() as u64, "listener connection lost; reconnecting");
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
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
) -> anyhow::Result<()> {
    let (client, mut connection) =
        tokio::time::timeout(Duration::from_secs(10), tokio_postgres::connect(database_url, NoTls)).await??;
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
    let result = async {
        let listen: String = std::iter::once(format!("SET application_name = '{application_name}';"))
            .chain(channels.iter().map(|c| format!("LISTEN {c};")))
            .collect();
        client.batch_execute(&listen).await?;
        tracing::info!(channels = ?channels, "listening");
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
                    if !overflowed {
                        match tx.try_send(ListenerEvent::Notification { channel, payload }) {
                            Ok(()) => {}
                            Err(mpsc::error::TrySendError::Full(_)) => overflowed = true,
                            Err(mpsc::error::TrySendError::Closed(_)) => return Ok(()),
                        }
                    }
                }
                _ = probe.tick() => {
                    tokio::time::timeout(probe_interval.max(Duration::from_secs(1)), client.simple_query("SELECT 1"))
                        .await
                        .map_err(|_| anyhow::anyhow!("listener liveness probe timed out"))??;
                    if overflowed && tx.is_closed() {
                        return Ok(());
                    }
                }
            }
        }
    }
    .await;
    driver.abort();
    result
}
