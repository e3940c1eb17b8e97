//! Human-written durations, as flags and environment variables take them: the project's one
//! grammar ([`driver_sdk_core::duration`]).

/// Parses a duration such as `250ms`, `2s`, `5m`, `1h30m` or `0`: whole numbers with units,
/// the largest first (the grammar a budget's `duration` uses too).
///
/// # Errors
/// A message that quotes the input and names the accepted forms.
pub fn parse_duration(s: &str) -> std::result::Result<std::time::Duration, String> {
    driver_sdk_core::duration::parse(s.trim())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_duration("1.5").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
