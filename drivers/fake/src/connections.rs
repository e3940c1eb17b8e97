//! The fake's connection hook: lets a `drop_connection` fault cut the connection of the call it
//! fires on, so callers can be tested against a connection lost mid-call. Registered with
//! [`driver_sdk::DriverServer::with_connection_hook`]; production drivers have nothing like it.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use driver_sdk::{BoxedConnection, ConnectionData};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A connection's cut switch, as calls find it in their `RequestContext`.
#[derive(Debug, Default)]
pub struct Cut(AtomicBool);

impl Cut {
    /// Cuts the connection: its next read or write fails.
    pub fn cut(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn is_cut(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The hook: wraps every accepted connection so that it can be cut.
pub fn cuttable(io: BoxedConnection) -> (BoxedConnection, ConnectionData) {
    let cut = Arc::new(Cut::default());
    (Box::new(Cuttable { io, cut: cut.clone() }), cut)
}

struct Cuttable {
    io: BoxedConnection,
    cut: Arc<Cut>,
}

fn cut_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "connection dropped by fault injection")
}

impl AsyncRead for Cuttable {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.cut.is_cut() {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Cuttable {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.cut.is_cut() {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.cut.is_cut() {
            return Poll::Ready(Err(cut_error()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
