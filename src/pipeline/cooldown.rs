//! Cooldown cache.
