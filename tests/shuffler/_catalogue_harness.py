"""The adversarial catalogue's harness: one shuffler process per module, the outcomes a case can have, its context."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shuffledp.shuffler.client import ShufflerClient

from ._fixtures_adv import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    FETCH,
    SUBMIT,
    craft_envelope,
    open_all,
    process,
    raw_channel,
    write_service_config,
)

# ----------------------------------------------------------------------------------- catalogue: the service
MAX_ENVELOPE = 1 << 20  # the catalogue service's max_envelope_bytes
MAX_BATCH = 64  # the catalogue service's max_batch_reports
HONEST = (0, 1, 2, 3)  # enrolled clients that send honest reports in every batch (k = 3)
RPC_TIMEOUT = 20.0  # seconds; a hung RPC is a failure, not a hang of the suite


@dataclass
class Svc:
    kit: Any
    proc: Any
    pid: int
    rounds: Iterator[int]

    def client(self) -> ShufflerClient:
        return self.kit.client(self.proc.address)


@pytest.fixture(scope="module", name="svc")
def catalogue_service(kit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Svc]:
    """The fixture ``svc``: one shuffler process for each module that imports it."""
    d: Path = tmp_path_factory.mktemp("catalogue")
    cfg = write_service_config(kit, d / "shuffler.toml", max_envelope_bytes=MAX_ENVELOPE, max_batch_reports=MAX_BATCH)
    p = process(kit, cfg)
    p.start()
    try:
        yield Svc(kit=kit, proc=p, pid=p.pid, rounds=itertools.count(1000))
    finally:
        p.stop()


# ------------------------------------------------------------------------------------------------ outcomes
@dataclass
class Drop:
    """A batch to submit as is; ``drops`` is the exact count per reason; ``payloads`` the honest payloads."""

    envelopes: list[bytes]
    drops: dict[str, int]
    payloads: list[bytes]
    envelope_length: int | None = None  # announced in the header (then odd lengths are counted drops)
    after: Callable[[], None] | None = None  # an extra check once the batch is released


@dataclass
class Refusal:
    """``action()`` performs the hostile request (it must raise); then ``resubmit`` must go through."""

    action: Callable[[], Any]
    code: grpc.StatusCode
    reason: str | None  # the shuffler's reason tag, or None when gRPC/TLS refuses before the handler
    resubmit: list[bytes] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    after: Callable[[], None] | None = None  # an extra check once the refusal has happened


@dataclass
class Ctx:
    svc: Svc
    r: int  # this case's round id
    last_client: Any = None

    @property
    def kit(self) -> Any:
        return self.svc.kit

    def honest(self, clients: tuple[int, ...] = HONEST, r: int | None = None) -> tuple[list[bytes], list[bytes]]:
        r = self.r if r is None else r
        payloads = [self.kit.payload(i) for i in clients]
        return [self.kit.seal(i, round_id=r) for i in clients], payloads

    def seal(self, i: int, **kw: Any) -> bytes:
        kw.setdefault("round_id", self.r)
        return self.kit.seal(i, **kw)

    def craft(self, i: int, **kw: Any) -> bytes:
        kit = self.kit
        return craft_envelope(
            kit.payload(i),
            server_pk=kit.server_pk,
            shuffler_pk=kit.shuffler_pk,
            signing_sk=kit.client_sks[i],
            key_epoch=kit.key_epoch,
            round_id=self.r,
            digest=kit.digest,
            **kw,
        )

    def submit(self, envelopes: list[bytes], **kw: Any) -> Any:
        extra = {"envelope_length": kw["envelope_length"]} if kw.get("envelope_length") else {}
        with self.svc.client() as c:
            self.last_client = c
            return c.submit(
                round_id=kw.get("round_id", self.r),
                key_epoch=kw.get("key_epoch", self.kit.key_epoch),
                model_digest=kw.get("model_digest", self.kit.digest),
                envelopes=envelopes,
                **extra,
            )

    def raw_submit(self, messages: list[bytes], *, max_bytes: int = 8 << 20) -> Any:
        with raw_channel(self.kit, self.svc.proc.address, max_bytes=max_bytes) as ch:
            call = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)
            return call(iter(messages), timeout=RPC_TIMEOUT)

    def raw_fetch(self, request: bytes) -> list[bytes]:
        with raw_channel(self.kit, self.svc.proc.address) as ch:
            call = ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)
            return list(call(request, timeout=RPC_TIMEOUT))

    def health_over(self, creds: grpc.ChannelCredentials | None) -> Any:
        addr = self.svc.proc.address
        ch = grpc.insecure_channel(addr) if creds is None else grpc.secure_channel(addr, creds)
        with ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)


Outcome = TypeVar("Outcome", Drop, Refusal)


class Catalogue(dict[str, Callable[[Ctx], Outcome]]):
    """One test module's cases by name: ``case = CASES.add`` is the decorator that files a case under its name."""

    def add(self, fn: Callable[[Ctx], Outcome]) -> Callable[[Ctx], Outcome]:
        self[fn.__name__] = fn
        return fn


# ---------------------------------------------------------------------------- catalogue: checks of a case
def _assert_alive(svc: Svc) -> None:
    assert svc.proc.proc.poll() is None and svc.proc.pid == svc.pid, "the shuffler process died or was restarted"
    assert svc.proc.health() == "SERVING"


def _released(ctx: Ctx, att: Any, round_id: int) -> list[bytes]:
    with ctx.svc.client() as c:
        inners = c.fetch_all(att)  # verifies count, lengths and the attested output digest
    return open_all(ctx.kit, inners, round_id)
