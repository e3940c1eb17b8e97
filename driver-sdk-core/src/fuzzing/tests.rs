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
fn token_open_seeds_and_regressions() {
    replay("token_open", check_token_open);
}

#[test]
fn provider_spec_validate_seeds_and_regressions() {
    replay("provider_spec_validate", check_provider_spec_validate);
}

/// The seed tokens are real tokens: they open with the target's codec.
#[test]
fn seed_tokens_open() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/token_open");
    let opened = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| token_codec().open(&std::fs::read(e.as_ref().unwrap().path()).unwrap()).is_ok())
        .count();
    assert!(opened >= 2, "only {opened} seeds in {} are sealed tokens", dir.display());
}
