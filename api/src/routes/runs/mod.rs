pub mod cancel_run;
pub mod get_run;
