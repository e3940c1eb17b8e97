//! `aws-ec2-driver`: the AWS EC2 driver as a sidecar.

use std::process::ExitCode;
use std::time::Duration;

use aws_ec2_driver::{AwsEc2Driver, Config};
use clap::Parser;
use driver_sdk::{telemetry, DriverServer, ServeArgs};

#[derive(Debug, Parser)]
#[command(name = "aws-ec2-driver", version, about = "AWS EC2 driver sidecar for machinedriver.v1")]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
    /// AWS region for specs that name none (default: AWS_REGION, AWS_DEFAULT_REGION, the
    /// profile, instance metadata).
    #[arg(long, env = "AWS_EC2_DRIVER_REGION")]
    region: Option<String>,
    /// poll_after of running operations.
    // The test `cli_defaults_are_the_constants` pins the duration strings to the constants.
    #[arg(long, env = "AWS_EC2_DRIVER_POLL_INTERVAL", default_value = "3s", value_parser = driver_sdk::parse_duration)]
    poll_interval: Duration,
    /// Attempts per EC2 call, including the first. Small on purpose: the controller owns backoff.
    #[arg(long, env = "AWS_EC2_DRIVER_MAX_ATTEMPTS", default_value_t = aws_ec2_driver::DEFAULT_MAX_ATTEMPTS,
          value_parser = clap::value_parser!(u32).range(1..=10))]
    max_attempts: u32,
    /// Bound on one EC2 call, retries included.
    #[arg(long, env = "AWS_EC2_DRIVER_CALL_TIMEOUT", default_value = "10s", value_parser = driver_sdk::parse_duration)]
    call_timeout: Duration,
    /// How long a launched instance may stay invisible to DescribeInstances before its create
    /// operation fails.
    #[arg(long, env = "AWS_EC2_DRIVER_VISIBILITY_TIMEOUT", default_value = "5m", value_parser = driver_sdk::parse_duration)]
    visibility_timeout: Duration,
    /// The SQS queue EventBridge feeds with the EC2 spot, rebalance, state-change and AWS Health
    /// events (`https://sqs.<region>.amazonaws.com/<account>/<name>`); none: no queue is read.
    #[arg(long, env = "AWS_EC2_DRIVER_INTERRUPTION_QUEUE_URL")]
    interruption_queue_url: Option<String>,
    /// How often DescribeInstanceStatus looks for impaired instances and scheduled events; 0s:
    /// never.
    #[arg(long, env = "AWS_EC2_DRIVER_INSTANCE_STATUS_INTERVAL", default_value = "1m", value_parser = driver_sdk::parse_duration)]
    instance_status_interval: Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _telemetry = telemetry::init("aws-ec2-driver", cli.serve.log_format);
    let config = Config {
        region: cli.region.clone(),
        poll_interval: cli.poll_interval,
        max_attempts: cli.max_attempts,
        call_timeout: cli.call_timeout,
        visibility_timeout: cli.visibility_timeout,
        events: aws_ec2_driver::events::EventConfig {
            queue_url: cli.interruption_queue_url.clone().filter(|u| !u.is_empty()),
            instance_status_interval: cli.instance_status_interval,
        },
    };
    let driver = match AwsEc2Driver::from_env(config).await {
        Ok(d) => d,
        Err(e) => {
            eprintln!("aws-ec2-driver: {e}");
            return ExitCode::from(2);
        }
    };
    tracing::info!(
        region = %driver.default_region(),
        "interruption_queue" = cli.interruption_queue_url.as_deref().unwrap_or("none"),
        "instance_status_interval" = ?cli.instance_status_interval,
        "aws-ec2-driver configured"
    );
    match DriverServer::new(driver).serve(&cli.serve).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aws-ec2-driver: {}", driver_sdk::error_chain(&e));
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
        assert_eq!(duration("poll-interval"), aws_ec2_driver::DEFAULT_POLL_INTERVAL);
        assert_eq!(duration("call-timeout"), aws_ec2_driver::DEFAULT_CALL_TIMEOUT);
        assert_eq!(duration("visibility-timeout"), aws_ec2_driver::DEFAULT_VISIBILITY_TIMEOUT);
        assert_eq!(duration("instance-status-interval"), aws_ec2_driver::events::DEFAULT_INSTANCE_STATUS_INTERVAL);
        assert_eq!(
            aws_ec2_driver::events::EventConfig::default().instance_status_interval,
            aws_ec2_driver::events::DEFAULT_INSTANCE_STATUS_INTERVAL
        );
        let d = Config::default();
        assert_eq!(
            (d.poll_interval, d.max_attempts, d.call_timeout, d.visibility_timeout),
            (
                aws_ec2_driver::DEFAULT_POLL_INTERVAL,
                aws_ec2_driver::DEFAULT_MAX_ATTEMPTS,
                aws_ec2_driver::DEFAULT_CALL_TIMEOUT,
                aws_ec2_driver::DEFAULT_VISIBILITY_TIMEOUT
            )
        );
    }

    /// `docs/src/operating/aws-ec2.md` (the driver's own flags) and `sidecar.md` (the shared ones)
    /// have a row for every flag with a default, stating that default.
    #[test]
    fn the_book_states_the_cli_defaults() {
        let doc = [
            include_str!("../../../docs/src/operating/aws-ec2.md"),
            include_str!("../../../docs/src/operating/sidecar.md"),
        ]
        .concat();
        let cmd = Cli::command();
        for arg in cmd.get_arguments().filter(|a| a.get_action().takes_values()) {
            let (Some(long), [default]) = (arg.get_long(), arg.get_default_values()) else { continue };
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `--{long}` |")))
                .unwrap_or_else(|| panic!("aws-ec2.md has no row for --{long}"));
            let default = default.to_string_lossy();
            assert!(row.contains(&format!("| `{default}` |")), "--{long} defaults to {default}: {row}");
        }
    }
}
