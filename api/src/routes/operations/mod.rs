//! The operations ledger of a run (SPEC §7, §13): list its operations, resolve an uncertain one.

pub mod list_operations;
pub mod resolve_operation;
