"""The ledger's files on disk: read-only opening, SQLite's side files, and atomic exports.

:mod:`shuffledp.accounting.ledger` uses these; they are separate so that the ledger module holds the ledger's
logic (schema setup, append, read) and this one what touches files.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import urllib.parse
from pathlib import Path

from shuffledp.accounting.ledger_schema import LedgerError

__all__ = ["atomic_write", "connect_read_only", "release_side_files", "side_files"]


def _uri(path: Path, mode: str) -> str:
    """A ``file:`` URI for ``path`` (quoted as bytes, so any file name works) with SQLite's ``mode``."""
    return "file:" + urllib.parse.quote(os.fsencode(path.resolve())) + f"?mode={mode}"


def side_files(path: Path) -> tuple[Path, Path]:
    """Return the write-ahead log and its shared-memory index, SQLite's side files of the WAL database ``path``.

    Args:
        path: the database file.

    Returns:
        ``(path-wal, path-shm)``.
    """
    return path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


def connect_read_only(path: Path) -> sqlite3.Connection:
    """Open ``path`` with SQLite's ``mode=ro``.

    Every committed round is read, including those still in the write-ahead log, and SQLite refuses every write
    through the connection.

    Why not ``immutable=1``, which would need no side files: it tells SQLite the file cannot change, so SQLite
    takes no lock and ignores the log. That holds only while no writer runs, and ``shuffledp ledger show`` is meant
    to be run beside a running server: a round still in the log would be missed, and a checkpoint writing the file
    during the read could show a torn state. So ``mode=ro`` it is. SQLite needs the ``-wal`` and ``-shm`` files
    next to the ledger for it and creates them (owned by the reader) if they are missing; the ledger file itself
    is not changed, and :func:`release_side_files` removes them again when that is safe.

    Args:
        path: the ledger file.

    Returns:
        The open connection (autocommit; transactions are explicit).

    Raises:
        LedgerError: the reader cannot write the directory, which SQLite needs for the side files (read a copy).
        sqlite3.Error: any other failure to open or read.
    """
    conn = sqlite3.connect(_uri(path, "ro"), uri=True, isolation_level=None, timeout=30.0)
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as exc:
        conn.close()
        if "readonly" in str(exc) or "unable to open" in str(exc):
            raise LedgerError(
                f"cannot read the ledger {str(path)!r} read-only ({exc}): SQLite needs write access to its "
                "directory for the side files of a WAL database (or to roll back a crashed write): copy the "
                "ledger with any -wal or -journal file beside it to a directory you can write, and read the copy "
                "(a writable open of the copy rolls a crashed write back)"
            ) from None
        raise
    return conn


def release_side_files(path: Path) -> None:
    """Remove the ``-wal``/``-shm`` files of ``path`` if (and only if) no connection uses them.

    Called after a read-only look that created them: a ``mode=ro`` connection cannot checkpoint, so SQLite leaves
    the side files behind when it closes. Deleting them by hand would be unsafe: a writer that opened the ledger
    meanwhile uses them, and would go on writing to an unlinked log. So the decision is SQLite's own: a short-lived
    connection opens the ledger without ``mode=ro`` (with ``query_only``: it runs no write statement), reads the
    schema, and closes. The last connection to a WAL database to close runs a checkpoint and removes the side
    files, and SQLite does so only when it gets an exclusive lock on the database, that is when no other
    connection, in any process, has it open. The checkpoint copies nothing unless a writer committed rounds
    while we read and could not checkpoint them itself; then it is the checkpoint any later open would run.
    Best effort: if the user cannot write the ledger or its directory, or SQLite fails, the side files stay (as
    they would have without this step).

    Args:
        path: the ledger file.
    """
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        return
    try:
        conn = sqlite3.connect(_uri(path, "rw"), uri=True, isolation_level=None, timeout=30.0)
        try:
            conn.execute("PRAGMA query_only = ON")
            conn.execute("PRAGMA synchronous = FULL")  # the checkpoint, if it has frames to copy, is durable
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        pass


def atomic_write(target: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``target``, fsync it, and rename it over ``target``.

    Args:
        target: the file to write.
        text: its whole content (UTF-8).

    Raises:
        LedgerError: the directory of ``target`` does not exist.
    """
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise LedgerError(f"cannot write {str(target)!r}: the directory {str(directory)!r} does not exist")
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", newline="", dir=directory, prefix=f".{target.name}.", delete=False
    ) as handle:
        try:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        except BaseException:
            handle.close()
            os.unlink(handle.name)
            raise
    os.replace(handle.name, target)
