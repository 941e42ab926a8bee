//! `vantage config`.

use clap::Subcommand;

use super::{exit, GlobalArgs};

/// `vantage config` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration and print it with secrets redacted.
    Check,
}

/// Runs `vantage config`.
///
/// `check` prints the effective configuration (every layer merged) as TOML on stdout, the
/// database password replaced by `***`, and exits 0; an invalid configuration prints the error,
/// which names the key, on stderr and exits 78. The `OTEL_*` variables are checked as
/// `vantage run` reads them, and a comment line says where spans would go. It never connects
/// to the database.
pub async fn run(global: &GlobalArgs, cmd: ConfigCommand) -> i32 {
    match cmd {
        ConfigCommand::Check => match global.load_settings() {
            Ok(settings) => match crate::telemetry::traces::from_process_env(&settings.telemetry) {
                Ok(traces) => {
                    print!("{}", settings.redacted_toml());
                    match traces {
                        Some(t) => println!(
                            "# traces: on, to {} ({}), service {}",
                            crate::text::one_line(&without_query(&t.endpoint)),
                            t.protocol.as_str(),
                            crate::text::one_line(&t.service_name)
                        ),
                        None => println!("# traces: off (no OTLP endpoint configured)"),
                    }
                    exit::OK
                }
                Err(e) => {
                    eprintln!("vantage: {e}");
                    exit::CONFIG
                }
            },
            Err(e) => {
                eprintln!("{e}");
                exit::CONFIG
            }
        },
    }
}

/// `endpoint` without its query string: a collector's API key is sometimes passed there, and
/// `config check` never prints a secret.
fn without_query(endpoint: &str) -> String {
    match url::Url::parse(endpoint) {
        Ok(mut u) if u.query().is_some() => {
            u.set_query(None);
            format!("{u}?***")
        }
        _ => endpoint.to_owned(),
    }
}
