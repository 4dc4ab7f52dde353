//! Printing without panics: `outln!` / `out!` for stdout, `errln!` for stderr.
//!
//! `println!` panics when stdout is a closed pipe (`tessera inspect F | head -1`: Rust ignores
//! SIGPIPE, so the write fails with EPIPE). `outln!` instead ends the program quietly with
//! status 0, since the reader has all it wanted, after removing unfinished output files
//! ([`tessera_files::exit_removing_temporaries`]). Restoring SIGPIPE's default action would end
//! it quietly too, but killed by the signal: status 141, a failure under `set -o pipefail`, and
//! no cleanup. Any other stdout error (`> /dev/full`) is a message and status 1. `errln!` ignores
//! a stderr that cannot be written: there is nowhere left to say so, and the exit status still
//! tells.

use std::fmt;
use std::io::{self, ErrorKind, Write};

/// Writes `args` to stdout; see the module doc for a stdout that cannot be written.
pub fn stdout(args: fmt::Arguments<'_>) {
    let written = io::stdout().lock().write_fmt(args);
    if let Err(e) = written {
        if e.kind() == ErrorKind::BrokenPipe {
            tessera_files::exit_removing_temporaries(0);
        }
        stderr(format_args!("error: writing to stdout: {e}\n"));
        tessera_files::exit_removing_temporaries(1);
    }
}

/// Flushes stdout (streamed text without a newline yet); a closed pipe ends the program as
/// [`stdout`] does.
pub fn flush() {
    if let Err(e) = io::stdout().lock().flush() {
        if e.kind() == ErrorKind::BrokenPipe {
            tessera_files::exit_removing_temporaries(0);
        }
        stderr(format_args!("error: writing to stdout: {e}\n"));
        tessera_files::exit_removing_temporaries(1);
    }
}

/// Writes `args` to stderr, ignoring failure.
pub fn stderr(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// `print!` that never panics (`output::stdout`).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!($($arg)*))
    };
}

/// `println!` that never panics (`output::stdout`).
macro_rules! outln {
    () => {
        $crate::output::stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that never panics (`output::stderr`).
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}
