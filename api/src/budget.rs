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
//!
//! The budget is shared, so nobody may hold all of it (acceptance probe H: eight idle
//! connections declaring 16 MiB imports, without any key, held the whole budget and every
//! tenant's writes waited 10 s and failed `server_busy`):
//! - the edge authenticates a request before it weighs its body; one with a bad credential, or
//!   none, is refused before its body is read — except the sign-in (`POST /api/session`, whose
//!   key is in its body), which takes from a small budget of its own ([`ANONYMOUS_BUDGET`],
//!   bodies of at most [`ANONYMOUS_MAX_BODY`], at most [`ANONYMOUS_PER_ADDRESS`] in flight from
//!   one source address);
//! - one principal's bodies hold at most half the budget (one body larger than that takes the
//!   whole half): its next body waits for its own earlier ones, within the same
//!   `API_BODY_TIMEOUT_MS`, while other principals are served from the other half.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

use crate::error::ApiError;
use crate::limits::{KeyedPermit, KeyedSemaphores};

/// Bytes of bodies in flight of requests without a credential, per process.
pub const ANONYMOUS_BUDGET: usize = 256 * 1024;
/// Largest body of a request without a credential (a sign-in is ~100 bytes).
pub const ANONYMOUS_MAX_BODY: usize = 16 * 1024;

/// Whose body: the authenticated principal's, or nobody's (no credential: a sign-in), from
/// this source address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    Principal(Uuid),
    Anonymous(Option<std::net::IpAddr>),
}

/// Bodies without a credential in flight from one source address (verification probe I: 40
/// keyless connections that never finished their bodies filled the anonymous budget, and every
/// browser sign-in waited 10 s and failed `server_busy`).
pub const ANONYMOUS_PER_ADDRESS: usize = 4;

/// The body budget of one api process.
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    anonymous: Arc<Semaphore>,
    total: usize,
    /// Each principal's share (half the budget), while it has bodies in flight or waiting.
    shares: KeyedSemaphores<Uuid>,
    /// Anonymous bodies in flight per source address.
    addresses: KeyedSemaphores<std::net::IpAddr>,
}

/// Bytes of the budget held by one request; given back when dropped.
pub struct BodyPermit {
    permit: Option<OwnedSemaphorePermit>,
    /// The principal's share, given back after `permit`.
    _share: Option<KeyedPermit<Uuid>>,
    /// The source address's slot (a body without a credential).
    _address: Option<KeyedPermit<std::net::IpAddr>>,
    bytes: usize,
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        metrics::gauge!("agentloop_body_bytes_in_flight").decrement(self.bytes as f64);
        drop(self.permit.take());
    }
}

impl BodyBudget {
    /// A budget of `total` bytes (at least 1, at most what a semaphore can count).
    pub fn new(total: usize) -> Self {
        let total = total.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(Semaphore::new(total)),
            anonymous: Arc::new(Semaphore::new(ANONYMOUS_BUDGET.min(total))),
            total,
            shares: KeyedSemaphores::new((total / 2).max(1)),
            addresses: KeyedSemaphores::new(ANONYMOUS_PER_ADDRESS),
        }
    }

    /// The configured budget in bytes.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Bytes held by requests now (anonymous ones not included).
    pub fn in_use(&self) -> usize {
        self.total - self.permits.available_permits()
    }

    /// Takes `bytes` of the budget for `owner` (at most all of it), waiting at most `wait` in
    /// all: first for the owner's share (a principal's bodies in flight take at most half the
    /// budget, a body larger than that takes the whole share; requests without a credential
    /// have their own [`ANONYMOUS_BUDGET`]), then for the budget. Error: 503 `server_busy`
    /// (with `Retry-After: 1`) when nothing was freed in time.
    pub async fn acquire(&self, bytes: usize, wait: Duration, owner: Owner) -> Result<BodyPermit, ApiError> {
        let deadline = tokio::time::Instant::now() + wait;
        let principal = match owner {
            Owner::Anonymous(ip) => {
                let address = match ip {
                    Some(ip) => match self.addresses.try_acquire(ip) {
                        Some(slot) => Some(slot),
                        None => {
                            crate::limits::count_refusal("body_budget_address");
                            return Err(ApiError::TooManyRequests {
                                code: "too_many_bodies_in_flight",
                                message: format!(
                                    "at most {ANONYMOUS_PER_ADDRESS} requests without a credential may send their bodies at once from one address"
                                ),
                                retry_after_s: 1,
                            });
                        }
                    },
                    None => None,
                };
                let total = ANONYMOUS_BUDGET.min(self.total);
                let permit = take(&self.anonymous, bytes.clamp(1, total), deadline, wait, total).await?;
                // Not in the gauge (`bytes: 0`): that is the principals' budget.
                return Ok(BodyPermit { permit: Some(permit), _share: None, _address: address, bytes: 0 });
            }
            Owner::Principal(principal) => principal,
        };
        let Some(share) = self.shares.acquire_until(principal, bytes, deadline).await else {
            return Err(busy(wait, self.total));
        };
        let weight = bytes.clamp(1, self.total);
        let permit = take(&self.permits, weight, deadline, wait, self.total).await?;
        metrics::gauge!("agentloop_body_bytes_in_flight").increment(weight as f64);
        Ok(BodyPermit { permit: Some(permit), _share: Some(share), _address: None, bytes: weight })
    }
}

