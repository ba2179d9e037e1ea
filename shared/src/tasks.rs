//! Background tasks a process cannot work without (lease keeper, stream flusher, live-update
//! listener, revocation check, ...): when one of them ends before the process is stopping —
//! a panic, or a return it was not asked for — the process exits (status 70, `EX_SOFTWARE`) so
//! that its supervisor (systemd `Restart=`, Kubernetes, `deploy/lib/supervise.sh`) starts it
//! again. Before, such a task died alone and the process went on half-working with every
//! health check green (acceptance probe J: a worker whose lease keeper had panicked kept
//! claiming runs, which other workers then took over, asking the model again for answers
//! already paid for).

use std::future::Future;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// Exit status of a process whose critical task ended (`EX_SOFTWARE`, sysexits.h).
pub const EXIT_TASK_ENDED: i32 = 70;

/// Spawns `task` as critical: when it ends while `stop` is not cancelled, the process exits
/// with [`EXIT_TASK_ENDED`] after logging which task. Aborting (or dropping an
/// `AbortOnDropHandle` of) the returned handle aborts `task` too, and is not an end.
pub fn spawn_critical<F>(name: &'static str, stop: CancellationToken, task: F) -> JoinHandle<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        let inner = AbortOnDropHandle::new(tokio::spawn(task));
        let result = inner.await;
        if stop.is_cancelled() {
            return;
        }
        match result {
            Ok(()) => tracing::error!(task = name, "a background task this process cannot work without returned; exiting so that its supervisor starts the process again"),
            Err(error) => tracing::error!(task = name, %error, "a background task this process cannot work without died; exiting so that its supervisor starts the process again"),
        }
        std::process::exit(EXIT_TASK_ENDED);
    })
}
