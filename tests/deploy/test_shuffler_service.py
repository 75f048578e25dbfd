"""shuffledp.deploy.shuffler_service: the service requires the ServerApp's client certificate (real process).

The same ``Stats`` call succeeds with the ServerApp certificate from ``deploy keys`` and is refused during the TLS
handshake without a client certificate, and with a client certificate from another CA (the SuperLink CA).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from shuffledp.deploy import deploy_cli
from shuffledp.deploy.errors import DeployError
from shuffledp.deploy.keys import create_deploy_keys
from shuffledp.deploy.shuffler_service import refuse_a_spent_key_epoch, start_shuffler
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import shuffler_pb2_grpc as pb_grpc
from shuffledp.shuffler import tls


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("mtls")
    keys = create_deploy_keys(root / "keys", 2, k=2)
    proc = start_shuffler(keys, root / "shuffler.log")
    try:
        yield keys, proc.address
    finally:
        proc.stop()


def _stats(address: str, creds: grpc.ChannelCredentials) -> pb.StatsResponse:
    with grpc.secure_channel(address, creds) as channel:
        return pb_grpc.ShufflerStub(channel).Stats(pb.StatsRequest(), timeout=10)


def test_serverapp_certificate_is_accepted(running) -> None:
    keys, address = running
    creds = grpc.ssl_channel_credentials(root_certificates=keys.shuffler_ca_cert.read_bytes(),
                                         private_key=keys.serverapp_key.read_bytes(),
                                         certificate_chain=keys.serverapp_cert.read_bytes())
    assert isinstance(_stats(address, creds), pb.StatsResponse)


def test_client_without_certificate_is_refused(running) -> None:
    keys, address = running
    creds = grpc.ssl_channel_credentials(root_certificates=keys.shuffler_ca_cert.read_bytes())
    with pytest.raises(grpc.RpcError) as err:
        _stats(address, creds)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_certificate_from_another_ca_is_refused(running) -> None:
    keys, address = running
    # a client certificate the SuperLink operator could mint: signed by the SuperLink CA, not the shuffler's
    cert, key = tls.issue_certificate(keys.superlink_ca_cert.read_bytes(), keys.superlink_ca_key.read_bytes(),
                                      "serverapp", sans=(), is_server=False, is_client=True)
    creds = grpc.ssl_channel_credentials(root_certificates=keys.shuffler_ca_cert.read_bytes(), private_key=key,
                                         certificate_chain=cert)
    with pytest.raises(grpc.RpcError) as err:
        _stats(address, creds)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_deploy_keys_layout(running) -> None:
    keys, _ = running
    root: Path = keys.root
    for private in [keys.superlink_key, keys.superlink_ca_key, keys.supernode_key(0), keys.supernode_key(1),
                    keys.serverapp_key, keys.client_key(0), root / "server" / "hpke.key"]:
        assert private.stat().st_mode & 0o777 == 0o600, private
    manifest = keys.load_manifest()
    assert manifest["nodes"] == 2 and "127.0.0.1" in manifest["superlink-sans"]
    with pytest.raises(DeployError, match="not an empty directory"):
        create_deploy_keys(root, 2)


def test_a_failed_stats_call_is_a_deploy_error_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The spent-epoch check's Stats call failing is a deploy error (exit 1) with the gRPC status, not a
    grpc.RpcError traceback out of `shuffledp deploy`."""
    import grpc

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection reset"

    class Silent:
        def spent_epoch_batches(self, timeout: float = 10.0) -> tuple[int, int]:
            raise Unavailable()

    with pytest.raises(DeployError, match="did not answer its Stats call \\(UNAVAILABLE: connection reset\\)"):
        refuse_a_spent_key_epoch(Silent(), 0)
    monkeypatch.setattr(deploy_cli, "run_local", lambda cfg, out: refuse_a_spent_key_epoch(Silent(), 0))
    assert deploy_cli.main(["deploy", "local", "--workdir", str(tmp_path / "w")]) == 1
    assert "did not answer its Stats call" in capsys.readouterr().err
