"""``shuffledp run|resume`` helpers that do not need Flower running (the full path is in test_e2e.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shuffledp.deploy import runner as runner


def test_finished_reads_the_report(tmp_path: Path) -> None:
    assert runner._finished(tmp_path) == (False, "no report.json was written")
    (tmp_path / "report.json").write_text(json.dumps({"finished": False}))
    assert runner._finished(tmp_path)[0] is False
    (tmp_path / "report.json").write_text(json.dumps({"finished": True}))
    assert runner._finished(tmp_path) == (True, "")


def test_usage_errors_exit_2_and_create_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert runner.main(["run", "--clients", "0", "--output-dir", str(tmp_path)]) == 2
    assert "--clients must be >= 1" in capsys.readouterr().err
    assert runner.main(["run", "--run-config", "eps0=-1", "--output-dir", str(tmp_path)]) == 2
    assert "'eps0' must be in" in capsys.readouterr().err
    argv = ["run", "--clients", "3", "--run-config", "min-reports=1000", "--output-dir", str(tmp_path)]
    assert runner.main(argv) == 2
    assert "'min-reports' (1000) is more than --clients (3)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert runner.main(["resume", "nope", "--output-dir", str(tmp_path)]) == 2
    assert "not a run started by `shuffledp run`" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    assert runner.main(["run", "--run-name", "taken", "--output-dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert runner.main(["bogus"]) == 2


def test_errors_found_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing MNIST folder, a flag given twice (once through --run-config) and an unknown key are refused with
    exit code 2 before keys, outputs or Flower are created."""
    argv = ["run", "--output-dir", str(tmp_path), "--run-config", f"dataset=mnist data-dir={tmp_path / 'none'}"]
    assert runner.main(argv) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "'dataset' and 'data-dir'" in err and "Traceback" not in err
    assert runner.main(["run", "--output-dir", str(tmp_path), "--run-config", "eps0=2", "--eps0", "3"]) == 2
    assert "--eps0 3 and --run-config eps0=2 both set eps0; give one" in capsys.readouterr().err
    assert runner.main(["run", "--output-dir", str(tmp_path), "--rounds", "2", "--run-config",
                        "num-server-rounds=3"]) == 2
    assert "both set num-server-rounds" in capsys.readouterr().err
    assert runner.main(["run", "--output-dir", str(tmp_path), "--run-config", "nosuch=1"]) == 2
    assert "nosuch" in capsys.readouterr().err
    # a run planned from a target: not with an eps0 too, not above the budget, not a target no eps0 can meet
    assert runner.main(["run", "--output-dir", str(tmp_path), "--eps0", "2", "--target-epsilon", "4"]) == 2
    assert "a target plans eps0 itself; give one" in capsys.readouterr().err
    assert runner.main(["run", "--output-dir", str(tmp_path), "--target-epsilon", "12"]) == 2
    assert "'target-epsilon' (12) is above 'budget-epsilon' (10)" in capsys.readouterr().err
    assert runner.main(["run", "--output-dir", str(tmp_path), "--target-epsilon", "1e-9", "--rounds", "1000"]) == 2
    assert "cannot plan eps0 for target epsilon 1e-09" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_other_platforms_are_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert runner.main(["run", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs Linux" in err and "this is darwin" in err and "shuffledp account" in err
    assert list(tmp_path.iterdir()) == []
    from shuffledp.deploy import deploy_cli

    assert deploy_cli.main(["deploy", "local", "--workdir", str(tmp_path / "w")]) == 2
    assert "deploy local needs Linux" in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_resuming_a_finished_run_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "done-run"
    run.mkdir()
    (run / runner.RUNNER_FILE).write_text(json.dumps({"clients": 3, "run_config": {"keys-dir": str(run / "keys")}}))
    (run / "report.json").write_text(json.dumps({"finished": True}))

    def no_launch(*args: object, **kwargs: object) -> int:
        raise AssertionError("a finished run was launched again")

    monkeypatch.setattr(runner, "_launch", no_launch)
    assert runner.main(["resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "already finished; nothing to resume" in out and str(run / "keys" / "journal") in out


def test_the_federation_config_sets_the_actors_through_rays_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Flower 1.42 takes whole CPUs per ClientApp; the actor count is the CPU count Ray is told
    assert runner.federation_config(10_000, 3) == (
        "num-supernodes=10000 client-resources-num-cpus=1 init-args-num-cpus=3")
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 8)
    assert runner.default_actors() == int(8 * runner.ACTORS_PER_CPU) and runner.federation_config(5).endswith(
        f"init-args-num-cpus={runner.default_actors()}")
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 1)
    assert runner.default_actors() == 2  # at least two: one waits for its Ray round trip while the other works
    for bad in (0, -1, True, 2.5):
        with pytest.raises(runner.RunnerError, match="actors must be an int >= 1"):
            runner.federation_config(5, bad)  # type: ignore[arg-type] - a wrong type on purpose


def test_actors_flag_is_checked_and_recorded_for_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.main(["run", "--clients", "3", "--actors", "0", "--output-dir", str(tmp_path)]) == 2
    assert "--actors must be >= 1" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
    seen: dict[str, object] = {}

    def fake_launch(project: Path, out_dir: Path, spec: dict[str, object], **kwargs: object) -> int:
        seen.update(spec)
        return 0

    monkeypatch.setattr(runner, "_launch", fake_launch)
    runner.main(["run", "--clients", "3", "--actors", "3", "--rounds", "1", "--run-name", "a",
                 "--output-dir", str(tmp_path)])
    assert seen["actors"] == 3 and seen["clients"] == 3
    assert json.loads((tmp_path / "a" / runner.RUNNER_FILE).read_text())["actors"] == 3  # resume launches the same
