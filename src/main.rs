//! The `vantage` binary: parse the command line, run it, exit with its code.

use clap::Parser;

/// jemalloc rather than the system's malloc: a daemon whose sessions are cut and re-made in
/// bursts keeps less of each burst resident afterwards (see Cargo.toml).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let cli = match vantage::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => std::process::exit(vantage::cli::parse_error(e)),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vantage: cannot start the async runtime: {e}");
            std::process::exit(vantage::cli::exit::FAILURE);
        }
    };
    let code = runtime.block_on(vantage::cli::run(cli));
    // Do not wait for lingering blocking tasks (e.g. a stdin reader) once the command is done.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    // The spans still queued (the last batches, the shutdown) go out before the process ends.
    vantage::telemetry::traces::flush(std::time::Duration::from_secs(5));
    std::process::exit(code);
}
