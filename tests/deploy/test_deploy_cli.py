"""Fast checks of ``shuffledp deploy``: argument validation, the files it writes, the timing breakdown and the
README's documented command (no Flower processes here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from shuffledp.deploy import local as dc

README = Path(__file__).resolve().parents[2] / "deploy" / "README.md"


def test_readme_local_section_starts_with_the_command() -> None:
    text = README.read_text()
    section = text.split("## Local TLS deployment", 1)[1]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block is not None
    command = block.group(1).strip()
    assert command == "shuffledp deploy local --nodes 3 --rounds 2"
    args = dc._parser().parse_args(command.split()[2:])
    assert (args.action, args.nodes, args.rounds) == ("local", 3, 2)


def test_readme_sections_exist() -> None:
    text = README.read_text()
    for heading in ("## Running the server side", "## Enrolling and starting a device", "## Rotating keys",
                    "## Simulation across several machines on a Ray cluster", "### ARM devices",
                    "## Keys and who keeps them"):
        assert heading in text, heading


@pytest.mark.parametrize(
    "argv, message",
    [
        (["deploy", "keys", "--out", "X", "--nodes", "0"], "--nodes must be an integer in [1, "),
        (["deploy", "local", "--nodes", "3", "--min-reports", "4"], "--min-reports must be an integer in [1, 3]"),
        (["deploy", "local", "--eps0", "-1"], "--eps0 must be a finite number > 0"),
        (["deploy", "local", "--clip-l1", "nan"], "--clip-l1 must be a finite number > 0"),
        (["deploy", "local", "--rounds", "0"], "--rounds must be an integer in [1, "),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(argv: list[str], message: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a if a != "X" else str(tmp_path / "k") for a in argv]
    assert dc.main(argv) == 2  # a usage error, as argparse's own; a failed run exits 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "k").exists()  # nothing written for a refused command


def test_an_output_that_exists_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing is overwritten: an --out that already holds files is refused with exit 2 (a wrong parameter), not
    1 (a failure), and left as it was."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine").write_text("keep")
    assert dc.main(["deploy", "keys", "--out", str(used), "--nodes", "2"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in used.iterdir()] == ["mine"] and (used / "mine").read_text() == "keep"


@pytest.mark.parametrize("which", ["workdir", "keys_dir"])
def test_workdir_or_keys_inside_the_app_are_refused(which: str, tmp_path: Path) -> None:
    """`flwr run` packs the app folder's TOML/JSON files into the app bundle; neither the run's directory nor the
    keys may be in it (the app folder itself included); a sibling of the app folder is fine."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text("[project]\nname='x'\n[tool.flwr.app.config]\n")
    for inside in (app / "sub" / "dir", app):
        with pytest.raises(dc.DeployError, match=f"--{'workdir' if which == 'workdir' else 'keys'} .* is inside "
                                                  "the app directory"):
            dc.LocalDeployment(app_dir=app, **{which: inside}).validate()
    assert dc.LocalDeployment(app_dir=app, **{which: tmp_path / "appx"}).validate() is None


def test_a_used_workdir_and_run_config_keys_the_deployment_sets_are_refused(tmp_path: Path) -> None:
    """A second run in the same --workdir would overwrite the first's results and read its old log lines; a
    --run-config of a key deploy local sets would contradict what the SuperNodes pin. Both are refused before
    anything starts, and the used directory is left as it was."""
    work = tmp_path / "work"
    work.mkdir()
    assert dc.LocalDeployment(workdir=work).validate() is None  # an empty directory is fine
    (work / "deploy-result.json").write_text("{}")
    with pytest.raises(dc.DeployError, match="not an empty directory"):
        dc.LocalDeployment(workdir=work).validate()
    assert (work / "deploy-result.json").read_text() == "{}"
    (tmp_path / "file").write_text("x")
    with pytest.raises(dc.DeployError, match="not an empty directory"):
        dc.LocalDeployment(workdir=tmp_path / "file").validate()
    for key, hint in (("eps0", "--eps0"), ("run-name", "wires it up"), ("key-epoch", "manifest")):
        with pytest.raises(dc.DeployError, match=f"--run-config {key} is set by deploy local itself.*{hint}"):
            dc.LocalDeployment(run_config={key: 1}).validate()
    dc.LocalDeployment(run_config={"local-epochs": 2}).validate()  # keys the deployment leaves alone pass


