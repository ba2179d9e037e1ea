//! The scheduler protocol of SPEC §5, readable in one place.
//!
//! - [`claim`]: one `FOR UPDATE SKIP LOCKED` statement claims `queued` runs and `running` runs
//!   whose lease expired (recovery needs no sweeper). It sets the owner, a new fencing token
//!   (`lease_epoch + 1`), `attempts + 1` and `lease_expires_at = now() + lease` — database clock
//!   only.
//! - [`lease`]: renewal with the fencing condition (`owner = me AND epoch = mine`), the fence
//!   every slice write takes in its own transaction, and the run transitions a slice may make
//!   (requeue, complete, fail, cancel), each of which ends by waking whoever waits.
//! - [`listener`]: the dedicated LISTEN connection (outside the pool) with reconnect, liveness
//!   probe and coalesced delivery; both binaries use it.

pub mod claim;
pub mod lease;
pub mod listener;

pub use claim::claim;
pub use lease::{Fence, Lease, LeaseLost};
