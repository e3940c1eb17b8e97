//! The defaults of `machine-controller` flags, one value each: the flags ([`crate::cli`]),
//! [`runtime::Config::default`](crate::runtime::Config),
//! [`app::Settings::default`](crate::app::Settings) and
//! [`leader::Config::default`](crate::leader::Config) read them, and the tests below pin the
//! flags' duration strings and the book (`docs/src/operating/running-the-controller.md`,
//! `kubernetes.md`, `nodes.md`) to them.

use std::time::Duration;

/// `--store`: the embedded SQLite store, in the working folder.
pub const STORE: &str = "machine-controller.db";
/// `rollout status --timeout`: a rollout of a few machines at a time through a cloud's VM
/// creates.
pub const ROLLOUT_STATUS_TIMEOUT: Duration = Duration::from_secs(600);

/// `run --workers`: reconciles mostly wait on drivers and the store, so a few workers keep many
/// objects moving.
pub const WORKERS: usize = 10;
/// `run --call-timeout`: a driver answers from its cloud's API within seconds; long work is an
/// operation, polled.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The deadline of one reconcile: a few driver calls and store writes, with room.
pub const RECONCILE_TIMEOUT: Duration = Duration::from_secs(30);
/// `run --debounce`: the changes one write sets off (status, owner, Node) coalesce into one
/// reconcile, no later than a person would notice.
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// `run --driver-qps`: driver calls per second, per driver, before the rate limit waits.
pub const DRIVER_QPS: f64 = 200.0;
/// `run --driver-burst`: calls that pass at once before [`DRIVER_QPS`] applies (twice it, so a
/// scale-up is not paced at its first second).
pub const DRIVER_BURST: u32 = 400;
/// `run --target-qps`: requests per second to the target cluster (every call, the Node watch and
/// the probe: [`crate::nodes::calls`]). About twice what a rolling update of 200 machines with
/// 2,000 pods averages (48 per second, `docs/src/reference/benchmarks-history.md`), so it paces
/// bursts, not drains; client-go's 5 would hold 1,000 joining machines' Node patches for
/// 200 s.
pub const TARGET_QPS: f64 = 100.0;
/// `run --target-burst`: requests that pass at once before [`TARGET_QPS`] applies (twice it).
pub const TARGET_BURST: u32 = 200;
/// `run --health-check-interval`: how long a Running machine's VM may be gone unnoticed.
pub const HEALTH_CHECK_INTERVAL: Duration = Duration::from_secs(30);
/// `run --orphan-interval`: one List per class and driver a minute.
pub const ORPHAN_INTERVAL: Duration = Duration::from_secs(60);
/// `run --orphan-grace`: far longer than a create takes to be recorded in a Machine's status, so
/// a machine being created is never taken for an orphan.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(300);
/// `run --controller-id`: the tag value that marks cloud machines as this controller's.
pub const CONTROLLER_ID: &str = "machine-controller";
/// `run --resync-interval`: a missed change notification delays a reconcile at most this long.
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(60);
/// The first retry delay of the error policy (`docs/src/reference/protocol.md`, section 5).
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// The longest retry delay: the backoff doubles from [`BACKOFF_BASE`] up to 5 minutes.
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// `run --drain-poll-interval`: how often a drain looks at its node's pods again.
pub const DRAIN_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// `run --leader-elect-lease-name`.
pub const LEASE_NAME: &str = "machine-controller";
/// `run --leader-elect-lease-duration`: client-go's and kube-controller-manager's default.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// `run --leader-elect-renew-deadline`: client-go's default, below [`LEASE_DURATION`] so the
/// leader stops acting before another candidate may take over.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// `run --leader-elect-retry-period`: client-go's default.
pub const RETRY_PERIOD: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use clap::{Args, CommandFactory};

    use super::*;
    use crate::cli::{Cli, RunArgs};
    use crate::resources::{
        DEFAULT_DRAIN_TIMEOUT_SECONDS, DEFAULT_NODE_STARTUP_TIMEOUT_SECONDS, DEFAULT_PROGRESS_DEADLINE_SECONDS,
        DEFAULT_VOLUME_DETACH_TIMEOUT_SECONDS,
    };

    fn run_command() -> clap::Command {
        RunArgs::augment_args(clap::Command::new("run"))
    }

    /// The default of `--long` of `cmd` as clap shows it in `--help` and parses it.
    fn default_of(cmd: &clap::Command, long: &str) -> String {
        let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap_or_else(|| panic!("no --{long}"));
        arg.get_default_values().iter().map(|v| v.to_string_lossy()).collect::<Vec<_>>().join(",")
    }

    fn duration_of(cmd: &clap::Command, long: &str) -> Duration {
        machine_driver_util::parse_duration(&default_of(cmd, long)).unwrap()
    }

    #[test]
    fn cli_defaults_are_the_constants() {
        let run = run_command();
        for (long, value) in [
            ("call-timeout", CALL_TIMEOUT),
            ("debounce", DEBOUNCE),
            ("health-check-interval", HEALTH_CHECK_INTERVAL),
            ("orphan-interval", ORPHAN_INTERVAL),
            ("orphan-grace", ORPHAN_GRACE),
            ("resync-interval", RESYNC_INTERVAL),
            ("drain-poll-interval", DRAIN_POLL_INTERVAL),
            ("leader-elect-lease-duration", LEASE_DURATION),
            ("leader-elect-renew-deadline", RENEW_DEADLINE),
            ("leader-elect-retry-period", RETRY_PERIOD),
        ] {
            assert_eq!(duration_of(&run, long), value, "--{long}");
        }
        let cli = Cli::command();
        let rollout_status = cli.find_subcommand("rollout").and_then(|c| c.find_subcommand("status")).unwrap();
        assert_eq!(duration_of(rollout_status, "timeout"), ROLLOUT_STATUS_TIMEOUT);
        assert_eq!(default_of(&cli, "store"), STORE);
        let demo = cli.find_subcommand("demo").unwrap();
        assert_eq!(duration_of(demo, "create-latency"), crate::demo::DEFAULT_CREATE_LATENCY);
        assert_eq!(duration_of(demo, "step-timeout"), crate::demo::DEFAULT_STEP_TIMEOUT);

        let config = crate::runtime::Config::default();
        assert_eq!(config.workers, WORKERS);
        assert_eq!(
            (config.call_timeout, config.reconcile_timeout, config.debounce),
            (CALL_TIMEOUT, RECONCILE_TIMEOUT, DEBOUNCE)
        );
        assert_eq!((config.driver_qps, config.driver_burst), (DRIVER_QPS, DRIVER_BURST));
        let settings = crate::app::Settings::default();
        assert_eq!(
            (settings.health_check_interval, settings.orphan_interval, settings.orphan_grace),
            (HEALTH_CHECK_INTERVAL, ORPHAN_INTERVAL, ORPHAN_GRACE)
        );
        assert_eq!(
            (settings.drain_poll_interval, settings.controller_id.as_str()),
            (DRAIN_POLL_INTERVAL, CONTROLLER_ID)
        );
        assert_eq!(default_of(&run, "target-qps").parse::<f64>().unwrap(), TARGET_QPS);
        assert_eq!(default_of(&run, "target-burst"), TARGET_BURST.to_string());
        let leader = crate::leader::Config::default();
        assert_eq!(
            (leader.lease_duration, leader.renew_deadline, leader.retry_period),
            (LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD)
        );
    }

    /// Collapses runs of whitespace (line breaks included) into one space.
    fn words(doc: &str) -> String {
        doc.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// `running-the-controller.md` lists the `run` flags as "`--flag` (default)".
    #[test]
    fn the_book_states_the_run_defaults() {
        let doc = words(include_str!("../../docs/src/operating/running-the-controller.md"));
        let run = run_command();
        for long in [
            "workers",
            "call-timeout",
            "debounce",
            "driver-qps",
            "driver-burst",
            "target-qps",
            "target-burst",
            "health-check-interval",
            "orphan-interval",
            "orphan-grace",
            "resync-interval",
            "drain-poll-interval",
        ] {
            let stated = format!("`--{long}` ({}", default_of(&run, long));
            assert!(doc.contains(&stated), "running-the-controller.md does not say {stated}");
        }
        let kubernetes = words(include_str!("../../docs/src/operating/kubernetes.md"));
        let lease = format!(
            "Lease {} s, renew deadline {} s, retry {} s",
            LEASE_DURATION.as_secs(),
            RENEW_DEADLINE.as_secs(),
            RETRY_PERIOD.as_secs()
        );
        assert!(kubernetes.contains(&lease), "kubernetes.md does not say {lease}");
        assert!(kubernetes.contains(&format!("Lease `{LEASE_NAME}`")), "kubernetes.md names another Lease");
    }

    /// The settings table of `nodes.md` and the validation table of `running-the-controller.md`
    /// state the spec defaults of [`crate::resources`].
    #[test]
    fn the_book_states_the_spec_defaults() {
        let nodes = include_str!("../../docs/src/operating/nodes.md");
        for (field, value) in [
            ("nodeStartupTimeoutSeconds", DEFAULT_NODE_STARTUP_TIMEOUT_SECONDS),
            ("drainTimeoutSeconds", DEFAULT_DRAIN_TIMEOUT_SECONDS),
            ("volumeDetachTimeoutSeconds", DEFAULT_VOLUME_DETACH_TIMEOUT_SECONDS),
        ] {
            let row = format!("| `{field}` | {value} |");
            assert!(nodes.contains(&row), "nodes.md has no row {row}");
        }
        let running = words(include_str!("../../docs/src/operating/running-the-controller.md"));
        let progress = format!("(default {DEFAULT_PROGRESS_DEADLINE_SECONDS} > 0)");
        assert!(running.contains(&progress), "running-the-controller.md does not say {progress}");
    }
}