def test_node_config_file_round_trips_through_toml(tmp_path: Path) -> None:
    keys = dc.create_deploy_keys(tmp_path / "keys with space", 2)
    conf = dc.node_config(keys, 1, 2, eps0=2.5, clip_l1=0.5)
    path = dc.write_toml(tmp_path / "n.toml", conf)
    loaded = tomllib.loads(path.read_text())
    assert loaded == conf
    assert Path(loaded["client-key"]).is_file() and " " in loaded["client-key"]
    assert set(conf) == {"partition-id", "num-partitions", "eps0", "clip-l1", "reply-floor", "max-local-epochs",
                         "min-batch-size", "max-model-parameters", "client-key", "server-public-key", "shuffler-public-key",
                         "dataset", "data-dir", "pca-components", "partition", "dirichlet-alpha", "partition-seed"}
    flwr_conf = tomllib.loads(dc.write_flower_config(tmp_path / "home", "127.0.0.1:9", keys.superlink_ca_cert)
                              .read_text())
    conn = flwr_conf["superlink"][dc.CONNECTION_NAME]
    assert flwr_conf["superlink"]["default"] == dc.CONNECTION_NAME
    assert conn == {"address": "127.0.0.1:9", "root-certificates": str(keys.superlink_ca_cert.resolve())}


def test_bundle_holds_only_the_devices_files(tmp_path: Path) -> None:
    keys = dc.create_deploy_keys(tmp_path / "keys", 3)
    bundle = dc.create_device_bundle(keys, 2, tmp_path / "b", eps0=1.0, clip_l1=2.0)
    names = sorted(p.name for p in bundle.iterdir())
    assert names == ["client.key", "node-config.toml", "server_hpke.pub", "shuffler_hpke.pub", "superlink-ca.crt",
                     "supernode.key", "supernode.pub"]
    assert (bundle / "client.key").read_bytes() == keys.client_key(2).read_bytes()
    assert (bundle / "supernode.key").read_bytes() == keys.supernode_key(2).read_bytes()
    assert (bundle / "client.key").stat().st_mode & 0o777 == 0o600
    conf = tomllib.loads((bundle / "node-config.toml").read_text())
    assert conf["partition-id"] == 2 and conf["eps0"] == 1.0 and conf["clip-l1"] == 2.0
    assert Path(conf["client-key"]) == (bundle / "client.key").resolve()
    with pytest.raises(dc.DeployError, match="already exists"):
        dc.create_device_bundle(keys, 1, bundle, eps0=1.0, clip_l1=1.0)
    with pytest.raises(dc.DeployError, match=r"--node must be an integer in \[0, 2\]"):
        dc.create_device_bundle(keys, 3, tmp_path / "b3", eps0=1.0, clip_l1=1.0)
    assert conf["reply-floor"] == 0.0  # off unless asked for
    timed = dc.create_device_bundle(keys, 1, tmp_path / "b1", eps0=1.0, clip_l1=2.0, reply_floor=45)
    conf = tomllib.loads((timed / "node-config.toml").read_text())
    assert conf["reply-floor"] == 45.0
    from shuffledp.clients.core import pinned_from_configs

    assert pinned_from_configs(conf, {}).reply_floor == 45.0  # what the device's ClientApp reads
    for bad in (-1.0, 3601.0, float("nan"), True):
        with pytest.raises(dc.DeployError, match=r"--reply-floor must be a number of seconds in \[0, 3600\]"):
            dc.create_device_bundle(keys, 0, tmp_path / f"bad{bad}", eps0=1.0, clip_l1=1.0, reply_floor=bad)
        assert not (tmp_path / f"bad{bad}").exists()  # refused before anything was written
    with pytest.raises(dc.DeployError, match="--reply-floor .* must be below --reply-timeout"):
        dc.LocalDeployment(reply_floor=300.0, reply_timeout=300.0).validate()
    # the work limits the device pins (defaults: 10 epochs, batches of 1), and the CLI flags that set them
    assert (conf["max-local-epochs"], conf["min-batch-size"], conf["max-model-parameters"]) == (10, 1, 1_000_000)
    assert dc.main(["deploy", "bundle", "--keys", str(keys.root), "--node", "0", "--out", str(tmp_path / "w"),
                    "--eps0", "1", "--clip-l1", "1", "--max-local-epochs", "2", "--min-batch-size", "16",
                    "--max-model-parameters", "5000"]) == 0
    limited = pinned_from_configs(tomllib.loads((tmp_path / "w" / "node-config.toml").read_text()), {})
    assert (limited.max_local_epochs, limited.min_batch_size, limited.max_model_parameters) == (2, 16, 5000)
    for kw, flag in (({"max_local_epochs": 0}, "--max-local-epochs"), ({"min_batch_size": 1.5}, "--min-batch-size"),
                     ({"max_model_parameters": 2**28 + 1}, "--max-model-parameters")):
        with pytest.raises(dc.DeployError, match=flag):
            dc.create_device_bundle(keys, 0, tmp_path / "badlimit", eps0=1.0, clip_l1=1.0, **kw)
        assert not (tmp_path / "badlimit").exists()


