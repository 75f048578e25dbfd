"""The ledger's schema and the validation of its records (:mod:`shuffledp.accounting.ledger` writes and reads them).

Holds the format constants, the SQL of the tables and of the append-only triggers, :class:`LedgerError` and
:func:`validate_record`, which checks one round before it is written. Parameter checks go through
:mod:`shuffledp.accounting.validation`; every invalid record is reported as a :class:`LedgerError`.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shuffledp.accounting.validation import check_epsilon, check_integer, check_real

__all__ = [
    "LEDGER_FORMAT",
    "LEDGER_SCHEMA_VERSION",
    "KINDS",
    "BATCH_ID_BYTES",
    "LedgerError",
    "validate_record",
    "check_int",
    "check_batch",
    "utc_now",
    "rollback",
    "trigger_statements",
    "VERSIONS_KEY",
    "parse_versions",
]

LEDGER_FORMAT = "shuffledp.ledger"
LEDGER_SCHEMA_VERSION = 1
KINDS = ("upper", "approximate", "lower", "refused")
ROW_KEYS = ("round", "time", "n_reports", "eps0", "mechanism", "delta", "default_family")
BATCH_KEYS = ("key_epoch", "batch_id")
#: The ``meta`` key of the versions the ledger was created with (a JSON object, distribution -> version). Added to
#: schema version 1 without a version change: a ledger without it is still a valid version-1 ledger.
VERSIONS_KEY = "versions"

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (
    round          INTEGER PRIMARY KEY CHECK (typeof(round) = 'integer' AND round >= 0),
    time           TEXT    NOT NULL,
    n_reports      INTEGER NOT NULL CHECK (typeof(n_reports) = 'integer' AND n_reports >= 1),
    eps0           REAL    NOT NULL CHECK (eps0 > 0),
    mechanism      TEXT    NOT NULL CHECK (length(mechanism) > 0),
    delta          REAL    NOT NULL CHECK (delta > 0 AND delta < 1),
    default_family TEXT    NOT NULL
);
CREATE TABLE IF NOT EXISTS epsilons (
    round  INTEGER NOT NULL REFERENCES rounds(round),
    family TEXT    NOT NULL,
    value  REAL,
    kind   TEXT    NOT NULL CHECK (kind IN ({", ".join(repr(k) for k in KINDS)})),
    reason TEXT,
    PRIMARY KEY (round, family),
    CHECK ((kind = 'refused') = (value IS NULL))
);
"""

# Separate from SCHEMA because a ledger written before it existed gets it on its next writable open.
BATCHES_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS batches (
    round     INTEGER PRIMARY KEY REFERENCES rounds(round),
    key_epoch INTEGER NOT NULL CHECK (typeof(key_epoch) = 'integer' AND key_epoch BETWEEN 0 AND {2**32 - 1}),
    batch_id  TEXT    NOT NULL CHECK (length(batch_id) = 32 AND batch_id NOT GLOB '*[^0-9a-f]*')
)
"""
BATCH_ID_BYTES = 16  # the shuffler's batch ids (shuffledp.shuffler.core) are 16 random bytes

_TRIGGERS = """
CREATE TRIGGER IF NOT EXISTS {table}_no_update BEFORE UPDATE ON {table}
BEGIN SELECT RAISE(ABORT, 'the shuffledp ledger is append-only: UPDATE on {table} is refused'); END;
CREATE TRIGGER IF NOT EXISTS {table}_no_delete BEFORE DELETE ON {table}
BEGIN SELECT RAISE(ABORT, 'the shuffledp ledger is append-only: DELETE on {table} is refused'); END;
CREATE TRIGGER IF NOT EXISTS {table}_no_replace BEFORE INSERT ON {table}
WHEN EXISTS (SELECT 1 FROM {table} WHERE {key_match})
BEGIN SELECT RAISE(ABORT, 'the shuffledp ledger is append-only: a second INSERT of a {table} key is refused'); END;
"""
# Primary key of each table, for the no-replace trigger: ``INSERT OR REPLACE`` deletes the old row without firing
# DELETE triggers (SQLite fires them on REPLACE only with recursive_triggers on, a per-connection setting), so
# only a BEFORE INSERT check on the key keeps a recorded row from being swapped.
_TABLE_KEYS = {
    "meta": "key = NEW.key",
    "rounds": "round = NEW.round",
    "epsilons": "round = NEW.round AND family = NEW.family",
    "batches": "round = NEW.round",
}


# A round's batch row is written in the round's own transaction (:meth:`Ledger.append`), so it names the last
# recorded round. The trigger refuses any other: an earlier round (every round of a ledger written before the table
# existed) cannot be given a batch afterwards, nor can a future round be pre-seeded. (The last round, if recorded
# without a batch, still can: a stricter check, e.g. "before its epsilons", would refuse an older shuffledp's
# appends, which write the batch row last.)
_BATCH_IN_ROUND_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS batches_last_round BEFORE INSERT ON batches
WHEN NEW.round IS NOT (SELECT MAX(round) FROM rounds)
BEGIN SELECT RAISE(ABORT, 'the shuffledp ledger is append-only: a batch is recorded with its round, not after'); END;
"""
TRIGGER_NAMES = frozenset({f"{table}_no_replace" for table in _TABLE_KEYS} | {"batches_last_round"})


