"""The ``shuffledp audit`` command: reads the ledgers and the shuffler's listing, runs
:func:`shuffledp.deploy.audit.audit` and prints its report as a table, or as JSON with ``--json``.

Exit code 0: consistent; 1: violations (listed); 2: the inputs could not be audited (reason on stderr).

``shuffledp audit privacy ...`` is the empirical privacy audit instead (:mod:`shuffledp.deploy.audit_privacy_cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any

from shuffledp.deploy.audit import AuditError, AuditReport, audit, read_releases, u32

__all__ = ["main", "format_report"]


def _verify_key_arg(values: Sequence[str]) -> tuple[str | None, dict[int, str]]:
    """Split the ``--shuffler-verify-key`` values into the bare key (at most one) and ``EPOCH=PATH`` keys."""
    bare: str | None = None
    per_epoch: dict[int, str] = {}
    for value in values:
        match = re.fullmatch(r"([0-9]+)=(.+)", value, flags=re.DOTALL)
        if match is None:
            if bare is not None:
                raise AuditError(f"--shuffler-verify-key is given twice without an epoch ({bare!r}, {value!r}): "
                                 "give other epochs' keys as EPOCH=PATH")
            bare = value
            continue
        epoch = u32(int(match.group(1)), f"the epoch of --shuffler-verify-key {value!r}")
        if epoch in per_epoch:
            raise AuditError(f"--shuffler-verify-key names key epoch {epoch} twice")
        per_epoch[epoch] = match.group(2)
    return bare, per_epoch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shuffledp audit",
        description="check that every batch the shuffler released was charged in the privacy ledgers "
                    "('shuffledp audit privacy --help': the empirical privacy audit)",
    )
    p.add_argument("--ledger", required=True, action="append",
                   help="a run's ledger.sqlite; repeat for each run (one per key epoch) the listing covers")
    p.add_argument("--releases", required=True,
                   help="the output of 'shuffledp shuffler journal --journal-dir DIR' (JSON lines)")
    p.add_argument("--shuffler-verify-key", action="append", default=[], metavar="[EPOCH=]PEM",
                   help="the shuffler's Ed25519 public key (PEM): verifies the audited epochs' attestations; "
                        "EPOCH=PEM gives one key epoch its own key (repeatable)")
    p.add_argument("--key-epoch", type=int, action="append",
                   help="audit only this key epoch (repeatable); default: every epoch in the releases")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``shuffledp audit ...`` (``argv[0]`` is ``"audit"``). Prints the report as a table (``--json``: as JSON).

    Exit code 0: consistent; 1: violations (listed); 2: the inputs could not be audited (reason on stderr).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "audit":
        args = args[1:]
    if args and args[0] == "privacy":
        from shuffledp.deploy.audit_privacy_cli import main as privacy_main

        return privacy_main(args)
    try:
        ns = _parser().parse_args(args)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    from shuffledp.accounting.ledger import Ledger, LedgerError

    try:
        with open(ns.releases, encoding="utf-8") as fh:
            releases = read_releases(fh.read())
        bare, per_epoch = _verify_key_arg(ns.shuffler_verify_key)
        from shuffledp.shuffler.keys import load_public_key

        verify_key = load_public_key(bare, "ed25519") if bare is not None else None
        epoch_keys = {epoch: load_public_key(path, "ed25519") for epoch, path in per_epoch.items()}
        ledgers: dict[str, list[dict[str, Any]]] = {}
        seen: dict[str, str] = {}
        for path in ns.ledger:
            real = os.path.realpath(path)
            if real in seen:
                raise AuditError(f"--ledger {path} is given twice (as {seen[real]!r})")
            seen[real] = path
            with Ledger(path, read_only=True) as ledger:  # the audit leaves the evidence as it was
                ledgers[path] = ledger.rows()
        report = audit(ledgers, releases, key_epochs=ns.key_epoch, verify_key=verify_key, epoch_keys=epoch_keys)
    except (AuditError, LedgerError, OSError, ValueError, sqlite3.Error) as exc:
        sys.stderr.write(f"shuffledp audit: {exc}\n")
        return 2
    if not report.signatures == "verified":
        sys.stderr.write("shuffledp audit: warning: attestation signatures were not (all) checked; give "
                         "--shuffler-verify-key\n")
    sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n" if ns.json else format_report(report))
    return 0 if report.ok else 1


def format_report(report: AuditReport) -> str:
    """The audit report as the table ``shuffledp audit`` prints by default.

    Returns:
        The text, ending with a newline.
    """
    verdict = "OK: every released batch was charged with its attested count" if report.ok else \
        f"VIOLATIONS: {len(report.violations)}"
    rows = [
        ("result", verdict),
        ("key epochs audited", ", ".join(str(e) for e in report.key_epochs)),
        ("ledgers", "; ".join(f"{name} (key epoch {epoch})" for name, epoch in report.ledger_epochs.items())),
        ("signatures", report.signatures),
        ("batches sealed / released", f"{report.batches_sealed} / {report.batches_released}"),
        ("reports released / charged", f"{report.reports_released} / {report.reports_charged}"),
        ("ledger rounds", str(report.ledger_rounds)),
        ("epsilons recomputed", f"{report.epsilon_values_checked} values in {report.epsilon_rows_checked} rows"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for title, items in (("violations", report.violations), ("notes", report.notes)):
        if items:
            lines.append(f"{title}:")
            lines += [f"  - {item}" for item in items]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
