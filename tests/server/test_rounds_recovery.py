"""Failures around a round's charge, and resumes from ledger and checkpoint: no round lost, reused or charged twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound
from shuffledp.server.resume import refuse_a_spent_key_epoch
from shuffledp.server.rounds import ResumeError

from ._rounds_records import _ledger_rounds  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def test_a_failure_after_the_charge_is_remembered_and_the_state_stays_resumable(h: Any) -> None:
    # Before, an exception after the ledger append left the round in the accountant and ledger but not in the
    # history: the same id could be run again, and a later checkpoint disagreed with the ledger (unresumable).
    cfg = h.config()
    engine = h.engine(cfg, h.grid([h.honest()] * h.N))
    engine.restore()

    def failing_evaluator(arrays: Any) -> Any:
        raise _Crash("evaluation failed")

    good_evaluator, engine.evaluator = engine.evaluator, failing_evaluator
    reported: list[Any] = []
    engine.on_round = reported.append  # progress line and report.json: the charge shows before the error
    with pytest.raises(_Crash):
        engine.run_round(1)
    assert [(o.round, o.status) for o in engine.history] == [(1, "applied")]
    assert reported == engine.history
    assert "failed after the charge" in engine.history[0].reason
    with pytest.raises(ValueError, match="never reused"):
        engine.run_round(1)
    engine.evaluator = good_evaluator
    assert engine.run_round(2).status == "applied"
    assert _ledger_rounds(engine) == [1, 2]
    engine.ledger.close()
    engine.store.close()
    resumed = h.engine(cfg, h.grid([h.honest()] * h.N))
    assert resumed.restore() == 3  # the checkpoint agrees with the ledger
    assert [e.n for e in resumed.accountant.rounds] == [h.N, h.N]


def test_a_failing_attestation_record_after_the_charge_is_remembered_and_nothing_is_fetched(h: Any) -> None:
    # the attestation hook (attestations.jsonl; it can fail, e.g. on a full disk) runs after the charge, inside
    # the block that records a charged round, so the round id cannot be run again
    cfg = h.config()
    engine = h.engine(cfg, h.grid([h.honest()] * h.N))
    engine.restore()
    before = [a.copy() for a in engine.arrays]

    def full_disk(round_id: int, att: Any, charged: bool) -> None:
        raise OSError(28, "No space left on device")

    engine.on_attestation = full_disk
    with pytest.raises(OSError, match="No space left"):
        engine.run_round(1)
    assert [(o.round, o.status, o.n_applied) for o in engine.history] == [(1, "lost", 0)]
    assert engine.history[0].epsilon == engine.accountant.epsilon().value > 0
    assert all(np.array_equal(a, b) for a, b in zip(engine.arrays, before))  # nothing fetched, nothing applied
    with pytest.raises(ValueError, match="never reused"):
        engine.run_round(1)
    assert _ledger_rounds(engine) == [1] and len(engine.accountant.rounds) == 1


def test_a_sealed_batch_that_fails_the_cross_check_is_on_record_and_never_fetched(h: Any, monkeypatch) -> None:
    """attestations.jsonl is the record of every sealed batch, so one whose attestation disagrees with the
    submission is recorded before the round raises."""
    import shuffledp.server.rounds as rounds_module

    engine = h.engine(h.config(), h.grid([h.honest()] * h.N))
    engine.restore()
    recorded: list[tuple[int, int, bool]] = []
    engine.on_attestation = lambda rnd, att, charged: recorded.append((rnd, int(att.n_accepted), charged))

    def mismatch(att: Any, **kwargs: Any) -> None:
        raise RuntimeError("the attestation's model_digest b'..' does not match the submitted b'..'")

    monkeypatch.setattr(rounds_module, "check_attestation", mismatch)
    fetched: list[Any] = []
    engine.shuffler.fetch = lambda att: fetched.append(att) or iter(())
    with pytest.raises(RuntimeError, match="does not match the submitted"):
        engine.run_round(1)
    assert recorded == [(1, h.N, False)] and fetched == [] and engine.ledger.rows() == []


def test_a_fresh_run_in_a_key_epoch_the_shuffler_already_released_is_refused(h: Any) -> None:
    # a new run directory with the same keys (key epoch) and shuffler must not start its accountant at 0 when
    # the epoch's earlier releases were charged to another run
    cfg = h.config(**{"min-reports": h.N + 1})  # round 1: below k, nothing sealed or released
    first = h.engine(cfg, h.grid([h.honest()] * h.N))
    assert first.restore() == 1 and first.run_round(1).status == "skipped"
    stats = h.shuffler.stats()
    assert (stats["key_epoch"], stats["epoch_batches_released"]) == (0, 0)
    fresh = h.engine(h.config(**{"run-name": "fresh-1"}), h.grid([h.honest()] * h.N))
    assert fresh.restore() == 1  # nothing of the epoch was released: a fresh run may start
    assert fresh.run_round(2).status == "applied"
    assert h.shuffler.stats()["epoch_batches_released"] == 1
    other = h.engine(h.config(**{"run-name": "fresh-2"}), h.grid([h.honest()] * h.N))
    with pytest.raises(ResumeError, match="already released 1 batch\\(es\\) of key epoch 0, and this run has no "
                                          "checkpoint"):
        other.restore()
    assert other.ledger.rows() == [] and other.store.load() is None  # refused before writing anything
    fresh.ledger.close()
    fresh.store.close()
    resumed = h.engine(h.config(**{"run-name": "fresh-1"}), h.grid([h.honest()] * h.N))
    assert resumed.restore() == 3  # the run that spent the epoch resumes as before
    # the first run has a checkpoint (its round 1 was skipped), so it is a resume, not a fresh
    # start; but fresh-1 has released a batch of the epoch since, which the first run's accountant leaves out
    first.ledger.close()
    first.store.close()
    again = h.engine(h.config(**{"min-reports": h.N + 1}), h.grid([h.honest()] * h.N))
    before = again.store.load()
    with pytest.raises(ResumeError, match="released 1 batch\\(es\\) of key epoch 0, but this run's ledger charges "
                                          "only 0: another run has used this key epoch"):
        again.restore()
    after = again.store.load()  # refused before changing anything
    assert again.ledger.rows() == [] and (after.round, after.history, after.accountant) == (
        before.round, before.history, before.accountant)


def test_a_failed_ledger_write_leaves_nothing_charged_in_the_accountant(h: Any) -> None:
    # Before, the accountant kept the round the ledger had refused: the next ledger row counted a phantom round,
    # and the run could not be resumed (the checkpoint's accountant did not match the ledger).
    cfg = h.config()
    engine = h.engine(cfg, h.grid([h.honest()] * h.N))
    engine.restore()
    record = engine.ledger.record

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise _Crash("database or disk is full")

    engine.ledger.record = full_disk
    with pytest.raises(_Crash):
        engine.run_round(1)
    assert engine.accountant.rounds == () and _ledger_rounds(engine) == []
    engine.ledger.record = record
    assert engine.run_round(2).status == "applied"
    one_round = ShuffleAccountant(target_delta=cfg.target_delta, family=cfg.accounting_family)
    one_round.compose(ShuffleRound(n=h.N, eps0=cfg.eps0))
    assert engine.ledger.rows()[0]["epsilons"][cfg.accounting_family]["value"] == one_round.epsilon().value
    engine.ledger.close()
    engine.store.close()
    assert h.engine(cfg, h.grid([h.honest()] * h.N)).restore() == 3


def test_more_reports_than_attested_are_never_applied(h: Any) -> None:
    cfg = h.config()
    engine = h.engine(cfg, h.grid([h.honest()] * h.N))
    engine.restore()
    before = [a.copy() for a in engine.arrays]
    fetch = engine.shuffler.fetch

    def fetch_one_extra(attestation: Any) -> Any:  # a shuffler client that does not enforce the count
        items = list(fetch(attestation))
        return [*items, items[0]]

    engine.shuffler.fetch = fetch_one_extra
    with pytest.raises(RuntimeError, match=f"released {h.N + 1} reports for an attested {h.N}"):
        engine.run_round(1)
    assert [(o.round, o.status) for o in engine.history] == [(1, "lost")]
    for a, b in zip(engine.arrays, before):
        np.testing.assert_array_equal(a, b)


class _Crash(RuntimeError):
    pass


def test_crash_between_ledger_and_checkpoint_is_resumed_without_double_counting(h: Any) -> None:
    cfg = h.config(**{"num-server-rounds": 4})
    grid = h.grid([h.honest()] * h.N)
    engine = h.engine(cfg, grid)
    engine.restore()
    assert engine.run_round(1).status == "applied"
    real_save = engine.store.save

    def crash_on_save(ckpt: Any) -> None:
        raise _Crash("killed after the ledger append, before the checkpoint")

    engine.store.save = crash_on_save
    with pytest.raises(_Crash):
        engine.run_round(2)
    engine.store.save = real_save
    assert _ledger_rounds(engine) == [1, 2]  # round 2 was charged before its reports were fetched
    assert engine.store.load().round == 1

    # a new process: same ledger and state files
    engine.ledger.close()
    engine.store.close()
    resumed = h.engine(cfg, grid)
    next_round = resumed.restore()
    assert next_round == 3
    assert [o.status for o in resumed.history] == ["applied", "lost"]
    assert [(e.n, e.eps0) for e in resumed.accountant.rounds] == [(h.N, cfg.eps0)] * 2
    resumed.run(start_round=next_round)
    assert _ledger_rounds(resumed) == [1, 2, 3, 4]
    assert len(resumed.accountant.rounds) == 4
    rows = resumed.report_rows()
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["accuracy"] is None and rows[2]["accuracy"] is not None
    # restoring again is idempotent: nothing is charged twice
    resumed.ledger.close()
    resumed.store.close()
    again = h.engine(cfg, grid)
    assert again.restore() == 5
    assert len(again.accountant.rounds) == 4


def test_crash_before_the_ledger_uses_a_fresh_round_id_and_charges_nothing(h: Any) -> None:
    cfg = h.config(**{"num-server-rounds": 3})
    grid = h.grid([h.honest()] * h.N)
    engine = h.engine(cfg, grid)
    engine.restore()
    engine.run_round(1)

    def crash_submit(**kwargs: Any) -> Any:
        raise _Crash("killed while talking to the shuffler")

    real_shuffler = engine.shuffler
    engine.shuffler = type("S", (), {"open_submit": staticmethod(crash_submit), "fetch": real_shuffler.fetch})()
    with pytest.raises(_Crash):
        engine.run_round(2)
    engine.ledger.close()
    engine.store.close()
    resumed = h.engine(cfg, grid)
    assert resumed.restore() == 3  # round 2 was started (messages went out): its id is not reused
    # the used id is on record (in report.json too), as nothing released or charged
    assert [(o.round, o.status) for o in resumed.history] == [(1, "applied"), (2, "abandoned")]
    assert "before it was charged" in resumed.history[1].reason
    resumed.run(start_round=3)
    assert _ledger_rounds(resumed) == [1, 3]
    assert [(o.round, o.status) for o in resumed.history] == [(1, "applied"), (2, "abandoned"), (3, "applied")]
    assert [r["round"] for r in resumed.report_rows()] == [1, 3]
    resumed.ledger.close()
    resumed.store.close()
    again = h.engine(cfg, grid)
    assert again.restore() == 4 and [o.status for o in again.history] == ["applied", "abandoned", "applied"]


def test_rounds_that_released_nothing_stay_in_report_json_after_a_resume(h: Any, tmp_path: Path) -> None:
    """A round stopped at its attested n (its id used, its batch sealed, never charged) and a round abandoned in
    a crash are listed with the skipped rounds of report.json after a resume, also when another process writes
    the report (the stopped one must be in 'skipped' or 'stopped')."""
    from shuffledp.server.job import RunPaths, write_outputs

    def bound(n: int) -> float:
        acct = ShuffleAccountant(target_delta=h.config().target_delta, family=h.config().accounting_family)
        acct.compose(ShuffleRound(n=n, eps0=1.0))
        return float(acct.epsilon().value)

    n_ok = h.N - 3
    grid = h.grid([h.honest()] * n_ok + [h.silent] * 3)
    engine = h.engine(h.config(**{"eps0": 1.0, "budget-epsilon": (bound(h.N) + bound(n_ok)) / 2}), grid)
    engine.restore()
    assert engine.run_round(1).status == "stopped"  # all 12 would fit the budget, the 9 attested do not
    engine.store.mark_started(2)  # round 2 started, then the process died before its charge
    engine.ledger.close()
    engine.store.close()
    resumed = h.engine(h.config(**{"eps0": 1.0, "budget-epsilon": 100.0}), grid)
    assert resumed.restore() == 3
    assert resumed.run_round(3).status == "applied"
    doc = write_outputs(resumed, RunPaths(out_dir=tmp_path / "o", keys_dir=tmp_path), plot=False)
    assert [(row["round"], row["reason"][:12]) for row in doc["skipped"]] == [(1, "round 1 with"), (2, "the process ")]
    assert doc["stopped"] is None and [row["round"] for row in doc["rounds"]] == [3]


def test_resume_counts_ledger_rows_without_a_batch_as_the_runs_own(h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a ledger written before batches were recorded have no key epoch; they count as this
    run's charges, so such a run still resumes (the check can only miss another run's use, never refuse its own)."""
    engine = h.engine(h.config(), h.grid([h.honest()] * h.N))
    engine.restore()
    assert engine.run_round(1).status == "applied"
    real_rows = engine.ledger.rows
    monkeypatch.setattr(type(engine.ledger), "rows",
                        lambda self: [{**r, "key_epoch": None, "batch_id": None} for r in real_rows()])
    refuse_a_spent_key_epoch(engine, engine.ledger.rows(), fresh=False)  # 1 released, 1 legacy row: accepted
    monkeypatch.setattr(type(engine.ledger), "rows", lambda self: [])
    with pytest.raises(ResumeError, match="charges only 0"):
        refuse_a_spent_key_epoch(engine, engine.ledger.rows(), fresh=False)


