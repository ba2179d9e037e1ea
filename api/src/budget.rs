//! The budget of request bodies in flight (issue 10 point 1: memory is bounded by
//! configuration, not by clients).
//!
//! Every request with a body takes permits from ONE weighted semaphore of this process
//! (`MAX_BODY_BYTES_IN_FLIGHT` bytes) before the edge reads its body: as many permits as its
//! `Content-Length` (a chunked body, whose length is unknown, takes its route's whole body
//! limit), and keeps them until its route has answered — the body, its parsed JSON, the step
//! function's argument and the answer built from them all live within that span. When the
//! budget is used up the request waits (its body stays in the kernel's socket buffer: actix
//! stops reading a payload nobody polls) at most `API_BODY_TIMEOUT_MS`, then gets 503
//! `server_busy` with `Retry-After: 1`. Waiters are served first come, first served (tokio's
//! semaphore is fair), so a stream of small bodies cannot starve a large one.
//!
//! A body larger than the whole budget takes the whole budget (it then runs alone), so a
//! budget below `API_MAX_BODY_BYTES` still serves every admissible body.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

/// The body budget of one api process.
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    total: usize,
}

/// Bytes of the budget held by one request; given back when dropped.
pub struct BodyPermit {
    _permit: OwnedSemaphorePermit,
    bytes: usize,
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        metrics::gauge!("agentloop_body_bytes_in_flight").decrement(self.bytes as f64);
    }
}

impl BodyBudget {
    /// A budget of `total` bytes (at least 1, at most what a semaphore can count).
    pub fn new(total: usize) -> Self {
        let total = total.clamp(1, Semaphore::MAX_PERMITS);
        Self { permits: Arc::new(Semaphore::new(total)), total }
    }

    /// The configured budget in bytes.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Bytes held by requests now.
    pub fn in_use(&self) -> usize {
        self.total - self.permits.available_permits()
    }

    /// Takes `bytes` of the budget (at most all of it), waiting at most `wait`.
    /// Error: 503 `server_busy` (with `Retry-After: 1`).
    pub async fn acquire(&self, bytes: usize, wait: Duration) -> Result<BodyPermit, ApiError> {
        let weight = bytes.clamp(1, self.total).min(u32::MAX as usize);
        let acquired = tokio::time::timeout(wait, self.permits.clone().acquire_many_owned(weight as u32)).await;
        match acquired {
            Ok(Ok(permit)) => {
                metrics::gauge!("agentloop_body_bytes_in_flight").increment(weight as f64);
                Ok(BodyPermit { _permit: permit, bytes: weight })
            }
            // The semaphore is never closed; a timeout is the only way here.
            _ => {
                crate::limits::count_refusal("body_budget");
                Err(ApiError::Unavailable {
                    code: "server_busy",
                    message: format!(
                        "the server is holding as many request bodies as it is configured for (MAX_BODY_BYTES_IN_FLIGHT, {} bytes) \
                         and none was freed within {} ms; retry shortly",
                        self.total,
                        wait.as_millis()
                    ),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn permits_are_weighed_waited_for_and_given_back() {
        let budget = BodyBudget::new(100);
        let a = budget.acquire(60, Duration::from_millis(10)).await.unwrap();
        assert_eq!(budget.in_use(), 60);
        // 60 + 50 > 100: waits, then times out into 503 server_busy.
        let refused = budget.acquire(50, Duration::from_millis(20)).await.err().unwrap();
        assert_eq!(refused.code(), "server_busy");
        // A body larger than the whole budget takes all of it once the budget is free.
        let waiter = budget.acquire(1_000, Duration::from_secs(5));
        drop(a);
        let all = waiter.await.unwrap();
        assert_eq!(budget.in_use(), 100);
        drop(all);
        assert_eq!(budget.in_use(), 0);
    }
}
