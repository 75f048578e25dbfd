"""Checkpoint stores: in-memory and SQLite behave the same; saves are atomic replacements."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from shuffledp.server.state import (
    Checkpoint,
    CheckpointError,
    InMemoryCheckpointStore,
    SqliteCheckpointStore,
    arrays_to_bytes,
)


def _ckpt(round_: int) -> Checkpoint:
    return Checkpoint(
        round=round_,
        arrays=[np.full((2, 3), round_, dtype=np.float32), np.arange(3, dtype=np.float64)],
        optimizer={"kind": "momentum", "steps": round_},
        optimizer_buffers=[np.ones(9) * round_],
        accountant={"rounds": [{"n": 10, "eps0": 1.0}] * round_},
        history=[{"round": r, "status": "applied"} for r in range(1, round_ + 1)],
        config={"eps0": 1.0},
    )


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    s = InMemoryCheckpointStore() if request.param == "memory" else SqliteCheckpointStore(tmp_path / "state.sqlite")
    yield s
    s.close()


def test_empty_store(store) -> None:
    assert store.load() is None
    assert store.last_started() == 0


def test_save_load_round_trip(store) -> None:
    store.save(_ckpt(2))
    store.save(_ckpt(3))
    got = store.load()
    assert got is not None and got.round == 3
    np.testing.assert_array_equal(got.arrays[0], np.full((2, 3), 3, dtype=np.float32))
    assert got.arrays[0].dtype == np.float32 and len(got.arrays) == 2
    np.testing.assert_array_equal(got.optimizer_buffers[0], np.ones(9) * 3)
    assert got.accountant == _ckpt(3).accountant
    assert [h["round"] for h in got.history] == [1, 2, 3]
    assert store.last_started() == 3  # a checkpoint of round r implies r was started


def test_mark_started_is_monotone(store) -> None:
    store.mark_started(5)
    store.mark_started(4)
    assert store.last_started() == 5


def test_unserialisable_state_is_refused_and_old_checkpoint_kept(store) -> None:
    store.save(_ckpt(1))
    bad = _ckpt(2)
    bad.accountant = {"x": float("nan")}
    with pytest.raises(ValueError):
        store.save(bad)
    got = store.load()
    assert got is not None and got.round == 1


def test_sqlite_survives_reopen_and_rejects_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    s = SqliteCheckpointStore(path)
    s.save(_ckpt(4))
    s.mark_started(6)
    s.close()
    s2 = SqliteCheckpointStore(path)
    got = s2.load()
    assert got is not None and got.round == 4 and s2.last_started() == 6
    s2.close()
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(CheckpointError, match="not a usable checkpoint database"):
        SqliteCheckpointStore(junk)
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE checkpoint (slot INTEGER PRIMARY KEY, round INTEGER, meta TEXT, arrays BLOB)")
    conn.execute("INSERT INTO checkpoint VALUES (1, 1, '{\"format\": \"other\"}', x'00')")
    conn.commit()
    conn.close()
    s3 = SqliteCheckpointStore(other)
    with pytest.raises(CheckpointError, match="not a shuffledp checkpoint"):
        s3.load()
    s3.close()


def test_a_corrupt_checkpoint_blob_or_metadata_is_a_checkpoint_error() -> None:
    # restore() turns CheckpointError into ResumeError; a corrupt blob raised a raw ValueError before.
    good = _ckpt(1)
    meta = good.meta_json()
    with pytest.raises(CheckpointError, match="corrupt"):
        Checkpoint.from_parts(meta, b"not an npz archive")
    broken = json.loads(meta)
    del broken["history"]
    with pytest.raises(CheckpointError, match="corrupt.*KeyError"):
        Checkpoint.from_parts(json.dumps(broken), arrays_to_bytes(good.arrays + good.optimizer_buffers))
