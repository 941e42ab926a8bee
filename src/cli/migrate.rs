//! `vantage migrate`: apply the migrations, print what was applied.

use super::{exit, GlobalArgs};
use crate::store::{Store, StoreOptions};

/// Runs `vantage migrate`.
pub async fn run(global: &GlobalArgs) -> i32 {
    let settings = match global.load_settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vantage: {e}");
            return exit::CONFIG;
        }
    };
    let store = match Store::connect(&StoreOptions::from_settings(&settings.database)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vantage: {e}");
            return exit::for_store_error(&e);
        }
    };
    match store.migrate().await {
        Ok(applied) if applied.is_empty() => {
            println!(
                "Schema '{}' is up to date; nothing to apply.",
                store.schema()
            );
            exit::OK
        }
        Ok(applied) => {
            for m in &applied {
                println!("Applied migration {} ({}).", m.version, m.description);
            }
            println!(
                "Applied {} migration(s) to schema '{}'.",
                applied.len(),
                store.schema()
            );
            exit::OK
        }
        // A newer or changed schema, a missing privilege: 78; a lost database: 69.
        Err(e) => {
            eprintln!("vantage: {e}");
            exit::for_store_error(&e)
        }
    }
}
