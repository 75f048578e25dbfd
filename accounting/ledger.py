"""A durable, append-only, per-round privacy ledger in SQLite.

One row per round: the round number, when it was recorded (UTC, ISO 8601), the attested number of shuffled
reports, the local epsilon ``eps0``, the mechanism, the target ``delta``, and the *cumulative* epsilon after
that round for the default bound family and for every comparison family, each with its kind (``upper``,
``approximate``, ``lower``) or, when a family refused the parameters, the kind ``refused`` with the reason and
no number.

Durability: the database runs in WAL mode with ``synchronous=FULL``, and each round (its row and all its
per-family rows) is written in one transaction, so a process killed with SIGKILL leaves every committed round
intact and no partial round. The ledger is append-only: triggers make SQLite itself refuse ``UPDATE`` and
``DELETE`` on every table, and ``round`` is the primary key, so a round can be recorded once only.

Schema (version 1)::

    meta(key TEXT PRIMARY KEY, value TEXT)                     -- format, schema version, creation time,
                                                               -- versions (JSON, see below)
    rounds(round INTEGER PRIMARY KEY, time TEXT, n_reports INTEGER, eps0 REAL, mechanism TEXT,
           delta REAL, default_family TEXT)
    epsilons(round INTEGER REFERENCES rounds, family TEXT, value REAL NULL, kind TEXT, reason TEXT NULL,
             PRIMARY KEY (round, family))                      -- one row per (round, family)
    batches(round INTEGER PRIMARY KEY REFERENCES rounds, key_epoch INTEGER, batch_id TEXT)
                                                               -- the shuffler batch a round was charged for

The ``batches`` table was added to schema version 1 later (an additive change: older readers ignore it). A
ledger written before it gets the table when it is next opened for writing; its earlier rounds have no batch
row, and :meth:`Ledger.rows` reports ``key_epoch`` and ``batch_id`` as None for them. A round recorded with
its batch lets ``shuffledp audit`` match the shuffler's release record by batch id, not by round number alone.

The ``versions`` meta key is another additive part of version 1: a JSON object, distribution -> version, of
shuffledp and the libraries the epsilons are computed with (:func:`shuffledp.accounting.versions.library_versions`),
written when the ledger is created. A ledger created before the key existed opens and verifies as before;
:meth:`Ledger.versions` returns None for it, and nothing is added later (the rounds already in it were computed by
unknown versions, and ``meta`` is append-only).
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shuffledp.accounting.ledger_files import atomic_write, connect_read_only, release_side_files, side_files
from shuffledp.accounting.ledger_schema import (
    BATCH_ID_BYTES,
    BATCH_KEYS,
    BATCHES_SCHEMA,
    KINDS,
    LEDGER_FORMAT,
    LEDGER_SCHEMA_VERSION,
    ROW_KEYS,
    SCHEMA,
    TRIGGER_NAMES,
    VERSIONS_KEY,
    LedgerError,
    check_batch,
    check_int,
    check_integrity,
    parse_versions,
    refuse_a_decrease,
    rollback,
    trigger_statements,
    utc_now,
    validate_record,
)
from shuffledp.accounting.versions import library_versions

if TYPE_CHECKING:  # pragma: no cover - typing only
    from shuffledp.accounting.accountant import ShuffleAccountant

__all__ = ["Ledger", "LedgerError", "LEDGER_FORMAT", "LEDGER_SCHEMA_VERSION", "KINDS", "BATCH_ID_BYTES"]

class Ledger:
    """Append-only SQLite ledger of one row per round (see the module docstring for the schema).

    Args:
        path: the database file. It is created (with its schema) if it does not exist, unless ``create`` is
            False, in which case a missing file is an error.
        create: allow creating a new ledger file.
        read_only: open for reading only (implies ``create=False``): SQLite refuses every write through this
            connection and nothing is added to an older ledger (no table, no trigger), so an auditor's look
            leaves the ledger file as it was. The ``-wal``/``-shm`` side files SQLite needs to read a WAL
            database are removed again at :meth:`close` if this reader created them and no other connection
            uses them (:func:`shuffledp.accounting.ledger_files.release_side_files`); a reader who cannot write
            the directory must read a copy. :meth:`append` and :meth:`record` then raise LedgerError.

    Raises:
        LedgerError: the file is missing (``create=False``) or is not a shuffledp ledger of a known version.

    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = bool(read_only)
        if read_only:
            create = False
        if not create and not self.path.is_file():
            raise LedgerError(f"no ledger at {str(self.path)!r}: the file does not exist")
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT) below.
        if not self.path.parent.is_dir():
            raise LedgerError(f"cannot open the ledger {str(self.path)!r}: its directory does not exist")
        if not self.read_only and self.path.is_file() and self.path.stat().st_size == 0:
            # SQLite would take an empty file for a new database: a ledger that lost its content is not re-created
            raise LedgerError(f"{str(self.path)!r} exists but is empty (0 bytes): not a ledger. A ledger that lost "
                              "its content is not re-created over it; restore it, or move it away to start anew")
        # Which side files were there before this reader: only those it created may be removed at close.
        self._side_files_before = any(side.exists() for side in side_files(self.path))
        try:
            if self.read_only:
                self._conn = connect_read_only(self.path)
            else:
                self._conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open the ledger {str(self.path)!r}: {exc}") from None
        try:
            self._setup(create)
        except sqlite3.DatabaseError as exc:  # e.g. a table with the expected name but other columns
            self.close()
            raise LedgerError(f"{str(self.path)!r} is not a readable shuffledp ledger: {exc}") from None
        except BaseException:
            self.close()
            raise

    # -- setup -------------------------------------------------------------------------------------------------
    def _setup(self, create: bool) -> None:
        conn = self._conn
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            mode = conn.execute("PRAGMA journal_mode" if self.read_only else "PRAGMA journal_mode = WAL").fetchone()[0]
            conn.execute("PRAGMA synchronous = FULL")
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"{str(self.path)!r} is not a shuffledp ledger (not an SQLite database: {exc})") from None
        if str(mode).lower() != "wal" and not self.read_only:  # a reader need not care (e.g. a copy of the file)
            raise LedgerError(f"could not put the ledger {str(self.path)!r} in WAL mode (SQLite reports {mode!r})")
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            if not create:
                raise LedgerError(f"{str(self.path)!r} is an empty database, not a shuffledp ledger")
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(BATCHES_SCHEMA)
                for statement in trigger_statements():
                    conn.execute(statement)
                conn.executemany(
                    "INSERT OR IGNORE INTO meta(key, value) VALUES (?, ?)",
                    [
                        ("format", LEDGER_FORMAT),
                        ("schema_version", str(LEDGER_SCHEMA_VERSION)),
                        ("created", utc_now()),
                        (VERSIONS_KEY, json.dumps(library_versions(), sort_keys=False)),
                    ],
                )
                conn.execute("COMMIT")
            except BaseException:
                rollback(conn)
                raise
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not {"meta", "rounds", "epsilons"} <= tables:
            raise LedgerError(f"{str(self.path)!r} is not a shuffledp ledger (its tables are {sorted(tables)})")
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("format") != LEDGER_FORMAT:
            raise LedgerError(f"{str(self.path)!r} is not a shuffledp ledger (no format marker {LEDGER_FORMAT!r})")
        if meta.get("schema_version") != str(LEDGER_SCHEMA_VERSION):
            raise LedgerError(
                f"the ledger {str(self.path)!r} has schema version {meta.get('schema_version')!r}; "
                f"this version of shuffledp reads version {LEDGER_SCHEMA_VERSION} only"
            )
        triggers = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        if not self.read_only and (
            "batches" not in tables or not TRIGGER_NAMES <= triggers
        ):
            # A ledger written before the batches table or the no-replace triggers existed gets them now. A
            # read-only file cannot, and need not: nothing can be appended to it through this connection either.
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(BATCHES_SCHEMA)
                for statement in trigger_statements():
                    conn.execute(statement)
                conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                rollback(conn)
                if "readonly" not in str(exc):
                    raise LedgerError(f"cannot add the append-only triggers to {str(self.path)!r}: {exc}") from exc
            except BaseException:
                rollback(conn)
                raise
        parse_versions(meta.get(VERSIONS_KEY))  # absent in a ledger created before the key: fine; damaged: refused
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        self._has_batches = "batches" in tables  # False only for a read-only ledger written before the table

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the database connection (committed rounds are already on disk).

        A read-only ledger that had no side files when it was opened has the ones its reader created removed
        (:func:`~shuffledp.accounting.ledger_files.release_side_files`), so a look leaves its folder as it was.
        """
        self._conn.close()
        if self.read_only and not self._side_files_before and any(side.exists() for side in side_files(self.path)):
            release_side_files(self.path)


    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------------------------------------
    def append(
        self,
        *,
        round: int,  # noqa: A002 - the column's name in the contract
        n_reports: int,
        eps0: float,
        mechanism: str,
        delta: float,
        epsilons: Mapping[str, float | None],
        kinds: Mapping[str, str],
        default_family: str = "clones",
        reasons: Mapping[str, str] | None = None,
        time: datetime | None = None,
        key_epoch: int | None = None,
        batch_id: bytes | str | None = None,
        composes: Sequence[tuple[int, float]] | None = None,
    ) -> None:
        """Record one round, atomically; the values are the cumulative epsilons *after* this round.

        Args:
            round: the round number, an integer >= 0, strictly greater than every round already recorded.
            n_reports: the attested number of shuffled reports, >= 1.
            eps0: the local epsilon of each report, finite and > 0.
            mechanism: a non-empty label of the local randomizer (e.g. ``"laplace(d=1000,C=1,b=2)"``).
            delta: the delta at which the cumulative epsilons are stated, in (0, 1).
            epsilons: family -> cumulative epsilon (finite, >= 0), or None for a family that refused.
            kinds: family -> ``"upper" | "approximate" | "lower" | "refused"``; same keys as ``epsilons``.
            default_family: the family the budget is enforced with; must be a key of ``epsilons`` and must not
                be refused.
            reasons: family -> reason, required for (and only for) every refused family.
            time: when the round was recorded (timezone-aware); defaults to now, UTC.
            key_epoch, batch_id: the shuffler batch this round was charged for (both or neither): its key epoch
                (a u32) and its 16-byte batch id (bytes or 32 lowercase hex digits), from the batch's verified
                attestation. Stored in the ``batches`` table in the same transaction as the round.
            composes: the ``(n_reports, eps0)`` of every round the cumulative epsilons compose *before* this one,
                oldest first. If given, the rounds already in the ledger must be exactly these (checked in the
                append's transaction): a writer whose accountant missed a round another writer recorded (two server
                processes on one run) cannot store a cumulative epsilon that leaves it out.

        Raises:
            LedgerError: any field is invalid, the round is already recorded, it is not after the last one, or
                the ledger's rounds are not ``composes``. Nothing is written in that case and every round already
                stored is untouched.
        """
        record = validate_record(
            round=round,
            n_reports=n_reports,
            eps0=eps0,
            mechanism=mechanism,
            delta=delta,
            epsilons=epsilons,
            kinds=kinds,
            default_family=default_family,
            reasons=reasons or {},
            time=time,
        )
        if self.read_only:
            raise LedgerError(f"the ledger {str(self.path)!r} was opened read-only: nothing can be appended")
        batch = check_batch(key_epoch, batch_id)
        if batch is not None and not self._has_batches:
            raise LedgerError(f"the ledger {str(self.path)!r} has no batches table (a read-only ledger written by an "
                              "older shuffledp): it cannot record a round's batch")
        conn = self._conn
        try:
            check_integrity(self._conn, self.path)
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            raise
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"the ledger {str(self.path)!r} cannot be written: {exc}") from None
        try:
            existing = conn.execute("SELECT time FROM rounds WHERE round = ?", (record["round"],)).fetchone()
            if existing is not None:
                raise LedgerError(
                    f"round {record['round']} is already in the ledger (recorded {existing[0]}); "
                    "the ledger is append-only, so a round can be recorded once only"
                )
            if composes is not None:
                stored = conn.execute("SELECT n_reports, eps0 FROM rounds ORDER BY round").fetchall()
                expected = [(int(n), float(e)) for n, e in composes]
                if [(int(n), float(e)) for n, e in stored] != expected:
                    raise LedgerError(
                        f"round {record['round']}: its cumulative epsilons compose {len(expected)} earlier round(s), "
                        f"but the ledger holds {len(stored)}, and their (n_reports, eps0) are not the accountant's: "
                        "another writer recorded rounds this accountant does not hold (two server processes on one "
                        "run?); refused, the ledger is unchanged"
                    )
            last = conn.execute("SELECT MAX(round) FROM rounds").fetchone()[0]
            if last is not None and record["round"] < last:
                raise LedgerError(
                    f"round {record['round']} is before the last recorded round {last}; rounds must be appended in "
                    "increasing order"
                )
            if last is not None:
                refuse_a_decrease(conn, record, int(last))
            conn.execute(
                "INSERT INTO rounds(round, time, n_reports, eps0, mechanism, delta, default_family) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                tuple(record[key] for key in ROW_KEYS),
            )
            if batch is not None:  # the batches_last_round trigger allows only the round just inserted
                conn.execute("INSERT INTO batches(round, key_epoch, batch_id) VALUES (?, ?, ?)",
                             (record["round"], *batch))
            conn.executemany(
                "INSERT INTO epsilons(round, family, value, kind, reason) VALUES (?, ?, ?, ?, ?)",
                [
                    (record["round"], family, entry["value"], entry["kind"], entry["reason"])
                    for family, entry in record["epsilons"].items()
                ],
            )
            conn.execute("COMMIT")
        except sqlite3.IntegrityError as exc:  # a constraint or trigger of the file refused it (e.g. an edited file)
            rollback(conn)
            raise LedgerError(f"the ledger {str(self.path)!r} refused round {record['round']}: {exc}") from exc
        except sqlite3.OperationalError:  # e.g. a full disk (SQLITE_FULL): reported as SQLite says it
            rollback(conn)
            raise
        except sqlite3.DatabaseError as exc:  # a damaged file: nothing is written, and the caller is told so
            rollback(conn)
            raise LedgerError(f"the ledger {str(self.path)!r} cannot be written: {exc}") from None
        except BaseException:
            rollback(conn)
            raise

    def record(
        self,
        accountant: ShuffleAccountant,
        *,
        round: int,  # noqa: A002 - "round" is the column's name in the contract
        mechanism: str,
        key_epoch: int | None = None,
        batch_id: bytes | str | None = None,
    ) -> dict[str, Any]:
        """Append the accountant's latest round with its cumulative epsilons (default + comparison families).

        The accountant must already have composed the round; its last composed :class:`ShuffleRound` supplies
        ``n_reports`` and ``eps0`` and its target delta supplies ``delta``. ``key_epoch`` and ``batch_id`` name
        the shuffler batch the round was charged for (see :meth:`append`). Returns the row as :meth:`rows`
        would. Refused comparison families are stored as refused, with their reasons.

        The ledger must hold exactly the rounds the accountant composed before this one (``composes`` of
        :meth:`append`), so the cumulative epsilons stored cover every recorded round.

        Raises:
            LedgerError: the accountant has composed no round, the ledger holds other rounds than the accountant
                composed before this one, or the append is refused (see :meth:`append`).
        """
        if not accountant.rounds:
            raise LedgerError("the accountant has composed no round yet; compose the round before recording it")
        last = accountant.rounds[-1]
        results = accountant.epsilons()
        epsilons: dict[str, float | None] = {}
        kinds: dict[str, str] = {}
        reasons: dict[str, str] = {}
        for family, result in results.items():
            epsilons[family] = result.value
            kinds[family] = result.kind
            reason = getattr(result, "reason", None)
            if reason is not None:
                reasons[family] = reason
        self.append(
            round=round,
            n_reports=last.n,
            eps0=last.eps0,
            mechanism=mechanism,
            delta=accountant.target_delta,
            epsilons=epsilons,
            kinds=kinds,
            default_family=accountant.family,
            reasons=reasons,
            key_epoch=key_epoch,
            batch_id=batch_id,
            composes=[(r.n, r.eps0) for r in accountant.rounds[:-1]],
        )
        return self.row(round)

    # -- reading -----------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        """Return the ``meta`` table as a dict (``format``, ``schema_version``, ``created``, ``versions``, ...).

        Returns:
            key -> stored text, in the order the keys were written.
        """
        return dict(self._conn.execute("SELECT key, value FROM meta ORDER BY rowid").fetchall())

    def versions(self) -> dict[str, str] | None:
        """Return the versions the ledger was created with (see the module docstring).

        Returns:
            distribution -> version (shuffledp, dp-accounting, numpy, scipy), or None for a ledger created before
            the versions were recorded.

        Raises:
            LedgerError: the stored value is damaged.
        """
        return parse_versions(self.metadata().get(VERSIONS_KEY))

    def last_round(self) -> int | None:
        """Return the largest recorded round number, or None if the ledger is empty."""
        return self._conn.execute("SELECT MAX(round) FROM rounds").fetchone()[0]

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM rounds").fetchone()[0])

    def rows(self) -> list[dict[str, Any]]:
        """Return every round in order, each as a dict.

        Keys: ``round, time, n_reports, eps0, mechanism, delta, default_family``, ``key_epoch`` and ``batch_id``
        (the shuffler batch charged, hex; None for a round recorded without one), and ``epsilons``, a dict
        family -> ``{"value": float | None, "kind": str, "reason": str | None}`` with the default family first.
        All reads happen in one snapshot, so a concurrent writer never shows a half-written round.

        Raises:
            LedgerError: SQLite cannot read the tables (a damaged file, or tables of another layout).
        """
        conn = self._conn
        batch_columns = "b.key_epoch, b.batch_id" if self._has_batches else "NULL, NULL"
        batch_join = "LEFT JOIN batches AS b ON b.round = r.round" if self._has_batches else ""
        try:
            conn.execute("BEGIN")
            try:
                base = conn.execute(
                    f"SELECT {', '.join('r.' + k for k in ROW_KEYS)}, {batch_columns} FROM rounds AS r "
                    f"{batch_join} ORDER BY r.round"
                ).fetchall()
                per_family = conn.execute(
                    "SELECT e.round, e.family, e.value, e.kind, e.reason FROM epsilons AS e "
                    "JOIN rounds AS r ON r.round = e.round "
                    "ORDER BY e.round, (e.family = r.default_family) DESC, e.rowid"
                ).fetchall()
            finally:
                conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"cannot read the ledger {str(self.path)!r}: {exc}") from None
        rows = {row[0]: dict(zip((*ROW_KEYS, *BATCH_KEYS), row)) | {"epsilons": {}} for row in base}
        for rnd, family, value, kind, reason in per_family:
            rows[rnd]["epsilons"][family] = {"value": value, "kind": kind, "reason": reason}
        return list(rows.values())

    def row(self, round: int) -> dict[str, Any]:  # noqa: A002 - "round" is the column's name in the contract
        """Return one recorded round (as in :meth:`rows`). Raises LedgerError if it is not recorded."""
        number = check_int("round", round, 0)
        for row in self.rows():
            if row["round"] == number:
                return row
        raise LedgerError(f"round {number} is not in the ledger")

    def families(self) -> list[str]:
        """Return every family that appears in the ledger, in order of first appearance."""
        seen: dict[str, None] = {}
        for row in self.rows():
            for family in row["epsilons"]:
                seen.setdefault(family, None)
        return list(seen)

    # -- export ------------------------------------------------------------------------------------------------
    def export_json(self, path: str | os.PathLike[str]) -> None:
        """Write the whole ledger as one JSON document ``{"format", "schema_version", "rows": [...]}``.

        The file is written to a temporary file next to ``path`` and renamed into place, so ``path`` is either
        the old file or the complete new one.
        """
        document = {"format": LEDGER_FORMAT, "schema_version": LEDGER_SCHEMA_VERSION, "rows": self.rows()}
        text = json.dumps(document, indent=2, allow_nan=False) + "\n"
        atomic_write(Path(path), text)

    def csv_header(self) -> list[str]:
        """Return the CSV columns: the round fields, ``key_epoch`` and ``batch_id`` (empty for a round recorded
        without its batch), then ``eps[F]``, ``kind[F]``, ``reason[F]`` per family F."""
        header = [*ROW_KEYS, *BATCH_KEYS]
        for family in self.families():
            header += [f"eps[{family}]", f"kind[{family}]", f"reason[{family}]"]
        return header

    def export_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the ledger as CSV, one line per round (see :meth:`csv_header`); floats in ``repr`` form.

        A family absent from a round has empty cells. Written atomically like :meth:`export_json`.
        """
        rows = self.rows()
        header = self.csv_header()
        families = self.families()
        lines: list[list[str]] = [header]
        for row in rows:
            line = [repr(row[key]) if isinstance(row[key], float) else str(row[key]) for key in ROW_KEYS]
            line += ["" if row[key] is None else str(row[key]) for key in BATCH_KEYS]
            for family in families:
                entry = row["epsilons"].get(family)
                if entry is None:
                    line += ["", "", ""]
                else:
                    value = "" if entry["value"] is None else repr(float(entry["value"]))
                    line += [value, entry["kind"], entry["reason"] or ""]
            lines.append(line)
        buffer = io.StringIO(newline="")
        csv.writer(buffer).writerows(lines)
        atomic_write(Path(path), buffer.getvalue())
