"""Checkpoints of a run: model, optimizer state, accountant state and round number, saved atomically.

One interface, :class:`CheckpointStore`, with two implementations in the style of Flower's state factories
(an in-memory one for tests and a durable SQLite one for real runs):

* :meth:`CheckpointStore.save` replaces the checkpoint in one transaction: after a crash either the old or the
  new checkpoint is there, never a mixture (SQLite, WAL journal, ``synchronous=FULL``).
* :meth:`CheckpointStore.mark_started` durably records that a round id has been *used* (messages were sent for
  it) before anything else happens in that round. A resumed run never reuses a round id: a client caches the
  sealed report of a round and the shuffler refuses a binding it has already seen, so reusing an id would fail
  or, worse, release the same reports twice.

How a resumed run reconciles the checkpoint with the privacy ledger is
:meth:`shuffledp.server.rounds.RoundEngine.restore`'s job; this module only stores bytes reliably.
"""

from __future__ import annotations

import copy
import io
import json
import os
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "InMemoryCheckpointStore",
    "SqliteCheckpointStore",
    "arrays_to_bytes",
    "arrays_from_bytes",
]

_FORMAT = "shuffledp.checkpoint"
_VERSION = 1


class CheckpointError(RuntimeError):
    """The checkpoint store is unreadable, of another format, or inconsistent."""


def arrays_to_bytes(arrays: Sequence[np.ndarray]) -> bytes:
    """Serialise a list of arrays losslessly (npz, no pickle)."""
    buffer = io.BytesIO()
    np.savez(buffer, *[np.asarray(a) for a in arrays])
    return buffer.getvalue()


