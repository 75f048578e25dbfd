"""The whole job on a fake Grid: auto shuffler process, outputs, and report.json against the accounting CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from shuffledp.accounting.ledger import Ledger, LedgerError
from shuffledp.accounting.versions import library_versions
from shuffledp.deploy import cli as shuffledp_cli
from shuffledp.server.config import ConfigError
from shuffledp.server.job import ShufflerConnection, resolve_paths, run_job


def _cli_epsilon(capsys: pytest.CaptureFixture[str], *, family: str, eps0: float, n: int, delta: float,
                 rounds: int) -> float:
    capsys.readouterr()
    code = shuffledp_cli.main(
        ["account", "epsilon", "--bound", family, "--eps0", repr(eps0), "--n", str(n), "--delta", repr(delta),
         "--rounds", str(rounds), "--json"]
    )
    assert code == 0
    return float(json.loads(capsys.readouterr().out)["value"])


def test_run_job_writes_outputs_that_agree_with_the_accounting_cli(
    tmp_path: Path, keys: Any, kit: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = kit.make_config(tmp_path, keys, **{"eps0": 2.0, "num-server-rounds": 3,
                                             "comparison-families": "rr-lower,clones"})
    grid = kit.FakeGrid.build([kit.honest_factory(keys)] * 12)
    lines: list[str] = []
    result = run_job(cfg, grid, run_id=1, node_wait=0.0, progress=lines.append)

    out = tmp_path / "outputs" / "t"
    assert result.paths.out_dir == out
    report = json.loads((out / "report.json").read_text())
    assert report["finished"] is True
    assert report["config"]["eps0"] == 2.0
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3]
    for row in report["rounds"]:
        assert set(row) == {"round", "n_reports", "accuracy", "loss", "eps0", "epsilon", "family", "kind", "delta",
                            "n_applied", "n_bad_reports", "epsilon_if_bad_gave_no_cover"}
        assert row["n_reports"] == row["n_applied"] == 12 and row["n_bad_reports"] == 0
        assert row["epsilon_if_bad_gave_no_cover"] is None
        assert (row["family"], row["kind"], row["delta"]) == (cfg.accounting_family, "upper", cfg.target_delta)
        cli = _cli_epsilon(capsys, family=row["family"], eps0=2.0, n=12, delta=cfg.target_delta, rounds=row["round"])
        assert row["epsilon"] == pytest.approx(cli, rel=1e-12, abs=0.0)
    eps = [r["epsilon"] for r in report["rounds"]]
    assert eps == sorted(eps) and eps[0] > 0
    assert report["accounting"]["comparison"]["rr-lower"]["kind"] == "lower"
    # rr-lower bounds the generic families from below; the mechanism-aware budget family (blanket-laplace, the
    # default for laplace) may lie below it (docs/accounting.md), so the comparison is with clones
    comparison = report["accounting"]["comparison"]
    assert comparison["rr-lower"]["value"] <= comparison["clones"]["value"]
    assert (out / "accuracy_epsilon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Ledger(out / "ledger.sqlite", create=False) as ledger:
        assert [r["round"] for r in ledger.rows()] == [1, 2, 3]
        # the report and the ledger name the versions of shuffledp and the accounting libraries that wrote them
        assert ledger.versions() == report["versions"] == library_versions()
    assert set(report["versions"]) == {"shuffledp", "dp-accounting", "numpy", "scipy"}
    from shuffledp.shuffler.attestation import Attestation
    from shuffledp.shuffler.keys import load_public_key

    verify_key = load_public_key(keys.d.shuffler_signing_pub, "ed25519")
    attested = [json.loads(line) for line in (out / "attestations.jsonl").read_text().splitlines()]
    assert [(a["round"], a["charged"]) for a in attested] == [(1, True), (2, True), (3, True)]
    for entry, row in zip(attested, report["rounds"]):
        att = Attestation.from_dict(entry, verify_key)  # the signature re-verifies
        assert att.round_id == row["round"] and att.n_accepted == row["n_reports"]
    # the shuffler's own record of what it released agrees with the ledger (shuffledp audit)
    assert shuffledp_cli.main(["shuffler", "journal", "--journal-dir", str(keys.d.root / "journal")]) == 0
    releases = tmp_path / "releases.jsonl"
    releases.write_text(capsys.readouterr().out)
    assert shuffledp_cli.main(["audit", "--json", "--ledger", str(out / "ledger.sqlite"), "--releases", str(releases),
                               "--shuffler-verify-key", str(keys.d.shuffler_signing_pub)]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert (audit["ok"], audit["batches_released"], audit["reports_released"], audit["reports_charged"]) == (
        True, 3, 36, 36)
    assert audit["violations"] == [] and audit["notes"] == []
    assert sum("[shuffledp] round" in line for line in lines) == 3
    # every printed epsilon says what it is
    assert sum(f"({cfg.accounting_family}, upper bound, delta {cfg.target_delta:g})" in line for line in lines) == 3
    assert sum(line.startswith("[shuffledp] ServerApp heap tuning") for line in lines) == 1  # run config default
    assert any(str(out) in line for line in lines)
    assert result.epsilon == eps[-1]


def test_a_second_server_process_on_a_running_run_is_refused(tmp_path: Path, keys: Any, kit: Any) -> None:
    # a resume (or a second flwr run with the same run-name) while the run still runs
    import subprocess
    import sys

    from shuffledp.server.job import RunInUseError, hold_run_lock

    cfg = kit.make_config(tmp_path, keys, **{"num-server-rounds": 1})
    out = resolve_paths(cfg, run_id=1).out_dir
    out.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib; from shuffledp.server.job import hold_run_lock\n"
         "with hold_run_lock(pathlib.Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        grid = kit.FakeGrid.build([kit.honest_factory(keys)] * 12)
        with pytest.raises(RunInUseError, match=f"in use by another server process \\(pid {holder.pid} holds"):
            run_job(cfg, grid, run_id=1, node_wait=0.0, progress=lambda line: None)
        assert not (out / "ledger.sqlite").exists() and not (out / "state.sqlite").exists()  # nothing touched
    finally:
        holder.communicate("")  # the holder exits, and the kernel releases its lock
    with hold_run_lock(out):  # free again (also after a crash: the lock dies with its process)
        pass
    result = run_job(cfg, grid, run_id=1, node_wait=0.0, progress=lambda line: None)
    assert [h.round for h in result.history] == [1]


def test_resolve_paths_needs_a_key_directory(tmp_path: Path, keys: Any, kit: Any) -> None:
    make_config = kit.make_config

    with pytest.raises(ConfigError, match="'keys-dir' is empty"):
        resolve_paths(make_config(tmp_path, keys, **{"keys-dir": ""}))
    with pytest.raises(ConfigError, match="does not hold a key directory"):
        resolve_paths(make_config(tmp_path, keys, **{"keys-dir": str(tmp_path)}))
    paths = resolve_paths(make_config(tmp_path, keys, **{"run-name": ""}), run_id=42)
    assert paths.out_dir.name == "run-42"


def test_a_model_larger_than_the_clients_limit_is_refused_before_any_round(tmp_path: Path, keys: Any, kit: Any) -> None:
    cfg = kit.make_config(tmp_path, keys, **{"max-model-parameters": 649})  # the digits logreg has 650
    grid = kit.FakeGrid.build([kit.honest_factory(keys)] * 12)
    with pytest.raises(ConfigError, match="the model has 650 parameters, more than run config 'max-model-parameters'"):
        run_job(cfg, grid, run_id=1, node_wait=0.0, progress=lambda line: None)
    assert not (tmp_path / "outputs" / "t" / "ledger.sqlite").exists()


_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {testdir!r})
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
import conftest as c
from shuffledp.shuffler.keys import KeyDirectory
from shuffledp.server.job import run_job
keys = c.Keys(KeyDirectory(Path({keys!r})))
cfg = c.make_config(Path({tmp!r}), keys, **{{"num-server-rounds": {rounds}}})
grid = c.FakeGrid.build([c.honest_factory(keys)] * c.N_CLIENTS)
run_job(cfg, grid, node_wait=0.0, evaluator=c.digits_evaluator, initial_arrays=c.model_arrays(), plot=False)
"""


