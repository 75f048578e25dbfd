"""``shuffledp audit``: set the shuffler's record of released batches against the server's privacy ledger.

The server charges its accountant, and appends the ledger row, *before* it fetches a batch (server.rounds); the
shuffler journals a release record before the first byte of a batch leaves it (shuffler.core, ``record_release``).
So every batch the shuffler released must have a ledger row for its round charged with exactly its attested
count. A released batch without one is privacy spent off the books; that, a count that differs, or an
attestation that does not verify is a **violation** (exit code 1). A ledger row whose batch was never released
(the server crashed between charge and fetch, or the fetch failed) over-charges, which is safe, and is only
noted; so is a sealed batch that was never released (nothing left the shuffler).

The two inputs come from two parties, which the trust model assumes do not collude:

    shuffledp shuffler journal --journal-dir DIR > releases.jsonl      (the shuffler's operator)
    shuffledp audit --ledger ledger.sqlite --releases releases.jsonl \\
        [--shuffler-verify-key shuffler-signing.pub] [--key-epoch E]    (the auditor)

With ``--shuffler-verify-key`` every listed attestation, of whatever key epoch, is verified and must name the
batch id, key epoch, round and count of its line. The release bit and ``released_at`` are the shuffler
operator's statement (they are not signed).

Matching: the server records with each ledger row the key epoch and batch id of the batch it charged (taken
from the verified attestation; ``accounting.ledger``, table ``batches``). A row is matched to the listing's
batch of its (key epoch, round), and a different batch id there is a violation, so a listing of another run
cannot pass for this one. The audited epochs are the ledger's; batches of other epochs are noted, not audited.
A ledger written before rows recorded their batch is matched by round number alone, in the epoch given by
``--key-epoch`` (needed only if the listing holds several), and the report notes it.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AuditError", "AuditReport", "audit", "main", "read_releases"]

_LISTING_KEYS = ("batch_id", "key_epoch", "round_id", "n", "statement", "signature", "released")
_U32_MAX = 2**32 - 1  # key epochs are u32 in the envelope binding and the attestation


class AuditError(ValueError):
    """The inputs cannot be audited (unreadable, malformed, or ambiguous); nothing was concluded."""


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found. ``violations`` empty means every released batch was charged as attested."""

    key_epochs: list[int]
    batches_sealed: int
    batches_released: int
    reports_released: int
    ledger_rounds: int
    reports_charged: int
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "key_epochs": list(self.key_epochs),
            "batches_sealed": self.batches_sealed,
            "batches_released": self.batches_released,
            "reports_released": self.reports_released,
            "ledger_rounds": self.ledger_rounds,
            "reports_charged": self.reports_charged,
            "violations": list(self.violations),
            "notes": list(self.notes),
        }


def read_releases(text: str) -> list[dict[str, Any]]:
    """Parse the JSON lines of ``shuffledp shuffler journal``. Raises :class:`AuditError` naming the bad line.

    Each line must carry the keys of :data:`_LISTING_KEYS` and ``released_at``, with ``key_epoch`` a u32,
    ``round_id`` and ``n`` integers >= 0, ``released`` a bool, and ``released_at`` whole seconds >= 0 exactly
    when ``released`` is true (``null`` otherwise).
    """
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AuditError(f"releases line {number} is not JSON ({exc.msg})") from None
        except (RecursionError, ValueError) as exc:  # nested too deeply; an integer with too many digits
            raise AuditError(f"releases line {number} cannot be read as JSON ({type(exc).__name__}: {exc})") from None
        if not isinstance(row, dict) or any(k not in row for k in (*_LISTING_KEYS, "released_at")):
            raise AuditError(f"releases line {number} lacks one of {[*_LISTING_KEYS, 'released_at']}")
        for k, top in (("key_epoch", _U32_MAX), ("round_id", None), ("n", None)):
            value = row[k]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (top is not None and value > top):
                allowed = f"an integer in [0, {top}]" if top is not None else "an integer >= 0"
                raise AuditError(f"releases line {number}: {k} must be {allowed}, got {value!r}")
        for k in ("batch_id", "statement", "signature"):
            if not isinstance(row[k], str):
                raise AuditError(f"releases line {number}: {k} must be a string, got {type(row[k]).__name__}")
        if not isinstance(row["released"], bool):
            raise AuditError(f"releases line {number}: released must be true or false, got {row['released']!r}")
        at = row["released_at"]
        if row["released"]:
            if isinstance(at, bool) or not isinstance(at, int) or at < 0:
                raise AuditError(f"releases line {number}: a released batch needs released_at, whole seconds "
                                 f"since the epoch >= 0, got {at!r}")
        elif at is not None:
            raise AuditError(f"releases line {number}: released is false but released_at is {at!r} (must be null)")
        rows.append(row)
    return rows