def trigger_statements() -> list[str]:
    """The append-only triggers of every table, one CREATE TRIGGER IF NOT EXISTS statement each."""
    statements = []
    for table, key_match in _TABLE_KEYS.items():
        for statement in _TRIGGERS.format(table=table, key_match=key_match).split("END;"):
            if statement.strip():
                statements.append(statement + "END;")
    return [*statements, _BATCH_IN_ROUND_TRIGGER.strip()]


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if SQLite has not already ended it: after some errors (SQLITE_FULL,
    SQLITE_IOERR, ...) it has, and an unconditional ROLLBACK would raise "no transaction is active" and hide the
    error that caused it."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


class LedgerError(ValueError):
    """A ledger operation was refused: a bad record, a duplicate or out-of-order round, or a foreign file."""


def parse_versions(text: str | None) -> dict[str, str] | None:
    """Parse the ``versions`` meta value.

    Args:
        text: the stored value, or None for a ledger created before the key existed.

    Returns:
        distribution -> version, or None when ``text`` is None.

    Raises:
        LedgerError: the value is not a JSON object of strings (a damaged or edited ledger).
    """
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise LedgerError(f"the ledger's {VERSIONS_KEY!r} entry is not a JSON object of version strings: {text!r}")
    return value


def utc_now() -> str:
    """The current UTC time as ISO 8601 with microseconds (the ledger's ``time`` column)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


_SQLITE_INT_MAX = 2**63 - 1  # SQLite's INTEGER is a signed 64-bit integer


def check_int(name: str, value: Any, minimum: int, maximum: int = _SQLITE_INT_MAX) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (SQLite's INTEGER by default); LedgerError otherwise."""
    allowed = f"an integer in [{minimum}, {maximum}]" + (" (SQLite's INTEGER)" if maximum == _SQLITE_INT_MAX else "")
    try:
        return check_integer(name, value, minimum, maximum, allowed=allowed)
    except (TypeError, ValueError) as exc:  # the ledger reports every invalid record as a LedgerError
        raise LedgerError(str(exc)) from None


def check_batch(key_epoch: Any, batch_id: Any) -> tuple[int, str] | None:
    """Validate an (optional) charged batch: a u32 key epoch and a 16-byte batch id; returns (epoch, hex)."""
    if key_epoch is None and batch_id is None:
        return None
    if key_epoch is None or batch_id is None:
        raise LedgerError("key_epoch and batch_id name the charged batch together: give both or neither, got "
                          f"key_epoch={key_epoch!r}, batch_id={batch_id!r}")
    epoch = check_int("key_epoch", key_epoch, 0, 2**32 - 1)  # a u32, as in the envelope binding
    if isinstance(batch_id, str):
        try:
            raw = bytes.fromhex(batch_id)
        except ValueError:
            raise LedgerError(f"batch_id must be {BATCH_ID_BYTES} bytes or their hex, got {batch_id!r}") from None
    elif isinstance(batch_id, (bytes, bytearray)):
        raw = bytes(batch_id)
    else:
        raise LedgerError(f"batch_id must be bytes or a hex string, got {type(batch_id).__name__}")
    if len(raw) != BATCH_ID_BYTES:
        raise LedgerError(f"batch_id must be {BATCH_ID_BYTES} bytes, got {len(raw)}")
    return epoch, raw.hex()


