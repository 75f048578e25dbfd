"""``shuffledp audit``: every batch the shuffler released must be charged in the ledger with its attested count."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from shuffledp.accounting.bounds import epsilon_for_rounds
from shuffledp.accounting.events import ShuffleRound
from shuffledp.accounting.ledger import Ledger
from shuffledp.deploy.audit import AuditError, AuditReport, audit, read_releases
from shuffledp.deploy.audit_cli import main
from shuffledp.shuffler.attestation import DROP_REASONS, Attestation, sign_statement
from shuffledp.shuffler.keys import save_public_key

_SK = ed25519.Ed25519PrivateKey.generate()
_SK_RAW = _SK.private_bytes_raw()
_PK_RAW = _SK.public_key().public_bytes_raw()


_SK1 = ed25519.Ed25519PrivateKey.generate()  # epoch 1's signing key: the signing key changes with the epoch
_PK1_RAW = _SK1.public_key().public_bytes_raw()


def _line(round_id: int, n: int, *, released: bool = True, epoch: int = 0, sign_n: int | None = None,
          key: bytes = _SK_RAW) -> dict:
    batch_id = bytes([round_id + 16 * epoch]) * 16
    statement = Attestation.build_statement(
        batch_id=batch_id, protocol_version=1, key_epoch=epoch, round_id=round_id, model_digest=b"\0" * 32, k=2,
        n_received=max(n, sign_n or 0), n_accepted=n if sign_n is None else sign_n, inner_length=64,
        output_digest=b"\1" * 32,
        dropped={r: 0 for r in DROP_REASONS},
    )
    return {"batch_id": batch_id.hex(), "key_epoch": epoch, "round_id": round_id, "n": n,
            "statement": statement.decode(), "signature": sign_statement(statement, key).hex(),
            "released": released, "released_at": 1_700_000_000 if released else None}


def _rows(*pairs: tuple[int, int], epoch: int | None = 0) -> list[dict]:
    """Ledger rows as Ledger.rows() gives them: with the batch each round charged (the batch ids of _line), or,
    with ``epoch=None``, as a ledger written before rows recorded their batch."""
    return [{"round": r, "n_reports": n, "key_epoch": epoch,
             "batch_id": None if epoch is None else (bytes([r + 16 * epoch]) * 16).hex()} for r, n in pairs]


def _honest(ns: list[int], eps0: float = 2.0, delta: float = 1e-6, family: str = "clones") -> list[float]:
    """The cumulative epsilons an honest ledger records after rounds of ``ns`` reports each."""
    return [epsilon_for_rounds(family, [ShuffleRound(n=n, eps0=eps0) for n in ns[: i + 1]], delta).value
            for i in range(len(ns))]


def _audit(rows: list[dict], lines: list[dict], **kwargs: object) -> AuditReport:
    return audit({"L": rows}, lines, **kwargs)


def test_consistent_run_passes() -> None:
    rep = _audit(_rows((1, 10), (2, 9)), [_line(1, 10), _line(2, 9)], verify_key=_PK_RAW)
    assert rep.ok and (rep.batches_released, rep.reports_released, rep.reports_charged) == (2, 19, 19)
    assert rep.notes == [] and rep.key_epochs == [0] and rep.ledger_epochs == {"L": 0}


def test_released_but_not_charged_is_a_violation() -> None:
    rep = _audit(_rows((1, 10)), [_line(1, 10), _line(2, 9)])
    assert not rep.ok and len(rep.violations) == 1 and rep.violations[0].startswith("round 2:")
    assert "off the books" in rep.violations[0]


def test_charged_with_another_count_is_a_violation() -> None:
    rep = _audit(_rows((1, 10), (2, 8)), [_line(1, 10), _line(2, 9)])
    assert rep.violations == [f"round 2: batch {bytes([2]).hex() * 16} released 9 reports, the ledger charged 8"]


def test_over_charging_is_noted_not_a_violation() -> None:
    rep = _audit(_rows((1, 10), (2, 9), (3, 7)), [_line(1, 10), _line(2, 9, released=False)], verify_key=_PK_RAW)
    assert rep.ok and rep.batches_sealed == 2 and rep.batches_released == 1
    assert len(rep.notes) == 2 and "round 2" in rep.notes[0] and "round 3" in rep.notes[1]
    # a sealed batch that was neither released nor charged is noted too
    rep = _audit(_rows((1, 10)), [_line(1, 10), _line(2, 9, released=False)], verify_key=_PK_RAW)
    assert rep.ok and rep.notes == ["round 2: sealed, never released, not charged (nothing left the shuffler)"]


def test_a_listing_that_disagrees_with_its_signed_attestation_is_a_violation() -> None:
    doctored = _line(2, 9, sign_n=12)  # the line says 9; the shuffler signed 12
    rep = _audit(_rows((1, 10), (2, 9)), [_line(1, 10), doctored], verify_key=_PK_RAW)
    assert len(rep.violations) == 1 and "names (batch, epoch, round, n)" in rep.violations[0]
    # without a key the statement is read unverified: a line changed without its statement is still caught
    rep = _audit(_rows((1, 10), (2, 9)), [_line(1, 10), doctored])
    assert len(rep.violations) == 1 and "names (batch, epoch, round, n)" in rep.violations[0]
    # a statement edited with its line is what only the signature shows: without a key it cannot tell
    edited = _line(2, 9) | {"signature": _line(2, 12)["signature"]}
    assert _audit(_rows((1, 10), (2, 9)), [_line(1, 10), edited]).ok
    assert "does not verify" in _audit(_rows((1, 10), (2, 9)), [_line(1, 10), edited],
                                       verify_key=_PK_RAW).violations[0]
    forged = _line(1, 10) | {"signature": "00" * 64}
    assert "does not verify" in _audit(_rows((1, 10)), [forged], verify_key=_PK_RAW).violations[0]


def test_an_old_ledger_is_matched_by_round_in_the_only_audited_epoch() -> None:
    lines = [_line(1, 10, epoch=0), _line(1, 4, epoch=1)]
    with pytest.raises(AuditError, match="leaves \\[0, 1\\] key epochs for it: audit it alone, naming its epoch"):
        _audit(_rows((1, 10), epoch=None), lines)
    # beside a ledger that records its epoch, an older one takes the audited epoch left
    both = audit({"old": _rows((1, 10), epoch=None), "new": _rows((1, 4), epoch=1)}, lines)
    assert both.ok and both.ledger_epochs == {"old": 0, "new": 1}
    rep = _audit(_rows((1, 10), epoch=None), lines, key_epochs=[0], verify_key=_PK_RAW)
    assert rep.ok and rep.batches_sealed == 1 and rep.key_epochs == [0] and rep.ledger_epochs == {"L": 0}
    # the matching by round alone is noted, and the left-out epoch's batch is not silently dropped from the report
    assert rep.notes == ["ledger L does not record which batch rounds [1] charged (written by an older "
                         "shuffledp): they were matched by round number in key epoch 0",
                         "1 sealed batch(es) of key epochs [1] (1 released) were left out of the audit by --key-epoch"]
    assert not _audit(_rows((1, 10), epoch=None), lines, key_epochs=[1]).ok  # epoch 1 released 4, charged 10
    assert _audit(_rows((1, 10), epoch=None), lines[:1]).ok  # one epoch in the listing: no need to name it
    with pytest.raises(AuditError, match="two batches"):
        _audit(_rows((1, 10)), [_line(1, 10), _line(1, 10)])


def test_the_scope_is_the_listing_or_the_auditor_never_the_audited_ledger() -> None:
    # Run A (epoch 0, three released rounds) is left off the books: its ledger is not given. Before, the ledger's
    # own epoch chose the scope and this passed with a note.
    lines = [_line(r, 50, epoch=0) for r in (1, 2, 3)] + [_line(r, 50, epoch=1, key=_SK1.private_bytes_raw())
                                                          for r in (1, 2)]
    run_b = _rows((1, 50), (2, 50), epoch=1)
    rep = _audit(run_b, lines, epoch_keys={0: _PK_RAW, 1: _PK1_RAW})
    assert rep.key_epochs == [0, 1] and rep.ledger_epochs == {"L": 1}
    assert [v.split(":")[0] for v in rep.violations] == [f"key epoch 0, round {r}" for r in (1, 2, 3)]
    assert all("no ledger given charged key epoch 0" in v for v in rep.violations)
    # with run A's ledger too, or with the auditor leaving epoch 0 out, it passes
    both = audit({"A": _rows((1, 50), (2, 50), (3, 50)), "B": run_b}, lines, epoch_keys={0: _PK_RAW, 1: _PK1_RAW})
    assert both.ok and both.ledger_epochs == {"A": 0, "B": 1} and both.reports_charged == both.reports_released == 250
    rep = _audit(run_b, lines, key_epochs=[1], verify_key=_PK1_RAW)
    assert rep.ok and rep.key_epochs == [1] and rep.batches_released == 2
    assert "3 sealed batch(es) of key epochs [0] (3 released) were left out" in rep.notes[-1]
    # the ledger cannot be outside what the auditor named
    with pytest.raises(AuditError, match="--key-epoch leaves out of the audit"):
        _audit(run_b, lines, key_epochs=[0])


def test_one_ledger_one_epoch_one_ledger_per_epoch() -> None:
    lines = [_line(1, 10, epoch=0), _line(2, 9, epoch=1)]
    with pytest.raises(AuditError, match="records batches of key epochs \\[0, 1\\]: a run keeps one key epoch"):
        _audit(_rows((1, 10)) + _rows((2, 9), epoch=1), lines)
    with pytest.raises(AuditError, match="ledgers A and B both charged key epoch 0"):
        audit({"A": _rows((1, 10)), "B": _rows((3, 1))}, lines, key_epochs=[0])


def test_a_rotated_signing_key_gives_no_false_violations() -> None:
    # epoch 0 was signed by the old key; the auditor has epoch 1's key and audits the run of epoch 1
    lines = [_line(1, 40), _line(2, 40), _line(1, 40, epoch=1, key=_SK1.private_bytes_raw())]
    rep = _audit(_rows((1, 40), epoch=1), lines, key_epochs=[1], verify_key=_PK1_RAW)
    assert rep.ok and rep.violations == []
    assert any(n.startswith("2 line(s) outside the audit (key epoch/round: 0/1, 0/2) verify with none of the given "
                            "keys") for n in rep.notes)
    # with epoch 0's own key its lines are verified too, and a forged one is caught
    forged = _line(2, 40) | {"signature": "00" * 64}
    rep = _audit(_rows((1, 40), epoch=1), lines[:1] + [forged] + lines[2:], key_epochs=[1], verify_key=_PK1_RAW,
                 epoch_keys={0: _PK_RAW})
    assert len(rep.violations) == 1 and rep.violations[0].startswith("key epoch 0, round 2")
    # a bare key does not verify another epoch's line in the audit: that is a violation, not a note
    rep = _audit(_rows((1, 40), epoch=1), lines, verify_key=_PK1_RAW)
    assert any(v.startswith("key epoch 0, round 1") and "does not verify" in v for v in rep.violations)


def test_a_relabelled_epoch_cannot_hide_a_released_batch() -> None:
    # The shuffler released round 2 in epoch 0 (signed so); the listing's unsigned key_epoch says 7.
    hidden = _line(2, 9) | {"key_epoch": 7}
    lines = [_line(1, 10), hidden]
    for kwargs in ({}, {"key_epochs": [0]}):  # in the audit (off the books) or left out by the auditor
        rep = _audit(_rows((1, 10)), lines, verify_key=_PK_RAW, **kwargs)
        assert not rep.ok
        assert any(v.startswith("key epoch 7, round 2") and "names (batch, epoch, round, n)" in v
                   for v in rep.violations)
    assert not _audit(_rows((1, 10), epoch=None), lines, key_epochs=[0], verify_key=_PK_RAW).ok
    # the same with the audited epoch's key given as EPOCH=PEM (as after a rotation): still caught
    rep = _audit(_rows((1, 10)), lines, key_epochs=[0], epoch_keys={0: _PK_RAW})
    assert any(v.startswith("key epoch 7, round 2") and "names (batch, epoch, round, n)" in v for v in rep.violations)


def test_a_relabelled_line_with_a_broken_signature_is_still_caught() -> None:
    # a line outside the scope whose unsigned epoch was relabelled *and* whose signature was broken must not pass
    # as merely noted when no key is given: the released batch it hides would then pass with exit 0.
    for signature in ("00" * 64, _line(1, 10)["signature"]):  # zeros, or another line's signature
        hidden = _line(2, 9) | {"key_epoch": 7, "signature": signature}
        for kwargs in ({"verify_key": _PK_RAW}, {"epoch_keys": {0: _PK_RAW}}, {}):
            rep = _audit(_rows((1, 10)), [_line(1, 10), hidden], key_epochs=[0], **kwargs)
            assert [v.split(" (")[0] for v in rep.violations] == ["key epoch 7, round 2"], kwargs
            batch = "02" * 16
            assert f"names (batch, epoch, round, n) = ('{batch}', 0, 2, 9), the line says ('{batch}', 7, 2, 9)" \
                in rep.violations[0]
    # a statement that is not an attestation is a violation, in the scope or out of it, released or not
    statement = json.loads(_line(2, 9)["statement"])
    for junk in ('{"format": 1', "{}", "[]", json.dumps(statement | {"format": "other/v1"}),
                 json.dumps(statement | {"n_accepted": 9.0}), json.dumps(statement | {"key_epoch": True}),
                 json.dumps(statement | {"round_id": "2"})):
        for epoch, released, kwargs in ((0, True, {}), (7, True, {"key_epochs": [0], "verify_key": _PK_RAW}),
                                        (0, False, {})):
            line = _line(2, 9, released=released) | {"key_epoch": epoch, "statement": junk}
            rep = _audit(_rows((1, 10)), [_line(1, 10), line], **kwargs)
            assert [v.split(" (")[0] for v in rep.violations if "statement is not an attestation" in v] == \
                [f"key epoch {epoch}, round 2"], (junk, epoch, released)
    # a line that was never released is checked too: its count, relabelled, is a violation
    unreleased = _line(2, 9, released=False) | {"n": 3}
    assert "names (batch, epoch, round, n)" in _audit(_rows((1, 10)), [_line(1, 10), unreleased]).violations[0]
    # Editing the statement as well (so it names epoch 7) breaks the signature, and the line is unattributed: the
    # same as deleting it from the listing, which no audit can see. The note names it.
    relabelled = _line(2, 9, epoch=7) | {"signature": "00" * 64}
    rep = _audit(_rows((1, 10)), [_line(1, 10), relabelled], key_epochs=[0], verify_key=_PK_RAW)
    assert rep.ok and any(n.startswith("1 line(s) outside the audit (key epoch/round: 7/2) verify with none")
                          and "unattributed" in n for n in rep.notes)


@pytest.mark.parametrize("key_epoch", [-1, 2**32, True, 1.0])
def test_a_key_epoch_outside_u32_is_refused(key_epoch: object) -> None:
    with pytest.raises(AuditError, match="u32"):
        _audit(_rows((1, 10), epoch=None), [_line(1, 10)], key_epochs=[key_epoch])
    with pytest.raises(AuditError, match="u32"):
        _audit(_rows((1, 10)), [_line(1, 10)], epoch_keys={key_epoch: _PK_RAW})


def test_an_epoch_or_listing_with_nothing_to_audit_is_refused_not_passed() -> None:
    with pytest.raises(AuditError, match="--key-epoch names key epochs \\[5\\] of which the releases hold no"):
        _audit(_rows((1, 10), epoch=None), [_line(1, 10), _line(2, 9)], key_epochs=[5])
    with pytest.raises(AuditError, match="no batch of key epoch 5, which ledger L charged"):
        _audit(_rows((1, 10), epoch=5), [_line(1, 10)])
    with pytest.raises(AuditError, match="list no sealed batch"):  # the wrong --journal-dir
        _audit(_rows((1, 10)), [])
    with pytest.raises(AuditError, match="is empty"):
        _audit(_rows((1, 10)), [_line(1, 10)], key_epochs=[])


@pytest.mark.parametrize(
    ("change", "match"),
    [({"n_reports": None}, "n_reports is None"), ({"n_reports": float("inf")}, "n_reports is inf"),
     ({"n_reports": 9.9}, "n_reports is 9.9"), ({"n_reports": 0}, "n_reports is 0"),
     ({"round": None}, "a round number is None"), ({"round": 1.0}, "a round number is 1.0"),
     ({"key_epoch": float("inf")}, "key_epoch must be an integer"), ({"key_epoch": 0.5}, "key_epoch must be"),
     ({"key_epoch": None}, "both or neither"), ({"batch_id": "AB" * 16}, "not 32 lowercase hex"),
     ({"batch_id": 7}, "not 32 lowercase hex")],
    ids=["n-null", "n-inf", "n-real", "n-zero", "round-null", "round-real", "epoch-inf", "epoch-real",
         "epoch-without-batch", "batch-upper", "batch-int"],
)
def test_malformed_ledger_rows_are_refused_not_a_traceback(change: dict, match: str) -> None:
    rows = _rows((1, 10), (2, 9))
    rows[1] = rows[1] | change
    with pytest.raises(AuditError, match=match):
        _audit(rows, [_line(1, 10), _line(2, 9)])
    with pytest.raises(AuditError, match="round 1 is recorded twice"):
        _audit(_rows((1, 10), (1, 10)), [_line(1, 10)])


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
        for rnd, n, eps in zip((1, 2), (10, 9), _honest([10, 9])):
            ledger.append(round=rnd, n_reports=n, eps0=2.0, mechanism="laplace", delta=1e-6,
                          epsilons={"clones": eps}, kinds={"clones": "upper"})
    key = tmp_path / "shuffler-signing.pub"
    save_public_key(key, _PK_RAW, "ed25519")
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(x) + "\n" for x in (_line(1, 10), _line(2, 9))))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in (_line(1, 10), _line(2, 9), _line(3, 5))))
    base = ["audit", "--json", "--ledger", str(ledger_path), "--shuffler-verify-key", str(key), "--releases"]
    assert main(base + [str(good)]) == 0 and json.loads(capsys.readouterr().out)["ok"] is True
    assert main(base + [str(bad)]) == 1
    assert "round 3" in json.loads(capsys.readouterr().out)["violations"][0]
    assert main(base + [str(tmp_path / "missing.jsonl")]) == 2
    assert "shuffledp audit:" in capsys.readouterr().err
    assert main(["audit", "--ledger", str(tmp_path / "none.sqlite"), "--releases", str(good)]) == 2
    assert "no ledger" in capsys.readouterr().err
    for epoch in ("-1", "4294967296", "5"):  # outside u32; an epoch with no batch in the listing
        assert main(base + [str(good), "--key-epoch", epoch]) == 2
        assert "--key-epoch" in capsys.readouterr().err
    # two runs (one per key epoch), each epoch with its own signing key; the ledger above records no batches
    sk1 = _SK1.private_bytes_raw()
    ledger1 = tmp_path / "ledger-epoch1.sqlite"
    with Ledger(ledger1) as ledger:
        ledger.append(round=1, n_reports=4, eps0=2.0, mechanism="laplace", delta=1e-6,
                      epsilons={"clones": _honest([4])[0]}, kinds={"clones": "upper"}, key_epoch=1,
                      batch_id=_line(1, 4, epoch=1)["batch_id"])
    key1 = tmp_path / "epoch1.pub"
    save_public_key(key1, _PK1_RAW, "ed25519")
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps(x) + "\n" for x in (_line(1, 4, epoch=1, key=sk1), _line(1, 10), _line(2, 9))))
    two_runs = ["audit", "--json", "--ledger", str(ledger1), "--releases", str(two),
                "--shuffler-verify-key", f"1={key1}"]
    assert main(two_runs) == 1  # epoch 0's released batches: no ledger given charges them
    assert "no ledger given charged key epoch 0" in json.loads(capsys.readouterr().out)["violations"][0]
    assert main(two_runs + ["--key-epoch", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["key_epochs"] == [1] and "left out of the audit" in out["notes"][-1]
    assert main(two_runs + ["--ledger", str(ledger_path), "--shuffler-verify-key", f"0={key}"]) == 0
    assert json.loads(capsys.readouterr().out)["ledger_epochs"] == {str(ledger1): 1, str(ledger_path): 0}
    (tmp_path / "again").symlink_to(tmp_path)
    assert main(two_runs + ["--ledger", str(tmp_path / "again" / ledger1.name)]) == 2
    assert "is given twice" in capsys.readouterr().err
    assert main(two_runs + ["--key-epoch", "1", "--shuffler-verify-key", "2=" + str(key), "--shuffler-verify-key",
                            "2=" + str(key1)]) == 2
    assert "names key epoch 2 twice" in capsys.readouterr().err
    assert main(base + [str(good), "--shuffler-verify-key", str(key1)]) == 2
    assert "given twice without an epoch" in capsys.readouterr().err
    forged = tmp_path / "forged.sqlite"  # a ledger made by hand, without the schema's CHECK constraints
    conn = sqlite3.connect(forged)
    conn.executescript(
        "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT); INSERT INTO meta VALUES ('format', 'shuffledp.ledger'), "
        "('schema_version', '1'); CREATE TABLE rounds(round INTEGER PRIMARY KEY, time TEXT, n_reports, eps0 REAL, "
        "mechanism TEXT, delta REAL, default_family TEXT); CREATE TABLE epsilons(round INTEGER, family TEXT, value "
        "REAL, kind TEXT, reason TEXT); INSERT INTO rounds VALUES (1, 't', NULL, 2.0, 'laplace', 1e-6, 'clones');")
    conn.close()
    assert main(["audit", "--ledger", str(forged), "--releases", str(good)]) == 2  # not 1 with a traceback
    assert "n_reports is None" in capsys.readouterr().err
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


def test_signatures_left_unchecked_are_said_so() -> None:
    rep = _audit(_rows((1, 10)), [_line(1, 10)])
    assert rep.ok and rep.signatures == "unchecked"
    assert "were NOT verified (no --shuffler-verify-key)" in rep.notes[-1]
    assert rep.to_dict()["signatures"] == "unchecked"
    assert _audit(_rows((1, 10)), [_line(1, 10)], verify_key=_PK_RAW).signatures == "verified"
    lines = [_line(1, 10), _line(1, 4, epoch=1, key=_SK1.private_bytes_raw())]
    rows = {"A": _rows((1, 10)), "B": _rows((1, 4), epoch=1)}
    assert audit(rows, lines, epoch_keys={1: _PK1_RAW}).signatures == "partly verified"


def test_the_ledgers_epsilons_are_recomputed() -> None:
    """Each row's cumulative epsilon is recomputed from the rows' (n, eps0): an upper bound recorded below it is a
    violation (the ledger understates what was spent), one recorded above it only a note."""
    honest = _honest([10, 9])

    def rows(values: list[float]) -> list[dict]:
        out = _rows((1, 10), (2, 9))
        for row, value in zip(out, values):
            row.update(eps0=2.0, delta=1e-6, epsilons={"clones": {"value": value, "kind": "upper", "reason": None}})
        return out

    lines = [_line(1, 10), _line(2, 9)]
    rep = _audit(rows(honest), lines, verify_key=_PK_RAW)
    assert rep.ok and rep.notes == [] and (rep.epsilon_rows_checked, rep.epsilon_values_checked) == (2, 2)
    rep = _audit(rows([honest[0], honest[1] * 0.9]), lines, verify_key=_PK_RAW)
    assert not rep.ok and rep.violations[0].startswith("L: round 2, clones: recorded epsilon")
    assert "understates the privacy spent" in rep.violations[0]
    rep = _audit(rows([honest[0] * 1.1, honest[1]]), lines, verify_key=_PK_RAW)
    assert rep.ok and rep.notes[0].startswith("L: round 1, clones: recorded epsilon")


def test_the_table_is_the_default_and_json_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger_path = tmp_path / "ledger.sqlite"
    with Ledger(ledger_path) as ledger:
        ledger.append(round=1, n_reports=10, eps0=2.0, mechanism="laplace", delta=1e-6,
                      epsilons={"clones": _honest([10])[0]}, kinds={"clones": "upper"})
    listing = tmp_path / "releases.jsonl"
    listing.write_text(json.dumps(_line(1, 10)) + "\n")
    assert main(["audit", "--ledger", str(ledger_path), "--releases", str(listing)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("result") and "OK: every released batch" in out
    table = dict(line.split("  ", 1) for line in out.splitlines() if "  " in line and not line.startswith(" "))
    assert table["signatures"].strip() == "unchecked"
    assert table["epsilons recomputed"].strip() == "1 values in 1 rows"
    assert "signatures were not (all) checked" in err
    assert main(["audit", "--json", "--ledger", str(ledger_path), "--releases", str(listing)]) == 0
    assert json.loads(capsys.readouterr().out)["signatures"] == "unchecked"
