"""Catalogue of hostile and malformed inputs against a real shuffler process (mTLS, 127.0.0.1, port 0).

One shuffler subprocess (``shuffledp.shuffler.process.ShufflerProcess``) serves the whole module; every case uses its
own round id. Each case is one of:

* a **drop**: the hostile envelopes ride in a batch with four honest reports. The attestation must count each
  hostile envelope under one specific reason (every other reason 0), the Stats counters must grow by exactly
  that, and the server must open exactly the honest payloads (as a multiset) from the fetched batch;
* a **refusal**: the request gets one specific gRPC status code (and, where the shuffler sends one, the reason
  tag at the head of the details). A refused batch releases nothing and consumes nothing, so the honest
  envelopes of that same batch, resubmitted alone, must then be accepted and released unharmed.

After every case the process must still be the same process (no restart) and answer health SERVING.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import tls, wire
from shuffledp.shuffler.attestation import DROP_REASONS
from shuffledp.shuffler.client import ShufflerClient, ShufflerError
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, ENVELOPE_VERSION, model_digest, seal
from shuffledp.shuffler.service import message_limit

from ._fixtures_adv import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    FETCH,
    SUBMIT,
    craft_envelope,
    envelope_msg,
    header_msg,
    open_all,
    process,
    raw_channel,
    write_service_config,
)

MAX_ENVELOPE = 1 << 20  # the service's max_envelope_bytes in this module
MAX_BATCH = 64  # the service's max_batch_reports in this module
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


@pytest.fixture(scope="module")
def svc(kit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Svc]:
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


CASES: dict[str, Callable[[Ctx], Drop | Refusal]] = {}


def case(fn: Callable[[Ctx], Drop | Refusal]) -> Callable[[Ctx], Drop | Refusal]:
    CASES[fn.__name__] = fn
    return fn


def _flip(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    b = bytearray(data)
    b[pos] ^= mask
    return bytes(b)


def _drop(ctx: Ctx, hostile: list[bytes], drops: dict[str, int]) -> Drop:
    envs, payloads = ctx.honest()
    # hostile envelopes are interleaved with the honest ones, not appended, so position tells nothing
    mixed = envs[:2] + hostile + envs[2:]
    return Drop(mixed, drops, payloads)


def _stranger() -> bytes:
    return ed25519.Ed25519PrivateKey.generate().private_bytes_raw()


# ------------------------------------------------------------------------------------ per-envelope drops
@case
def truncated_below_overhead(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4)[: ENVELOPE_OVERHEAD - 1]], {"malformed": 1})


@case
def truncated_to_prefix(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4)[:5], ctx.seal(5)[:3]], {"malformed": 2})


@case
def truncated_by_one_byte(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4)[:-1]], {"undecryptable": 1})


@case
def empty_envelope_message(ctx: Ctx) -> Drop:
    # a zero-length envelope is the submitter's placeholder for a missing report: counted as its own reason
    return _drop(ctx, [b""], {"empty": 1})


@case
def oversized_envelope_within_transport_limit(ctx: Ctx) -> Drop:
    # a genuinely sealed envelope from an enrolled client, one byte above max_envelope_bytes
    big = ctx.seal(4, size=MAX_ENVELOPE + 1 - ENVELOPE_OVERHEAD)
    assert len(big) == MAX_ENVELOPE + 1
    return _drop(ctx, [big], {"oversized": 1})


@case
def bitflip_version_prefix(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), 0, 0x02)], {"wrong_version": 1})


@case
def bitflip_epoch_prefix(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), 4)], {"wrong_epoch": 1})


@case
def bitflip_encapsulated_key(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), 5 + 7)], {"undecryptable": 1})


@case
def bitflip_ciphertext_body(ctx: Ctx) -> Drop:
    e = ctx.seal(4)
    return _drop(ctx, [_flip(e, len(e) // 2, 0x80)], {"undecryptable": 1})


@case
def bitflip_aead_tag(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), -1)], {"undecryptable": 1})


@case
def wrong_key_epoch_envelope(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4, key_epoch=ctx.kit.key_epoch + 1)], {"wrong_epoch": 1})


@case
def wrong_round_envelope(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4, round_id=ctx.r + 1), ctx.seal(5, round_id=ctx.r - 1)], {"undecryptable": 2})


@case
def wrong_model_digest_tagging(ctx: Ctx) -> Drop:
    # a server that sends client 4 a tagged model: that client's envelope no longer opens in the round's batch
    tagged = model_digest([b"model-v1", b"tag-for-client-4"])
    return _drop(ctx, [ctx.seal(4, digest=tagged)], {"undecryptable": 1})


@case
def sealed_to_another_shuffler_key(ctx: Ctx) -> Drop:
    other = x25519.X25519PrivateKey.generate().public_key().public_bytes_raw()
    kit = ctx.kit
    e = seal(kit.payload(4), server_public_key=kit.server_pk, shuffler_public_key=other,
             signing_key=kit.client_sks[4], key_epoch=kit.key_epoch, round_id=ctx.r, model_digest=kit.digest)
    return _drop(ctx, [e], {"undecryptable": 1})


@case
def random_bytes_with_valid_prefix(ctx: Ctx) -> Drop:
    n = len(ctx.seal(4))
    junk = bytes([ENVELOPE_VERSION]) + ctx.kit.key_epoch.to_bytes(4, "big") + secrets.token_bytes(n - 5)
    return _drop(ctx, [junk], {"undecryptable": 1})


@case
def replayed_envelope_in_same_batch(ctx: Ctx) -> Drop:
    envs, payloads = ctx.honest()
    return Drop(envs[:2] + [envs[1], envs[0]] + envs[2:] + [envs[3]], {"replay": 3}, payloads)


@case
def replayed_report_id_under_fresh_encryption(ctx: Ctx) -> Drop:
    # client 4 reuses honest client 0's report id: a fresh HPKE enc, but the report-id replay key catches it
    rid = secrets.token_bytes(16)
    first = ctx.craft(0, report_id=rid)
    envs, payloads = ctx.honest((1, 2, 3))
    return Drop([first] + envs[:1] + [ctx.craft(4, report_id=rid)] + envs[1:], {"replay": 1},
                [ctx.kit.payload(0)] + payloads)


@case
def replayed_envelope_from_a_sealed_round(ctx: Ctx) -> Drop:
    # seal round r-1 first, then replay one of its envelopes in round r: bound to another round, it cannot open
    old, old_payloads = ctx.honest(r=ctx.r - 1)
    att = ctx.submit(old, round_id=ctx.r - 1)
    assert att.n_accepted == len(old)
    return _drop(ctx, [old[0]], {"undecryptable": 1})


@case
def same_client_twice_different_envelopes(ctx: Ctx) -> Drop:
    envs, payloads = ctx.honest()
    second = ctx.seal(0, payload=ctx.kit.payload(999))  # client 0 again, other payload: the first is kept
    return Drop(envs + [second], {"duplicate_signer": 1}, payloads)


@case
def unknown_signer(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4, signing_key=_stranger()), ctx.seal(5, signing_key=_stranger())],
                 {"unknown_signer": 2})


@case
def bad_signature_enrolled_key_signed_by_another(ctx: Ctx) -> Drop:
    # claims to be enrolled client 4, but the signature is made with a stranger's key
    forged = craft_envelope(
        ctx.kit.payload(4), server_pk=ctx.kit.server_pk, shuffler_pk=ctx.kit.shuffler_pk, signing_sk=_stranger(),
        key_epoch=ctx.kit.key_epoch, round_id=ctx.r, digest=ctx.kit.digest,
        claimed_signer_pk=ctx.kit.enrolment["client-4"],
    )
    return _drop(ctx, [forged], {"bad_signature": 1})


@case
def signature_over_another_round(ctx: Ctx) -> Drop:
    from ._fixtures_adv import doc_binding  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)

    other = doc_binding(ctx.kit.key_epoch, ctx.r + 7, ctx.kit.digest)
    return _drop(ctx, [ctx.craft(4, sign_binding=other)], {"bad_signature": 1})


@case
def signature_over_another_report_id(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.craft(4, sign_report_id=secrets.token_bytes(16))], {"bad_signature": 1})


@case
def wrong_version_inside_outer_layer(ctx: Ctx) -> Drop:
    # version 1 is a version the shuffler speaks, but not this envelope's (2): the two must agree
    return _drop(ctx, [ctx.craft(4, outer_version=1)], {"wrong_version": 1})


@case
def outer_plaintext_too_short(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.craft(4, truncate_outer_pt=60)], {"malformed": 1})


@case
def kitchen_sink(ctx: Ctx) -> Drop:
    envs, payloads = ctx.honest()
    hostile = [
        b"",
        ctx.seal(4)[:-2],
        _flip(ctx.seal(5), 0, 0x04),
        ctx.seal(6, key_epoch=9),
        ctx.seal(7, signing_key=_stranger()),
        envs[2],
        ctx.seal(1, payload=ctx.kit.payload(77)),  # after client 1's honest one: duplicate
    ]
    return Drop(envs[:2] + hostile + envs[2:] + [envs[0]], {
        "empty": 1, "undecryptable": 1, "wrong_version": 1, "wrong_epoch": 1, "unknown_signer": 1,
        "replay": 2, "duplicate_signer": 1,
    }, payloads)


# ------------------------------------------------------------------ with the round's envelope length announced
def _announced(ctx: Ctx, hostile: list[bytes], drops: dict[str, int]) -> Drop:
    d = _drop(ctx, hostile, drops)
    d.envelope_length = len(d.envelopes[0])
    return d


@case
def announced_length_drops_a_valid_envelope_of_another_length(ctx: Ctx) -> Drop:
    # enrolled, correctly sealed and signed, but longer: unannounced this refuses the batch (mixed_lengths)
    return _announced(ctx, [ctx.seal(4, size=80)], {"wrong_length": 1})


@case
def announced_length_drops_truncated_and_padded(ctx: Ctx) -> Drop:
    e = ctx.seal(4)
    return _announced(ctx, [e[:-1], e + b"\0", b""], {"wrong_length": 2, "empty": 1})


@case
def announced_length_oversized_is_still_oversized(ctx: Ctx) -> Drop:
    big = ctx.seal(4, size=MAX_ENVELOPE + 1 - ENVELOPE_OVERHEAD)
    return _announced(ctx, [big], {"oversized": 1})


@case
def envelope_too_large_for_the_channel_becomes_a_counted_drop(ctx: Ctx) -> Drop:
    # the ShufflerClient does not let one huge envelope abort the stream: it sends an empty placeholder
    huge = secrets.token_bytes(MAX_ENVELOPE + 4096)
    d = _drop(ctx, [huge], {"empty": 1})

    def check() -> None:
        assert ctx.last_client.skipped_oversized == 1

    d.after = check
    return d


# ------------------------------------------------------------------------------------- whole-request refusals
@case
def oversized_beyond_message_limit(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    huge = secrets.token_bytes(message_limit(MAX_ENVELOPE) + 4096)  # above the service's gRPC message limit
    msgs = [header_msg(ctx.kit, 5, round_id=ctx.r)] + [envelope_msg(e) for e in envs[:2] + [huge] + envs[2:]]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.RESOURCE_EXHAUSTED, None, envs, payloads)


@case
def mixed_inner_lengths(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    odd = ctx.seal(4, size=80)  # enrolled, valid, but a different length: would link input to output
    return Refusal(lambda: ctx.submit(envs[:2] + [odd] + envs[2:]), grpc.StatusCode.INVALID_ARGUMENT,
                   "mixed_lengths", envs, payloads)


@case
def empty_batch(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.submit([]), grpc.StatusCode.INVALID_ARGUMENT, "empty_batch", envs, payloads)


@case
def batch_below_k_announced(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.submit(envs[: ctx.kit.k - 1]), grpc.StatusCode.FAILED_PRECONDITION,
                   "below_threshold", envs, payloads)


@case
def batch_below_k_after_drops(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    few = envs[: ctx.kit.k - 1] + [b"garbage"] * 3
    return Refusal(lambda: ctx.submit(few), grpc.StatusCode.FAILED_PRECONDITION, "below_threshold", envs, payloads)


@case
def batch_below_k_one_client_many_reports(ctx: Ctx) -> Refusal:
    # n-1 style: five well-formed reports, all from one enrolled client, count as one distinct signer
    sybil = [ctx.seal(5, payload=ctx.kit.payload(500 + j)) for j in range(5)]
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.submit(sybil), grpc.StatusCode.FAILED_PRECONDITION, "below_threshold", envs, payloads)


@case
def announced_length_below_the_envelope_overhead(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 4, round_id=ctx.r, envelope_length=ENVELOPE_OVERHEAD - 1)]
    msgs += [envelope_msg(e) for e in envs]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "envelope_length", envs, payloads)


@case
def announced_length_above_max_envelope_bytes(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 4, round_id=ctx.r, envelope_length=MAX_ENVELOPE + 1)]
    msgs += [envelope_msg(e) for e in envs]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "envelope_length", envs, payloads)


@case
def announced_length_that_no_envelope_has(ctx: Ctx) -> Refusal:
    # every envelope is then a wrong_length drop: below k, nothing released, nothing consumed
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.submit(envs, envelope_length=len(envs[0]) + 1), grpc.StatusCode.FAILED_PRECONDITION,
                   "below_threshold", envs, payloads)


@case
def batch_too_large(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, MAX_BATCH + 1, round_id=ctx.r)]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.RESOURCE_EXHAUSTED, "batch_too_large", envs, payloads)


def _sealed_then(ctx: Ctx) -> tuple[list[bytes], list[bytes], Any, list[bytes]]:
    envs, payloads = ctx.honest()
    att = ctx.submit(envs)
    with ctx.svc.client() as c:
        first = c.fetch_all(att)
    return envs, payloads, att, first


@case
def reused_binding_with_another_batch(ctx: Ctx) -> Refusal:
    envs, payloads, att, first = _sealed_then(ctx)
    other = envs[:3] + [ctx.seal(4)]  # overlapping set: a second release would let the server difference them

    def action() -> None:
        ctx.submit(other)

    def check_unchanged() -> None:
        with ctx.svc.client() as c:
            assert c.fetch_all(att) == first

    return Refusal(action, grpc.StatusCode.ALREADY_EXISTS, "binding_used", envs, payloads, after=check_unchanged)


@case
def reused_binding_with_subset(ctx: Ctx) -> Refusal:
    envs, payloads, _, _ = _sealed_then(ctx)
    return Refusal(lambda: ctx.submit(envs[:3]), grpc.StatusCode.ALREADY_EXISTS, "binding_used", envs, payloads)


@case
def reused_binding_other_model_digest(ctx: Ctx) -> Refusal:
    envs, payloads, _, _ = _sealed_then(ctx)
    d2 = model_digest([b"model-v2"])
    other = [ctx.seal(i, digest=d2) for i in HONEST]
    return Refusal(lambda: ctx.submit(other, model_digest=d2), grpc.StatusCode.ALREADY_EXISTS, "binding_used",
                   envs, payloads)


@case
def garbage_protobuf_on_submit(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.raw_submit([b"\xff\xff\xff\xff\x0f junk"]), grpc.StatusCode.INTERNAL, None,
                   envs, payloads)


@case
def garbage_protobuf_after_header(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 5, round_id=ctx.r)] + [envelope_msg(e) for e in envs] + [b"\x0a\xff\xff\xff"]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INTERNAL, None, envs, payloads)


@case
def garbage_protobuf_on_fetch(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.raw_fetch(b"\x0a\x10short"), grpc.StatusCode.INTERNAL, None, envs, payloads)


@case
def large_non_canonical_batch_message(ctx: Ctx) -> Refusal:
    """300 KB of empty items in a batch field split in two (valid protobuf, never what a serialiser writes):
    refused without running the generated parser, which would build one object per item."""
    envs, payloads = ctx.honest()
    half = b"\x0a\x00" * 75_000
    odd = wire.encode_bytes_field(4, half) * 2
    msgs = [header_msg(ctx.kit, 5, round_id=ctx.r), odd]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "non_canonical", envs, payloads)


@case
def envelopes_before_header(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [envelope_msg(e) for e in envs] + [header_msg(ctx.kit, 4, round_id=ctx.r)]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "no_header", envs, payloads)


@case
def keepalive_before_header(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    keepalive = pb.SubmitRequest(keepalive=pb.Keepalive()).SerializeToString()
    msgs = [keepalive, header_msg(ctx.kit, 4, round_id=ctx.r)] + [envelope_msg(e) for e in envs]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "no_header", envs, payloads)


@case
def empty_stream_no_header(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.raw_submit([]), grpc.StatusCode.INVALID_ARGUMENT, "no_header", envs, payloads)


@case
def second_header_mid_stream(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    h = header_msg(ctx.kit, 4, round_id=ctx.r)
    msgs = [h] + [envelope_msg(e) for e in envs[:2]] + [h] + [envelope_msg(e) for e in envs[2:]]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "not_envelope", envs, payloads)


@case
def unset_oneof_message(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 5, round_id=ctx.r)] + [envelope_msg(e) for e in envs] + [b""]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "not_envelope", envs, payloads)


@case
def expected_count_above_sent(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 5, round_id=ctx.r)] + [envelope_msg(e) for e in envs]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "count_mismatch", envs, payloads)


@case
def expected_count_below_sent(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 3, round_id=ctx.r)] + [envelope_msg(e) for e in envs]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "count_mismatch", envs, payloads)


@case
def packed_flood_beyond_count(ctx: Ctx) -> Refusal:
    # one packed message: the announced envelopes, then 100,000 two-byte placeholders (only one more than the
    # count is ever sliced out; it is refused)
    envs, payloads = ctx.honest()
    flood = wire.encode_bytes_field(4, wire.encode_repeated_bytes_field(1, list(envs) + [b""] * 100_000))
    msgs = [header_msg(ctx.kit, len(envs), round_id=ctx.r), flood]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "count_mismatch", envs, payloads)


@case
def wrong_protocol_version_header(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 4, round_id=ctx.r, protocol_version=3)] + [envelope_msg(e) for e in envs]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "protocol_version", envs, payloads)


@case
def wrong_key_epoch_header(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    e1 = [ctx.seal(i, key_epoch=ctx.kit.key_epoch + 1) for i in HONEST]
    return Refusal(lambda: ctx.submit(e1, key_epoch=ctx.kit.key_epoch + 1), grpc.StatusCode.FAILED_PRECONDITION,
                   "key_epoch", envs, payloads)


@case
def short_model_digest_header(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    msgs = [header_msg(ctx.kit, 4, round_id=ctx.r, model_digest=b"short")] + [envelope_msg(e) for e in envs]
    return Refusal(lambda: ctx.raw_submit(msgs), grpc.StatusCode.INVALID_ARGUMENT, "model_digest", envs, payloads)


@case
def fetch_unknown_batch_id(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    req = pb.FetchRequest(batch_id=secrets.token_bytes(16)).SerializeToString()
    return Refusal(lambda: ctx.raw_fetch(req), grpc.StatusCode.NOT_FOUND, "unknown_batch", envs, payloads)


@case
def fetch_malformed_batch_id(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    req = pb.FetchRequest(batch_id=b"12345").SerializeToString()
    return Refusal(lambda: ctx.raw_fetch(req), grpc.StatusCode.INVALID_ARGUMENT, "batch_id", envs, payloads)


@case
def tls_peer_without_client_certificate(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    creds = grpc.ssl_channel_credentials(root_certificates=ctx.kit.ca)
    return Refusal(lambda: ctx.health_over(creds), grpc.StatusCode.UNAVAILABLE, None, envs, payloads)


@case
def client_certificate_from_another_ca(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    ca, ca_key = tls.create_ca("rogue CA")
    cert, key = tls.issue_certificate(ca, ca_key, "serverapp", is_server=False, is_client=True)
    # the rogue client trusts the real CA for the server, so only the server's check of the client can fail
    creds = grpc.ssl_channel_credentials(root_certificates=ctx.kit.ca, private_key=key, certificate_chain=cert)
    return Refusal(lambda: ctx.health_over(creds), grpc.StatusCode.UNAVAILABLE, None, envs, payloads)


@case
def plaintext_channel_to_mtls_server(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    return Refusal(lambda: ctx.health_over(None), grpc.StatusCode.UNAVAILABLE, None, envs, payloads)


@case
def certificate_with_unlisted_common_name(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    ca_key = (ctx.kit.d.tls_dir / "ca.key").read_bytes()
    cert, key = tls.issue_certificate(ctx.kit.ca, ca_key, "curious-observer", is_server=False, is_client=True)

    def action() -> None:
        with ShufflerClient(ctx.svc.proc.address, root_certificate=ctx.kit.ca, client_certificate=cert,
                            client_key=key, shuffler_verify_key=ctx.kit.verify_key,
                            max_message_bytes=MAX_ENVELOPE) as c:
            c.submit(round_id=ctx.r, key_epoch=ctx.kit.key_epoch, model_digest=ctx.kit.digest, envelopes=envs)

    return Refusal(action, grpc.StatusCode.PERMISSION_DENIED, "client_not_allowed", envs, payloads)


@case
def client_cancels_mid_stream(ctx: Ctx) -> Refusal:
    envs, payloads = ctx.honest()
    gate = threading.Event()

    def requests() -> Iterator[bytes]:
        yield header_msg(ctx.kit, 4, round_id=ctx.r)
        yield envelope_msg(envs[0])
        yield envelope_msg(envs[1])
        gate.wait(10)  # hold the stream open with half the batch sent, then cancel it

    def action() -> None:
        with raw_channel(ctx.kit, ctx.svc.proc.address) as ch:
            fut = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None).future(
                requests(), timeout=RPC_TIMEOUT
            )
            threading.Timer(0.5, fut.cancel).start()
            try:
                fut.result()
            except grpc.FutureCancelledError:
                raise ShufflerError(fut.code(), fut.details() or "") from None
            finally:
                gate.set()

    return Refusal(action, grpc.StatusCode.CANCELLED, None, envs, payloads)


# --------------------------------------------------------------------------------------------------- runner
def _stats(svc: Svc) -> dict[str, Any]:
    with svc.client() as c:
        return c.stats()


def _assert_alive(svc: Svc) -> None:
    assert svc.proc.proc.poll() is None and svc.proc.pid == svc.pid, "the shuffler process died or was restarted"
    assert svc.proc.health() == "SERVING"


def _released(ctx: Ctx, att: Any, round_id: int) -> list[bytes]:
    with ctx.svc.client() as c:
        inners = c.fetch_all(att)  # verifies count, lengths and the attested output digest
    return open_all(ctx.kit, inners, round_id)


@pytest.mark.parametrize("name", list(CASES))
def test_catalogue(svc: Svc, name: str) -> None:
    r = next(svc.rounds) * 10  # spaced round ids: cases may use r-1 .. r+9
    ctx = Ctx(svc, r)
    outcome = CASES[name](ctx)
    before = _stats(svc)
    if isinstance(outcome, Drop):
        att = ctx.submit(outcome.envelopes, envelope_length=outcome.envelope_length)
        expected = {reason: outcome.drops.get(reason, 0) for reason in DROP_REASONS}
        assert set(outcome.drops) <= set(DROP_REASONS)
        assert dict(att.dropped) == expected
        assert att.n_received == len(outcome.envelopes)
        assert att.n_accepted == len(outcome.payloads)
        assert Counter(_released(ctx, att, r)) == Counter(outcome.payloads)
        after = _stats(svc)
        for reason in DROP_REASONS:
            assert after["dropped"][reason] - before["dropped"][reason] == expected[reason], reason
        assert after["reports_accepted"] - before["reports_accepted"] == len(outcome.payloads)
        if outcome.after is not None:
            outcome.after()
    else:
        with pytest.raises((ShufflerError, grpc.RpcError)) as info:
            outcome.action()
        err = info.value
        code = err.code if isinstance(err, ShufflerError) else err.code()
        details = err.details if isinstance(err, ShufflerError) else (err.details() or "")
        assert code == outcome.code, details
        if outcome.reason is not None:
            assert details.split(":", 1)[0] == outcome.reason, details
        _assert_alive(svc)
        if outcome.after is not None:
            outcome.after()
        # nothing was released and nothing consumed: the honest envelopes of the refused request go through
        if outcome.resubmit:
            att = ctx.submit(outcome.resubmit)
            assert att.n_accepted == len(outcome.payloads) and sum(att.dropped.values()) == 0
            assert Counter(_released(ctx, att, r)) == Counter(outcome.payloads)
    _assert_alive(svc)


def test_crafted_honest_envelopes_follow_the_documented_format(svc: Svc) -> None:
    """The independent implementation of docs/shuffler.md in _fixtures_adv is accepted (so the forged variants
    above differ from an honest envelope only where they say)."""
    ctx = Ctx(svc, next(svc.rounds) * 10)
    envs = [ctx.craft(i) for i in range(6)]
    att = ctx.submit(envs)
    assert att.n_accepted == 6 and sum(att.dropped.values()) == 0
    assert Counter(_released(ctx, att, ctx.r)) == Counter(ctx.kit.payload(i) for i in range(6))


def test_identical_resubmission_is_idempotent(svc: Svc) -> None:
    """A retry of the same multiset (any order) gets the same batch id, attestation and bytes."""
    ctx = Ctx(svc, next(svc.rounds) * 10)
    envs, payloads = ctx.honest()
    envs.append(b"garbage")
    att = ctx.submit(envs)
    with svc.client() as c:
        first = c.fetch_all(att)
    again = ctx.submit(list(reversed(envs)))
    assert (again.batch_id, again.statement, again.signature) == (att.batch_id, att.statement, att.signature)
    with svc.client() as c:
        assert c.fetch_all(again) == first
    assert Counter(open_all(ctx.kit, first, ctx.r)) == Counter(payloads)
    _assert_alive(svc)


def test_racing_submissions_for_one_binding_seal_exactly_once(svc: Svc) -> None:
    """Two different batches for the same (epoch, round) sent at the same time: one is sealed, the other gets
    ALREADY_EXISTS; the server never obtains two releases to difference."""
    ctx = Ctx(svc, next(svc.rounds) * 10)
    a, pa = ctx.honest((0, 1, 2, 3))
    b, pb_ = ctx.honest((0, 1, 2, 4))  # overlapping: differencing the two would expose clients 3 and 4
    results: dict[str, Any] = {}
    start = threading.Barrier(2)

    def go(name: str, envs: list[bytes]) -> None:
        start.wait()
        try:
            results[name] = ctx.submit(envs)
        except ShufflerError as exc:
            results[name] = exc

    threads = [threading.Thread(target=go, args=("a", a)), threading.Thread(target=go, args=("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [v for v in results.values() if isinstance(v, ShufflerError)]
    sealed = {k: v for k, v in results.items() if not isinstance(v, ShufflerError)}
    assert len(sealed) == 1 and len(errors) == 1, results
    assert (errors[0].code, errors[0].reason) == (grpc.StatusCode.ALREADY_EXISTS, "binding_used")
    (winner, att), = sealed.items()
    assert Counter(_released(ctx, att, ctx.r)) == Counter(pa if winner == "a" else pb_)
    _assert_alive(svc)


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 20