def _check_real(name: str, value: Any, *, low: float, high: float | None = None) -> float:
    allowed = "a finite real number " + (f"> {low}" if high is None else f"in ({low}, {high})")
    try:
        result = check_real(name, value, allowed)
    except TypeError as exc:  # the ledger reports every invalid record as a LedgerError
        raise LedgerError(str(exc)) from None
    if not math.isfinite(result) or result <= low or (high is not None and result >= high):
        raise LedgerError(f"{name} must be {allowed}, got {result!r}")
    return result


#: How a round's mechanism label starts for each randomizer a mechanism-aware family covers (the server writes
#: ``discrete-laplace-l1(d=...,C=...,eps0=...,report=...)`` for the project's discrete Laplace randomizer and
#: ``duchi-l2(d=...,C=...,eps0=...,report=...)`` for its Duchi et al. mechanism,
#: ``privunit2-l2(d=...,C=...,eps0=...,p=...,gamma=...,report=...)`` for its PrivUnit2).
MECHANISM_LABEL_PREFIXES = {"laplace": "discrete-laplace", "duchi": "duchi-l2(", "privunit2": "privunit2-l2("}


def _check_family_mechanism(default_family: str, mechanism: str) -> None:
    """A mechanism-aware default family bounds only its own randomizer's reports: LedgerError for a round whose
    mechanism label names another one."""
    from shuffledp.accounting.families import FAMILY_MECHANISMS

    covered = FAMILY_MECHANISMS.get(default_family)
    if covered is None:
        return
    prefix = MECHANISM_LABEL_PREFIXES[covered]
    if not mechanism.startswith(prefix):
        raise LedgerError(
            f"the default family {default_family!r} bounds only reports of the {covered!r} randomizer (a mechanism "
            f"label starting {prefix!r}); this round's reports came from {mechanism!r}: charge it with a generic "
            "family such as clones-focs"
        )


def validate_record(
    *,
    round: int,  # noqa: A002 - "round" is the column's name in the contract
    n_reports: int,
    eps0: float,
    mechanism: str,
    delta: float,
    epsilons: Mapping[str, float | None],
    kinds: Mapping[str, str],
    default_family: str,
    reasons: Mapping[str, str],
    time: datetime | None,
) -> dict[str, Any]:
    """Check one round's record and return it normalised (what :meth:`Ledger.append` writes).

    Args:
        round: the round number, an integer >= 0.
        n_reports: the attested number of shuffled reports, >= 1.
        eps0: the local epsilon, finite and > 0.
        mechanism: the local randomizer's name.
        delta: the target delta, 0 < delta < 1.
        epsilons: family -> cumulative epsilon (None for a refused family).
        kinds: family -> kind (one of :data:`KINDS`).
        default_family: the budget-enforcing family (it must not be refused).
        reasons: refused family -> reason.
        time: when the round was recorded (timezone-aware), or None for now.

    Returns:
        The record: the columns of ``rounds`` and ``epsilons`` (family -> value, kind, reason), default first.

    Raises:
        LedgerError: anything invalid, with what is allowed.
    """
    record: dict[str, Any] = {
        "round": check_int("round", round, 0),
        "n_reports": check_int("n_reports", n_reports, 1),
        "eps0": _check_real("eps0", eps0, low=0.0),
        "delta": _check_real("delta", delta, low=0.0, high=1.0),
    }
    if not isinstance(mechanism, str) or not mechanism.strip():
        raise LedgerError(f"mechanism must be a non-empty string naming the local randomizer, got {mechanism!r}")
    record["mechanism"] = mechanism
    if time is None:
        record["time"] = utc_now()
    else:
        if not isinstance(time, datetime) or time.tzinfo is None:
            raise LedgerError(f"time must be a timezone-aware datetime, got {time!r}")
        record["time"] = time.astimezone(timezone.utc).isoformat(timespec="microseconds")
    if not isinstance(epsilons, Mapping) or not isinstance(kinds, Mapping) or not isinstance(reasons, Mapping):
        raise LedgerError("epsilons, kinds and reasons must be mappings from family name")
    if not epsilons:
        raise LedgerError("epsilons must name at least the default family")
    if set(epsilons) != set(kinds):
        raise LedgerError(
            f"epsilons and kinds must have the same families; epsilons has {sorted(epsilons)}, "
            f"kinds has {sorted(kinds)}"
        )
    if not isinstance(default_family, str) or default_family not in epsilons:
        raise LedgerError(
            f"default_family {default_family!r} must be one of the recorded families {sorted(epsilons)}"
        )
    _check_family_mechanism(default_family, mechanism)
    extra_reasons = set(reasons) - {f for f, k in kinds.items() if k == "refused"}
    if extra_reasons:
        raise LedgerError(f"reasons given for families that were not refused: {sorted(extra_reasons)}")
    entries: dict[str, dict[str, Any]] = {}
    for family in epsilons:  # insertion order is kept: default first if the caller put it first
        if not isinstance(family, str) or not family:
            raise LedgerError(f"family names must be non-empty strings, got {family!r}")
        kind = kinds[family]
        if kind not in KINDS:
            raise LedgerError(f"kind of {family!r} must be one of {list(KINDS)}, got {kind!r}")
        value = epsilons[family]
        if kind == "refused":
            if value is not None:
                raise LedgerError(f"family {family!r} is refused, so its epsilon must be None, got {value!r}")
            reason = reasons.get(family)
            if not isinstance(reason, str) or not reason.strip():
                raise LedgerError(f"family {family!r} is refused: give its reason in reasons[{family!r}]")
            if family == default_family:
                raise LedgerError(
                    f"the default family {family!r} refused this round ({reason}); the ledger records only "
                    "rounds whose budget the default family can account"
                )
            entries[family] = {"value": None, "kind": kind, "reason": reason}
        elif family == default_family and kind != "upper":
            raise LedgerError(
                f"the default family {family!r} is labelled {kind!r}: the budget is enforced with an upper bound "
                "(a guarantee), so the default family's kind must be 'upper'"
            )
        else:
            try:
                number = check_epsilon(value, f"epsilon of {family!r}")
            except (TypeError, ValueError) as exc:  # the ledger reports every invalid record as a LedgerError
                raise LedgerError(str(exc)) from None
            entries[family] = {"value": number, "kind": kind, "reason": None}
    # Store the default family first so that exports list it first.
    record["epsilons"] = {default_family: entries[default_family]} | {
        f: e for f, e in entries.items() if f != default_family
    }
    record["default_family"] = default_family
    return record


