"""Append-only, fsynced journal of sealed batches (the shuffler's commit log).

File ``journal.log`` is a sequence of records::

    "SJR1" || body_length:u32 || SHA-256(body):32B || body (UTF-8 JSON)

A record is durable once :meth:`Journal.append` returns (write, flush, ``fsync``). On open, records are read
in order; a final record that is incomplete or fails its checksum is a torn tail from a crash during the
append: it is cut off (the file is truncated to the last good record) and reported in ``torn_bytes``. A bad
record followed by further data is corruption, not a torn tail, and opening fails loudly.

Batch outputs live in ``batches/<batch_id>.out`` (written to a temporary name, fsynced, renamed, directory
fsynced) before their commit record is appended; an output file without a commit record is an orphan from a
crash and is deleted on open, as are leftover staging files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

__all__ = ["Journal", "JournalCorrupt", "fsync_dir"]

_MAGIC = b"SJR1"
_HEAD = struct.Struct(">4sI32s")
_MAX_RECORD = 256 * 1024 * 1024
log = logging.getLogger("shuffler.journal")


class JournalCorrupt(RuntimeError):
    """The journal has a damaged record before its end; refusing to guess."""


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and creations in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """The commit log. ``records`` holds the recovered bodies (dicts), in order."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.batches_dir = self.dir / "batches"
        self.staging_dir = self.dir / "staging"
        for d in (self.dir, self.batches_dir, self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        self.path = self.dir / "journal.log"
        self.torn_bytes = 0
        self.records: list[dict[str, Any]] = self._recover()
        self._fh = open(self.path, "ab")
        self._clean_orphans()

    def _recover(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)
            os.fsync(fd)
            os.close(fd)
            fsync_dir(self.dir)
            return []
        data = self.path.read_bytes()
        records: list[dict[str, Any]] = []
        pos = 0
        while pos < len(data):
            start = pos
            bad: str | None = None
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
                        bad = "checksum mismatch"
                    else:
                        records.append(json.loads(body))
                        pos = end
                        continue
            # A damaged record is acceptable only as the very last thing in the file (a torn append).
            if not self._is_torn_tail(data, start):
                raise JournalCorrupt(f"{self.path}: {bad} at byte {start} with further data after it")
            self.torn_bytes = len(data) - start
            log.warning("journal: ignoring a torn tail of %d bytes (%s)", self.torn_bytes, bad)
            with open(self.path, "r+b") as fh:
                fh.truncate(start)
                fh.flush()
                os.fsync(fh.fileno())
            break
        return records

    @staticmethod
    def _is_torn_tail(data: bytes, start: int) -> bool:
        """True if ``data[start:]`` can be the remains of an interrupted append."""
        tail = data[start:]
        if len(tail) < _HEAD.size:
            return _MAGIC.startswith(tail[:4]) or not tail.strip(b"\0")
        magic, length, _ = _HEAD.unpack_from(tail, 0)
        if magic != _MAGIC:
            return not tail.strip(b"\0")  # a file extended with zeros by the filesystem after a crash
        return _HEAD.size + length >= len(tail)

    def _clean_orphans(self) -> None:
        committed = {r["output"] for r in self.records if r.get("type") == "batch"}
        for p in self.batches_dir.iterdir():
            if p.name not in committed:
                p.unlink()
        for p in self.staging_dir.iterdir():
            p.unlink()

    def append(self, record: dict[str, Any]) -> None:
        """Append one record and fsync it; durable when this returns."""
        body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        if len(body) > _MAX_RECORD:
            raise ValueError(f"journal record of {len(body)} bytes exceeds {_MAX_RECORD}")
        self._fh.write(_HEAD.pack(_MAGIC, len(body), hashlib.sha256(body).digest()) + body)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.records.append(record)

    def close(self) -> None:
        self._fh.close()
