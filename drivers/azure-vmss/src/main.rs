//! `azure-vmss-driver`: the Azure VM Scale Sets driver as a sidecar.

use std::process::ExitCode;
use std::time::Duration;

use azure_core::Url;
use azure_vmss_driver::arm::{self, ArmClient, ArmConfig};
use azure_vmss_driver::class_credential::ClassCredentials;
use azure_vmss_driver::credential::{self, CredentialKind};
use azure_vmss_driver::{AzureVmssDriver, Config};
use clap::Parser;
use driver_sdk::{telemetry, DriverServer, ServeArgs};

#[derive(Debug, Parser)]
#[command(name = "azure-vmss-driver", version, about = "Azure VM Scale Sets behind the machinedriver.v1 protocol")]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
    /// Default subscription (a provider spec's `subscriptionId` or a class Secret's wins).
    #[arg(long, env = "AZURE_SUBSCRIPTION_ID")]
    subscription_id: Option<String>,
    /// Default resource group (a provider spec's `resourceGroup` wins).
    #[arg(long, env = "AZURE_RESOURCE_GROUP")]
    resource_group: Option<String>,
    /// Default Flexible scale set machines join (a provider spec's `virtualMachineScaleSet`
    /// wins; neither: standalone VMs).
    #[arg(long, env = "AZURE_VMSS_SCALE_SET")]
    scale_set: Option<String>,
    /// ARM endpoint (sovereign clouds: e.g. <https://management.usgovcloudapi.net>; tests: the emulator).
    #[arg(long, env = "AZURE_ARM_ENDPOINT", default_value = arm::DEFAULT_ENDPOINT)]
    arm_endpoint: String,
    /// Token scopes (comma-separated; default `{arm-endpoint}/.default`).
    #[arg(long = "scope", env = "AZURE_ARM_SCOPES", value_delimiter = ',')]
    scopes: Vec<String>,
    /// Which credential to use.
    #[arg(long, env = "AZURE_VMSS_CREDENTIAL", value_enum, default_value = "default")]
    credential: CredentialKind,
    /// Microsoft Entra authority host (sovereign clouds), e.g. <https://login.microsoftonline.us>.
    #[arg(long, env = "AZURE_AUTHORITY_HOST")]
    authority_host: Option<String>,
    /// TEST ONLY: the bearer token of `--credential static-token`.
    #[arg(long, env = "AZURE_VMSS_STATIC_TOKEN", hide_env_values = true)]
    static_token: Option<String>,
    /// Time limit of one ARM request.
    // The test `cli_defaults_are_the_constants` pins the duration strings to the constants.
    #[arg(long, default_value = "30s", value_parser = driver_sdk::parse_duration)]
    request_timeout: Duration,
    /// Retries of an ARM request that got no response (statuses are never retried here).
    #[arg(long, default_value_t = arm::DEFAULT_MAX_RETRIES)]
    max_retries: u32,
    /// `poll_after` when ARM sends no Retry-After.
    #[arg(long, default_value = "15s", value_parser = driver_sdk::parse_duration)]
    default_poll_interval: Duration,
    /// How often the event stream (WatchEvents) lists the machine VMs of each resource group
    /// to see VMs stopped, deallocated or deleted out of band.
    #[arg(long, default_value = "30s", value_parser = driver_sdk::parse_duration)]
    event_poll_interval: Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _telemetry = telemetry::init("azure-vmss-driver", cli.serve.log_format);
    let endpoint = match Url::parse(&cli.arm_endpoint) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("azure-vmss-driver: --arm-endpoint {}: {e}", cli.arm_endpoint);
            return ExitCode::from(2);
        }
    };
    let scopes = if cli.scopes.is_empty() {
        vec![format!("{}/.default", cli.arm_endpoint.trim_end_matches('/'))]
    } else {
        cli.scopes.clone()
    };
    if cli.credential == CredentialKind::StaticToken {
        tracing::warn!(
            "using a fixed bearer token (--credential static-token): for tests against an ARM emulator only"
        );
    }
    let cred = match credential::build(cli.credential, cli.static_token.as_deref(), cli.authority_host.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("azure-vmss-driver: {}", driver_sdk::error_chain(&e));
            return ExitCode::from(2);
        }
    };
    let authority = match credential::authority_host(cli.authority_host.as_deref()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("azure-vmss-driver: {}", driver_sdk::error_chain(&e));
            return ExitCode::from(2);
        }
    };
    let class_credentials = ClassCredentials::new(cred.clone(), authority);
    let arm = ArmClient::new(
        ArmConfig { endpoint, scopes, request_timeout: cli.request_timeout, max_retries: cli.max_retries },
        cred,
    );
    let driver = AzureVmssDriver::new(
        arm,
        class_credentials,
        Config {
            subscription_id: cli.subscription_id.clone().filter(|s| !s.is_empty()),
            resource_group: cli.resource_group.clone().filter(|s| !s.is_empty()),
            scale_set: cli.scale_set.clone().filter(|s| !s.is_empty()),
            default_poll: cli.default_poll_interval,
            min_poll: azure_vmss_driver::MIN_POLL,
            event_poll: cli.event_poll_interval,
        },
    );
    match DriverServer::new(driver).serve(&cli.serve).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("azure-vmss-driver: {}", driver_sdk::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// The default of `--long` as clap shows it in `--help` and parses it.
    fn default_of(cmd: &clap::Command, long: &str) -> String {
        let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap_or_else(|| panic!("no --{long}"));
        arg.get_default_values().iter().map(|v| v.to_string_lossy()).collect::<Vec<_>>().join(",")
    }

    #[test]
    fn cli_defaults_are_the_constants() {
        let cmd = Cli::command();
        let duration = |long: &str| driver_sdk::parse_duration(&default_of(&cmd, long)).unwrap();
        assert_eq!(duration("request-timeout"), arm::DEFAULT_REQUEST_TIMEOUT);
        assert_eq!(duration("default-poll-interval"), azure_vmss_driver::DEFAULT_POLL_INTERVAL);
        assert_eq!(duration("event-poll-interval"), azure_vmss_driver::events::DEFAULT_EVENT_POLL_INTERVAL);
    }

    /// `docs/src/operating/azure-vmss.md` (the driver's own flags) and `sidecar.md` (the shared
    /// ones) have a row for every flag with a default, stating that default.
    #[test]
    fn the_book_states_the_cli_defaults() {
        let doc = [
            include_str!("../../../docs/src/operating/azure-vmss.md"),
            include_str!("../../../docs/src/operating/sidecar.md"),
        ]
        .concat();
        let cmd = Cli::command();
        for arg in cmd.get_arguments().filter(|a| a.get_action().takes_values()) {
            let (Some(long), [default]) = (arg.get_long(), arg.get_default_values()) else { continue };
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `--{long}` |")))
                .unwrap_or_else(|| panic!("azure-vmss.md has no row for --{long}"));
            let default = default.to_string_lossy();
            assert!(row.contains(&format!("| `{default}` |")), "--{long} defaults to {default}: {row}");
        }
    }
}
