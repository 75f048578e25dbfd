"""Append-only, fsynced journal of sealed batches (the shuffler's commit log).

File ``journal.log`` is a sequence of records::

    "SJR1" || body_length:u32 || SHA-256(body):32B || body (UTF-8 JSON)

A record is durable once :meth:`Journal.append` returns. The record is written through an unbuffered file
descriptor (an ``os.write`` loop) and ``fsync``ed. If the write or the fsync fails (disk full, I/O error),
the file is truncated back to where the record started and fsynced again, so a failed append leaves nothing
behind that could be committed later or make a later, acknowledged record look like a torn tail. If even the
rollback fails, the journal marks itself ``failed`` and refuses every further append (the service then goes
NOT_SERVING): an unknown tail must never be followed by an acknowledged record.

On open, records are read in order. Only a last record that is *physically incomplete* (shorter than its
header, or than the body length its header announces, with no complete checksum-valid record after it), or a
tail of zero bytes, is a torn tail from a crash during the append: it is cut off and reported in
``torn_bytes``. A complete record whose checksum fails, a bad header, or any damage followed by further data
(also a header whose damaged length reaches past later records) is corruption, and opening fails loudly
(:class:`JournalCorrupt`). So is a missing ``journal.log`` beside sealed outputs, or more than one output
without a commit record (a crash leaves at most one: commits are serialised), since records were lost.

Batch outputs live in ``batches/<batch_id>.out`` (written to a temporary name, fsynced, renamed, directory
fsynced) before their commit record is appended. An output file without a commit record is moved to
``quarantine/`` on open (never deleted: if it ever were an acknowledged batch, the operator can still recover
it), and leftover staging files are removed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import struct
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "Journal",
    "JournalCorrupt",
    "JournalFailed",
    "JournalWriteError",
    "fsync_dir",
    "read_records",
    "write_file_durably",
]

_MAGIC = b"SJR1"
_HEAD = struct.Struct(">4sI32s")
_MAX_RECORD = 256 * 1024 * 1024
log = logging.getLogger("shuffledp.shuffler.journal")


class JournalCorrupt(RuntimeError):
    """The journal has a damaged record; refusing to guess."""


class JournalWriteError(OSError):
    """An append failed and was rolled back: the journal is exactly as before the call. ``errno`` is the
    original error's."""


class JournalFailed(RuntimeError):
    """An append failed and could not be rolled back; the journal refuses all further appends."""


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and creations in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: link() errors of filesystems without hard links (vfat, exFAT, some FUSE and SMB mounts)
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK})
#: fsync() errors of directories on filesystems that do not sync directories (some FUSE, 9p, vboxsf mounts)
_NO_DIR_SYNC_ERRNOS = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def write_file_durably(
    path: str | os.PathLike[str], data: bytes, *, mode: int | None = None, overwrite: bool = True
) -> Path:
    """Create or replace ``path`` with ``data`` so that a crash leaves the old content or the new, never a mix.

    The data goes to a temporary file in the same directory (created 0600, then ``chmod mode`` if given), which
    is fsynced and renamed over ``path``; the directory is then fsynced (skipped, with a debug log, where the
    filesystem does not sync directories). With ``overwrite=False`` the temporary file is hard-linked to
    ``path`` instead: ``link`` fails if the name exists, so there is no window between a check and the rename
    in which another writer's file (a key, say) could be replaced. Where the filesystem has no hard links, the
    file is created with ``O_CREAT | O_EXCL`` and written in place: still never replacing anything, but a
    crash mid-write can leave it short. The parent directory is created if missing. Returns ``path``.

    Raises :class:`FileExistsError` (``filename`` = ``path``) if ``overwrite`` is false and ``path`` exists.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    linked = True
    try:
        _write_synced(fd, data, mode)
        if overwrite:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise FileExistsError(errno.EEXIST, "exists; not overwritten", str(target)) from None
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS:
                    raise
                linked = False
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not linked:
        _create_exclusive(target, data, 0o600 if mode is None else mode)
    try:
        fsync_dir(target.parent)
    except OSError as exc:
        if exc.errno not in _NO_DIR_SYNC_ERRNOS:
            raise
        log.debug("write_file_durably: the filesystem of %s does not sync directories", target.parent)
    return target


def _write_synced(fd: int, data: bytes, mode: int | None) -> None:
    """Set ``mode`` (if given; a creation mode is masked by the umask), write ``data``, fsync, close ``fd``."""
    with os.fdopen(fd, "wb") as fh:
        if mode is not None:
            os.fchmod(fh.fileno(), mode)
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _create_exclusive(target: Path, data: bytes, mode: int) -> None:
    """``write_file_durably(overwrite=False)`` without hard links: create ``target`` exclusively and write it."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "exists; not overwritten", str(target)) from None
    try:
        _write_synced(fd, data, mode)
    except BaseException:
        target.unlink(missing_ok=True)
        raise