#: Relative tolerance of the check that the default family's cumulative epsilon does not decrease.
MONOTONE_REL_TOL = 1e-9


def check_integrity(conn: sqlite3.Connection, path: Path) -> None:
    """``PRAGMA quick_check`` before a write: a damaged page (that reading would fail on) refuses the write instead
    of adding a round to a file that stays unreadable. Cheap for a ledger (kilobytes).

    Raises:
        LedgerError: SQLite reports a problem.
        sqlite3.DatabaseError: SQLite cannot even run the check (the caller turns it into a LedgerError).
    """
    problems = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
    if problems != ["ok"]:
        raise LedgerError(f"the ledger {str(path)!r} is damaged (SQLite's quick_check: {'; '.join(problems[:3])}); "
                          "it is not written. Restore it from a copy")


def refuse_a_decrease(conn: sqlite3.Connection, record: Mapping[str, Any], last: int) -> None:
    """A cumulative epsilon never decreases: the default family's value (an upper bound) at the same delta must
    not fall below the last round's, beyond :data:`MONOTONE_REL_TOL` (numerical noise of the accounting).

    Args:
        conn: the ledger's connection, inside the append's transaction.
        record: the round being appended (:func:`validate_record`; its default family first).
        last: the last recorded round.

    Raises:
        LedgerError: it does.
    """
    family = next(iter(record["epsilons"]))  # the default family comes first
    new = record["epsilons"][family]["value"]
    row = conn.execute(
        "SELECT e.value, r.delta FROM epsilons e JOIN rounds r ON r.round = e.round "
        "WHERE e.round = ? AND e.family = ?", (last, family)).fetchone()
    if row is None or row[0] is None or float(row[1]) != record["delta"]:
        return
    if new < float(row[0]) * (1.0 - MONOTONE_REL_TOL):
        raise LedgerError(
            f"round {record['round']}: the cumulative epsilon of {family!r} would fall from {float(row[0])!r} "
            f"(round {last}) to {new!r} at the same delta; composing a round never lowers it. Refused, the ledger "
            "is unchanged"
        )
