"""``shuffledp audit``: every batch the shuffler released must be charged in the ledger with its attested count."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from accounting.ledger import Ledger
from server.audit import AuditError, audit, main, read_releases
from shuffler.attestation import DROP_REASONS, Attestation, sign_statement
from shuffler.keys import save_public_key

_SK = ed25519.Ed25519PrivateKey.generate()
_SK_RAW = _SK.private_bytes_raw()
_PK_RAW = _SK.public_key().public_bytes_raw()


def _line(round_id: int, n: int, *, released: bool = True, epoch: int = 0, sign_n: int | None = None) -> dict:
    batch_id = bytes([round_id]) * 16
    statement = Attestation.build_statement(
        batch_id=batch_id, protocol_version=1, key_epoch=epoch, round_id=round_id, model_digest=b"\0" * 32, k=2,
        n_received=max(n, sign_n or 0), n_accepted=n if sign_n is None else sign_n, inner_length=64, output_digest=b"\1" * 32,
        dropped={r: 0 for r in DROP_REASONS},
    )
    return {"batch_id": batch_id.hex(), "key_epoch": epoch, "round_id": round_id, "n": n,
            "statement": statement.decode(), "signature": sign_statement(statement, _SK_RAW).hex(),
            "released": released, "released_at": 1_700_000_000 if released else None}


def _rows(*pairs: tuple[int, int], epoch: int | None = 0) -> list[dict]:
    """Ledger rows as Ledger.rows() gives them: with the batch each round charged (the batch ids of _line), or,
    with ``epoch=None``, as a ledger written before rows recorded their batch."""
    return [{"round": r, "n_reports": n, "key_epoch": epoch,
             "batch_id": None if epoch is None else (bytes([r]) * 16).hex()} for r, n in pairs]


def test_consistent_run_passes() -> None:
    rep = audit(_rows((1, 10), (2, 9)), [_line(1, 10), _line(2, 9)], verify_key=_PK_RAW)
    assert rep.ok and (rep.batches_released, rep.reports_released, rep.reports_charged) == (2, 19, 19)
    assert rep.notes == []


def test_released_but_not_charged_is_a_violation() -> None:
    rep = audit(_rows((1, 10)), [_line(1, 10), _line(2, 9)])
    assert not rep.ok and len(rep.violations) == 1 and "round 2" in rep.violations[0]
    assert "off the books" in rep.violations[0]


def test_charged_with_another_count_is_a_violation() -> None:
    rep = audit(_rows((1, 10), (2, 8)), [_line(1, 10), _line(2, 9)])
    assert rep.violations == [f"round 2: batch {bytes([2]).hex() * 16} released 9 reports, the ledger charged 8"]


def test_over_charging_is_noted_not_a_violation() -> None:
    rep = audit(_rows((1, 10), (2, 9), (3, 7)), [_line(1, 10), _line(2, 9, released=False)])
    assert rep.ok and rep.batches_sealed == 2 and rep.batches_released == 1
    assert len(rep.notes) == 2 and "round 2" in rep.notes[0] and "round 3" in rep.notes[1]
    # a sealed batch that was neither released nor charged is noted too
    rep = audit(_rows((1, 10)), [_line(1, 10), _line(2, 9, released=False)])
    assert rep.ok and rep.notes == ["round 2: sealed, never released, not charged (nothing left the shuffler)"]


def test_a_listing_that_disagrees_with_its_signed_attestation_is_a_violation() -> None:
    doctored = _line(2, 9, sign_n=12)  # the line says 9; the shuffler signed 12
    rep = audit(_rows((1, 10), (2, 9)), [_line(1, 10), doctored], verify_key=_PK_RAW)
    assert len(rep.violations) == 1 and "names (batch, epoch, round, n)" in rep.violations[0]
    assert audit(_rows((1, 10), (2, 9)), [_line(1, 10), doctored]).ok  # without the key it cannot tell
    forged = _line(1, 10) | {"signature": "00" * 64}
    assert "does not verify" in audit(_rows((1, 10)), [forged], verify_key=_PK_RAW).violations[0]


def test_an_old_ledger_is_matched_by_round_in_the_named_epoch() -> None:
    lines = [_line(1, 10, epoch=0), _line(1, 4, epoch=1)]
    with pytest.raises(AuditError, match="key epochs \\[0, 1\\]"):
        audit(_rows((1, 10), epoch=None), lines)
    rep = audit(_rows((1, 10), epoch=None), lines, key_epoch=0)
    assert rep.ok and rep.batches_sealed == 1 and rep.key_epochs == [0]
    # the matching by round alone is noted, and the other epoch's batch is not silently dropped from the report
    assert rep.notes == ["the ledger does not record which batch rounds [1] charged (written by an older "
                         "shuffledp): they were matched by round number in key epoch 0",
                         "1 sealed batch(es) of other key epochs [1] (1 released) were not audited: they are not "
                         "this run's"]
    assert not audit(_rows((1, 10), epoch=None), lines, key_epoch=1).ok  # epoch 1's round 1 released 4, charged 10
    assert audit(_rows((1, 10), epoch=None), lines[:1]).ok  # one epoch in the listing: no need to name it
    with pytest.raises(AuditError, match="two batches"):
        audit(_rows((1, 10)), [_line(1, 10), _line(1, 10)])


def test_the_ledger_names_its_epochs_and_key_epoch_is_then_a_check() -> None:
    lines = [_line(1, 10, epoch=0), _line(1, 4, epoch=1)]
    rep = audit(_rows((1, 10)), lines)  # the rows say epoch 0: no ambiguity
    assert rep.ok and rep.key_epochs == [0] and rep.batches_sealed == 1
    assert audit(_rows((1, 10)), lines, key_epoch=0).ok
    with pytest.raises(AuditError, match="not an epoch of this ledger"):
        audit(_rows((1, 10)), lines, key_epoch=1)
    # a run whose key was rotated: round 1 in epoch 0, round 2 in epoch 1; both audited
    rows = _rows((1, 10)) + _rows((2, 9), epoch=1)
    rep = audit(rows, [_line(1, 10, epoch=0), _line(2, 9, epoch=1), _line(3, 5, epoch=1, released=False)],
                verify_key=_PK_RAW)
    assert rep.ok and rep.key_epochs == [0, 1] and (rep.batches_released, rep.reports_released) == (2, 19)
    assert rep.notes == ["key epoch 1, round 3: sealed, never released, not charged (nothing left the shuffler)"]


def test_a_listing_of_another_run_with_the_same_rounds_and_counts_does_not_pass() -> None:
    other = [_line(1, 10) | {"batch_id": "ab" * 16}, _line(2, 9)]  # round 1 sealed as another batch
    rep = audit(_rows((1, 10), (2, 9)), other)
    assert len(rep.violations) == 1 and rep.violations[0].startswith(
        f"round 1: the ledger charged batch {'01' * 16} (10 reports), the shuffler sealed batch {'ab' * 16}")
    # an old ledger cannot tell (it recorded no batch ids), and the report says how it matched
    rep = audit(_rows((1, 10), (2, 9), epoch=None), other)
    assert rep.ok and "matched by round number" in rep.notes[0]


def test_a_relabelled_epoch_cannot_hide_a_released_batch() -> None:
    # The shuffler released round 2 in epoch 0 (signed so); the listing's unsigned key_epoch says 7.
    hidden = _line(2, 9) | {"key_epoch": 7}
    lines = [_line(1, 10), hidden]
    rep = audit(_rows((1, 10)), lines, verify_key=_PK_RAW)
    assert not rep.ok and len(rep.violations) == 1
    assert rep.violations[0].startswith("key epoch 7, round 2") and "names (batch, epoch, round, n)" in rep.violations[0]
    assert not audit(_rows((1, 10), epoch=None), lines, key_epoch=0, verify_key=_PK_RAW).ok


@pytest.mark.parametrize("key_epoch", [-1, 2**32, True, 1.0])
def test_a_key_epoch_outside_u32_is_refused(key_epoch: object) -> None:
    with pytest.raises(AuditError, match="u32"):
        audit(_rows((1, 10), epoch=None), [_line(1, 10)], key_epoch=key_epoch)  # type: ignore[arg-type]


def test_a_key_epoch_with_no_batch_in_the_listing_is_refused_not_passed() -> None:
    # before: every batch became "another epoch's", nothing was audited, and the report said ok
    with pytest.raises(AuditError, match="no batch of key epoch"):
        audit(_rows((1, 10), epoch=None), [_line(1, 10), _line(2, 9)], key_epoch=5)
    with pytest.raises(AuditError, match="no batch of key epoch"):
        audit(_rows((1, 10), epoch=5), [_line(1, 10)])


@pytest.mark.parametrize(
    ("text", "match"),
    [("{not json", "line 2 is not JSON"), ('{"batch_id": "00"}', "lacks one of"),
     (json.dumps(_line(1, 3) | {"n": -1}), "n must be an integer >= 0"),
     (json.dumps(_line(1, 3) | {"key_epoch": 2**32}), "line 2: key_epoch must be an integer in \\[0, 4294967295\\]"),
     (json.dumps(_line(1, 3) | {"released": "yes"}), "released must be true or false"),
     (json.dumps(_line(1, 3) | {"statement": {"n": 3}}), "line 2: statement must be a string"),
     (json.dumps({k: v for k, v in _line(1, 3).items() if k != "released_at"}), "lacks one of"),
     (json.dumps(_line(1, 3) | {"released_at": None}), "line 2: a released batch needs released_at"),
     (json.dumps(_line(1, 3) | {"released_at": "2026-01-01"}), "a released batch needs released_at"),
     (json.dumps(_line(1, 3) | {"released_at": -5}), "a released batch needs released_at"),
     (json.dumps(_line(1, 3, released=False) | {"released_at": 1_700_000_000}), "released is false but"),
     ("[" * 100_000 + "]" * 100_000, "line 2 cannot be read as JSON \\(RecursionError"),
     ('{"n": ' + "9" * 5000 + "}", "line 2 cannot be read as JSON \\(ValueError")],
    ids=["not-json", "missing-keys", "negative-n", "epoch-over-u32", "released-not-bool", "statement-not-str",
         "no-released_at", "released-at-null", "released-at-str", "released-at-negative", "unreleased-with-time",
         "deep-nesting", "huge-int"],
)
def test_malformed_listing_lines_are_refused_by_number(text: str, match: str) -> None:
    with pytest.raises(AuditError, match=match):
        read_releases("\n" + text)


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger_path = tmp_path / "ledger.sqlite"
    with Ledger(ledger_path) as ledger:
        for rnd, n, eps in ((1, 10, 1.0), (2, 9, 1.5)):
            ledger.append(round=rnd, n_reports=n, eps0=2.0, mechanism="laplace", delta=1e-6,
                          epsilons={"clones": eps}, kinds={"clones": "upper"})
    key = tmp_path / "shuffler-signing.pub"
    save_public_key(key, _PK_RAW, "ed25519")
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(x) + "\n" for x in (_line(1, 10), _line(2, 9))))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in (_line(1, 10), _line(2, 9), _line(3, 5))))
    base = ["audit", "--ledger", str(ledger_path), "--shuffler-verify-key", str(key), "--releases"]
    assert main(base + [str(good)]) == 0 and json.loads(capsys.readouterr().out)["ok"] is True
    assert main(base + [str(bad)]) == 1
    assert "round 3" in json.loads(capsys.readouterr().out)["violations"][0]
    assert main(base + [str(tmp_path / "missing.jsonl")]) == 2
    assert "shuffledp audit:" in capsys.readouterr().err
    assert main(["audit", "--ledger", str(tmp_path / "none.sqlite"), "--releases", str(good)]) == 2
    assert "no ledger" in capsys.readouterr().err
    for epoch in ("-1", "4294967296", "5"):  # outside u32; an epoch with no batch in the listing
        assert main(base + [str(good), "--key-epoch", epoch]) == 2
        assert "key epoch" in capsys.readouterr().err
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps(_line(1, 10)) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(base + [str(deep)]) == 2 and "line 2" in capsys.readouterr().err
    broken = tmp_path / "broken.sqlite"  # right name and markers, wrong columns: SQLite errors, not a traceback
    conn = sqlite3.connect(broken)
    conn.executescript("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT); CREATE TABLE rounds(x); "
                       "CREATE TABLE epsilons(y); INSERT INTO meta VALUES ('format', 'shuffledp.ledger'), "
                       "('schema_version', '1');")
    conn.close()
    assert main(["audit", "--ledger", str(broken), "--releases", str(good)]) == 2
    assert "cannot read the ledger" in capsys.readouterr().err
