//! `driver-conformance --endpoint ENDPOINT`: runs the conformance suite against a live driver,
//! prints one line per check and a closing `N passed, N failed, N skipped` line, and exits non-zero when any
//! check failed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use driver_sdk::conformance::{self, Config};

#[derive(Debug, Parser)]
#[command(
    name = "driver-conformance",
    version,
    about = "Checks that a live machinedriver.v1 driver keeps the protocol's promises"
)]
struct Cli {
    /// The driver: unix:///path.sock or tcp://host:port.
    #[arg(long, env = "DRIVER_ENDPOINT")]
    endpoint: String,
    /// A valid provider spec (JSON, or @FILE). Default: the first `examples` entry of the schema.
    #[arg(long)]
    provider_spec: Option<String>,
    /// A second valid, different provider spec (JSON or @FILE). Default: the second example.
    #[arg(long)]
    alt_provider_spec: Option<String>,
    /// A JSON file with secrets ({"key": "value"}) sent with every call.
    #[arg(long)]
    secrets_file: Option<PathBuf>,
    /// How often idempotent calls are repeated.
    #[arg(long, default_value_t = conformance::DEFAULT_REPEAT)]
    repeat: usize,
    /// How long one operation may take.
    // The test `cli_defaults_are_the_constants` pins these duration strings to the constants.
    #[arg(long, default_value = "120s", value_parser = driver_sdk::parse_duration)]
    operation_timeout: Duration,
    /// Per-call deadline.
    #[arg(long, default_value = "15s", value_parser = driver_sdk::parse_duration)]
    call_timeout: Duration,
    /// A shell command that makes the cloud report one event on the machine $MACHINE_NAME
    /// (provider ID $PROVIDER_ID, driver $DRIVER_ENDPOINT): checks redelivery, resume and
    /// acknowledgement on a real event. Without it that check is skipped.
    #[arg(long)]
    event_trigger: Option<String>,
}

fn json_arg(what: &str, arg: &str) -> Result<serde_json::Value, String> {
    let text = match arg.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("reading {what} file {path}: {e}"))?,
        None => arg.to_string(),
    };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{what} is not valid JSON: {e}"))?;
    if !v.is_object() {
        return Err(format!("{what} must be a JSON object"));
    }
    Ok(v)
}

fn config(cli: Cli) -> Result<Config, String> {
    let secrets: HashMap<String, String> = match &cli.secrets_file {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
            serde_json::from_str(&text)
                .map_err(|e| format!("{}: expected a JSON object of strings: {e}", p.display()))?
        }
        None => HashMap::new(),
    };
    Ok(Config {
        endpoint: cli.endpoint,
        provider_spec: cli.provider_spec.as_deref().map(|s| json_arg("--provider-spec", s)).transpose()?,
        alt_provider_spec: cli.alt_provider_spec.as_deref().map(|s| json_arg("--alt-provider-spec", s)).transpose()?,
        secrets,
        repeat: cli.repeat.max(1),
        operation_timeout: cli.operation_timeout,
        call_timeout: cli.call_timeout,
        event_trigger: cli.event_trigger,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let cfg = match config(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("driver-conformance: {e}");
            return ExitCode::from(2);
        }
    };
    println!("driver-conformance against {}", cfg.endpoint);
    let report = match conformance::run(&cfg, |r| println!("{r}")).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("driver-conformance: {}", driver_sdk::error_chain(&e));
            println!("0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", report.summary());
    if report.failed() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// The default of `--long` as clap shows it in `--help` and parses it.
    fn default_of(long: &str) -> String {
        let cmd = Cli::command();
        let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap_or_else(|| panic!("no --{long}"));
        arg.get_default_values().iter().map(|v| v.to_string_lossy()).collect::<Vec<_>>().join(",")
    }

    #[test]
    fn cli_defaults_are_the_constants() {
        let duration = |long: &str| driver_sdk::parse_duration(&default_of(long)).unwrap();
        assert_eq!(duration("operation-timeout"), conformance::DEFAULT_OPERATION_TIMEOUT);
        assert_eq!(duration("call-timeout"), driver_sdk::client::DEFAULT_CALL_TIMEOUT);
        let d = Config::default();
        assert_eq!(
            (d.repeat, d.operation_timeout, d.call_timeout),
            (conformance::DEFAULT_REPEAT, duration("operation-timeout"), duration("call-timeout"))
        );
    }

    /// The flag table of `docs/src/developer/driver-sdk.md` states every default.
    #[test]
    fn the_book_states_the_cli_defaults() {
        let doc = include_str!("../../../docs/src/developer/driver-sdk.md");
        for long in ["repeat", "operation-timeout", "call-timeout"] {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `--{long}` |")))
                .unwrap_or_else(|| panic!("driver-sdk.md has no row for --{long}"));
            let default = default_of(long);
            assert!(row.contains(&format!("| `{default}` |")), "driver-sdk.md: --{long} defaults to {default}: {row}");
        }
    }
}
