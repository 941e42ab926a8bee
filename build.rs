// sqlx::migrate! embeds migrations/ at compile time; without this a new migration file would not
// rebuild the crate, and tests would run against the old set.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
