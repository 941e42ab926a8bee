//! Runs `vantage bench` until the lead wires its `Bench` variant into `vantage`'s command
//! enum (then this is `vantage bench …`): the same options, the same report.
//!
//! ```sh
//! cargo run --release --example bench -- --events 200000 --streams 2000
//! ```

use clap::Parser;
use vantage::cli::bench::BenchArgs;
use vantage::cli::GlobalArgs;

/// `vantage bench`, as an example binary.
#[derive(Debug, Parser)]
#[command(name = "vantage-bench")]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(flatten)]
    args: BenchArgs,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let code = vantage::cli::bench::run(&cli.global, cli.args).await;
    std::process::exit(code);
}
