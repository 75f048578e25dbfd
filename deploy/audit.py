"""``shuffledp audit``: set the shuffler's record of released batches against the server's privacy ledgers.

The server charges its accountant, and appends the ledger row, *before* it fetches a batch
(shuffledp.server.rounds); the shuffler journals a release record before the first byte of a batch leaves it
(shuffledp.shuffler.core, ``record_release``). So every batch the shuffler released must have a ledger row charged
with exactly its attested count. A released batch without one is privacy spent off the books; that, a count that
differs, a row that names another batch, or an attestation that does not verify is a **violation** (exit code 1). A
ledger row whose batch was never released (the server crashed between charge and fetch, or the fetch failed)
over-charges, which is safe, and is only noted; so is a sealed batch that was never released (nothing left the
shuffler).

The inputs come from two parties, which the trust model assumes do not collude:

    shuffledp shuffler journal --journal-dir DIR > releases.jsonl      (the shuffler's operator)
    shuffledp audit --ledger ledger.sqlite [--ledger other-run.sqlite ...] --releases releases.jsonl \\
        [--shuffler-verify-key shuffler-signing.pub] [--shuffler-verify-key 0=epoch0-signing.pub] \\
        [--key-epoch E ...]                                            (the auditor)

**Scope.** A run keeps one key epoch (a resume with another is refused, and the shuffler seals one batch per
(key epoch, round)), so a ledger charges the batches of one epoch, and an honest ledger records one. The audit
covers every key epoch in the listing unless the auditor names the epochs to audit (``--key-epoch``, repeatable):
the scope is the auditor's choice or the shuffler's record, never the audited server's, so leaving a run's ledger
out makes its released batches violations instead of hiding them. Epochs the auditor leaves out are noted.

**Signatures.** A bare ``--shuffler-verify-key`` verifies the lines of the audited epochs; ``E=PEM`` gives epoch
E its own key (the signing key changes with the key epoch). Every line's statement, verified or not, must name
the batch id, key epoch, round and count of its line (the shuffler records the line with the values it signed),
so relabelling those fields cannot move a released batch out of the audit, whatever its signature. A
line outside the scope is checked with its own key if given, else with every key given; one that none verifies
(it may be another key's) is counted in a note that names it. Such a line is attributed to no audited epoch:
editing its statement too is the same as deleting the line from the listing, which no audit can see. The release
bit and ``released_at`` are the shuffler operator's statement (they are not signed).

**Matching.** The server records with each ledger row the key epoch and batch id of the batch it charged (from
the verified attestation; ``shuffledp.accounting.ledger``, table ``batches``). A row is matched to the listing's
batch of its (key epoch, round), and a different batch id there is a violation, so a listing of another run cannot pass
for this one. A ledger written before rows recorded their batch is matched by round number alone, in the one
audited epoch that no other ledger charged (audit it alone with ``--key-epoch`` if that is ambiguous), and the
report notes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shuffledp.deploy.audit_recheck import recheck_epsilons

__all__ = ["AuditError", "AuditReport", "audit", "read_releases", "u32"]

_LISTING_KEYS = ("batch_id", "key_epoch", "round_id", "n", "statement", "signature", "released")
_U32_MAX = 2**32 - 1  # key epochs are u32 in the envelope binding and the attestation
_BATCH_ID_HEX = re.compile(r"[0-9a-f]{32}")  # shuffledp.accounting.ledger.BATCH_ID_BYTES = 16, stored as lowercase hex


class AuditError(ValueError):
    """The inputs cannot be audited (unreadable, malformed, or ambiguous); nothing was concluded."""


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found. ``violations`` empty means every released batch of the audited key epochs was
    charged, in the ledger of its epoch, with its attested count.

    ``key_epochs`` are the audited epochs; ``ledger_epochs`` maps each ledger's name to the key epoch it charged
    (None for a ledger with no rounds).
    """

    key_epochs: list[int]
    ledger_epochs: dict[str, int | None]
    batches_sealed: int
    batches_released: int
    reports_released: int
    ledger_rounds: int
    reports_charged: int
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: ``verified`` (every audited epoch's lines checked with a key), ``partly verified`` or ``unchecked``
    signatures: str = "unchecked"
    #: ledger rows and recorded epsilons recomputed (:mod:`shuffledp.deploy.audit_recheck`)
    epsilon_rows_checked: int = 0
    epsilon_values_checked: int = 0

    @property
    def ok(self) -> bool:
        """Whether the audit found no violation."""
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what ``shuffledp audit`` prints).

        Returns:
            ``ok``, the audited key epochs, counts, violations and notes.
        """
        return {
            "ok": self.ok,
            "key_epochs": list(self.key_epochs),
            "ledger_epochs": dict(self.ledger_epochs),
            "batches_sealed": self.batches_sealed,
            "batches_released": self.batches_released,
            "reports_released": self.reports_released,
            "ledger_rounds": self.ledger_rounds,
            "reports_charged": self.reports_charged,
            "signatures": self.signatures,
            "epsilon_rows_checked": self.epsilon_rows_checked,
            "epsilon_values_checked": self.epsilon_values_checked,
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


def _is_int(value: Any, low: int, high: int | None = None) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int) and value >= low
            and (high is None or value <= high))


def u32(value: Any, what: str) -> int:
    """``value`` as a key epoch (a u32 in the envelope binding and the attestation).

    Returns:
        It, as an int.

    Raises:
        AuditError: not an integer in [0, 2**32 - 1]; the message starts with ``what``.
    """
    if not _is_int(value, 0, _U32_MAX):
        raise AuditError(f"{what} must be an integer in [0, {_U32_MAX}] (a u32), got {value!r}")
    return int(value)


def _check_ledger_rows(name: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Refuse (AuditError) a ledger whose rows are not what :meth:`Ledger.rows` of a well-formed ledger gives:
    a hand-made or damaged file need not carry the CHECK constraints the ledger's schema does."""
    seen: set[int] = set()
    for row in rows:
        rnd = row.get("round")
        if not _is_int(rnd, 0):
            raise AuditError(f"ledger {name}: a round number is {rnd!r}, not an integer >= 0")
        if rnd in seen:
            raise AuditError(f"ledger {name}: round {rnd} is recorded twice")
        seen.add(rnd)
        n = row.get("n_reports")
        if not _is_int(n, 1):
            raise AuditError(f"ledger {name}, round {rnd}: n_reports is {n!r}, not an integer >= 1")
        epoch, batch_id = row.get("key_epoch"), row.get("batch_id")
        if (epoch is None) != (batch_id is None):
            raise AuditError(f"ledger {name}, round {rnd}: key_epoch {epoch!r} and batch_id {batch_id!r} name the "
                             "charged batch together (both or neither)")
        if epoch is not None:
            u32(epoch, f"ledger {name}, round {rnd}: key_epoch")
            if not isinstance(batch_id, str) or not _BATCH_ID_HEX.fullmatch(batch_id):
                raise AuditError(f"ledger {name}, round {rnd}: batch_id {batch_id!r} is not 32 lowercase hex digits")