def _check_attestation(row: Mapping[str, Any], verify_key: bytes) -> str | None:
    """None if the line's attestation verifies and names its batch, epoch, round and count; else why not."""
    from shuffler.attestation import Attestation, AttestationError

    try:
        att = Attestation.verify(str(row["statement"]).encode(), bytes.fromhex(str(row["signature"])), verify_key)
    except (AttestationError, ValueError) as exc:
        return f"its attestation does not verify ({exc})"
    named = (att.batch_id.hex(), att.key_epoch, att.round_id, att.n_accepted)
    listed = (row["batch_id"], row["key_epoch"], row["round_id"], row["n"])
    if named != listed:
        return f"its attestation names (batch, epoch, round, n) = {named}, the line says {listed}"
    return None


def _key_epoch_arg(key_epoch: Any) -> int | None:
    if key_epoch is None:
        return None
    if isinstance(key_epoch, bool) or not isinstance(key_epoch, int) or not 0 <= key_epoch <= _U32_MAX:
        raise AuditError(f"the key epoch must be an integer in [0, {_U32_MAX}] (a u32), got {key_epoch!r}")
    return key_epoch


def _ledger_epochs(ledger_rows: Sequence[Mapping[str, Any]], releases: Sequence[Mapping[str, Any]],
                   key_epoch: int | None) -> tuple[list[int], int | None, list[str]]:
    """Which key epochs the ledger's run used: (epochs audited, epoch assumed for rows without one, notes)."""
    recorded = sorted({int(r["key_epoch"]) for r in ledger_rows if r.get("key_epoch") is not None})
    unbound = [int(r["round"]) for r in ledger_rows if r.get("key_epoch") is None]
    listed = sorted({int(r["key_epoch"]) for r in releases})
    notes: list[str] = []
    if recorded and key_epoch is not None and key_epoch not in recorded:
        raise AuditError(f"--key-epoch {key_epoch} is not an epoch of this ledger: it records batches of key "
                         f"epochs {recorded}")
    assumed: int | None = None
    if unbound or not recorded:
        if key_epoch is not None:
            assumed = key_epoch
        elif len(recorded) == 1:
            assumed = recorded[0]
        elif len(listed) == 1 and not recorded:
            assumed = listed[0]
        elif listed or recorded:
            raise AuditError(f"the ledger does not record the key epoch of rounds {unbound} and the releases hold "
                             f"batches of key epochs {listed}: say which one the ledger's run used (--key-epoch)")
        if unbound:
            notes.append(f"the ledger does not record which batch rounds {unbound} charged (written by an older "
                         f"shuffledp): they were matched by round number in key epoch {assumed}")
    epochs = sorted(set(recorded) | ({assumed} if assumed is not None else set()))
    if listed and not set(epochs) & set(listed):
        raise AuditError(f"the releases hold no batch of key epoch(s) {epochs}, only of {listed}: the wrong "
                         "--key-epoch, or the listing of another shuffler")
    return epochs, assumed, notes