def test_killed_run_resumes_with_each_round_in_the_ledger_exactly_once(tmp_path: Path, keys: Any, kit: Any) -> None:
    """SIGKILL a real run_job process mid-run (wherever it happens to be), then resume it."""
    import signal
    import subprocess
    import sys
    import time

    from shuffledp.deploy.processes import alive as _alive
    from shuffledp.deploy.processes import descendants as _descendants

    rounds = 4
    script = _CHILD.format(testdir=str(Path(__file__).parent), keys=str(keys.d.root), tmp=str(tmp_path), rounds=rounds)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    ledger_path = tmp_path / "outputs" / "t" / "ledger.sqlite"
    deadline = time.monotonic() + 240
    killed_after = 0
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if ledger_path.exists():
                try:
                    with Ledger(ledger_path, create=False) as ledger:
                        killed_after = len(ledger)
                except LedgerError:  # the child is still creating the schema
                    killed_after = 0
                if killed_after >= 2:
                    break
            time.sleep(0.05)
        assert child.poll() is None, f"the run ended before it could be killed: {child.stderr.read()[-3000:]!r}"
        orphans = _descendants(child.pid)  # its shuffler process: ended by pid below
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    for pid in orphans:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    for pid in orphans:
        for _ in range(100):
            if not _alive(pid):
                break
            time.sleep(0.05)

    cfg = kit.make_config(tmp_path, keys, **{"num-server-rounds": rounds})
    grid = kit.FakeGrid.build([kit.honest_factory(keys)] * kit.N)
    result = run_job(cfg, grid, node_wait=0.0, evaluator=kit.digits_evaluator, initial_arrays=kit.model_arrays(),
                     plot=False, progress=lambda line: None)
    with Ledger(ledger_path, create=False) as ledger:
        charged = [r["round"] for r in ledger.rows()]
    assert len(charged) == len(set(charged)) and charged == sorted(charged)
    assert len(charged) >= killed_after >= 2
    assert charged[-1] == rounds and set(charged) <= set(range(1, rounds + 1))
    report = json.loads((tmp_path / "outputs" / "t" / "report.json").read_text())
    assert [r["round"] for r in report["rounds"]] == charged  # applied + lost rounds, each once
    assert report["finished"] is True
    assert [o.round for o in result.history] == sorted({o.round for o in result.history})
    ckpt_rounds = [o.round for o in result.history if o.status in ("applied", "lost")]
    assert ckpt_rounds == charged


