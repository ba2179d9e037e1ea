pub mod cancel_thread;
pub mod compact_thread;
pub mod create_thread;
pub mod get_context;
pub mod get_thread;
pub mod list_messages;
pub mod list_threads;
