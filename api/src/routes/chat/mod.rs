pub mod post_chat;
