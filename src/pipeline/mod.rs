//! The drain pipeline, one stage per module: claim → DLQ filter → envelope → cooldown → apply.

pub mod backoff;
pub mod cooldown;
pub mod envelope;
