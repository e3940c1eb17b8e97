//! Where the server listens: a Unix socket (mode 0660, a stale socket removed, a live one
//! refused) or TCP (optionally under TLS); every accepted connection goes through the driver's
//! connection hook.

use std::io;
use std::path::Path;

use futures::{Stream, StreamExt};
use h2_authority::AuthorityRewrite;
use tokio::net::{TcpStream, UnixStream};

use super::error::ServeError;
use crate::connection::{Conn, ConnectionHook};

/// Listens on the Unix socket at `path` ([`bind_unix`]); connections get their `:authority`
/// rewritten ([`AuthorityRewrite`]).
///
/// # Errors
/// [`bind_unix`]'s.
pub(super) fn unix(
    path: &Path,
    hook: Option<ConnectionHook>,
    driver_name: &str,
) -> Result<impl Stream<Item = io::Result<Conn<AuthorityRewrite<UnixStream>>>>, ServeError> {
    let listener = bind_unix(path)?;
    tracing::info!(driver = %driver_name, "serving on unix://{}", path.display());
    Ok(tokio_stream::wrappers::UnixListenerStream::new(listener)
        .map(move |r| r.map(|s| Conn::new(AuthorityRewrite::new(s), hook.as_ref()))))
}

/// Listens on TCP at `addr` (`host:port`), with Nagle off.
///
/// # Errors
/// [`ServeError::Bind`].
pub(super) async fn tcp(
    addr: &str,
    hook: Option<ConnectionHook>,
    driver_name: &str,
) -> Result<impl Stream<Item = io::Result<Conn<TcpStream>>>, ServeError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { endpoint: format!("tcp://{addr}"), source })?;
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    tracing::info!(driver = %driver_name, "serving on tcp://{local}");
    Ok(tokio_stream::wrappers::TcpListenerStream::new(listener).map(move |r| {
        r.map(|s| {
            let _ = s.set_nodelay(true);
            Conn::new(s, hook.as_ref())
        })
    }))
}

/// The TLS configuration from PEM files; with `client_ca`, client certificates are required.
///
/// # Errors
/// [`ServeError::Tls`] when a file cannot be read.
pub(super) fn tls_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<tonic::transport::ServerTlsConfig, ServeError> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| ServeError::Tls(format!("reading {}: {e}", p.display()).into()));
    let identity = tonic::transport::Identity::from_pem(read(cert)?, read(key)?);
    let mut cfg = tonic::transport::ServerTlsConfig::new().identity(identity);
    if let Some(ca) = client_ca {
        cfg = cfg.client_ca_root(tonic::transport::Certificate::from_pem(read(ca)?));
    }
    Ok(cfg)
}

/// Binds a Unix socket: creates the parent folder, removes a stale socket, refuses to remove a
/// live one or a non-socket file, and sets mode 0660.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, ServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let bind_err = |source| ServeError::Bind { endpoint: format!("unix://{}", path.display()), source };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(bind_err)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ServeError::SocketInUse(path.to_path_buf()));
            }
            tracing::info!("removing stale socket {}", path.display());
            std::fs::remove_file(path).map_err(bind_err)?;
        }
        Ok(_) => return Err(ServeError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(bind_err)?;
    Ok(listener)
}
