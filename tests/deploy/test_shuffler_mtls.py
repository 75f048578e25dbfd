"""The shuffler service started by the deployment requires the ServerApp's client certificate (real process).

The same ``Stats`` call succeeds with the ServerApp certificate from ``deploy keys`` and is refused during the TLS
handshake without a client certificate, and with a client certificate from another CA (the SuperLink CA).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from shuffledp.deploy import local as dc
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import shuffler_pb2_grpc as pb_grpc
from shuffledp.shuffler import tls


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("mtls")
    keys = dc.create_deploy_keys(root / "keys", 2, k=2)
    proc = dc.start_shuffler(keys, root / "shuffler.log")
    try:
        yield keys, proc.address
    finally:
        proc.stop()


def _stats(address: str, creds: grpc.ChannelCredentials) -> pb.StatsResponse:
    with grpc.secure_channel(address, creds) as channel:
        return pb_grpc.ShufflerStub(channel).Stats(pb.StatsRequest(), timeout=10)


def test_serverapp_certificate_is_accepted(running) -> None:  # type: ignore[no-untyped-def]
    keys, address = running
    creds = grpc.ssl_channel_credentials(root_certificates=keys.shuffler_ca_cert.read_bytes(),
                                         private_key=keys.serverapp_key.read_bytes(),
                                         certificate_chain=keys.serverapp_cert.read_bytes())
    assert isinstance(_stats(address, creds), pb.StatsResponse)


def test_client_without_certificate_is_refused(running) -> None:  # type: ignore[no-untyped-def]
    keys, address = running
    creds = grpc.ssl_channel_credentials(root_certificates=keys.shuffler_ca_cert.read_bytes())
    with pytest.raises(grpc.RpcError) as err:
        _stats(address, creds)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_certificate_from_another_ca_is_refused(running) -> None:  # type: ignore[no-untyped-def]
    keys, address = running
    # a client certificate the SuperLink operator could mint: signed by the SuperLink CA, not the shuffler's
    cert, key = tls.issue_certificate(keys.superlink_ca_cert.read_bytes(), keys.superlink_ca_key.read_bytes(),
                                      "serverapp", sans=(), is_server=False, is_client=True)
    creds = grpc.ssl_channel_credentials(root_certificates=keys.shuffler_ca_cert.read_bytes(), private_key=key,
                                         certificate_chain=cert)
    with pytest.raises(grpc.RpcError) as err:
        _stats(address, creds)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_deploy_keys_layout(running) -> None:  # type: ignore[no-untyped-def]
    keys, _ = running
    root: Path = keys.root
    for private in [keys.superlink_key, keys.superlink_ca_key, keys.supernode_key(0), keys.supernode_key(1),
                    keys.serverapp_key, keys.client_key(0), root / "server" / "hpke.key"]:
        assert private.stat().st_mode & 0o777 == 0o600, private
    manifest = keys.load_manifest()
    assert manifest["nodes"] == 2 and "127.0.0.1" in manifest["superlink-sans"]
    with pytest.raises(dc.DeployError, match="not an empty directory"):
        dc.create_deploy_keys(root, 2)
