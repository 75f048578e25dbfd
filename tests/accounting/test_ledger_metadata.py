"""The ledger's metadata (the versions it was created with) and its read-only open, which leaves no side files."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from shuffledp.accounting.ledger import Ledger, LedgerError
from shuffledp.accounting.versions import ACCOUNTING_DISTRIBUTIONS, NOT_INSTALLED, library_versions


def _append(ledger: Ledger, rnd: int) -> None:
    ledger.append(round=rnd, n_reports=1000, eps0=1.0, mechanism="binary-rr", delta=1e-6,
                  epsilons={"clones": 0.1 * rnd}, kinds={"clones": "upper"})


def _without_versions(path: Path) -> None:
    """Make ``path`` a ledger as an older shuffledp created it: no ``versions`` meta key."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("DROP TRIGGER meta_no_delete")
        conn.execute("DELETE FROM meta WHERE key = 'versions'")
        conn.execute("CREATE TRIGGER meta_no_delete BEFORE DELETE ON meta BEGIN SELECT RAISE(ABORT, 'x'); END")
        conn.commit()
    finally:
        conn.close()


def test_library_versions_name_shuffledp_and_the_accounting_libraries() -> None:
    versions = library_versions()
    assert tuple(versions) == ACCOUNTING_DISTRIBUTIONS == ("shuffledp", "dp-accounting", "numpy", "scipy")
    assert all(v != NOT_INSTALLED and v[0].isdigit() for v in versions.values())


def test_a_new_ledger_records_the_versions_it_was_created_with(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        _append(ledger, 1)
        assert ledger.versions() == library_versions()
    with Ledger(path, read_only=True) as ledger:
        meta = ledger.metadata()
        assert list(meta)[:3] == ["format", "schema_version", "created"] and "versions" in meta
        assert ledger.versions() == library_versions()


def test_a_ledger_without_versions_still_opens_verifies_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        _append(ledger, 1)
    _without_versions(path)
    with Ledger(path, read_only=True) as ledger:
        assert ledger.versions() is None and [r["round"] for r in ledger.rows()] == [1]
    with Ledger(path, create=False) as ledger:  # a writable open adds nothing: round 1's versions are unknown
        _append(ledger, 2)
        assert ledger.versions() is None and "versions" not in ledger.metadata()
    with Ledger(path, read_only=True) as ledger:
        assert [r["round"] for r in ledger.rows()] == [1, 2]


def test_a_damaged_versions_entry_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    _without_versions(path)
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO meta(key, value) VALUES ('versions', '[1, 2]')")
    conn.commit()
    conn.close()
    with pytest.raises(LedgerError, match="versions"):
        Ledger(path, read_only=True)


def test_a_read_only_look_leaves_no_side_files(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        _append(ledger, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]
    before = path.read_bytes()
    with Ledger(path, read_only=True) as ledger:
        assert len(ledger) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]
    assert path.read_bytes() == before


def test_a_read_only_look_beside_a_writer_keeps_the_writers_side_files(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        _append(ledger, 1)
    writer = Ledger(path, create=False)
    try:
        with Ledger(path, read_only=True) as reader:
            assert len(reader) == 1
        assert (tmp_path / "ledger.sqlite-wal").exists() and (tmp_path / "ledger.sqlite-shm").exists()
        _append(writer, 2)  # the writer's log is intact
        with Ledger(path, read_only=True) as reader:
            assert [r["round"] for r in reader.rows()] == [1, 2]
    finally:
        writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]  # the writer, last, removed them


def test_a_writer_in_another_process_during_a_read_only_look_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger(path) as ledger:
        _append(ledger, 1)
    reader = Ledger(path, read_only=True)  # created the side files; the writer below finds them
    code = (
        "import sys\nfrom shuffledp.accounting.ledger import Ledger\n"
        "with Ledger(sys.argv[1], create=False) as l:\n"
        "    l.append(round=2, n_reports=1000, eps0=1.0, mechanism='binary-rr', delta=1e-6,\n"
        "             epsilons={'clones': 0.2}, kinds={'clones': 'upper'})\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
    assert (tmp_path / "ledger.sqlite-wal").stat().st_size > 0  # the writer could not checkpoint past the reader
    assert [r["round"] for r in reader.rows()] == [1, 2]
    reader.close()  # the last connection: round 2 is checkpointed into the file, the side files go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)  # the main file alone holds both rounds
    assert conn.execute("SELECT round FROM rounds ORDER BY round").fetchall() == [(1,), (2,)]
    conn.close()
