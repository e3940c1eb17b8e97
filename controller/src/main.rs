//! `machine-controller`: see `machine-controller --help`.

use std::process::ExitCode;

use clap::Parser;
use machine_controller::cli::{self, Cli, Command};

/// mimalloc, not glibc malloc: see the dependency's comment in Cargo.toml.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Commands print their own output; only `run` logs at info by default (`RUST_LOG` overrides).
    let default_level = if matches!(cli.command, Command::Run(_)) { "info" } else { "warn" };
    let _telemetry =
        machine_driver_util::telemetry::init_with_default_level("machine-controller", cli.log_format, default_level);
    match cli::execute(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("{}", f.message);
            ExitCode::from(f.code)
        }
    }
}
