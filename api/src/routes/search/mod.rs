pub mod search_threads;
