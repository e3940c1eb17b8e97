//! `arm-emulator`: serves the emulated ARM VM Scale Sets API over HTTP (test support).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use arm_emulator::{Config, Emulator, Fault, Principal};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "arm-emulator",
    version,
    about = "Emulates the Azure Resource Manager API for VM Scale Sets, VMs, NICs and disks, and the Microsoft Entra ID token endpoint (test support)"
)]
struct Cli {
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Write the bound address (host:port) to this file once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// How long a scale-set create or update takes.
    // The test `cli_defaults_are_the_constants` pins the duration strings to the constants.
    #[arg(long, default_value = "2s", value_parser = driver_sdk_core::duration::parse)]
    operation_duration: Duration,
    /// How long deleting a scale set or instances takes.
    #[arg(long, default_value = "1s", value_parser = driver_sdk_core::duration::parse)]
    delete_duration: Duration,
    /// How long a manual upgrade of instances takes.
    #[arg(long, default_value = "1s", value_parser = driver_sdk_core::duration::parse)]
    upgrade_duration: Duration,
    /// How long after `POST …/simulateEviction` a Spot VM is evicted (ARM: about 30 s).
    #[arg(long, default_value = "0s", value_parser = driver_sdk_core::duration::parse)]
    eviction_delay: Duration,
    /// Retry-After (seconds) on accepted operations and in-progress polls.
    #[arg(long, default_value_t = arm_emulator::DEFAULT_RETRY_AFTER_SECS)]
    retry_after: u64,
    /// VMs per page of the VM list.
    #[arg(long, default_value_t = arm_emulator::DEFAULT_PAGE_SIZE)]
    page_size: usize,
    /// Most VMs in the emulated subscription (quota).
    #[arg(long)]
    max_instances: Option<u64>,
    /// JSON file of fault rules (see `arm_emulator::Fault`).
    #[arg(long)]
    faults: Option<PathBuf>,
    /// A service principal the Entra token endpoint knows, as TENANT:CLIENT_ID:SECRET
    /// (repeatable; `PUT /_emulator/principals` replaces them).
    #[arg(long = "principal", value_name = "TENANT:CLIENT_ID:SECRET", value_parser = |s: &str| Principal::parse(s, false))]
    principals: Vec<Principal>,
    /// A workload identity the Entra token endpoint knows, as TENANT:CLIENT_ID:TOKEN, TOKEN being
    /// the exact client assertion it accepts (repeatable).
    #[arg(long = "federated-principal", value_name = "TENANT:CLIENT_ID:TOKEN", value_parser = |s: &str| Principal::parse(s, true))]
    federated_principals: Vec<Principal>,
    /// Lifetime of the access tokens the Entra token endpoint issues (whole seconds count).
    #[arg(long, default_value = "3600s", value_parser = driver_sdk_core::duration::parse)]
    token_lifetime: Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let faults: Vec<Fault> = match &cli.faults {
        Some(p) => match std::fs::read_to_string(p)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        {
            Ok(f) => f,
            Err(e) => {
                eprintln!("arm-emulator: faults file {}: {e}", p.display());
                return ExitCode::from(2);
            }
        },
        None => Vec::new(),
    };
    let emu = Emulator::new(Config {
        operation_duration: cli.operation_duration,
        delete_duration: cli.delete_duration,
        upgrade_duration: cli.upgrade_duration,
        eviction_delay: cli.eviction_delay,
        retry_after_secs: cli.retry_after,
        page_size: cli.page_size,
        max_instances: cli.max_instances,
        faults,
        principals: cli.principals.into_iter().chain(cli.federated_principals).collect(),
        token_lifetime: cli.token_lifetime,
        zones: Vec::new(),
    });
    let (addr, server) = match emu.bind(cli.listen).await {
        Ok(x) => x,
        Err(e) => {
            eprintln!(
                "arm-emulator: {e}: {}",
                std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default()
            );
            return ExitCode::FAILURE;
        }
    };
    println!("arm-emulator listening on http://{addr}");
    if let Some(p) = &cli.addr_file {
        // Written atomically so a script polling for the file never reads half of it.
        let tmp = p.with_extension("tmp");
        if let Err(e) = std::fs::write(&tmp, addr.to_string()).and_then(|()| std::fs::rename(&tmp, p)) {
            eprintln!("arm-emulator: writing {}: {e}", p.display());
            return ExitCode::FAILURE;
        }
    }
    tokio::select! {
        r = server => match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => { eprintln!("arm-emulator: {e}"); ExitCode::FAILURE }
        },
        _ = tokio::signal::ctrl_c() => ExitCode::SUCCESS,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_defaults_are_the_constants() {
        let cmd = Cli::command();
        let duration = |long: &str| {
            let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap();
            driver_sdk_core::duration::parse(&arg.get_default_values()[0].to_string_lossy()).unwrap()
        };
        assert_eq!(duration("operation-duration"), arm_emulator::DEFAULT_OPERATION_DURATION);
        assert_eq!(duration("delete-duration"), arm_emulator::DEFAULT_DELETE_DURATION);
        assert_eq!(duration("upgrade-duration"), arm_emulator::DEFAULT_UPGRADE_DURATION);
        assert_eq!(duration("eviction-delay"), arm_emulator::DEFAULT_EVICTION_DELAY);
        assert_eq!(duration("token-lifetime"), arm_emulator::DEFAULT_TOKEN_LIFETIME);
    }
}
