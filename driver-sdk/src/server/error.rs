//! Why a server could not start or stopped.

use std::io;
use std::path::PathBuf;

use crate::endpoint::EndpointError;
use crate::token::KeyError;

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The endpoint string is malformed.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The token key is missing or unusable.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// Another process serves on the socket.
    #[error("another process is already serving on {0}")]
    SocketInUse(PathBuf),
    /// A non-socket file is where the socket should go.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// Binding or preparing the listener failed.
    #[error("listening on {endpoint}")]
    Bind {
        /// The gRPC endpoint (`unix:///path`, `tcp://host:port`) or the metrics listener
        /// (`http://host:port`).
        endpoint: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// TLS files could not be read or used.
    #[error("configuring TLS")]
    Tls(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The driver's provider-spec schema is not a valid JSON Schema draft 2020-12 schema or would
    /// be weaker than it reads (an unknown keyword, a reference outside it, …): see
    /// [`crate::schema`].
    #[error("the driver's provider_spec_schema is refused")]
    ProviderSpecSchema(#[source] crate::schema::SchemaError),
    /// The driver's name is not DNS-style or longer than 63 characters.
    #[error("driver name {0:?} must be 1 to 63 characters of letters, digits, '-' and '.'")]
    DriverName(String),
    /// TLS was asked for on a Unix socket.
    #[error("TLS is only supported on tcp:// endpoints")]
    TlsOnUnix,
    /// Building the reflection service failed.
    #[error("building the reflection service")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// The gRPC server failed.
    #[error("serving gRPC")]
    Transport(#[source] tonic::transport::Error),
}
