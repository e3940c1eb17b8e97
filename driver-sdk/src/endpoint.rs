//! Endpoints: `unix:///path.sock` or `tcp://host:port`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Where a driver listens / a client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix domain socket path.
    Unix(PathBuf),
    /// `host:port`.
    Tcp(String),
}

/// Why an endpoint string was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("invalid endpoint {input:?}: {why} (expected unix:///path/to/driver.sock or tcp://host:port)")]
pub struct EndpointError {
    input: String,
    why: &'static str,
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why| EndpointError { input: s.to_string(), why };
        if let Some(path) = s.strip_prefix("unix://") {
            if path.is_empty() {
                return Err(err("the socket path is empty"));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if let Some(addr) = s.strip_prefix("tcp://") {
            let (host, port) = addr.rsplit_once(':').ok_or_else(|| err("missing :port"))?;
            if host.is_empty() {
                return Err(err("missing host"));
            }
            port.parse::<u16>().map_err(|_| err("the port is not a number from 0 to 65535"))?;
            return Ok(Endpoint::Tcp(addr.to_string()));
        }
        Err(err("unknown scheme"))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp://{a}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_schemes() {
        assert_eq!("unix:///run/d.sock".parse(), Ok(Endpoint::Unix("/run/d.sock".into())));
        assert_eq!("unix://rel.sock".parse(), Ok(Endpoint::Unix("rel.sock".into())));
        assert_eq!("tcp://127.0.0.1:9000".parse(), Ok(Endpoint::Tcp("127.0.0.1:9000".into())));
        assert_eq!("tcp://[::1]:9000".parse(), Ok(Endpoint::Tcp("[::1]:9000".into())));
        assert_eq!(Endpoint::Unix("/a".into()).to_string(), "unix:///a");
    }

    #[test]
    fn refuses_bad_endpoints_with_a_hint() {
        for bad in ["", "/tmp/x.sock", "unix://", "tcp://host", "tcp://:80", "tcp://h:99999", "http://x:1"] {
            let e = bad.parse::<Endpoint>().unwrap_err();
            assert!(e.to_string().contains("unix:///"), "{e}");
        }
    }
}
