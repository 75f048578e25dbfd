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

from shuffledp.deploy import local as dc


@pytest.fixture(scope="module")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dc.DeployKeys, str, Path, dc.ProcessGroup]]:
    root = tmp_path_factory.mktemp("auth")
    keys = dc.create_deploy_keys(root / "keys", 2, k=1)
    group = dc.ProcessGroup(grace_seconds=5)
    try:
        address = dc.start_superlink(group, keys, root / "superlink", dict(os.environ), root / "superlink.log",
                                     isolation="process")
        yield keys, address, root, group
    finally:
        started = [p.popen for p in group.procs]
        group.stop_all()
        assert started and all(p.poll() is not None for p in started)


@pytest.mark.e2e
def test_unregistered_supernode_is_refused(superlink: tuple[dc.DeployKeys, str, Path, dc.ProcessGroup],
                                           tmp_path: Path) -> None:
    keys, address, root, group = superlink
    base_env = dict(os.environ)
    logs = tmp_path / "logs"
    cli_env = dc.flower_env(tmp_path / "cli-home", base_env)
    dc.write_flower_config(tmp_path / "cli-home", address, keys.superlink_ca_cert)
    node_id = dc.register_supernode(cli_env, keys.supernode_pub(0))
    assert int(node_id) > 0

    procs = []
    for i in (0, 1):
        conf = dc.write_toml(tmp_path / f"node-{i}.toml", dc.node_config(keys, i, 2, eps0=1.0, clip_l1=1.0))
        procs.append(dc.start_supernode(group, keys, i, address, conf, tmp_path / f"node-{i}", base_env,
                                        logs / f"supernode-{i}.log", max_retries=1))
    # the registered node is activated with the id the registration returned
    dc._wait_for(lambda: dc._log_contains(logs / "supernode-0.log", "SuperNode ID"), 90, "node 0", dc.ProcessGroup())
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
        superlink: tuple[dc.DeployKeys, str, Path, dc.ProcessGroup], tmp_path: Path) -> None:
    """With ``--isolation process`` the Runtime API shares the public port; an executor that does not hold
    ``superlink/superexec.secret`` is refused when it asks for a ServerApp task."""
    keys, address, root, group = superlink
    wrong = tmp_path / "wrong.secret"
    wrong.write_bytes(b"not-the-deployment-secret")
    wrong.chmod(0o600)
    group.start("intruder", [dc._flower_bin("flower-superexec"), "--runtime-api-address", address,
                             "--root-certificates", str(keys.superlink_ca_cert),
                             "--superexec-auth-secret-file", str(wrong)],
                log=tmp_path / "intruder.log", env=dc.flower_env(tmp_path / "home", dict(os.environ)))
    log_path = root / "superlink.log"
    dc._wait_for(lambda: dc._log_contains(log_path, "SuperExec authentication failed"), 90,
                 "the SuperLink to refuse the executor", dc.ProcessGroup())
    log = log_path.read_text()
    assert '"POST /v1/runtime/acquire-task HTTP/1.1" 401' in log
    assert '"POST /v1/runtime/acquire-task HTTP/1.1" 200' not in log


def test_supernode_keypair_is_what_flower_reads() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    private, public = dc.supernode_keypair()
    sk = load_ssh_private_key(private, None)
    pk = load_ssh_public_key(public)
    assert isinstance(sk, ec.EllipticCurvePrivateKey) and isinstance(pk, ec.EllipticCurvePublicKey)
    assert sk.curve.name == "secp384r1"
    assert sk.public_key().public_numbers() == pk.public_numbers()
    assert dc.supernode_keypair()[0] != private  # fresh randomness each time


@pytest.mark.e2e
def test_supernode_that_lost_its_port_is_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port chosen for a SuperNode's Runtime HTTP API is taken before the SuperNode binds it (another process
    listens there): the node exits with EADDRINUSE, is restarted on a fresh port and is accepted."""
    keys = dc.create_deploy_keys(tmp_path / "keys", 1, k=1)
    group = dc.ProcessGroup(grace_seconds=5)
    base_env = dict(os.environ)
    logs = tmp_path / "logs"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        try:
            address = dc.start_superlink(group, keys, tmp_path / "superlink", base_env, logs / "superlink.log")
            cli_env = dc.flower_env(tmp_path / "cli-home", base_env)
            dc.write_flower_config(tmp_path / "cli-home", address, keys.superlink_ca_cert)
            node_id = dc.register_supernode(cli_env, keys.supernode_pub(0))
            real_free_port = dc.free_port
            offered = iter([taken])
            monkeypatch.setattr(dc, "free_port", lambda host="127.0.0.1": next(offered, None) or real_free_port(host))
            conf = dc.write_toml(tmp_path / "node-0.toml", dc.node_config(keys, 0, 1, eps0=1.0, clip_l1=1.0))
            dc.start_supernodes(group, keys, address, [conf], tmp_path / "nodes", base_env, logs, timeout=90)
            log = (logs / "supernode-0.log").read_text()
            assert log.count("address already in use") == 1 and f"127.0.0.1', {taken})" in log
            assert f"SuperNode ID: {node_id}" in log
            assert [p.name for p in group.procs] == ["flower-superlink", "flower-supernode 0"]
            assert all(p.popen.poll() is None for p in group.procs)
        finally:
            group.stop_all()


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [dc.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p <= 65535 for p in ports)
