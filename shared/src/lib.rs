//! agentloop's shared library: domain types, diesel schema and queries, the scheduler protocol,
//! the notification protocol, configuration, the model provider client and the tools, used by
//! both the `agentloop-api` and `agentloop-worker` binaries.

pub mod approvals;
pub mod commands;
pub mod auth;
pub mod compaction;
pub mod config;
pub mod context;
pub mod db;
pub mod events;
pub mod generation;
pub mod import;
pub mod messages;
pub mod operations;
pub mod provider;
pub mod receipts;
pub mod mcp_auth;
pub mod runs;
pub mod scheduler;
pub mod secrets;
pub mod snapshots;
pub mod store;
pub mod streaming;
pub mod tasks;
pub mod telemetry;
pub mod text;
pub mod threads;
pub mod tokens;
pub mod tools;
pub mod webhooks;
