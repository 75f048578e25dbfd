"""Who the SuperLink accepts (real flower-superlink / flower-supernode / flower-superexec processes).

One SuperLink with TLS, ``--enable-supernode-auth`` and ``--isolation process`` with a SuperExec secret (the
compose set-up), keys from ``create_deploy_keys``:

* node 0's public key is registered with ``flwr supernode register``, node 1's is not: node 0 is activated,
  node 1 exits with an error and is never activated;
* a ServerApp executor that does not hold the SuperExec secret is refused by the Runtime API.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from shuffledp.deploy import flower
from shuffledp.deploy.bundle import node_config
from shuffledp.deploy.flower import (
    flower_bin,
    flower_env,
    register_supernode,
    start_superlink,
    start_supernode,
    start_supernodes,
    write_flower_config,
    write_toml,
)
from shuffledp.deploy.keys import DeployKeys, create_deploy_keys
from shuffledp.deploy.processes import ProcessGroup, log_contains, wait_for


@pytest.fixture(scope="module")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DeployKeys, str, Path, ProcessGroup]]:
    root = tmp_path_factory.mktemp("auth")
    keys = create_deploy_keys(root / "keys", 2, k=1)
    group = ProcessGroup(grace_seconds=5)
    try:
        address = start_superlink(group, keys, root / "superlink", dict(os.environ), root / "superlink.log",
                                     isolation="process")
        yield keys, address, root, group
    finally:
        started = [p.popen for p in group.procs]
        group.stop_all()
        assert started and all(p.poll() is not None for p in started)


@pytest.mark.e2e
def test_unregistered_supernode_is_refused(superlink: tuple[DeployKeys, str, Path, ProcessGroup],
                                           tmp_path: Path) -> None:
    keys, address, root, group = superlink
    base_env = dict(os.environ)
    logs = tmp_path / "logs"
    cli_env = flower_env(tmp_path / "cli-home", base_env)
    write_flower_config(tmp_path / "cli-home", address, keys.superlink_ca_cert)
    node_id = register_supernode(cli_env, keys.supernode_pub(0))
    assert int(node_id) > 0

    procs = []
    for i in (0, 1):
        conf = write_toml(tmp_path / f"node-{i}.toml", node_config(keys, i, 2, eps0=1.0, clip_l1=1.0))
        procs.append(start_supernode(group, keys, i, address, conf, tmp_path / f"node-{i}", base_env,
                                        logs / f"supernode-{i}.log", max_retries=1))
    # the registered node is activated with the id the registration returned
    wait_for(lambda: log_contains(logs / "supernode-0.log", "SuperNode ID"), 90, "node 0", ProcessGroup())
    assert node_id in (logs / "supernode-0.log").read_text()
    # the unregistered node gives up: non-zero exit, the activation refused
    code = procs[1].wait(timeout=90)
    log1 = (logs / "supernode-1.log").read_text()
    assert code != 0
    assert "Failed to activate SuperNode" in log1
    assert "SuperNode ID" not in log1
    assert procs[0].poll() is None  # the registered one is still running
    sl = (root / "superlink.log").read_text()
    assert sl.count("Activated node_id") == 1 and f"Activated node_id={node_id}" in sl


@pytest.mark.e2e
def test_serverapp_executor_without_the_secret_is_refused(
        superlink: tuple[DeployKeys, str, Path, ProcessGroup], tmp_path: Path) -> None:
    """With ``--isolation process`` the Runtime API shares the public port; an executor that does not hold
    ``superlink/superexec.secret`` is refused when it asks for a ServerApp task."""
    keys, address, root, group = superlink
    wrong = tmp_path / "wrong.secret"
    wrong.write_bytes(b"not-the-deployment-secret")
    wrong.chmod(0o600)
    group.start("intruder", [flower_bin("flower-superexec"), "--runtime-api-address", address,
                             "--root-certificates", str(keys.superlink_ca_cert),
                             "--superexec-auth-secret-file", str(wrong)],
                log=tmp_path / "intruder.log", env=flower_env(tmp_path / "home", dict(os.environ)))
    log_path = root / "superlink.log"
    wait_for(lambda: log_contains(log_path, "SuperExec authentication failed"), 90,
                 "the SuperLink to refuse the executor", ProcessGroup())
    log = log_path.read_text()
    assert '"POST /v1/runtime/acquire-task HTTP/1.1" 401' in log
    assert '"POST /v1/runtime/acquire-task HTTP/1.1" 200' not in log


@pytest.mark.e2e
def test_supernode_that_lost_its_port_is_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port chosen for a SuperNode's Runtime HTTP API is taken before the SuperNode binds it (another process
    listens there): the node exits with EADDRINUSE, is restarted on a fresh port and is accepted."""
    keys = create_deploy_keys(tmp_path / "keys", 1, k=1)
    group = ProcessGroup(grace_seconds=5)
    base_env = dict(os.environ)
    logs = tmp_path / "logs"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        try:
            address = start_superlink(group, keys, tmp_path / "superlink", base_env, logs / "superlink.log")
            cli_env = flower_env(tmp_path / "cli-home", base_env)
            write_flower_config(tmp_path / "cli-home", address, keys.superlink_ca_cert)
            node_id = register_supernode(cli_env, keys.supernode_pub(0))
            real_free_port = flower.free_port
            offered = iter([taken])
            monkeypatch.setattr(flower, "free_port",
                                lambda host="127.0.0.1": next(offered, None) or real_free_port(host))
            conf = write_toml(tmp_path / "node-0.toml", node_config(keys, 0, 1, eps0=1.0, clip_l1=1.0))
            start_supernodes(group, keys, address, [conf], tmp_path / "nodes", base_env, logs, timeout=90)
            log = (logs / "supernode-0.log").read_text()
            assert log.count("address already in use") == 1 and f"127.0.0.1', {taken})" in log
            assert f"SuperNode ID: {node_id}" in log
            assert [p.name for p in group.procs] == ["flower-superlink", "flower-supernode 0"]
            assert all(p.popen.poll() is None for p in group.procs)
        finally:
            group.stop_all()