def _is_torn_tail(data: bytes, start: int) -> bool:
    """True if ``data[start:]`` can be the remains of an interrupted append."""
    tail = data[start:]
    if len(tail) < _HEAD.size:
        return _MAGIC.startswith(tail[:4]) or not tail.strip(b"\0")
    magic, length, _ = _HEAD.unpack_from(tail, 0)
    if magic != _MAGIC:
        return not tail.strip(b"\0")  # a file extended with zeros by the filesystem after a crash
    # a complete header with a plausible length, and fewer bytes than it announces: an interrupted append, unless
    # a complete, checksum-valid record follows (then the header was damaged, e.g. a flipped bit in its length,
    # and cutting there would erase acknowledged records)
    return length <= _MAX_RECORD and _HEAD.size + length > len(tail) and _no_record_after(data, start + 4)


def _no_record_after(data: bytes, start: int) -> bool:
    """True if no complete record with a matching checksum starts at or after ``start`` (a torn append is a prefix
    of one record, so it holds none)."""
    pos = data.find(_MAGIC, start)
    while pos >= 0:
        if len(data) - pos >= _HEAD.size:
            _, length, digest = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if end <= len(data) and hashlib.sha256(data[pos + _HEAD.size : end]).digest() == digest:
                return False
        pos = data.find(_MAGIC, pos + 1)
    return True



def read_records(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int | None]:
    """The journal's complete records, in order, and the byte offset of a torn tail (None if there is none).

    Reads only: it never truncates, moves or creates anything, so an auditor may run it on the journal of a
    live shuffler (``shuffledp shuffler journal``). A torn tail is what :class:`Journal` would cut off on open
    (see the module docstring); any other damage raises :class:`JournalCorrupt`.
    """
    path = Path(path)
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < _HEAD.size:
            bad = "incomplete header"
        else:
            magic, length, digest = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if magic != _MAGIC or length > _MAX_RECORD:
                bad = "bad record header"
            elif end > len(data):
                bad = "incomplete body"
            else:
                body = data[pos + _HEAD.size : end]
                if hashlib.sha256(body).digest() != digest:
                    # a complete record cannot be the remains of an interrupted append
                    more = " with further data after it" if end < len(data) else " (the last record)"
                    raise JournalCorrupt(f"{path}: checksum mismatch in the complete record at byte {pos}{more}")
                records.append(json.loads(body))
                pos = end
                continue
        # A damaged record is acceptable only as the very last thing in the file (a torn append).
        if not _is_torn_tail(data, pos):
            raise JournalCorrupt(f"{path}: {bad} at byte {pos} and it is not a torn tail (further data)")
        return records, pos
    return records, None


