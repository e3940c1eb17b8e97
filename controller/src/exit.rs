//! How a command of the `machine-controller` binary ends when it fails: the message printed to
//! stderr and the process's exit code. Shared by the CLI ([`crate::cli`]) and the demo
//! ([`crate::demo`]), which neither imports the other for it.

/// A failed command: the message to print and the exit code.
#[derive(Debug)]
pub struct Exit {
    /// Printed to stderr.
    pub message: String,
    /// Process exit code.
    pub code: u8,
}

impl Exit {
    /// A failure with exit code 1.
    pub fn fail(message: impl Into<String>) -> Self {
        Exit { message: message.into(), code: 1 }
    }
}

impl<E: std::error::Error + 'static> From<E> for Exit {
    fn from(e: E) -> Self {
        Exit { message: machine_driver_util::error_chain(&e), code: 1 }
    }
}
