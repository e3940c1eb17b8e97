//! # h2-authority
//!
//! Lets every gRPC client stack call an HTTP/2 server over a Unix socket, whatever it sends as
//! `:authority`: [`AuthorityRewrite`] wraps an accepted connection's IO and re-encodes every
//! inbound header block with `:authority` replaced by [`AUTHORITY`] (see the [`AuthorityRewrite`]
//! docs for why and how). It carries its own small HPACK decoder and plain-literal encoder.
//!
//! With the `fuzzing` feature, the hidden `fuzzing` module exposes the checks of the
//! `hpack_decode` and `authority_reencode` fuzz targets in `fuzz/`; `cargo test -p h2-authority`
//! replays their seeds and regressions.

#![warn(missing_docs)]

mod authority;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod hpack;

pub use authority::{AuthorityRewrite, AUTHORITY};