def test_run_job_uses_a_configured_remote_shuffler_over_mtls(
    tmp_path: Path, keys: Any, kit: Any, shuffler_service: Any
) -> None:
    """shuffler-address = host:port: no process is started; the job connects with the mTLS files."""
    cfg = kit.make_config(tmp_path, keys, **{"num-server-rounds": 1, "shuffler-address": shuffler_service.address,
                                             "shuffler-root-cert": str(keys.d.ca_cert),
                                             "shuffler-client-cert": str(keys.d.serverapp_cert),
                                             "shuffler-client-key": str(keys.d.serverapp_tls_key)})
    grid = kit.FakeGrid.build([kit.honest_factory(keys)] * kit.N)
    result = run_job(cfg, grid, node_wait=0.0, evaluator=kit.digits_evaluator, initial_arrays=kit.model_arrays(),
                     plot=False, progress=lambda line: None)
    assert [o.status for o in result.history] == ["applied"]
    assert not (result.paths.out_dir / "shuffler.log").exists()  # no local shuffler was started
    assert "accepted=12" in shuffler_service.log_tail()
    wrong = kit.make_config(tmp_path, keys, **{"run-name": "t2", "shuffler-address": shuffler_service.address,
                                               "shuffler-client-key": str(tmp_path / "missing.key")})
    with pytest.raises(ConfigError, match="mTLS files for the shuffler connection are missing"):
        run_job(wrong, grid, node_wait=0.0, evaluator=kit.digits_evaluator, initial_arrays=kit.model_arrays(),
                plot=False, progress=lambda line: None)