def test_devices_pin_their_data_settings(tmp_path: Path) -> None:
    """The device reads the data its node config names (shuffledp.clients.core.data_settings_from_configs), so the bundle
    and `deploy local` write the data settings there: bundle flags, or the run's (app defaults + --run-config)."""
    from shuffledp.clients.core import data_settings_from_configs

    keys = dc.create_deploy_keys(tmp_path / "keys", 2)
    plain = tomllib.loads((dc.create_device_bundle(keys, 0, tmp_path / "b0", eps0=1.0, clip_l1=1.0)
                           / "node-config.toml").read_text())
    assert {k: plain[k] for k in ("dataset", "data-dir", "pca-components", "partition", "dirichlet-alpha",
                                  "partition-seed")} == {"dataset": "digits", "data-dir": "", "pca-components": 10,
                                                         "partition": "iid", "dirichlet-alpha": 0.5,
                                                         "partition-seed": 0}
    assert dc.main(["deploy", "bundle", "--keys", str(keys.root), "--node", "1", "--out", str(tmp_path / "b1"),
                    "--eps0", "1", "--clip-l1", "1", "--dataset", "mnist", "--data-dir", "/device/data",
                    "--pca-components", "0", "--partition", "dirichlet", "--dirichlet-alpha", "0.3",
                    "--partition-seed", "7"]) == 0
    conf = tomllib.loads((tmp_path / "b1" / "node-config.toml").read_text())
    # what the device's ClientApp reads, whatever the server's run config says about data-dir or partitions
    assert data_settings_from_configs(conf, {"data-dir": "/srv", "partition-seed": 0, "dataset": "mnist"}) == {
        "dataset": "mnist", "data_dir": "/device/data", "pca_components": None, "scheme": "dirichlet",
        "alpha": 0.3, "seed": 7}
    for flags, data in ((["--pca-components", "-1"], {"pca-components": -1}),
                        (["--partition", "zipf"], {"partition": "zipf"}),
                        (["--dirichlet-alpha", "0"], {"dirichlet-alpha": 0.0}),
                        (["--dataset", "minst"], {"dataset": "minst"})):
        assert dc.main(["deploy", "bundle", "--keys", str(keys.root), "--node", "0", "--out", str(tmp_path / "bad"),
                        "--eps0", "1", "--clip-l1", "1", *flags]) == 2
        with pytest.raises(dc.DeployError, match=f"data settings\\['{next(iter(data))}'\\] must be"):
            dc.create_device_bundle(keys, 0, tmp_path / "bad", eps0=1.0, clip_l1=1.0, data=data)
        assert not (tmp_path / "bad").exists()  # refused before anything was written
    with pytest.raises(dc.DeployError, match="dataset 'mnist' needs 'data-dir'"):  # else it fails on the device
        dc.create_device_bundle(keys, 0, tmp_path / "bad", eps0=1.0, clip_l1=1.0, data={"dataset": "mnist"})
    # deploy local: the app's run-config defaults with --run-config on top, the same for every node
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text('[tool.flwr.app.config]\ndataset = "digits"\npca-components = 20\n'
                                        'partition-seed = 4\n')
    local = dc.LocalDeployment(app_dir=app, run_config={"pca-components": 0, "local-epochs": 2})
    local.validate()
    data = local.data_settings()
    assert (data["pca-components"], data["partition-seed"], data["dataset"]) == (0, 4, "digits")
    assert dc.node_config(keys, 1, 2, eps0=1.0, clip_l1=1.0, data=data)["pca-components"] == 0
    with pytest.raises(dc.DeployError, match="pca-components"):
        dc.LocalDeployment(app_dir=app, run_config={"pca-components": "many"}).validate()
    (app / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(dc.DeployError, match="run-config defaults"):
        local.data_settings()


def test_round_timings_splits_each_round() -> None:
    ev = [
        (10.0, "supernode-0", "INFO : [RUN 5, ROUND 1]"),
        (13.0, "supernode-0", "INFO : Receiving: train.shuffled message (ID: a)"),
        (13.5, "supernode-1", "[RUN 5, ROUND 1]"),
        (14.0, "supernode-1", "Receiving: train.shuffled message (ID: b)"),
        (16.0, "supernode-0", "[RUN 5, ROUND 1]"),
        (16.1, "supernode-0", "Sent successfully"),
        (17.0, "supernode-1", "Sent successfully"),
        (20.0, "superlink", "[shuffledp] round 1: 2 reports (attested), accuracy 0.5"),
        (20.5, "run", "[shuffledp] round 1: 2 reports (attested), accuracy 0.5"),  # later copy is ignored
        (22.0, "supernode-0", "[RUN 5, ROUND 2]"),
        (23.0, "supernode-0", "Receiving: train.shuffled message (ID: c)"),
        (23.25, "supernode-0", "Received successfully"),
        (23.5, "supernode-0", "Start `flwr-clientapp` process"),
        (24.5, "supernode-0", "[RUN 5, ROUND 2]"),
        (24.5, "supernode-0", "Sending: train.shuffled message (ID: d)"),
        (25.0, "supernode-0", "Sent successfully"),
        (26.0, "run", "[shuffledp] round 2: 1 reports (attested)"),
    ]
    ev.append((26.5, "run", "[shuffledp] round 3: stopped - round 3 is not run: the budget ..."))
    ends = {1: 20.0, 2: 26.0, 3: 26.5}  # the ServerApp's own clock
    rows = dc.round_timings(ev, run_start=5.0, round_ends=ends)
    assert rows[0] == {"round": 1, "wall": 15.0, "to-first-node": 8.0, "node-spread": 1.0, "client": 3.1,
                       "server-side": 3.0}
    assert rows[1] == {"round": 2, "wall": 6.0, "to-first-node": 3.0, "node-spread": 0.0, "client": 2.0,
                       "server-side": 1.0, "client-download": 0.25, "client-pickup": 0.25, "clientapp": 1.0,
                       "client-upload": 0.5}
    assert rows[2] == {"round": 3, "wall": 0.5, "status": "stopped"}
    # the round boundaries are the ServerApp's clock, not the progress lines' arrival: relayed late, every progress
    # line arriving in one read at 40 s gives the same rows
    late = [(40.0, key, line) if "[shuffledp]" in line else (t, key, line) for t, key, line in ev]
    assert dc.round_timings(late, run_start=5.0, round_ends=ends) == rows
    # the report prints a stopped round as what it is, not as a row of unknown phases
    result = dc.DeployResult(status="finished:completed", run_id="5", report={"rounds": []}, report_path=None,
                             timings={"rounds": rows}, workdir=Path("."))
    text = dc.format_report(result)
    assert "  round 3: stopped (no model update), wall 0.50\n" in text
    assert "  round 2: wall 6.00 | ServerApp collect ? = slowest client 2.00" in text
    # a round with a progress line but no end on the server's clock (a budget stop is not checkpointed) has no
    # figure measured from its end, rather than one measured from a late log line
    rows = dc.round_timings(late, run_start=5.0, round_ends={1: 20.0, 2: 26.0})
    assert rows[2] == {"round": 3, "status": "stopped"}


def test_round_ends_come_from_the_server_history() -> None:
    history = [{"round": 1, "finished_at": 1000.25, "seconds": {"collect": 2.0}},
               {"round": 2, "finished_at": None}, {"round": 3, "finished_at": 1003.0}]
    assert dc.server_round_ends(history, wall_t0=990.0) == {1: 10.25, 3: 13.0}
    rows = [{"round": 1, "client": 1.5}, {"round": 2}]
    dc.merge_server_seconds(rows, history)
    assert rows == [{"round": 1, "client": 1.5, "server-collect": 2.0, "messaging": 0.5}, {"round": 2}]


def test_file_tailer_stamps_new_lines(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    tailer = dc.FileTailer({"a": log, "missing": tmp_path / "none.log"}, t0=0.0)
    tailer.poll()
    assert tailer.events == []
    log.write_text("one\ntw")
    tailer.poll()
    with open(log, "a") as fh:
        fh.write("o\n\x1b[92mINFO\x1b[0m three\n")
    tailer.poll()
    assert [(k, line) for _, k, line in tailer.events] == [("a", "one"), ("a", "two"), ("a", "INFO three")]
    times = [t for t, _, _ in tailer.events]
    assert times == sorted(times)


def test_process_group_stops_the_whole_group(tmp_path: Path) -> None:
    import os
    import sys

    group = dc.ProcessGroup(grace_seconds=2)
    # a parent that ignores SIGTERM and starts a child: both must be gone after stop_all
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "open(sys.argv[1], 'w').write(str(c.pid))\n"
              "time.sleep(60)\n")
    pidfile = tmp_path / "child.pid"
    popen = group.start("sleeper", [sys.executable, "-c", script, str(pidfile)], log=tmp_path / "s.log",
                        env=dict(os.environ))
    dc._wait_for(pidfile.exists, 20, "the child", group)
    child = int(pidfile.read_text())
    group.stop_all()
    assert popen.poll() is not None
    assert _dead_within(child, 5.0), "the child in the process group survived stop_all"


def _dead_within(pid: int, seconds: float) -> bool:
    """True once ``pid`` no longer runs (gone, or a zombie waiting for init to reap it)."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_every_deploy_command_in_the_readme_parses() -> None:
    import shlex

    commands, inside = [], False
    for line in README.read_text().splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif inside and line.strip().startswith("shuffledp deploy"):
            commands.append(line.split("#")[0].strip())
    assert len(commands) >= 4
    parser = dc._parser()
    for command in commands:
        argv = shlex.split(command.replace("$", ""))[2:]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # argparse reports the bad flag on stderr
            raise AssertionError(f"README command does not parse: {command}") from exc


def test_a_failed_stats_call_is_a_deploy_error_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Review 51, L3: the spent-epoch check's Stats call let grpc.RpcError out of `shuffledp deploy`."""
    import grpc

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection reset"

    class Silent:
        def spent_epoch_batches(self, timeout: float = 10.0) -> tuple[int, int]:
            raise Unavailable()

    with pytest.raises(dc.DeployError, match="did not answer its Stats call \\(UNAVAILABLE: connection reset\\)"):
        dc._refuse_a_spent_key_epoch(Silent(), 0)
    monkeypatch.setattr(dc, "run_local", lambda cfg, out: dc._refuse_a_spent_key_epoch(Silent(), 0))
    assert dc.main(["deploy", "local", "--workdir", str(tmp_path / "w")]) == 1
    assert "did not answer its Stats call" in capsys.readouterr().err
