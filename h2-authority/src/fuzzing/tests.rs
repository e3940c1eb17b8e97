//! Replays the committed fuzz seeds and every crash the fuzzers found (`fuzz/corpus/<target>/`,
//! `fuzz/regressions/<target>/`) through the targets' own checks.

use std::path::Path;

use super::*;

/// Runs `check` on every file of the target's seed corpus (which must not be empty) and of its
/// regressions folder (which may be missing: nothing found yet), and names every file that fails.
fn replay(target: &str, check: fn(&[u8])) {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut inputs = Vec::new();
    for (dir, required) in [(fuzz.join("corpus").join(target), true), (fuzz.join("regressions").join(target), false)] {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => panic!("reading {}: {e}", dir.display()),
        };
        let before = inputs.len();
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_file() && path.file_name().is_some_and(|n| n != "README.md") {
                inputs.push(path);
            }
        }
        assert!(!required || inputs.len() > before, "{} holds no seed", dir.display());
    }
    inputs.sort();
    let failed: Vec<String> = inputs
        .iter()
        .filter_map(|path| {
            let data = std::fs::read(path).unwrap();
            let outcome = std::panic::catch_unwind(|| check(&data));
            outcome.err().map(|_| path.display().to_string())
        })
        .collect();
    assert!(failed.is_empty(), "{target}: {} of {} inputs fail: {failed:#?}", failed.len(), inputs.len());
}

#[test]
fn hpack_decode_seeds_and_regressions() {
    replay("hpack_decode", check_hpack_decode);
}

#[test]
fn authority_reencode_seeds_and_regressions() {
    replay("authority_reencode", check_authority_reencode);
}
