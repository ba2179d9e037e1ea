//! The scheduler protocol of SPEC §5-§6, readable in one place. Every write goes through
//! [`crate::store`]: one step function call per durable step.
//!
//! - [`claim`]: one `FOR UPDATE SKIP LOCKED` statement claims `queued` runs and `running` runs
//!   whose lease expired (recovery needs no sweeper); it sets the owner, a new fencing token
//!   (`lease_epoch + 1`), `attempts + 1` and `lease_expires_at = now() + lease` — database clock
//!   only — and re-adopts runs whose claim answer was lost.
//! - [`lease`]: the [`Lease`] a worker holds, the fence every step takes, and the renewal of all
//!   of a worker's leases in one statement that never waits on a row lock.
//! - [`step`]: the steps of a slice — start, checkpoint (with the slice end, the run transition
//!   and FIFO promotion), streaming flush — each one fenced transaction.
//! - [`listener`]: the dedicated LISTEN connection (outside the pool) with reconnect, liveness
//!   probe and coalesced delivery; both binaries use it.

pub mod claim;
pub mod lease;
pub mod listener;
pub mod step;

pub use claim::{Claimed, Pass, Released, claim};
pub use lease::{Lease, LeaseLost, Renewal};
pub use step::{Commit, Committed, SliceEnd, Started, Usage};