def test_resume_refuses_a_changed_privacy_setting(h: Any) -> None:
    cfg = h.config()
    engine = h.engine(cfg, h.grid([h.honest()] * h.N))
    engine.restore()
    engine.run_round(1)
    engine.ledger.close()
    engine.store.close()
    changed = h.config(eps0=2.0)
    resumed = h.engine(changed, h.grid([h.honest()] * h.N))
    with pytest.raises(ResumeError, match="eps0: 8.0 -> 2.0"):
        resumed.restore()
    # settings the checkpoint restores from its own state would be silently ignored: refused as well
    # and a new seed would re-draw the splits, so a client's rows could land in the server's public or test split
    for key, value in (("server-lr", 0.01), ("server-momentum", 0.5), ("comparison-families", "girgis"),
                       ("mechanism", "duchi"), ("seed", 3)):
        resumed = h.engine(h.config(**{key: value}), h.grid([h.honest()] * h.N))
        with pytest.raises(ResumeError, match=key):
            resumed.restore()
        resumed.ledger.close()
        resumed.store.close()


def test_resume_with_a_changed_budget_is_allowed_and_logged(h: Any, caplog: pytest.LogCaptureFixture) -> None:
    cfg = h.config(**{"budget-epsilon": 1e6})
    engine = h.engine(cfg, h.grid([h.honest()] * h.N))
    engine.restore()
    engine.run_round(1)
    engine.ledger.close()
    engine.store.close()
    resumed = h.engine(h.config(**{"budget-epsilon": 2e6}), h.grid([h.honest()] * h.N))
    with caplog.at_level("WARNING", logger="shuffledp.server"):
        assert resumed.restore() == 2
    assert any("budget-epsilon changed" in r.getMessage() and "1000000.0 -> 2000000.0" in r.getMessage()
               for r in caplog.records)
    assert len(resumed.accountant.rounds) == 1  # the spent round is still charged
    # on record, not only in the log: kept in the checkpoint across later resumes, and written to report.json
    change = {"after_round": 1, "from": 1e6, "to": 2e6}
    assert resumed.budget_changes == [change]
    resumed.ledger.close()
    resumed.store.close()
    again = h.engine(h.config(**{"budget-epsilon": 2e6}), h.grid([h.honest()] * h.N))
    again.restore()
    assert again.budget_changes == [change]  # unchanged budget: nothing new, the old change kept
    again.ledger.close()
    again.store.close()
    last = h.engine(h.config(**{"budget-epsilon": "inf"}), h.grid([h.honest()] * h.N))
    last.restore()
    assert last.budget_changes == [change, {"after_round": 1, "from": 2e6, "to": "inf"}]
    import json

    from shuffledp.server.report import report_document, write_report

    path = write_report(h.tmp_path / "report.json", report_document(
        config=last.cfg.as_dict(), rounds=last.report_rows(), budget_changes=last.budget_changes))
    assert json.loads(path.read_text())["budget_changes"] == last.budget_changes
