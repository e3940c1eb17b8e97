//! Accepted connections: the IO a connection hook wraps, the data it attaches, and how that
//! data travels from the connection to each call's [`RequestContext`](crate::RequestContext).
//!
//! A leaf module: the server ([`crate::DriverServer`]) produces these, the layer and the request
//! context consume them, and none of them needs the others for it.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The IO of an accepted connection, as a [connection hook](crate::DriverServer::with_connection_hook)
/// gets and returns it.
pub trait ConnectionIo: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> ConnectionIo for T {}

/// A boxed [`ConnectionIo`].
pub type BoxedConnection = Box<dyn ConnectionIo>;

/// What a connection hook attaches to a connection; each call on it reads it back with
/// [`RequestContext::connection`](crate::RequestContext::connection).
pub type ConnectionData = Arc<dyn std::any::Any + Send + Sync>;

pub(crate) type ConnectionHook = Arc<dyn Fn(BoxedConnection) -> (BoxedConnection, ConnectionData) + Send + Sync>;

/// An accepted connection: as it came, or as the driver's connection hook wrapped it.
pub(crate) enum Conn<IO> {
    Plain(IO),
    Hooked(BoxedConnection, ConnectionData),
}

impl<IO: ConnectionIo> Conn<IO> {
    pub(crate) fn new(io: IO, hook: Option<&ConnectionHook>) -> Self {
        match hook {
            None => Conn::Plain(io),
            Some(hook) => {
                let (io, data) = hook(Box::new(io));
                Conn::Hooked(io, data)
            }
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Conn<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_read(cx, buf),
            Conn::Hooked(io, _) => Pin::new(io).poll_read(cx, buf),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Conn<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_write(cx, buf),
            Conn::Hooked(io, _) => Pin::new(io).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_flush(cx),
            Conn::Hooked(io, _) => Pin::new(io).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_shutdown(cx),
            Conn::Hooked(io, _) => Pin::new(io).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_write_vectored(cx, bufs),
            Conn::Hooked(io, _) => Pin::new(io).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(io) => io.is_write_vectored(),
            Conn::Hooked(io, _) => io.is_write_vectored(),
        }
    }
}

impl<IO: Send + 'static> Connected for Conn<IO> {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Conn::Plain(_) => ConnectionInfo(None),
            Conn::Hooked(_, data) => ConnectionInfo(Some(data.clone())),
        }
    }
}

/// The data a connection hook attached to the caller's connection.
#[derive(Clone)]
pub(crate) struct Connection(pub(crate) ConnectionData);

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connection(..)")
    }
}

/// The data the connection hook attached to the connection `req` came on (plain or TLS).
pub(crate) fn connection_data<B>(req: &Request<B>) -> Option<ConnectionData> {
    let ext = req.extensions();
    ext.get::<ConnectionInfo>()
        .or_else(|| ext.get::<tonic::transport::server::TlsConnectInfo<ConnectionInfo>>().map(|t| t.get_ref()))
        .and_then(|c| c.0.clone())
}

/// What the server knows of a call's connection: the data its connection hook attached.
#[derive(Clone)]
pub(crate) struct ConnectionInfo(pub(crate) Option<ConnectionData>);
