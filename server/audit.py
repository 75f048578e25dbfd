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

With ``--shuffler-verify-key`` every listed attestation is verified and must name the batch id, key epoch, round
and count of its line. The release bit itself is the shuffler operator's statement (it is not signed).
Key epochs: a ledger is one run, whose rounds are unique within one key epoch; a listing with batches of several
epochs needs ``--key-epoch``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AuditError", "AuditReport", "audit", "main", "read_releases"]

_LISTING_KEYS = ("batch_id", "key_epoch", "round_id", "n", "statement", "signature", "released")


class AuditError(ValueError):
    """The inputs cannot be audited (unreadable, malformed, or ambiguous); nothing was concluded."""


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found. ``violations`` empty means every released batch was charged as attested."""

    key_epoch: int | None
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
            "key_epoch": self.key_epoch,
            "batches_sealed": self.batches_sealed,
            "batches_released": self.batches_released,
            "reports_released": self.reports_released,
            "ledger_rounds": self.ledger_rounds,
            "reports_charged": self.reports_charged,
            "violations": list(self.violations),
            "notes": list(self.notes),
        }


def read_releases(text: str) -> list[dict[str, Any]]:
    """Parse the JSON lines of ``shuffledp shuffler journal``. Raises :class:`AuditError` naming the bad line."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AuditError(f"releases line {number} is not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or any(k not in row for k in _LISTING_KEYS):
            raise AuditError(f"releases line {number} lacks one of {list(_LISTING_KEYS)}")
        for k in ("key_epoch", "round_id", "n"):
            if isinstance(row[k], bool) or not isinstance(row[k], int) or row[k] < 0:
                raise AuditError(f"releases line {number}: {k} must be an integer >= 0, got {row[k]!r}")
        if not isinstance(row["released"], bool):
            raise AuditError(f"releases line {number}: released must be true or false, got {row['released']!r}")
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


def audit(
    ledger_rows: Sequence[Mapping[str, Any]],
    releases: Sequence[Mapping[str, Any]],
    *,
    key_epoch: int | None = None,
    verify_key: bytes | None = None,
) -> AuditReport:
    """Check that every released batch was charged in the ledger with its attested count.

    ``ledger_rows`` as :meth:`accounting.ledger.Ledger.rows` returns them (``round``, ``n_reports``);
    ``releases`` as :func:`read_releases`. Raises :class:`AuditError` if the listing holds several key epochs
    and ``key_epoch`` is None, or names a round twice within the epoch.
    """
    epochs = sorted({int(r["key_epoch"]) for r in releases})
    if key_epoch is None and len(epochs) > 1:
        raise AuditError(f"the releases hold batches of key epochs {epochs}: say which one the ledger's run used "
                         "(--key-epoch)")
    epoch = key_epoch if key_epoch is not None else (epochs[0] if epochs else None)
    batches = [r for r in releases if int(r["key_epoch"]) == epoch]
    by_round: dict[int, Mapping[str, Any]] = {}
    for r in batches:
        rnd = int(r["round_id"])
        if rnd in by_round:  # the shuffler seals one batch per (epoch, round): a listing with two is not its own
            raise AuditError(f"the releases list two batches for key epoch {epoch}, round {rnd}")
        by_round[rnd] = r
    charged = {int(row["round"]): int(row["n_reports"]) for row in ledger_rows}
    violations: list[str] = []
    notes: list[str] = []
    if verify_key is not None:
        for r in batches:
            why = _check_attestation(r, verify_key)
            if why is not None:
                violations.append(f"round {r['round_id']} (batch {r['batch_id']}): {why}")
    released = [r for r in batches if r["released"]]
    for r in released:
        rnd, n = int(r["round_id"]), int(r["n"])
        if rnd not in charged:
            violations.append(f"round {rnd}: batch {r['batch_id']} ({n} reports) was released but the ledger has "
                              "no row for the round: privacy spent off the books")
        elif charged[rnd] != n:
            violations.append(f"round {rnd}: batch {r['batch_id']} released {n} reports, the ledger charged "
                              f"{charged[rnd]}")
    for rnd in sorted(charged):
        r = by_round.get(rnd)
        if r is None:
            notes.append(f"round {rnd}: charged ({charged[rnd]} reports) with no sealed batch in the releases "
                         "(over-charged, safe; is this the shuffler that served the run?)")
        elif not r["released"]:
            notes.append(f"round {rnd}: charged ({charged[rnd]} reports) but its batch was never released "
                         "(over-charged, safe: e.g. the server stopped between charge and fetch)")
    for r in batches:
        if not r["released"] and int(r["round_id"]) not in charged:
            notes.append(f"round {r['round_id']}: sealed, never released, not charged (nothing left the shuffler)")
    others = [r for r in releases if int(r["key_epoch"]) != epoch]
    if others:
        notes.append(f"{len(others)} sealed batch(es) of other key epochs "
                     f"{sorted({int(r['key_epoch']) for r in others})} ({sum(1 for r in others if r['released'])} "
                     "released) were not audited: they are not this run's")
    return AuditReport(
        key_epoch=epoch,
        batches_sealed=len(batches),
        batches_released=len(released),
        reports_released=sum(int(r["n"]) for r in released),
        ledger_rounds=len(charged),
        reports_charged=sum(charged.values()),
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
    p.add_argument("--key-epoch", type=int, help="the run's key epoch (needed if the releases hold several)")
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
        with Ledger(ns.ledger, create=False) as ledger:
            rows = ledger.rows()
        report = audit(rows, releases, key_epoch=ns.key_epoch, verify_key=verify_key)
    except (AuditError, LedgerError, OSError, ValueError) as exc:
        sys.stderr.write(f"shuffledp audit: {exc}\n")
        return 2
    sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
