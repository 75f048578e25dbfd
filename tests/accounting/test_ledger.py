"""The SQLite ledger: append-only, one row per round, exports, and durability under SIGKILL."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from shuffledp.accounting.ledger import LEDGER_FORMAT, Ledger, LedgerError

FAMILIES_IN_TEST = ("clones", "ccg-gdp", "rr-lower")


@contextlib.contextmanager
def _raw(path: Path) -> Iterator[sqlite3.Connection]:
    """Another SQLite client on the ledger file, bypassing the Python API (foreign keys off, its default)."""
    conn = sqlite3.connect(path)
    try:
        yield conn
    finally:
        conn.close()


def _rows_of(path: Path) -> list[dict]:
    with Ledger(path, read_only=True) as ledger:
        return ledger.rows()


def _as_written_before_the_batches_table(path: Path) -> None:
    """Make ``path`` a ledger as an older shuffledp wrote it: no batches table (its triggers go with it)."""
    with _raw(path) as conn:
        conn.execute("DROP TABLE batches")
        conn.commit()


def _append(ledger: Ledger, rnd: int, **overrides: object) -> None:
    record: dict[str, object] = {
        "round": rnd,
        "n_reports": 1000 + rnd,
        "eps0": 1.0,
        "mechanism": "laplace(d=10,C=1,b=2)",
        "delta": 1e-6,
        "epsilons": {"clones": 0.1 * rnd, "ccg-gdp": 0.05 * rnd, "rr-lower": 0.01 * rnd},
        "kinds": {"clones": "upper", "ccg-gdp": "approximate", "rr-lower": "lower"},
    }
    record.update(overrides)
    ledger.append(**record)


def test_round_trip_of_rows_and_order(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        assert ledger.last_round() is None
        assert ledger.rows() == []
        for rnd in (1, 2, 5):
            _append(ledger, rnd)
        rows = ledger.rows()
        assert [r["round"] for r in rows] == [1, 2, 5]
        assert ledger.last_round() == 5 and len(ledger) == 3
        row = rows[2]
        assert row["n_reports"] == 1005 and row["eps0"] == 1.0 and row["delta"] == 1e-6
        assert row["mechanism"] == "laplace(d=10,C=1,b=2)" and row["default_family"] == "clones"
        assert list(row["epsilons"]) == list(FAMILIES_IN_TEST)  # default family first
        assert row["epsilons"]["clones"] == {"value": 0.1 * 5, "kind": "upper", "reason": None}
        assert row["epsilons"]["rr-lower"]["kind"] == "lower"
        parsed = datetime.fromisoformat(row["time"])
        assert parsed.utcoffset() == timedelta(0)
        assert abs((datetime.now(timezone.utc) - parsed).total_seconds()) < 60
    # reopening sees the same rows
    with Ledger(tmp_path / "l.db", create=False) as again:
        assert again.rows() == rows


def test_default_family_is_stored_first_even_if_given_last(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(
            ledger, 1,
            epsilons={"rr-lower": 0.01, "clones-focs": 0.2},
            kinds={"rr-lower": "lower", "clones-focs": "upper"},
            default_family="clones-focs",
        )
        assert list(ledger.rows()[0]["epsilons"]) == ["clones-focs", "rr-lower"]


def test_explicit_time_is_stored_in_utc(tmp_path: Path) -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1, time=when)
        assert ledger.rows()[0]["time"] == "2026-01-02T01:04:05.000000+00:00"
        with pytest.raises(LedgerError, match="timezone-aware"):
            _append(ledger, 2, time=datetime(2026, 1, 2))


def test_duplicate_round_raises_and_keeps_the_stored_row(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1)
        _append(ledger, 2)
        before = ledger.rows()
        with pytest.raises(LedgerError, match="round 2 is already in the ledger"):
            _append(ledger, 2, eps0=9.0, epsilons={"clones": 9.0}, kinds={"clones": "upper"})
        assert ledger.rows() == before
        with pytest.raises(LedgerError, match="before the last recorded round 2"):
            _append(ledger, 0)
        assert ledger.rows() == before
        _append(ledger, 3)  # the ledger is still usable after a refusal
        assert ledger.last_round() == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"round": -1}, r"round must be an integer in \[0, 9223372036854775807\] \(SQLite's INTEGER\), got -1"),
        ({"round": 2**63}, r"round must be an integer in \[0, 9223372036854775807\]"),  # not an OverflowError
        ({"round": 1.5}, "round must be an integer"),
        ({"n_reports": 0}, r"n_reports must be an integer in \[1, "),
        ({"n_reports": True}, "boolean"),
        ({"eps0": 0.0}, "eps0 must be a finite real number > 0"),
        ({"eps0": float("inf")}, "eps0 must be a finite"),
        ({"delta": 1.0}, r"delta must be a finite real number in \(0.0, 1.0\)"),
        ({"mechanism": " "}, "mechanism must be a non-empty string"),
        ({"epsilons": {"clones": 0.1}}, "same families"),
        ({"epsilons": {}, "kinds": {}}, "at least the default family"),
        ({"kinds": {"clones": "upper", "ccg-gdp": "guess", "rr-lower": "lower"}}, "kind of 'ccg-gdp' must be one of"),
        (
            {"epsilons": {"clones": float("nan"), "ccg-gdp": 0.1, "rr-lower": 0.0}},
            "epsilon of 'clones' must be a finite",
        ),
        ({"epsilons": {"clones": -0.1, "ccg-gdp": 0.1, "rr-lower": 0.0}}, "epsilon of 'clones' must be a finite"),
        ({"default_family": "fmt"}, "default_family 'fmt' must be one of the recorded families"),
        (
            {"epsilons": {"clones": 0.1, "ccg-gdp": None, "rr-lower": 0.0},
             "kinds": {"clones": "upper", "ccg-gdp": "refused", "rr-lower": "lower"}},
            r"give its reason in reasons\['ccg-gdp'\]",
        ),
        (
            {"epsilons": {"clones": 0.1, "ccg-gdp": 0.2, "rr-lower": 0.0},
             "kinds": {"clones": "upper", "ccg-gdp": "refused", "rr-lower": "lower"}, "reasons": {"ccg-gdp": "x"}},
            "its epsilon must be None",
        ),
        ({"reasons": {"clones": "why"}}, "not refused"),
        (
            {"epsilons": {"clones": None}, "kinds": {"clones": "refused"}, "reasons": {"clones": "outside region"}},
            "the default family 'clones' refused",
        ),
    ],
)
def test_invalid_records_are_refused_and_nothing_is_written(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1)
        before = ledger.rows()
        with pytest.raises(LedgerError, match=message):
            _append(ledger, 2, **overrides)
        assert ledger.rows() == before


def test_refused_family_is_stored_without_a_number(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(
            ledger, 1,
            epsilons={"clones": 0.3, "ccg-gdp": None},
            kinds={"clones": "upper", "ccg-gdp": "refused"},
            reasons={"ccg-gdp": "CLT refusal: n/(e^eps0+1) < 2 ln(1/delta)"},
        )
        entry = ledger.rows()[0]["epsilons"]["ccg-gdp"]
        assert entry == {"value": None, "kind": "refused", "reason": "CLT refusal: n/(e^eps0+1) < 2 ln(1/delta)"}


def test_sqlite_itself_refuses_update_and_delete(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with Ledger(path) as ledger:
        _append(ledger, 1)
        before = ledger.rows()
    with _raw(path) as conn:
        for statement in (
            "UPDATE rounds SET eps0 = 0.5",
            "DELETE FROM rounds",
            "UPDATE epsilons SET value = 0.0",
            "DELETE FROM epsilons",
            "DELETE FROM meta",
            "UPDATE meta SET value = 'x'",
            # REPLACE deletes the old row without firing DELETE triggers; the BEFORE INSERT key check refuses it
            "INSERT OR REPLACE INTO rounds(round, time, n_reports, eps0, mechanism, delta, default_family) "
            "VALUES (1, 't', 100000, 1.0, 'm', 1e-6, 'clones')",
            "REPLACE INTO epsilons(round, family, value, kind, reason) "
            "SELECT round, family, 0.01, kind, reason FROM epsilons",
            "INSERT OR REPLACE INTO meta(key, value) VALUES ('format', 'x')",
        ):
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                conn.execute(statement)
        # a refused kind with a number violates the table's CHECK, even bypassing the Python API
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO epsilons VALUES (1, 'fmt', 0.5, 'refused', 'x')")
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert _rows_of(path) == before  # the API's view is unchanged


def test_a_ledger_from_before_the_replace_triggers_gets_them_at_open(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with Ledger(path) as ledger:
        _append(ledger, 1)
    conn = sqlite3.connect(path)
    for table in ("meta", "rounds", "epsilons"):
        conn.execute(f"DROP TRIGGER {table}_no_replace")
    conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('created', 'then')")  # possible without them
    conn.commit()
    with Ledger(path, create=False) as ledger:
        assert [row["round"] for row in ledger.rows()] == [1]
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("INSERT OR REPLACE INTO rounds(round, time, n_reports, eps0, mechanism, delta, default_family) "
                     "VALUES (1, 't', 100000, 1.0, 'm', 1e-6, 'clones')")
    conn.close()


def test_a_round_records_the_batch_it_charged(tmp_path: Path) -> None:
    batch = bytes(range(16))
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1)  # without its batch (as a caller that has none)
        _append(ledger, 2, key_epoch=7, batch_id=batch)
        _append(ledger, 3, key_epoch=2**32 - 1, batch_id=(b"\xff" * 16).hex())
        rows = ledger.rows()
        ledger.export_csv(tmp_path / "out.csv")
    assert [(r["key_epoch"], r["batch_id"]) for r in rows] == [(None, None), (7, batch.hex()), (2**32 - 1, "ff" * 16)]
    with open(tmp_path / "out.csv", newline="", encoding="utf-8") as handle:
        table = list(csv.DictReader(handle))
    expected = [("", ""), ("7", batch.hex()), (str(2**32 - 1), "ff" * 16)]
    assert [(r["key_epoch"], r["batch_id"]) for r in table] == expected


@pytest.mark.parametrize(
    ("batch", "match"),
    [({"key_epoch": 1}, "both or neither"), ({"batch_id": b"\0" * 16}, "both or neither"),
     ({"key_epoch": -1, "batch_id": b"\0" * 16}, r"key_epoch must be an integer in \[0, 4294967295\], got -1"),
     ({"key_epoch": 2**32, "batch_id": b"\0" * 16}, r"\[0, 4294967295\], got 4294967296"),
     ({"key_epoch": True, "batch_id": b"\0" * 16}, "key_epoch"),
     ({"key_epoch": 0, "batch_id": b"\0" * 15}, "16 bytes, got 15"),
     ({"key_epoch": 0, "batch_id": "zz" * 16}, "bytes or their hex"),
     ({"key_epoch": 0, "batch_id": 5}, "bytes or a hex string")],
)
def test_a_bad_batch_is_refused_and_nothing_is_written(tmp_path: Path, batch: dict, match: str) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1, key_epoch=0, batch_id=b"\1" * 16)
        before = ledger.rows()
        with pytest.raises(LedgerError, match=match):
            _append(ledger, 2, **batch)
        assert ledger.rows() == before


def test_the_batches_table_is_append_only_too(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with Ledger(path) as ledger:
        _append(ledger, 1, key_epoch=0, batch_id=b"\1" * 16)
        before = ledger.rows()
    with _raw(path) as conn:
        for statement in ("UPDATE batches SET batch_id = '" + "22" * 16 + "'", "DELETE FROM batches",
                          "INSERT OR REPLACE INTO batches VALUES (1, 0, '" + "22" * 16 + "')"):
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                conn.execute(statement)
        with pytest.raises(sqlite3.IntegrityError):  # not hex, even bypassing the Python API
            conn.execute("INSERT INTO batches VALUES (2, 0, '" + "ZZ" * 16 + "')")
    assert _rows_of(path) == before  # the API's view is unchanged


def test_a_ledger_from_before_the_batches_table_gets_it_and_keeps_its_rounds(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with Ledger(path) as ledger:
        _append(ledger, 1)
        before = ledger.rows()
    _as_written_before_the_batches_table(path)
    with Ledger(path, create=False) as ledger:
        assert ledger.rows() == before and before[0]["batch_id"] is None
        _append(ledger, 2, key_epoch=3, batch_id=b"\2" * 16)
        assert ledger.rows()[1]["batch_id"] == "02" * 16


def test_a_read_only_open_changes_nothing_and_refuses_appends(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with Ledger(path) as ledger:
        _append(ledger, 1)
    _as_written_before_the_batches_table(path)
    before = path.read_bytes()
    with Ledger(path, read_only=True) as ledger:
        rows = ledger.rows()
        assert [(r["round"], r["key_epoch"], r["batch_id"]) for r in rows] == [(1, None, None)]
        with pytest.raises(LedgerError, match="read-only"):
            _append(ledger, 2)
    assert path.read_bytes() == before  # no table added, nothing written
    wal = tmp_path / "l.db-wal"  # SQLite may create the WAL side files to read; it writes no frame to them
    assert not wal.exists() or wal.stat().st_size == 0
    with pytest.raises(LedgerError, match="does not exist"):
        Ledger(tmp_path / "missing.db", read_only=True)
    assert not (tmp_path / "missing.db").exists()


def _read_only_rows_as_a_reader_without_write_access(directory: Path, ledger: Path) -> str:
    """Open ``ledger`` read-only in a forked child that cannot write ``directory`` (made 0555; as root, the child
    also drops to uid 65534, which root's permission override would otherwise defeat). A fork, not an exec: the
    interpreter may live where uid 65534 cannot reach."""
    for p in (directory, *directory.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    directory.chmod(0o555)
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(read_end)
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                try:
                    with Ledger(ledger, read_only=True) as opened:
                        said = f"rows {[r['round'] for r in opened.rows()]}"
                except LedgerError as exc:
                    said = f"LedgerError {exc}"
                os.write(write_end, said.encode())
            finally:
                os._exit(0)
        os.close(write_end)
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        os.waitpid(pid, 0)
    finally:
        os.close(read_end)
        directory.chmod(0o755)
    return b"".join(chunks).decode()


def test_a_reader_who_cannot_write_the_directory_is_told_to_read_a_copy(tmp_path: Path) -> None:
    import shutil
    import tempfile

    evidence = Path(tempfile.mkdtemp(prefix="shuffledp-ro-", dir="/tmp"))  # tmp_path is not readable by uid 65534
    try:
        with Ledger(evidence / "l.db") as ledger:
            _append(ledger, 1, key_epoch=0, batch_id=b"\1" * 16)
            _append(ledger, 2)
            # a copy taken while the writer is open: its committed rounds are still in the write-ahead log
            (tmp_path / "l.db").write_bytes((evidence / "l.db").read_bytes())
            (tmp_path / "l.db-wal").write_bytes((evidence / "l.db-wal").read_bytes())
            assert len(ledger) == 2 and (evidence / "l.db-wal").stat().st_size > 0
            # while the writer is open its -shm exists: SQLite reads through it, log included, without writing
            said = _read_only_rows_as_a_reader_without_write_access(evidence, evidence / "l.db")
            assert said == "rows [1, 2]"
        before = (evidence / "l.db").read_bytes()
        said = _read_only_rows_as_a_reader_without_write_access(evidence, evidence / "l.db")  # checkpointed
        assert said.startswith("LedgerError") and "copy the ledger" in said, said  # not "not an SQLite database"
        assert sorted(p.name for p in evidence.iterdir()) == ["l.db"] and (evidence / "l.db").read_bytes() == before
        assert _rows_of(tmp_path / "l.db") == _rows_of(evidence / "l.db")  # the copy, in a writable place, reads whole
        assert [r["round"] for r in _rows_of(tmp_path / "l.db")] == [1, 2]
    finally:
        shutil.rmtree(evidence, ignore_errors=True)


def test_a_read_only_open_takes_any_file_name(tmp_path: Path) -> None:
    for name in ("a b%20c#?x=1&mode=rw.db", "caf\u00e9.db", "bad\udcff.db", "file:x.db"):
        path = tmp_path / name
        try:
            with Ledger(path) as ledger:
                _append(ledger, 1)
        except UnicodeEncodeError:  # a file system that cannot store the name at all
            continue
        with Ledger(path, read_only=True) as ledger:
            assert [r["round"] for r in ledger.rows()] == [1], name


def test_a_batch_cannot_be_added_to_an_earlier_round_or_a_future_one(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    with Ledger(path) as ledger:
        _append(ledger, 1)  # as a round of a ledger written before the batches table: no batch
        _append(ledger, 2, key_epoch=0, batch_id=b"\2" * 16)
        before = ledger.rows()
    with _raw(path) as conn:  # another SQLite client: foreign keys off
        for rnd in (1, 3):  # re-label an earlier round; pre-seed a future one
            with pytest.raises(sqlite3.IntegrityError, match="a batch is recorded with its round"):
                conn.execute("INSERT INTO batches VALUES (?, 7, ?)", (rnd, "ee" * 16))
        conn.execute("DROP TRIGGER batches_last_round")  # an older ledger, or an edit: pre-seed round 3
        conn.execute("INSERT INTO batches VALUES (3, 7, ?)", ("ee" * 16,))
        conn.commit()
    with Ledger(path) as ledger:  # the writable open puts the trigger back
        with pytest.raises(LedgerError, match="refused round 3"):  # not a raw sqlite3.IntegrityError
            _append(ledger, 3, key_epoch=0, batch_id=b"\3" * 16)
        assert ledger.rows() == before
    with _raw(path) as conn:
        with pytest.raises(sqlite3.IntegrityError, match="a batch is recorded with its round"):
            conn.execute("INSERT INTO batches VALUES (1, 7, ?)", ("ee" * 16,))


def test_unreadable_tables_are_a_ledger_error_not_a_traceback(tmp_path: Path) -> None:
    for name, script in (
        ("meta.db", "CREATE TABLE meta(k TEXT); CREATE TABLE rounds(x); CREATE TABLE epsilons(y);"),
        ("rounds.db", "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT); CREATE TABLE rounds(x); "
                      "CREATE TABLE epsilons(y); INSERT INTO meta VALUES ('format', 'shuffledp.ledger'), "
                      "('schema_version', '1');"),
    ):
        conn = sqlite3.connect(tmp_path / name)
        conn.executescript(script)
        conn.close()
        with pytest.raises(LedgerError, match="shuffledp ledger|cannot read the ledger"):
            with Ledger(tmp_path / name, create=False) as ledger:
                ledger.rows()


def test_a_full_disk_is_reported_as_such_and_loses_no_recorded_round(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1)
        before = ledger.rows()
        pages = ledger._conn.execute("PRAGMA page_count").fetchone()[0]
        ledger._conn.execute(f"PRAGMA max_page_count = {pages}")  # the file may not grow: SQLITE_FULL
        with pytest.raises(sqlite3.OperationalError, match="full"):  # not "cannot rollback"
            ledger.append(round=2, n_reports=10, eps0=1.0, mechanism="m" * 20000, delta=1e-6,
                          epsilons={"clones": 0.7}, kinds={"clones": "upper"}, default_family="clones")
        assert ledger.rows() == before


def test_open_refuses_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="does not exist"):
        Ledger(tmp_path / "missing.db", create=False)
    assert not (tmp_path / "missing.db").exists()
    with pytest.raises(LedgerError, match="directory does not exist"):
        Ledger(tmp_path / "no-such-dir" / "l.db")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(LedgerError, match="not a shuffledp ledger"):
        Ledger(junk)
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(LedgerError, match="not a shuffledp ledger"):
        Ledger(other)


def test_export_json_and_csv(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1)
        _append(
            ledger, 2,
            epsilons={"clones": 0.25, "ccg-gdp": None, "rr-lower": 1 / 3},
            kinds={"clones": "upper", "ccg-gdp": "refused", "rr-lower": "lower"},
            reasons={"ccg-gdp": "too few clones, refused"},
        )
        ledger.export_json(tmp_path / "out.json")
        ledger.export_csv(tmp_path / "out.csv")
        rows = ledger.rows()
    document = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    assert document["format"] == LEDGER_FORMAT
    assert document["rows"] == rows
    with open(tmp_path / "out.csv", newline="", encoding="utf-8") as handle:
        table = list(csv.DictReader(handle))
    assert [int(r["round"]) for r in table] == [1, 2]
    assert float(table[1]["eps[rr-lower]"]) == 1 / 3  # floats written exactly (repr)
    assert table[1]["eps[ccg-gdp]"] == "" and table[1]["kind[ccg-gdp]"] == "refused"
    assert table[1]["reason[ccg-gdp]"] == "too few clones, refused"
    assert float(table[0]["eps[ccg-gdp]"]) == 0.05 and table[0]["kind[ccg-gdp]"] == "approximate"
    assert table[0]["time"] == rows[0]["time"] and int(table[0]["n_reports"]) == 1001


def test_export_to_a_missing_directory_is_refused_cleanly(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.db") as ledger:
        _append(ledger, 1)
        for export in (ledger.export_json, ledger.export_csv):
            with pytest.raises(LedgerError, match="does not exist"):
                export(tmp_path / "no-such-dir" / "out")
        (tmp_path / "out.csv").write_text("old contents", encoding="utf-8")
        ledger.export_csv(tmp_path / "out.csv")  # replaces an existing file
    assert (tmp_path / "out.csv").read_text(encoding="utf-8").startswith("round,time")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary file left


_WRITER = textwrap.dedent(
    """
    import sys
    from shuffledp.accounting.ledger import Ledger
    ledger = Ledger(sys.argv[1])
    families = [f"family-{i}" for i in range(8)]
    rnd = 0
    while True:
        rnd += 1
        ledger.append(
            round=rnd, n_reports=rnd, eps0=1.0, mechanism="rr", delta=1e-6, default_family="family-0",
            epsilons={f: rnd + i / 10 for i, f in enumerate(families)}, kinds={f: "upper" for f in families},
        )
        print(rnd, flush=True)
    """
)


def test_ledger_survives_sigkill_mid_stream(tmp_path: Path) -> None:
    path = tmp_path / "killed.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    committed: list[int] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while len(committed) < 25 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            committed.append(int(line))
        assert len(committed) >= 25, f"writer stopped early: {proc.stderr.read() if proc.stderr else ''}"
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: the writer is still appending
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    with _raw(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with Ledger(path, create=False) as ledger:
        rows = ledger.rows()
        stored = [r["round"] for r in rows]
        # every round the writer reported as committed is there, and the stored rounds are a gap-free prefix
        assert stored[: len(committed)] == committed
        assert stored == list(range(1, len(stored) + 1))
        for row in rows:  # no partial round: every round has all 8 families with its exact values
            assert row["n_reports"] == row["round"]
            assert row["epsilons"] == {
                f"family-{i}": {"value": row["round"] + i / 10, "kind": "upper", "reason": None} for i in range(8)
            }
        # the reopened ledger accepts the next round and refuses a committed one
        nxt = stored[-1] + 1
        ledger.append(round=nxt, n_reports=1, eps0=1.0, mechanism="rr", delta=1e-6,
                      epsilons={"clones": 1.0}, kinds={"clones": "upper"})
        with pytest.raises(LedgerError, match="already in the ledger"):
            ledger.append(round=committed[-1], n_reports=1, eps0=1.0, mechanism="rr", delta=1e-6,
                          epsilons={"clones": 1.0}, kinds={"clones": "upper"})
