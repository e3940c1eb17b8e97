//! The one duration grammar of the project: command-line flags, environment variables and a
//! budget's `duration` all read durations with [`parse`], so `1h30m` means the same everywhere.
//!
//! A duration is `0`, or one or more whole numbers each followed by a unit — `h`, `m`, `s`,
//! `ms` — each unit at most once and the largest first: `250ms`, `2s`, `5m`, `1h30m`,
//! `1m30s500ms` (the integer subset of Go's `time.ParseDuration`, which Kubernetes' own
//! durations use). No fractions, no spaces, no bare numbers but `0`.

use std::time::Duration;

/// The accepted forms, for error messages.
pub const FORMS: &str = "like 250ms, 90s, 5m or 1h30m";

/// Reads a duration (see the [module](self) for the grammar).
///
/// # Errors
/// A message that quotes the input and names the accepted forms.
pub fn parse(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration {FORMS}");
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(bad());
    }
    let mut rest = s;
    let mut total = Duration::ZERO;
    // The rank of the last unit read: each unit once, largest first.
    let mut last = usize::MAX;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        let after = &rest[digits..];
        let (rank, len, unit) = if after.starts_with("ms") {
            (0, 2, Duration::from_millis(1))
        } else if after.starts_with('s') {
            (1, 1, Duration::from_secs(1))
        } else if after.starts_with('m') {
            (2, 1, Duration::from_secs(60))
        } else if after.starts_with('h') {
            (3, 1, Duration::from_secs(3600))
        } else {
            return Err(bad());
        };
        if rank >= last {
            return Err(bad());
        }
        last = rank;
        let part = u32::try_from(n).ok().and_then(|n| unit.checked_mul(n)).ok_or_else(bad)?;
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = &after[len..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_whole_numbers_with_units_largest_first() {
        let ms = |s: &str| parse(s).map(|d| d.as_millis());
        assert_eq!(ms("0"), Ok(0));
        assert_eq!(ms("250ms"), Ok(250));
        assert_eq!(ms("2s"), Ok(2_000));
        assert_eq!(ms("5m"), Ok(300_000));
        assert_eq!(ms("1h30m"), Ok(5_400_000));
        assert_eq!(ms("90s"), Ok(90_000));
        assert_eq!(ms("0s"), Ok(0));
        assert_eq!(ms("2h0m5s"), Ok(7_205_000));
        assert_eq!(ms("1m30s500ms"), Ok(90_500));
        for bad in [
            "",
            "h",
            "1",
            "1.5s",
            "1d",
            "30m1h",
            "1h1h",
            "5ms2s",
            "-1h",
            " 1s",
            "1s ",
            "1 s",
            "5 parsecs",
            "99999999999h",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse("1d").unwrap_err(), "\"1d\" is not a duration like 250ms, 90s, 5m or 1h30m");
    }
}
