//! Database faults, classified once (SPEC §5 "Faults are classified once"; issue 9).
//!
//! Every step of the write path is a single statement in autocommit mode, so an error
//! *response* from the server means the statement's transaction rolled back; only a connection
//! that breaks (or a call that times out) after the statement may have been sent leaves the
//! outcome unknown. The classes:
//!
//! | class | examples (SQLSTATE) | caller does |
//! |---|---|---|
//! | [`Fault::Refused`] | `AL4xx` raised by a step function | answer the client with that status and code |
//! | [`Fault::Retry`] | deadlock `40P01`, serialization `40001`, lock timeout `55P03`, statement timeout / cancel `57014`, out of memory and other resources `53xxx` but the two below | retry the same call (it certainly did not commit) |
//! | [`Fault::Outage`] | the database is unavailable to every caller, whatever it sends: admin or crash shutdown `57P01`/`57P02`/`57P03`, connection exceptions `08xxx`, read-only during failover `25006`, disk full `53100`, too many connections `53300`; pool wait timeouts and failed connects | as `Retry`; and a run handed back for it is not at fault (counts no fault towards `abandoned`) |
//! | [`Fault::Unknown`] | socket closed or reset, call timed out | retry only if the call is replay-safe (worker steps carry a commit id; commands with an idempotency key), else report that the outcome is unknown |
//! | [`Fault::Deterministic`] | constraint `23xxx`, data `22xxx`, programming `42xxx`, `P0001`, internal | do not retry: the same call fails the same way |

use deadpool::managed::PoolError;

/// What a failed call means (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// A business refusal raised by a step function: HTTP `status`, stable `code`, `message`.
    Refused { status: u16, code: String, message: String },
    /// The statement did not commit; retrying is safe. It may have failed because of what it
    /// was asked to do (a statement timeout on a huge context, a deadlock with its own data):
    /// a run that keeps handing back for it counts faults and ends `abandoned`.
    Retry(String),
    /// The statement did not commit because the database is unavailable to everyone (see the
    /// module docs); retrying is safe, and nothing about the call is to blame.
    Outage(String),
    /// The statement may or may not have committed.
    Unknown(String),
    /// Retrying would fail the same way.
    Deterministic { sqlstate: String, message: String },
}

/// SQLSTATEs (or classes, by their first two characters) whose statement rolled back and may
/// simply be retried.
fn transient(code: &str) -> bool {
    matches!(code, "40001" | "40P01" | "55P03" | "57014" | "57P01" | "57P02" | "57P03" | "25006" | "25P03")
        || code.starts_with("08")
        || code.starts_with("53")
}

/// Transient SQLSTATEs that say the database is unavailable to every caller, not that this
/// statement failed: a run handed back for one of them is not at fault.
fn outage(code: &str) -> bool {
    matches!(code, "57P01" | "57P02" | "57P03" | "25006" | "53100" | "53300") || code.starts_with("08")
}

/// Classifies an error of a call that was (possibly) sent.
pub fn classify(error: &tokio_postgres::Error) -> Fault {
    let Some(db) = error.as_db_error() else {
        return Fault::Unknown(error.to_string());
    };
    let code = db.code().code();
    if let Some(status) = code.strip_prefix("AL") {
        return Fault::Refused {
            status: status.parse().unwrap_or(400),
            code: db.message().to_owned(),
            message: db.detail().unwrap_or_else(|| db.message()).to_owned(),
        };
    }
    if outage(code) {
        return Fault::Outage(format!("{code}: {}", db.message()));
    }
    if transient(code) {
        return Fault::Retry(format!("{code}: {}", db.message()));
    }
    Fault::Deterministic { sqlstate: code.to_owned(), message: db.message().to_owned() }
}

/// Classifies a failure to obtain a connection (nothing was sent).
pub fn classify_pool(error: &PoolError<tokio_postgres::Error>) -> Fault {
    match error {
        PoolError::Timeout(kind) => Fault::Outage(format!("no database connection within the pool's wait ({kind:?})")),
        PoolError::Backend(e) => match classify(e) {
            Fault::Deterministic { sqlstate, message } if sqlstate.starts_with("28") => Fault::Deterministic { sqlstate, message },
            Fault::Unknown(message) | Fault::Retry(message) | Fault::Outage(message) | Fault::Deterministic { message, .. } => {
                Fault::Outage(format!("connecting: {message}"))
            }
            refused @ Fault::Refused { .. } => refused,
        },
        PoolError::PostCreateHook(e) => Fault::Outage(e.to_string()),
        PoolError::Closed | PoolError::NoRuntimeSpecified => {
            Fault::Deterministic { sqlstate: "XX000".into(), message: error.to_string() }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_the_documented_ones() {
        for code in ["57P01", "57P02", "57P03", "08006", "08001", "25006", "53100", "53300"] {
            assert!(outage(code) && transient(code), "{code}");
        }
        for code in ["40001", "40P01", "55P03", "57014", "53200", "23505", "XX000"] {
            assert!(!outage(code), "{code}");
        }
    }

    #[test]
    fn transient_codes_are_the_documented_ones() {
        for code in ["40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03", "53300", "53200", "08006", "08001", "25006"] {
            assert!(transient(code), "{code}");
        }
        for code in ["23505", "23514", "22P02", "42883", "P0001", "XX000", "42501", "28P01"] {
            assert!(!transient(code), "{code}");
        }
    }
}
