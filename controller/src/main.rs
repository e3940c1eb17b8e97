//! `machine-controller`: see `machine-controller --help`.

use std::process::ExitCode;

use clap::Parser;
use machine_controller::cli::{self, Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Commands print their own output; only `run` logs at info by default.
    if std::env::var_os("RUST_LOG").is_none() {
        let level = if matches!(cli.command, Command::Run(_)) { "info" } else { "warn" };
        // Still one thread: the runtime (and with it every other thread) starts below.
        #[allow(clippy::disallowed_methods)]
        std::env::set_var("RUST_LOG", level);
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("Failed building the Runtime")
        .block_on(run(cli))
}

async fn run(cli: Cli) -> ExitCode {
    let _telemetry = driver_sdk::telemetry::init("machine-controller", cli.log_format);
    match cli::execute(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("{}", f.message);
            ExitCode::from(f.code)
        }
    }
}