def _statement_mismatch(row: Mapping[str, Any]) -> str | None:
    """None if the line's statement, read *without* verifying its signature, is an attestation of a known format
    that names the line's batch id, key epoch, round and count (with the types the shuffler writes: a string and
    three integers); else why not. The shuffler records a batch's line with the values it signed, so an honest
    listing agrees with itself: a line whose batch id, epoch, round or count was changed without its statement is
    caught with no key at all (editing the statement too breaks the signature, see the module docstring). The
    release bit is not in the statement, and not covered."""
    from shuffledp.shuffler.attestation import ATTESTATION_FORMATS

    try:
        doc = json.loads(str(row["statement"]))
    except (ValueError, RecursionError) as exc:
        return f"its statement is not an attestation (not JSON: {exc})"
    if not isinstance(doc, dict) or doc.get("format") not in ATTESTATION_FORMATS:
        return f"its statement is not an attestation (format {doc.get('format') if isinstance(doc, dict) else doc!r})"
    named = tuple(doc.get(k) for k in ("batch_id", "key_epoch", "round_id", "n_accepted"))
    if not isinstance(named[0], str) or not all(_is_int(v, 0) for v in named[1:]):
        return f"its statement is not an attestation ((batch, epoch, round, n) = {named})"
    listed = (row["batch_id"], row["key_epoch"], row["round_id"], row["n"])
    if named != listed:
        return f"its attestation names (batch, epoch, round, n) = {named}, the line says {listed}"
    return None


