"""The catalogue's whole-request refusals, and idempotent or racing resubmissions of a binding (see test_catalogue)."""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import tls, wire
from shuffledp.shuffler.client import ShufflerClient, ShufflerError
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, model_digest
from shuffledp.shuffler.service import message_limit

from ._catalogue_harness import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    HONEST,
    MAX_BATCH,
    MAX_ENVELOPE,
    RPC_TIMEOUT,
    Catalogue,
    Ctx,
    Refusal,
    Svc,
    _assert_alive,
    _released,
    catalogue_service,  # noqa: F401 - the fixture svc (this module's shuffler process), found by pytest
)
from ._fixtures_adv import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    SUBMIT,
    envelope_msg,
    header_msg,
    open_all,
    raw_channel,
)

CASES: Catalogue[Refusal] = Catalogue()
case = CASES.add


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
@pytest.mark.parametrize("name", list(CASES))
def test_catalogue(svc: Svc, name: str) -> None:
    r = next(svc.rounds) * 10  # spaced round ids: cases may use r-1 .. r+9
    ctx = Ctx(svc, r)
    outcome = CASES[name](ctx)
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