class Journal:
    """The commit log. ``records`` holds the bodies (dicts) recovered at open, in order; appended records are
    written, not kept (the reader loads ``records`` once, then may clear them)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.batches_dir = self.dir / "batches"
        self.staging_dir = self.dir / "staging"
        self.quarantine_dir = self.dir / "quarantine"
        for d in (self.dir, self.batches_dir, self.staging_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        self.path = self.dir / "journal.log"
        self.torn_bytes = 0
        self.failed = False
        self.quarantined: list[str] = []
        self.records: list[dict[str, Any]] = self._recover()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size
        self._clean_orphans()

    def _recover(self) -> list[dict[str, Any]]:
        # sealed outputs are named <batch id>.out (shuffledp.shuffler.core); other names are leftovers, quarantined too
        outputs = {p.name for p in self.batches_dir.iterdir()
                   if p.name.endswith(".out") and not p.name.startswith(".")}
        if not self.path.exists():
            if outputs:
                raise JournalCorrupt(
                    f"{self.path} is missing but {self.batches_dir} holds {len(outputs)} sealed output(s): refusing "
                    "to start with an empty journal, which would forget their bindings, replay cache and release "
                    "records: restore the journal (only a new key epoch may start from an empty one)"
                )
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.fsync(fd)
            os.close(fd)
            fsync_dir(self.dir)
            return []
        records, torn_at = read_records(self.path)
        # Commits are serialised (the output is renamed into batches/, then its record appended, under one lock,
        # and a failed journal stops all commits), and every start moves outputs without a record to quarantine/.
        # So a crash leaves at most one output without a record: more means records were lost (a journal cut at
        # a record boundary or restored from an older copy). Checked before a torn tail is cut off.
        orphans = outputs - {r["output"] for r in records if r.get("type") == "batch"}
        if len(orphans) > 1:
            raise JournalCorrupt(
                f"{self.batches_dir} holds {len(orphans)} sealed outputs without a commit record in {self.path}; a "
                "crash leaves at most one, so records were probably lost (a truncated or older journal): refusing "
                "to start. Restore the journal if you can. Do not start over with an empty journal in this key "
                "epoch (its bindings and replay cache would be forgotten); if you know why the outputs lack a "
                f"record, move them to {self.quarantine_dir} by hand"
            )
        if torn_at is not None:
            self.torn_bytes = self.path.stat().st_size - torn_at
            log.warning("journal: ignoring a torn tail of %d bytes", self.torn_bytes)
            with open(self.path, "r+b") as fh:
                fh.truncate(torn_at)
                fh.flush()
                os.fsync(fh.fileno())
        return records

    def _clean_orphans(self) -> None:
        """Quarantine outputs without a commit record (never delete them); remove staging files."""
        committed = {r["output"] for r in self.records if r.get("type") == "batch"}
        moved = False
        for p in self.batches_dir.iterdir():
            if p.name not in committed:
                dest = self.quarantine_dir / f"{p.name}.{secrets.token_hex(4)}"
                os.replace(p, dest)
                self.quarantined.append(dest.name)
                moved = True
        if moved:
            fsync_dir(self.quarantine_dir)
            fsync_dir(self.batches_dir)
            log.warning("journal: moved %d output file(s) without a commit record to quarantine/",
                        len(self.quarantined))
        for p in self.staging_dir.iterdir():
            p.unlink()

    def append(self, record: dict[str, Any]) -> None:
        """Append one record and fsync it; durable when this returns.

        Raises :class:`JournalWriteError` if the append failed and was rolled back (nothing of it remains), or
        :class:`JournalFailed` if the rollback failed too or the journal had already failed.
        """
        if self.failed:
            raise JournalFailed("the journal failed earlier and refuses further appends")
        body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        if len(body) > _MAX_RECORD:
            raise ValueError(f"journal record of {len(body)} bytes exceeds {_MAX_RECORD}")
        head = _HEAD.pack(_MAGIC, len(body), hashlib.sha256(body).digest())
        start = self._size
        try:
            for part in (head, body):  # two writes, not one joined copy of a record that may be tens of MB
                data = memoryview(part)
                written = 0
                while written < len(data):
                    n = os.write(self._fd, data[written:])
                    if n <= 0:
                        raise OSError(errno.ENOSPC, "write made no progress")
                    written += n
            os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)
                os.fsync(self._fd)
            except OSError as exc2:
                self.failed = True
                log.error("journal: an append failed (%s) and its rollback failed too (%s); refusing all "
                          "further appends", exc.strerror, exc2.strerror)
                raise JournalFailed(
                    f"journal append failed ({exc.strerror}) and could not be rolled back ({exc2.strerror})"
                ) from exc
            log.error("journal: an append failed and was rolled back (%s)", exc.strerror)
            raise JournalWriteError(exc.errno, f"journal append failed and was rolled back: {exc.strerror}") from exc
        self._size = start + len(head) + len(body)  # not kept in memory: ``records`` are the recovered ones

    def close(self) -> None:
        """Close the journal's file descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