def audit(
    ledger_rows: Sequence[Mapping[str, Any]],
    releases: Sequence[Mapping[str, Any]],
    *,
    key_epoch: int | None = None,
    verify_key: bytes | None = None,
) -> AuditReport:
    """Check that every released batch of the run's key epochs was charged in the ledger with its attested count.

    ``ledger_rows`` as :meth:`accounting.ledger.Ledger.rows` returns them (``round``, ``n_reports`` and, for
    rounds recorded with their batch, ``key_epoch`` and ``batch_id``); ``releases`` as :func:`read_releases`.

    * With ``verify_key`` every line's attestation is verified first, whatever its epoch, so relabelling a line's
      (unsigned) epoch or round cannot move a released batch out of the audit.
    * The run's key epochs are those the ledger records. For rounds recorded without their batch (an older
      ledger) ``key_epoch`` names the epoch; it may be omitted when the ledger or the listing has only one.
    * A ledger row is matched to the listing's batch of its (epoch, round); where the row names its batch id,
      a different batch there is a violation (the two records disagree on what was charged).

    Raises:
        AuditError: ``key_epoch`` is not a u32 or not one of the ledger's epochs; the epoch is ambiguous; the
            listing holds no batch of the run's epochs; or it names an (epoch, round) twice.
    """
    key_epoch = _key_epoch_arg(key_epoch)
    by_key: dict[tuple[int, int], Mapping[str, Any]] = {}
    for r in releases:
        key = (int(r["key_epoch"]), int(r["round_id"]))
        if key in by_key:  # the shuffler seals one batch per (epoch, round): a listing with two is not its own
            raise AuditError(f"the releases list two batches for key epoch {key[0]}, round {key[1]}")
        by_key[key] = r
    violations: list[str] = []
    if verify_key is not None:
        for r in releases:
            why = _check_attestation(r, verify_key)
            if why is not None:
                violations.append(f"key epoch {r['key_epoch']}, round {r['round_id']} (batch {r['batch_id']}): {why}")
    epochs, assumed, notes = _ledger_epochs(ledger_rows, releases, key_epoch)
    batches = [r for r in releases if int(r["key_epoch"]) in epochs]
    released = [r for r in batches if r["released"]]
    charged_keys: set[tuple[int, int]] = set()
    for row in ledger_rows:
        rnd, n = int(row["round"]), int(row["n_reports"])
        epoch = assumed if row.get("key_epoch") is None else int(row["key_epoch"])
        charged_keys.add((epoch, rnd))
        line = by_key.get((epoch, rnd))
        where = f"round {rnd}" if len(epochs) == 1 else f"key epoch {epoch}, round {rnd}"
        if line is None:
            notes.append(f"{where}: charged ({n} reports) with no sealed batch in the releases "
                         "(over-charged, safe; is this the shuffler that served the run?)")
        elif row.get("batch_id") is not None and row["batch_id"] != line["batch_id"]:
            violations.append(f"{where}: the ledger charged batch {row['batch_id']} ({n} reports), the shuffler "
                              f"sealed batch {line['batch_id']} ({line['n']} reports, "
                              f"{'released' if line['released'] else 'not released'}): the records disagree")
        elif not line["released"]:
            notes.append(f"{where}: charged ({n} reports) but its batch was never released "
                         "(over-charged, safe: e.g. the server stopped between charge and fetch)")
        elif int(line["n"]) != n:
            violations.append(f"{where}: batch {line['batch_id']} released {line['n']} reports, the ledger "
                              f"charged {n}")
    for r in batches:
        key = (int(r["key_epoch"]), int(r["round_id"]))
        if key in charged_keys:
            continue
        where = f"round {key[1]}" if len(epochs) == 1 else f"key epoch {key[0]}, round {key[1]}"
        if r["released"]:
            violations.append(f"{where}: batch {r['batch_id']} ({r['n']} reports) was released but the ledger has "
                              "no row for the round: privacy spent off the books")
        else:
            notes.append(f"{where}: sealed, never released, not charged (nothing left the shuffler)")
    others = [r for r in releases if int(r["key_epoch"]) not in epochs]
    if others:
        notes.append(f"{len(others)} sealed batch(es) of other key epochs "
                     f"{sorted({int(r['key_epoch']) for r in others})} ({sum(1 for r in others if r['released'])} "
                     "released) were not audited: they are not this run's")
    return AuditReport(
        key_epochs=epochs,
        batches_sealed=len(batches),
        batches_released=len(released),
        reports_released=sum(int(r["n"]) for r in released),
        ledger_rounds=len(ledger_rows),
        reports_charged=sum(int(row["n_reports"]) for row in ledger_rows),
        violations=violations,
        notes=notes,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shuffledp audit",
        description="check that every batch the shuffler released was charged in the privacy ledger",
    )
    p.add_argument("--ledger", required=True, help="the run's ledger.sqlite")
    p.add_argument("--releases", required=True,
                   help="the output of 'shuffledp shuffler journal --journal-dir DIR' (JSON lines)")
    p.add_argument("--shuffler-verify-key", help="the shuffler's Ed25519 public key (PEM): verify every attestation")
    p.add_argument("--key-epoch", type=int,
                   help="the run's key epoch, for a ledger that does not record it (written by an older shuffledp) "
                        "when the releases hold several; with a ledger that records its epochs, a check")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``shuffledp audit ...`` (``argv[0]`` is ``"audit"``). Prints the report as JSON on stdout.

    Exit code 0: consistent; 1: violations (listed); 2: the inputs could not be audited (reason on stderr).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "audit":
        args = args[1:]
    try:
        ns = _parser().parse_args(args)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    from accounting.ledger import Ledger, LedgerError

    try:
        with open(ns.releases, encoding="utf-8") as fh:
            releases = read_releases(fh.read())
        verify_key = None
        if ns.shuffler_verify_key:
            from shuffler.keys import load_public_key

            verify_key = load_public_key(ns.shuffler_verify_key, "ed25519")
        with Ledger(ns.ledger, read_only=True) as ledger:  # the audit leaves the evidence as it was
            rows = ledger.rows()
        report = audit(rows, releases, key_epoch=ns.key_epoch, verify_key=verify_key)
    except (AuditError, LedgerError, OSError, ValueError, sqlite3.Error) as exc:
        sys.stderr.write(f"shuffledp audit: {exc}\n")
        return 2
    sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
