"""Calls the service tests make: a channel to an in-process server, a submit, the server itself, its health."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(kit, address: str, cert: bytes | None = None, key: bytes | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=kit.ca, private_key=key or kit.app_key, certificate_chain=cert or kit.app_cert
    )
    return grpc.secure_channel(address, creds, options=[("grpc.max_receive_message_length", 4 << 20)])


def _submit(kit, running, envs, **kw):
    with kit.client(running.address) as c:
        return c.submit(round_id=kw.pop("round_id", 1), key_epoch=kw.pop("key_epoch", 0),
                        model_digest=kw.pop("model_digest", kit.digest), envelopes=envs)


def _service(kit, tmp_path, *, max_workers: int = 4, idle: float | None = None, stall: float | None = None,
             max_duration: float | None = None, **config: object):
    from shuffledp.shuffler.config import load_config
    from shuffledp.shuffler.service import build_server, core_from_config

    from .conftest import write_config  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)

    path = write_config(kit, tmp_path / "shuffler.toml", **config)
    if idle is not None:  # top-level keys must come before the [tls] table
        path.write_text(f"submit_idle_timeout = {idle}\n" + path.read_text())
    if max_duration is not None:
        path.write_text(f"submit_max_duration = {max_duration}\n" + path.read_text())
    if stall is not None:  # and no transfer-time allowance to speak of (a rate of 1 GB/s)
        path.write_text(f"fetch_stall_timeout = {stall}\nfetch_min_rate = 1000000000\n" + path.read_text())
    cfg = load_config(path)
    core = core_from_config(cfg)
    server, port, health_servicer = build_server(cfg, core, max_workers=max_workers)
    return server, core, f"127.0.0.1:{port}"


def _health(kit, address: str, timeout: float = 2.0) -> int:
    with _channel(kit, address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status