@pytest.mark.parametrize("tuning", [True, False])
def test_shuffler_connection_tunes_the_heap_for_its_message_limit(
    tmp_path: Path, keys: Any, kit: Any, monkeypatch: pytest.MonkeyPatch, tuning: bool
) -> None:
    """run config heap-tuning: the ServerApp, which receives the fetched batch, applies
    shuffledp.shuffler.heap.tune_heap with its channel's message limit, max(max-message-bytes, the packing size) +
    slack, before the client connects (and not at all when the key is false)."""
    import shuffledp.shuffler.heap
    from shuffledp.shuffler.service import message_limit

    calls: list[int] = []
    done = shuffledp.shuffler.heap.HeapTuning(True, 1 << 20, 1 << 28)
    monkeypatch.setattr(shuffledp.shuffler.heap, "tune_heap", lambda limit: calls.append(limit) or done)
    cfg = kit.make_config(tmp_path, keys, **{"shuffler-address": "127.0.0.1:9", "heap-tuning": tuning,
                                             "max-message-bytes": 3 << 20})
    connection = ShufflerConnection(cfg, resolve_paths(cfg))
    with connection as client:
        assert client is not None
    assert calls == ([(3 << 20) + 1024] if tuning else [])
    assert connection.heap is (done if tuning else None)  # run_job prints connection.heap.describe()
    if tuning:  # a limit below the packing size: the packed messages set the size
        small = kit.make_config(tmp_path, keys, **{"shuffler-address": "127.0.0.1:9", "max-message-bytes": 300_000})
        with ShufflerConnection(small, resolve_paths(small)):
            pass
        assert calls[-1] == message_limit(300_000) == (1 << 20) + 1024


def test_progress_lines_print_bounds_outward_and_survive_a_failed_evaluation() -> None:
    # An upper bound printed to nearest could print below the bound; a charged round whose evaluation failed
    # (accuracy None) must not make the progress line raise, or report.json would miss the charge.
    from shuffledp.server.job import format_progress
    from shuffledp.server.report import format_epsilon
    from shuffledp.server.rounds import RoundOutcome

    assert format_epsilon(0.12344, "upper") == "0.1235" and format_epsilon(0.12346, "lower") == "0.1234"
    assert format_epsilon(0.12344, "approximate") == "0.1234" and format_epsilon(2.0, "upper") == "2.0000"
    out = RoundOutcome(round=3, status="applied", n_reports=12, eps0=2.0, epsilon=0.12344, epsilon_family="clones",
                       epsilon_kind="upper", delta=1e-6, accuracy=None, loss=None)
    line = format_progress(out)
    assert "accuracy n/a, loss n/a (the evaluation failed)" in line
    assert "epsilon so far 0.1235 (clones, upper bound, delta 1e-06)" in line
    # the runner's watcher prints the same rows from report.json, rounded the same way
    from shuffledp.deploy.console import progress_line as _progress_line

    row = {"round": 3, "n_reports": 12, "accuracy": 0.5, "loss": 1.0, "epsilon": 0.12344, "family": "clones",
           "kind": "upper", "delta": 1e-6}
    assert "epsilon so far 0.1235 (clones, upper bound, delta 1e-06)" in _progress_line(row)
    assert "bad reports" not in _progress_line(row) and "no cover" not in _progress_line(row)
    # a round with reports that failed to open: both figures, each rounded outward, on both paths
    row.update(n_bad_reports=2, epsilon_if_bad_gave_no_cover=0.20001)
    assert _progress_line(row).endswith(", 2 bad reports skipped, epsilon 0.2001 if the bad reports gave no cover")
    out.n_bad_reports, out.epsilon_if_bad_gave_no_cover = 2, 0.20001
    assert format_progress(out).endswith(", 2 bad reports skipped, epsilon 0.2001 if the bad reports gave no cover")


def test_the_run_lock_on_a_filesystem_without_flock_warns_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # flock fails with ENOLCK or EOPNOTSUPP on some network and FUSE mounts; rather than a bare OSError for every
    # run, it runs unlocked with a warning (the ledger still refuses a row that leaves a round out).
    import errno
    import fcntl

    from shuffledp.server.job import hold_run_lock

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    ran = []
    with caplog.at_level("WARNING", logger="shuffledp.server"), hold_run_lock(tmp_path):
        ran.append(True)
    assert ran == [True] and "one server process per run is not enforced here" in caplog.text
