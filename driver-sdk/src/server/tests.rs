//! The defaults of [`ServeArgs`]: one value each in the constants, the flags and the book.

use clap::{Args, Command};

use super::*;

fn command() -> Command {
    ServeArgs::augment_args(Command::new("driver"))
}

/// The default of `--long` as clap shows it in `--help` and parses it.
fn default_of(cmd: &Command, long: &str) -> String {
    let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap_or_else(|| panic!("no --{long}"));
    arg.get_default_values().iter().map(|v| v.to_string_lossy()).collect::<Vec<_>>().join(",")
}

#[test]
fn cli_defaults_are_the_constants() {
    let cmd = command();
    let duration = |long: &str| crate::parse_duration(&default_of(&cmd, long)).unwrap();
    assert_eq!(duration("drain-timeout"), DEFAULT_DRAIN_TIMEOUT);
    assert_eq!(duration("probe-interval"), DEFAULT_PROBE_INTERVAL);
    assert_eq!(duration("token-key-reload-interval"), DEFAULT_TOKEN_KEY_RELOAD_INTERVAL);
    assert_eq!(default_of(&cmd, "max-message-bytes"), DEFAULT_MAX_MESSAGE_BYTES.to_string());
    assert_eq!(default_of(&cmd, "max-concurrent-calls"), DEFAULT_MAX_CONCURRENT_CALLS.to_string());
    assert_eq!(default_of(&cmd, "endpoint"), DEFAULT_ENDPOINT);

    let d = ServeArgs::default();
    assert_eq!(
        (d.drain_timeout, d.probe_interval, d.token_key_reload_interval),
        (DEFAULT_DRAIN_TIMEOUT, DEFAULT_PROBE_INTERVAL, DEFAULT_TOKEN_KEY_RELOAD_INTERVAL)
    );
    assert_eq!(
        (d.max_message_bytes, d.max_concurrent_calls),
        (DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_CONCURRENT_CALLS)
    );
}

/// `docs/src/operating/sidecar.md` has a row for every flag with a default, stating that default.
#[test]
fn the_book_states_the_cli_defaults() {
    let doc = include_str!("../../../docs/src/operating/sidecar.md");
    let cmd = command();
    let mut checked = 0;
    for arg in cmd.get_arguments().filter(|a| a.get_action().takes_values()) {
        let (Some(long), [default]) = (arg.get_long(), arg.get_default_values()) else { continue };
        let row = doc
            .lines()
            .find(|l| l.starts_with(&format!("| `--{long}` |")))
            .unwrap_or_else(|| panic!("sidecar.md has no row for --{long}"));
        let default = default.to_string_lossy();
        assert!(row.contains(&format!("| `{default}` |")), "sidecar.md: --{long} defaults to {default}: {row}");
        checked += 1;
    }
    assert_eq!(checked, 7, "flags with a default");
}

// ------------------------------------------------------- refusal of a provider-spec schema

/// A driver whose only fault is its provider-spec schema.
struct BadSchemaDriver;

#[async_trait::async_trait]
impl crate::Driver for BadSchemaDriver {
    fn info(&self) -> crate::DriverInfo {
        crate::DriverInfo {
            name: "bad-schema.machinedriver.dev".into(),
            vendor_version: "0".into(),
            provider_spec_schema: serde_json::json!({
                "type": "object",
                "properties": {"size": {"type": "string", "maxLenght": 8}}
            }),
        }
    }

    fn capabilities(&self) -> Vec<crate::Capability> {
        vec![crate::Capability::Machines]
    }

    async fn get_operation(
        &self,
        _ctx: &crate::RequestContext,
        _handle: crate::OperationHandle,
        _secrets: crate::Secrets,
    ) -> crate::Result<crate::Operation> {
        Err(crate::DriverError::unimplemented("GetOperation"))
    }
}

#[tokio::test]
async fn a_driver_with_a_refused_schema_does_not_start() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let socket = dir.path().join("driver.sock");
    let args = crate::ServeArgs { endpoint: format!("unix://{}", socket.display()), ..Default::default() };
    let serve = crate::DriverServer::new(BadSchemaDriver).with_token_key(crate::TokenKey::dev()).serve(&args);
    let result = tokio::time::timeout(std::time::Duration::from_secs(10), serve).await.expect("serve returns at once");
    let err = result.expect_err("the server refuses to start");
    assert!(
        matches!(err, crate::ServeError::ProviderSpecSchema(crate::schema::SchemaError::UnknownKeyword { .. })),
        "{err:?}"
    );
    // What the driver binaries print before exiting with a failure code.
    assert_eq!(
        crate::error_chain(&err),
        "the driver's provider_spec_schema is refused: unknown keyword \"maxLenght\" at #/properties/size: \
         JSON Schema draft 2020-12 does not define it, so it would be silently ignored (did you mean \"maxLength\"?)"
    );
    assert!(!socket.exists(), "nothing listened");
}