def _check_attestation(row: Mapping[str, Any], verify_key: bytes) -> str | None:
    """None if the line's attestation verifies with ``verify_key`` (its naming its line is
    :func:`_statement_mismatch`'s check); else why not."""
    from shuffledp.shuffler.attestation import Attestation, AttestationError

    try:
        Attestation.verify(str(row["statement"]).encode(), bytes.fromhex(str(row["signature"])), verify_key)
    except (AttestationError, ValueError) as exc:
        return f"its attestation does not verify ({exc})"
    return None


def _ledger_epoch(name: str, rows: Sequence[Mapping[str, Any]], scope: set[int], named: bool,
                  claimed: set[int]) -> tuple[int | None, list[str]]:
    """The key epoch a ledger charged, and notes. A run keeps one epoch, so a ledger that records several is not
    one run's; a ledger that records none (an older shuffledp) is put in the only audited epoch that no other
    ledger (``claimed``) charged."""
    recorded = sorted({int(r["key_epoch"]) for r in rows if r.get("key_epoch") is not None})
    unbound = [int(r["round"]) for r in rows if r.get("key_epoch") is None]
    if len(recorded) > 1:
        raise AuditError(f"ledger {name} records batches of key epochs {recorded}: a run keeps one key epoch "
                         "(a resume with another is refused), so this is not one run's ledger")
    if recorded:
        epoch = recorded[0]
        if named and epoch not in scope:
            raise AuditError(f"ledger {name} charged batches of key epoch {epoch}, which --key-epoch leaves out of "
                             f"the audit (it names {sorted(scope)})")
    elif not rows:
        return None, [f"ledger {name} has no rounds"]
    elif len(scope - claimed) == 1:
        epoch = next(iter(scope - claimed))
    else:
        free = sorted(scope - claimed)
        raise AuditError(f"ledger {name} does not record the key epoch it charged (written by an older shuffledp) "
                         f"and the audit leaves {free or 'no'} key epochs for it: audit it alone, naming its epoch "
                         "with --key-epoch")
    notes = []
    if unbound:
        notes.append(f"ledger {name} does not record which batch rounds {unbound} charged (written by an older "
                     f"shuffledp): they were matched by round number in key epoch {epoch}")
    return epoch, notes