/// `weight` permits of `semaphore` by `deadline`, else 503 `server_busy`.
async fn take(
    semaphore: &Arc<Semaphore>,
    weight: usize,
    deadline: tokio::time::Instant,
    wait: Duration,
    total: usize,
) -> Result<OwnedSemaphorePermit, ApiError> {
    let weight = weight.min(u32::MAX as usize) as u32;
    match tokio::time::timeout_at(deadline, semaphore.clone().acquire_many_owned(weight)).await {
        Ok(Ok(permit)) => Ok(permit),
        // The semaphores are never closed; a timeout is the only way here.
        _ => Err(busy(wait, total)),
    }
}

/// 503 `server_busy`: nothing of the budget was freed within `wait`.
fn busy(wait: Duration, total: usize) -> ApiError {
    crate::limits::count_refusal("body_budget");
    ApiError::Unavailable {
        code: "server_busy",
        message: format!(
            "the server is holding as many request bodies as it is configured for (MAX_BODY_BYTES_IN_FLIGHT, {total} bytes; \
             one principal at most half) and none was freed within {} ms; retry shortly",
            wait.as_millis()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn permits_are_weighed_waited_for_and_given_back() {
        let budget = BodyBudget::new(100);
        let a = budget.acquire(60, Duration::from_millis(10), Owner::Principal(Uuid::new_v4())).await.unwrap();
        assert_eq!(budget.in_use(), 60);
        // 60 + 50 > 100: waits, then times out into 503 server_busy.
        let refused = budget.acquire(50, Duration::from_millis(20), Owner::Principal(Uuid::new_v4())).await.err().unwrap();
        assert_eq!(refused.code(), "server_busy");
        // A body larger than the whole budget takes all of it once the budget is free.
        let waiter = budget.acquire(1_000, Duration::from_secs(5), Owner::Principal(Uuid::new_v4()));
        drop(a);
        let all = waiter.await.unwrap();
        assert_eq!(budget.in_use(), 100);
        drop(all);
        assert_eq!(budget.in_use(), 0);
    }

    /// Nobody holds the whole budget: anonymous bodies have their own small budget, and a
    /// principal's bodies take at most half (acceptance probe H); its next body waits for its
    /// own, not for the others'.
    #[tokio::test]
    async fn anonymous_bodies_and_one_principal_cannot_take_the_whole_budget() {
        let budget = BodyBudget::new(1024 * 1024);
        let anonymous: Vec<_> = futures_util::future::join_all((0..16).map(|_| budget.acquire(16 * 1024, Duration::from_millis(10), Owner::Anonymous(None))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert!(budget.acquire(16 * 1024, Duration::from_millis(10), Owner::Anonymous(None)).await.is_err(), "the anonymous budget is spent");
        assert_eq!(budget.in_use(), 0, "the principals' budget is untouched");
        let greedy = Owner::Principal(Uuid::new_v4());
        let first = budget.acquire(400 * 1024, Duration::from_millis(10), greedy).await.unwrap();
        let refused = budget.acquire(400 * 1024, Duration::from_millis(20), greedy).await.err().unwrap();
        assert_eq!(refused.code(), "server_busy", "past its half, a principal waits for its own bodies");
        let other = budget.acquire(400 * 1024, Duration::from_millis(10), Owner::Principal(Uuid::new_v4())).await.unwrap();
        // Its next body goes when its first is answered, though the budget has room meanwhile.
        let next = budget.acquire(400 * 1024, Duration::from_secs(5), greedy);
        drop(first);
        let next = next.await.unwrap();
        drop((next, other));
        // One body of any size is admissible: it takes the whole share, then the whole budget.
        let big = budget.acquire(2 * 1024 * 1024, Duration::from_millis(50), greedy).await.unwrap();
        assert_eq!(budget.in_use(), 1024 * 1024);
        drop(big);
        drop(anonymous);
        assert_eq!(budget.in_use(), 0);
        assert_eq!(budget.shares.keys_in_use(), 0, "shares are forgotten when idle");
    }
}
