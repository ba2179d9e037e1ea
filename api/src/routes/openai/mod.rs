pub mod chat_completions;
