//! Retry backoff.