def arrays_from_bytes(data: bytes) -> list[np.ndarray]:
    """Inverse of :func:`arrays_to_bytes` (refuses pickled objects)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


@dataclass
class Checkpoint:
    """Everything needed to continue a run after the round ``round`` has finished.

    Attributes:
        round: the last round id the run has used (applied, skipped, charged but lost, or started and abandoned,
            as reconciled by ``RoundEngine.restore``); 0 before the first round.
        arrays: the model's parameters, in the model's order.
        optimizer: the server optimizer's scalars (:meth:`shuffledp.server.optim.ServerOptimizer.state_dict`).
        optimizer_buffers: the optimizer's arrays (momentum / Adam moments).
        accountant: ``ShuffleAccountant.state_dict()``, JSON-safe.
        history: one JSON-safe dict per round (the rows of report.json, and skipped rounds).
        config: the run's configuration (kebab-case keys), to refuse resuming with incompatible settings.
        budget_changes: one ``{"after_round", "from", "to"}`` per resume that changed ``budget-epsilon``, oldest
            first (absent from checkpoints written before it existed: read as none).
    """

    round: int
    arrays: list[np.ndarray]
    optimizer: dict[str, Any]
    optimizer_buffers: list[np.ndarray]
    accountant: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    budget_changes: list[dict[str, Any]] = field(default_factory=list)

    def meta_json(self) -> str:
        """The metadata as JSON (everything but the arrays), with the format and version tags; NaN or infinity raise."""
        return json.dumps(
            {
                "format": _FORMAT,
                "version": _VERSION,
                "round": self.round,
                "n_arrays": len(self.arrays),
                "optimizer": self.optimizer,
                "accountant": self.accountant,
                "history": self.history,
                "config": self.config,
                "budget_changes": self.budget_changes,
            },
            allow_nan=False,
        )

    @classmethod
    def from_parts(cls, meta_text: str, blob: bytes) -> Checkpoint:
        """Rebuild a checkpoint from :meth:`meta_json` text and the ``arrays_to_bytes`` blob of its arrays.

        Args:
            meta_text: the metadata JSON.
            blob: the model's arrays followed by the optimizer's buffers.

        Returns:
            The checkpoint.

        Raises:
            CheckpointError: the text is not checkpoint metadata of this version, or the blob or metadata is corrupt.
        """
        try:
            meta = json.loads(meta_text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"checkpoint metadata is not valid JSON: {exc}") from None
        if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise CheckpointError(
                f"not a shuffledp checkpoint of version {_VERSION} (format {meta.get('format')!r}, "
                f"version {meta.get('version')!r})"
            )
        try:
            arrays = arrays_from_bytes(blob)
            n_model = int(meta["n_arrays"])
            if len(arrays) < n_model:
                raise CheckpointError(f"checkpoint holds {len(arrays)} arrays, its metadata promises {n_model}+")
            return cls(
                round=int(meta["round"]),
                arrays=arrays[:n_model],
                optimizer=meta["optimizer"],
                optimizer_buffers=arrays[n_model:],
                accountant=meta["accountant"],
                history=list(meta["history"]),
                config=dict(meta["config"]),
                budget_changes=[dict(c) for c in meta.get("budget_changes", [])],
            )
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, OSError, EOFError) as exc:  # a corrupt blob or metadata
            raise CheckpointError(f"the checkpoint is corrupt: {type(exc).__name__}: {exc}") from None


class CheckpointStore(ABC):
    """Where a run keeps its latest checkpoint and the highest round id it has started."""

    @abstractmethod
    def save(self, checkpoint: Checkpoint) -> None:
        """Atomically replace the stored checkpoint with ``checkpoint``."""

    @abstractmethod
    def load(self) -> Checkpoint | None:
        """Return the stored checkpoint, or None if none was ever saved."""

    @abstractmethod
    def mark_started(self, round_id: int) -> None:
        """Durably record that ``round_id`` has been used (before messages of that round are sent)."""

    @abstractmethod
    def last_started(self) -> int:
        """The highest round id passed to :meth:`mark_started` (0 if none)."""

    @abstractmethod
    def record_bad_reports(self, round_id: int, n_bad: int) -> None:
        """Durably record how many of a charged round's released reports failed to open or decode, as soon as
        they are opened (before the model update), so that a round lost in a crash keeps its count on resume."""

    @abstractmethod
    def bad_reports(self) -> dict[int, int]:
        """Every count passed to :meth:`record_bad_reports`, by round id."""

    def close(self) -> None:  # noqa: B027 - optional for stores without resources
        """Release resources (no-op by default)."""


class InMemoryCheckpointStore(CheckpointStore):
    """A store that lives as long as the object (tests, dry runs). Saves are deep copies."""

    def __init__(self) -> None:
        self._checkpoint: Checkpoint | None = None
        self._started = 0
        self._bad: dict[int, int] = {}

    def save(self, checkpoint: Checkpoint) -> None:
        """Keep a copy of ``checkpoint``, made through the same serialisation as the SQLite store."""
        if checkpoint.round < 0:
            raise CheckpointError(f"checkpoint round must be >= 0, got {checkpoint.round}")
        # serialise through the same code path as SQLite so unserialisable state fails here too
        meta, blob = checkpoint.meta_json(), arrays_to_bytes(checkpoint.arrays + checkpoint.optimizer_buffers)
        self._checkpoint = Checkpoint.from_parts(meta, blob)
        self._started = max(self._started, checkpoint.round)

    def load(self) -> Checkpoint | None:
        """A deep copy of the saved checkpoint, or None."""
        return copy.deepcopy(self._checkpoint)

    def mark_started(self, round_id: int) -> None:
        """Raise the highest started round id to ``round_id``."""
        self._started = max(self._started, int(round_id))

    def last_started(self) -> int:
        """The highest round id started or saved (0 if none)."""
        return self._started

    def record_bad_reports(self, round_id: int, n_bad: int) -> None:
        """Record ``n_bad`` for ``round_id``, replacing an earlier count."""
        self._bad[int(round_id)] = int(n_bad)

    def bad_reports(self) -> dict[int, int]:
        """A copy of the recorded counts, by round id."""
        return dict(self._bad)


class SqliteCheckpointStore(CheckpointStore):
    """A durable store in one SQLite file (WAL, ``synchronous=FULL``; each save is one transaction).

    Args:
        path: the database file; created with its schema if missing.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
        try:
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = FULL")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS checkpoint ("
                " slot INTEGER PRIMARY KEY CHECK (slot = 1),"
                " round INTEGER NOT NULL CHECK (round >= 0),"
                " meta TEXT NOT NULL,"
                " arrays BLOB NOT NULL)"
            )
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS progress (key TEXT PRIMARY KEY, value INTEGER NOT NULL)"
            )
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise CheckpointError(f"{str(self.path)!r} is not a usable checkpoint database: {exc}") from None

    def save(self, checkpoint: Checkpoint) -> None:
        """Replace the checkpoint and raise the started round id to its round, in one transaction."""
        if checkpoint.round < 0:
            raise CheckpointError(f"checkpoint round must be >= 0, got {checkpoint.round}")
        meta = checkpoint.meta_json()
        blob = arrays_to_bytes(checkpoint.arrays + checkpoint.optimizer_buffers)
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "INSERT OR REPLACE INTO checkpoint(slot, round, meta, arrays) VALUES (1, ?, ?, ?)",
                (int(checkpoint.round), meta, sqlite3.Binary(blob)),
            )
            conn.execute(
                "INSERT INTO progress(key, value) VALUES ('started', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = MAX(value, excluded.value)",
                (int(checkpoint.round),),
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # after SQLITE_FULL or an I/O error SQLite has already rolled back
                conn.execute("ROLLBACK")
            raise

    def load(self) -> Checkpoint | None:
        """The saved checkpoint, or None; a row whose round disagrees with its metadata raises CheckpointError."""
        row = self._conn.execute("SELECT round, meta, arrays FROM checkpoint WHERE slot = 1").fetchone()
        if row is None:
            return None
        checkpoint = Checkpoint.from_parts(row[1], bytes(row[2]))
        if checkpoint.round != int(row[0]):
            raise CheckpointError(f"checkpoint row says round {row[0]}, its metadata says {checkpoint.round}")
        return checkpoint

    def mark_started(self, round_id: int) -> None:
        """Raise the highest started round id to ``round_id`` (autocommit, durable on return)."""
        self._conn.execute(
            "INSERT INTO progress(key, value) VALUES ('started', ?) "
            "ON CONFLICT(key) DO UPDATE SET value = MAX(value, excluded.value)",
            (int(round_id),),
        )

    def last_started(self) -> int:
        """The highest round id started or saved (0 if none)."""
        row = self._conn.execute("SELECT value FROM progress WHERE key = 'started'").fetchone()
        return 0 if row is None else int(row[0])

    def record_bad_reports(self, round_id: int, n_bad: int) -> None:
        """Record ``n_bad`` for ``round_id``, replacing an earlier count (autocommit, durable on return)."""
        self._conn.execute("INSERT OR REPLACE INTO progress(key, value) VALUES (?, ?)",
                           (f"bad-reports:{int(round_id)}", int(n_bad)))

    def bad_reports(self) -> dict[int, int]:
        """Every recorded count, by round id."""
        rows = self._conn.execute("SELECT key, value FROM progress WHERE key LIKE 'bad-reports:%'").fetchall()
        return {int(key.split(":", 1)[1]): int(value) for key, value in rows}

    def close(self) -> None:
        """Close the database connection."""
        self._conn.close()
