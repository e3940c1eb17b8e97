//! Human-written durations, as flags and environment variables take them.

/// Parses a duration such as `250ms`, `2s`, `1.5s`, `5m`, `1h` (a bare number means seconds).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(s: &str) -> std::result::Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 250ms, 2s, 5m, 1h"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("invalid duration {s:?}: unit must be ms, s, m or h")),
    };
    if !secs.is_finite() || !(0.0..=1.0e9).contains(&secs) {
        return Err(format!("invalid duration {s:?}: out of range"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
