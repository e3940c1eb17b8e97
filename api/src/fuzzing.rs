//! The check behind the `manifest_parse` fuzz target in `fuzz/`, shared with the regression test
//! that replays its seeds and every crash found (`fuzz/corpus/manifest_parse/`,
//! `fuzz/regressions/manifest_parse/`) under plain `cargo test`. Not a stable API.

/// The `manifest_parse` target: [`crate::manifest::parse`] on any UTF-8 text (other bytes are
/// dropped) never panics, and every error it reports names the file and a document.
pub fn check_manifest_parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Err(errors) = crate::manifest::parse(text, "fuzz.yaml") {
        assert!(!errors.is_empty(), "an error without a problem");
        for e in &errors {
            assert!(e.source == "fuzz.yaml" && e.document >= 1, "{e:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The seeds (there must be some) and every crash the fuzzer found, through the check.
    #[test]
    fn manifest_parse_seeds_and_regressions() {
        let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        let mut inputs = Vec::new();
        for (dir, required) in
            [(fuzz.join("corpus/manifest_parse"), true), (fuzz.join("regressions/manifest_parse"), false)]
        {
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => panic!("reading {}: {e}", dir.display()),
            };
            let before = inputs.len();
            inputs.extend(entries.map(|e| e.unwrap().path()).filter(|p| p.is_file()));
            assert!(!required || inputs.len() > before, "{} holds no seed", dir.display());
        }
        inputs.sort();
        let failed: Vec<_> = inputs
            .iter()
            .filter(|path| {
                let data = std::fs::read(path).unwrap();
                std::panic::catch_unwind(|| super::check_manifest_parse(&data)).is_err()
            })
            .collect();
        assert!(failed.is_empty(), "{} of {} inputs fail: {failed:#?}", failed.len(), inputs.len());
    }
}