def audit(
    ledgers: Mapping[str, Sequence[Mapping[str, Any]]],
    releases: Sequence[Mapping[str, Any]],
    *,
    key_epochs: Collection[int] | None = None,
    verify_key: bytes | None = None,
    epoch_keys: Mapping[int, bytes] | None = None,
) -> AuditReport:
    """Check that every released batch of the audited key epochs was charged with its attested count.

    Args:
        ledgers: ledger name (e.g. its path) -> its rows, as :meth:`shuffledp.accounting.ledger.Ledger.rows` returns
            them (``round``, ``n_reports`` and, for rounds recorded with their batch, ``key_epoch`` and ``batch_id``).
            One ledger per run, so one per key epoch.
        releases: the shuffler's listing, as :func:`read_releases` returns it.
        key_epochs: the epochs to audit; None (the default) audits every epoch in the listing. Released batches
            of an audited epoch that no ledger charges are violations.
        verify_key: the shuffler's Ed25519 public key (raw 32 bytes) for the audited epochs without their own.
        epoch_keys: key epoch -> its own verify key (the signing key changes with the key epoch).

    Raises:
        AuditError: a key epoch is not a u32; the listing is empty, names an (epoch, round) twice, or holds no
            batch of an audited ledger's epoch; a ledger's rows are malformed, record several epochs, record an
            epoch outside ``key_epochs``, share an epoch with another ledger, or (older ledgers) leave the epoch
            ambiguous.
    """
    if not isinstance(ledgers, Mapping):
        raise TypeError(f"ledgers must map each ledger's name to its rows, got {type(ledgers).__name__}")
    named = key_epochs is not None
    scope = {u32(e, "--key-epoch") for e in key_epochs} if key_epochs is not None else set()
    own_keys = {u32(e, "the epoch of a verify key"): k for e, k in (epoch_keys or {}).items()}
    if named and not scope:
        raise AuditError("key_epochs is empty: name at least one epoch to audit, or None to audit every epoch")
    if not releases:
        raise AuditError("the releases list no sealed batch: nothing to audit against (the wrong --journal-dir, "
                         "or a shuffler that sealed nothing)")
    by_key: dict[tuple[int, int], Mapping[str, Any]] = {}
    for r in releases:
        key = (int(r["key_epoch"]), int(r["round_id"]))
        if key in by_key:  # the shuffler seals one batch per (epoch, round): a listing with two is not its own
            raise AuditError(f"the releases list two batches for key epoch {key[0]}, round {key[1]}")
        by_key[key] = r
    listed = {epoch for epoch, _ in by_key}
    if not named:
        scope = set(listed)
    elif scope - listed:
        raise AuditError(f"--key-epoch names key epochs {sorted(scope - listed)} of which the releases hold no batch "
                         f"(they hold {sorted(listed)})")

    notes: list[str] = []
    charged: dict[tuple[int, int], tuple[str, Mapping[str, Any]]] = {}
    ledger_epochs: dict[str, int | None] = {}
    for name, rows in ledgers.items():
        _check_ledger_rows(name, rows)

    def records_epochs(item: tuple[str, Sequence[Mapping[str, Any]]]) -> bool:
        return any(r.get("key_epoch") is not None for r in item[1])

    # ledgers that record their epoch first, so an older one is put in the one audited epoch none of them charged
    for name, rows in sorted(ledgers.items(), key=lambda item: not records_epochs(item)):
        claimed = {e for e in ledger_epochs.values() if e is not None}
        epoch, why = _ledger_epoch(name, rows, scope, named, claimed)
        notes += why
        ledger_epochs[name] = epoch
        if epoch is None:
            continue
        other = next((n for n, e in ledger_epochs.items() if e == epoch and n != name), None)
        if other is not None:
            raise AuditError(f"ledgers {other} and {name} both charged key epoch {epoch}: one run per key epoch "
                             "(the shuffler seals one batch per epoch and round)")
        if epoch not in listed:
            raise AuditError(f"the releases hold no batch of key epoch {epoch}, which ledger {name} charged (only "
                             f"of {sorted(listed)}): the listing of another shuffler or journal")
        for row in rows:
            charged[(epoch, int(row["round"]))] = (name, row)

    def where(epoch: int, rnd: int) -> str:
        return f"round {rnd}" if len(scope) == 1 else f"key epoch {epoch}, round {rnd}"

    violations: list[str] = []
    unverified: dict[str, set[tuple[int, int]]] = {"no key": set(), "another key": set()}
    any_keys = [k for k in (verify_key, *own_keys.values()) if k is not None]
    for r in releases:
        epoch = int(r["key_epoch"])
        why = _statement_mismatch(r)  # every line, in the scope or not, keys or none
        key = own_keys.get(epoch, verify_key if epoch in scope else None)
        if why is None and key is not None:
            why = _check_attestation(r, key)
        elif why is None and any_keys:  # no key of its own, but signature checks were asked for
            if epoch in scope:
                unverified["no key"].add((epoch, int(r["round_id"])))
            elif all(_check_attestation(r, k) is not None for k in any_keys):
                # Outside the scope and no key given verifies it: it may be another key's. Its statement names its
                # line (checked above), so it is not attributed to any audited epoch.
                unverified["another key"].add((epoch, int(r["round_id"])))
        if why is not None:
            violations.append(f"key epoch {epoch}, round {r['round_id']} (batch {r['batch_id']}): {why}")
    if unverified["no key"]:
        notes.append(f"the lines of key epochs {sorted({e for e, _ in unverified['no key']})} were not verified: "
                     "no key was given for them")
    if unverified["another key"]:
        lines = ", ".join(f"{e}/{rnd}" for e, rnd in sorted(unverified["another key"]))
        notes.append(f"{len(unverified['another key'])} line(s) outside the audit (key epoch/round: {lines}) verify "
                     "with none of the given keys: expected if their epoch had another signing key (give it as "
                     "EPOCH=PEM); otherwise they are unattributed, like lines missing from the listing")

    for (epoch, rnd), (name, row) in sorted(charged.items()):
        n = int(row["n_reports"])
        line = by_key.get((epoch, rnd))
        if line is None:
            notes.append(f"{where(epoch, rnd)}: charged ({n} reports) with no sealed batch in the releases "
                         "(over-charged, safe; is this the shuffler that served the run?)")
        elif row.get("batch_id") is not None and row["batch_id"] != line["batch_id"]:
            violations.append(f"{where(epoch, rnd)}: the ledger charged batch {row['batch_id']} ({n} reports), the "
                              f"shuffler sealed batch {line['batch_id']} ({line['n']} reports, "
                              f"{'released' if line['released'] else 'not released'}): the records disagree")
        elif not line["released"]:
            notes.append(f"{where(epoch, rnd)}: charged ({n} reports) but its batch was never released "
                         "(over-charged, safe: e.g. the server stopped between charge and fetch)")
        elif int(line["n"]) != n:
            violations.append(f"{where(epoch, rnd)}: batch {line['batch_id']} released {line['n']} reports, the "
                              f"ledger charged {n}")
    batches = [r for r in releases if int(r["key_epoch"]) in scope]
    covered = {e for e in ledger_epochs.values() if e is not None}
    for r in batches:
        epoch, rnd = int(r["key_epoch"]), int(r["round_id"])
        if (epoch, rnd) in charged:
            continue
        if r["released"]:
            hint = "" if epoch in covered else (f" (no ledger given charged key epoch {epoch}: give that run's "
                                                "ledger with --ledger, or leave the epoch out with --key-epoch)")
            violations.append(f"{where(epoch, rnd)}: batch {r['batch_id']} ({r['n']} reports) was released but no "
                              f"ledger row charged it: privacy spent off the books{hint}")
        else:
            notes.append(f"{where(epoch, rnd)}: sealed, never released, not charged (nothing left the shuffler)")
    others = [r for r in releases if int(r["key_epoch"]) not in scope]
    if others:
        notes.append(f"{len(others)} sealed batch(es) of key epochs {sorted({int(r['key_epoch']) for r in others})} "
                     f"({sum(1 for r in others if r['released'])} released) were left out of the audit by "
                     "--key-epoch")
    rows_checked = values_checked = 0
    for name, rows in ledgers.items():
        recheck = recheck_epsilons(name, rows)
        violations += recheck.violations
        notes += recheck.notes
        rows_checked += recheck.rows_checked
        values_checked += recheck.values_checked
    unchecked = sorted(e for e in scope if e not in own_keys and verify_key is None)
    signatures = "verified" if not unchecked else "unchecked" if len(unchecked) == len(scope) else "partly verified"
    if unchecked:
        notes.append(f"the attestations of key epochs {unchecked} were NOT verified (no --shuffler-verify-key): "
                     "the counts are the shuffler operator's listing, not its signed statements")
    released = [r for r in batches if r["released"]]
    all_rows = [row for rows in ledgers.values() for row in rows]
    return AuditReport(
        key_epochs=sorted(scope),
        ledger_epochs={name: ledger_epochs[name] for name in ledgers},
        batches_sealed=len(batches),
        batches_released=len(released),
        reports_released=sum(int(r["n"]) for r in released),
        ledger_rounds=len(all_rows),
        reports_charged=sum(int(row["n_reports"]) for row in all_rows),
        violations=violations,
        notes=notes,
        signatures=signatures,
        epsilon_rows_checked=rows_checked,
        epsilon_values_checked=values_checked,
    )
