"""The local deployment for real: flower-superlink (TLS, node authentication, file database), the shuffler
(mTLS), 3 flower-supernode processes, ``flwr run`` of this project, 2 rounds; and the clean-up on Ctrl-C."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shuffledp.deploy.errors import DeployError
from shuffledp.deploy.keys import create_deploy_keys
from shuffledp.deploy.local import LocalDeployment, run_local
from shuffledp.deploy.processes import processes_mentioning, tail
from shuffledp.deploy.timeline import format_report

pytestmark = pytest.mark.e2e


def _wait_gone(text: str, seconds: float = 15.0) -> list[tuple[int, str]]:
    deadline = time.monotonic() + seconds
    left = processes_mentioning(text)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_mentioning(text)
    return left


def test_local_deployment_three_nodes_two_rounds(tmp_path: Path) -> None:
    from shuffledp.accounting.bounds import epsilon as epsilon_bound

    work = tmp_path / "work"
    cfg = LocalDeployment(nodes=3, rounds=2, workdir=work, eps0=4.0, clip_l1=1.0, timeout=600,
                             reply_timeout=240)
    result = run_local(cfg)
    print(format_report(result))  # shown with -s; the figures quoted in deploy/README.md come from here
    assert result.status == "finished:completed", tail(work / "logs" / "superlink.log", 40)
    assert result.report is not None
    rounds = result.report["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["n_reports"] == 3 for r in rounds)  # the counts the shuffler attested
    config = result.report["config"]
    family, delta = config["accounting-family"], float(config["target-delta"])
    for i, row in enumerate(rounds, start=1):
        assert row["eps0"] == 4.0 and row["delta"] == delta
        expected = epsilon_bound(family, 4.0, 3, delta, rounds=i).value
        assert math.isclose(row["epsilon"], expected, rel_tol=1e-9), (row, expected)
    assert rounds[1]["epsilon"] > rounds[0]["epsilon"] > 0
    # every SuperNode answered both rounds over TLS with node authentication
    superlink_log = (work / "logs" / "superlink.log").read_text()
    assert superlink_log.count("Activated node_id") == 3
    for i in range(3):
        assert (work / "logs" / f"supernode-{i}.log").read_text().count("Sent successfully") == 2
    timing = result.timings["rounds"]
    assert [row["round"] for row in timing] == [1, 2] and all(row["wall"] > 0 for row in timing)
    # the ServerApp's own per-phase clock was merged in; the collect phase contains the slowest client
    assert all(row["server-collect"] + 0.5 >= row["client"] > 0 and row["server-shuffle"] >= 0 for row in timing)
    # the run config (sent to every SuperNode) names key files by path and holds no key material
    run_config = (work / "run-config.toml").read_text()
    assert "PRIVATE KEY" not in run_config and "shuffler-client-key" in run_config
    # nothing the deployment started is left running
    assert _wait_gone(str(work)) == []
    # a second run with the same keys (the same key epoch, whose batches were released above) is refused once the
    # shuffler answers, before any SuperNode starts or anything is submitted
    again = tmp_path / "again"
    with pytest.raises(DeployError, match=r"already released 2 batch\(es\) of key epoch 0"):
        run_local(LocalDeployment(nodes=3, rounds=1, workdir=again, keys_dir=work / "keys", timeout=120))
    assert not (again / "supernodes").exists() and not (again / "run-config.toml").exists()
    assert _wait_gone(str(again)) == [] and _wait_gone(str(work)) == []


def test_process_isolation_as_in_the_compose_file(tmp_path: Path) -> None:
    """The SuperLink with ``--isolation process`` and a separate ``flower-superexec`` holding the SuperExec secret
    (the ``superlink``/``serverapp`` services of deploy/compose.yml, as local processes)."""
    work = tmp_path / "work"
    result = run_local(LocalDeployment(nodes=2, rounds=1, workdir=work, isolation="process", timeout=600))
    assert result.status == "finished:completed", tail(work / "logs" / "serverapp-executor.log", 40)
    assert result.report is not None and [r["n_reports"] for r in result.report["rounds"]] == [2]
    # the ServerApp ran under the separate executor, not under a SuperExec the SuperLink spawned itself
    assert "Starting Flower SuperExec" not in (work / "logs" / "superlink.log").read_text()
    assert (work / "logs" / "serverapp-executor.log").stat().st_size > 0
    assert _wait_gone(str(work)) == []


def test_failure_after_start_stops_every_process(tmp_path: Path) -> None:
    """The SuperLink is up when the shuffler fails to start (a corrupt key): the error names the step and the
    SuperLink is stopped."""
    keys = create_deploy_keys(tmp_path / "keys", 2, k=2)
    hpke = keys.root / "shuffler" / "hpke.key"
    hpke.write_bytes(b"-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n")
    work = tmp_path / "work"
    with pytest.raises(DeployError, match="the shuffler service did not start"):
        run_local(LocalDeployment(nodes=2, rounds=1, workdir=work, keys_dir=keys.root))
    assert "Uvicorn running on" in (work / "logs" / "superlink.log").read_text()  # it had started
    assert _wait_gone(str(work)) == [] and _wait_gone(str(keys.root)) == []


def _sigint_as_in_a_foreground_job() -> None:
    """Give the child SIGINT's default action, as a terminal gives the foreground job that Ctrl-C reaches. A job
    that a non-interactive shell starts in the background (``cmd &``, as some CI runners launch the suite)
    inherits SIGINT *ignored*; Python then installs no KeyboardInterrupt handler, the deployment rightly ignores
    the signal, and its 100 rounds end normally (exit 0, reproduced by running this test under SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_stop_every_process(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    work = tmp_path / "work"
    # 100 rounds (about 50 s here), so the run is still going when the signal arrives. Two CI runs that saw exit
    # code 0 were started in the background, with SIGINT ignored: see _sigint_as_in_a_foreground_job
    proc = subprocess.Popen([sys.executable, "-m", "shuffledp.deploy.cli", "deploy", "local", "--nodes", "2",
                             "--rounds", "100", "--workdir", str(work)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_as_in_a_foreground_job)
    try:
        deadline = time.monotonic() + 120
        log = work / "logs" / "supernode-1.log"
        while not (log.exists() and "SuperNode ID" in log.read_text()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the deployment did not come up"
            time.sleep(0.2)
        assert len(processes_mentioning(str(work))) >= 3  # SuperLink and two SuperNodes at least
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert "every process was stopped" in err
    assert _wait_gone(str(work)) == []
