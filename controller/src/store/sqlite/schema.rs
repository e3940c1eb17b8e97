//! The store file's tables, and what every connection to it sets: WAL (switched on only where it
//! is not yet, so a second process can open a file another one writes to), the busy timeout,
//! the page cache. A file made by an older version gains what it lacks when it is opened.

use std::path::Path;
use std::time::Duration;

use rusqlite::Connection;

/// How long a connection waits for another process's lock (SQLite's busy timeout) before a
/// write fails as [`Error::Unavailable`](crate::store::Error::Unavailable): far longer than any
/// write transaction holds it.
pub(super) const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Each connection's page cache, as SQLite's `cache_size` takes it (negative: KiB). Reads come
/// from the in-memory cache of texts, so SQLite's pages serve only writes and the poller, and a
/// page missing here is read from the OS's page cache. SQLite's default, 2 MB, was 2–4 MB of
/// the controller's peak at 10,000 machines, and 256 KiB costs no measurable CPU at 10,000 or
/// 100,000 (`docs/src/reference/benchmarks-history.md`, "Fourth round").
pub(super) const CONNECTION_CACHE_KIB: i64 = -256;

/// A connection to the store file at `path`, its tables made where they are missing.
pub(super) fn connect(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    // Switching to WAL needs an exclusive lock; only do it when the file is not WAL yet, so a
    // second process (the CLI) can open the store while `run` writes to it.
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        conn.pragma_update(None, "journal_mode", "WAL")?;
    }
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "cache_size", CONNECTION_CACHE_KIB)?;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS objects(
            kind TEXT NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL,
            rv INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY(kind, namespace, name));
         CREATE INDEX IF NOT EXISTS objects_rv ON objects(rv);
         CREATE TABLE IF NOT EXISTS tombstones(
            kind TEXT NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL,
            rv INTEGER NOT NULL, owner TEXT, PRIMARY KEY(kind, namespace, name));
         CREATE TABLE IF NOT EXISTS counter(id INTEGER PRIMARY KEY CHECK (id = 0), rv INTEGER NOT NULL);
         INSERT OR IGNORE INTO counter(id, rv) VALUES (0, 0);
         CREATE TABLE IF NOT EXISTS events(
            id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT, namespace TEXT, name TEXT,
            type TEXT, reason TEXT, message TEXT, time TEXT, count INTEGER NOT NULL DEFAULT 1);
         CREATE INDEX IF NOT EXISTS events_object ON events(kind, namespace, name);",
    )?;
    add_event_counts(&conn)?;
    Ok(conn)
}

/// Gives a store made before event series its `count` column (each old row one event).
fn add_event_counts(conn: &Connection) -> rusqlite::Result<()> {
    let has: bool =
        conn.query_row("SELECT COUNT(*) > 0 FROM pragma_table_info('events') WHERE name = 'count'", [], |r| r.get(0))?;
    if has {
        return Ok(());
    }
    match conn.execute_batch("ALTER TABLE events ADD COLUMN count INTEGER NOT NULL DEFAULT 1") {
        // Another process opening the file at the same moment added it first.
        Err(e) if e.to_string().contains("duplicate column") => Ok(()),
        other => other,
    }
}
