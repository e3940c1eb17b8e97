//! Secret values (cloud credentials) a request carries, and their redaction.
//!
//! A leaf module: errors ([`crate::error`]) redact with it and requests ([`crate::types`]) carry
//! it, so it depends on neither.

use std::collections::BTreeMap;
use std::fmt;

/// Secret values (cloud credentials). `Debug` prints the keys only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets(BTreeMap<String, String>);

impl Secrets {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Whether there are no secrets.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The keys.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// `text` with every secret value (of 4 characters or more) replaced by `[REDACTED]`.
    pub fn redact(&self, text: &str) -> String {
        let mut out = text.to_string();
        for value in self.0.values().filter(|v| v.len() >= 4) {
            if out.contains(value.as_str()) {
                out = out.replace(value.as_str(), "[REDACTED]");
            }
        }
        out
    }

    /// The underlying map, for conversion to the wire.
    pub fn expose(&self) -> &BTreeMap<String, String> {
        &self.0
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Secrets {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self(iter.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secrets").field("keys", &self.0.keys().collect::<Vec<_>>()).finish_non_exhaustive()
    }
}
