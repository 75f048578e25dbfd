"""The gRPC service over mTLS on 127.0.0.1: end to end, status codes, wire format, authentication, client checks."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shuffledp.shuffler import keys, tls
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler.attestation import AttestationError
from shuffledp.shuffler.client import ShufflerClient, ShufflerError
from shuffledp.shuffler.envelope import ENVELOPE_VERSION, open_inner

from ._fixtures_adv import FETCH, SUBMIT  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
from ._service_calls import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    _channel,
    _submit,
)


def test_submit_fetch_end_to_end(kit, running) -> None:
    envs = [kit.seal(i) for i in range(6)] + [b"garbage"]
    with kit.client(running.address) as c:
        att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=iter(envs))
        assert att.n_accepted == 6 and att.n_received == 7 and att.dropped["malformed"] == 1
        first = c.fetch_all(att)
        assert c.fetch_all(att) == first  # idempotent
        assert sorted(
            open_inner(x, server_private_key=kit.server_sk, key_epoch=0, round_id=1) for x in first
        ) == sorted(kit.payload(i) for i in range(6))
        # identical resubmission (e.g. a retry after a lost ack) returns the same attestation
        again = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=envs)
        assert again.batch_id == att.batch_id and again.statement == att.statement
        stats = c.stats()
        assert stats["batches_sealed"] == 1 and stats["dropped"]["malformed"] == 1
        assert stats["batches_released"] == 1  # fetched twice, released (and journalled) once


def test_fetched_stream_carries_only_inner_ciphertexts(kit, running) -> None:
    """Wire format: every Fetch message holds only field 1 (inner) entries, and nothing else."""
    envs = [kit.seal(i) for i in range(4)]
    att = _submit(kit, running, envs)
    with _channel(kit, running.address) as ch:
        raw = list(
            ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)(
                pb.FetchRequest(batch_id=att.batch_id).SerializeToString()
            )
        )
    inner_len = att.inner_length
    varint = bytes([inner_len]) if inner_len < 128 else bytes([(inner_len & 0x7F) | 0x80, inner_len >> 7])
    assert inner_len < 128 * 128
    item = 1 + len(varint) + inner_len
    assert sum(len(m) for m in raw) == 4 * item  # four items, nothing else
    for msg in raw:
        # repeated: tag 0x0a (field 1, length-delimited), the varint length, then the ciphertext; nothing else
        assert len(msg) % item == 0
        for pos in range(0, len(msg), item):
            assert msg[pos : pos + 1 + len(varint)] == b"\x0a" + varint
        parsed = pb.FetchResponse.FromString(msg)
        assert [f.name for f, _ in parsed.ListFields()] == ["inner"]
        for x in parsed.inner:
            assert open_inner(x, server_private_key=kit.server_sk, key_epoch=0, round_id=1)


@pytest.mark.parametrize(
    "case,code,reason",
    [
        ("below_k", grpc.StatusCode.FAILED_PRECONDITION, "below_threshold"),
        ("wrong_epoch", grpc.StatusCode.FAILED_PRECONDITION, "key_epoch"),
        ("empty", grpc.StatusCode.INVALID_ARGUMENT, "empty_batch"),
        ("mixed", grpc.StatusCode.INVALID_ARGUMENT, "mixed_lengths"),
        ("bad_digest", grpc.StatusCode.INVALID_ARGUMENT, "model_digest"),
    ],
)
def test_refusals_map_to_status_codes(kit, running, case: str, code: grpc.StatusCode, reason: str) -> None:
    envs = [kit.seal(i) for i in range(4)]
    kw: dict = {}
    if case == "below_k":
        envs = envs[:2] + [b"x" * 300]
    elif case == "wrong_epoch":
        kw["key_epoch"] = 3
    elif case == "empty":
        envs = []
    elif case == "mixed":
        envs = envs + [kit.seal(5, size=80)]
    elif case == "bad_digest":
        kw["model_digest"] = b"\x00" * 32
    with kit.client(running.address) as c:
        with pytest.raises(ShufflerError) as info:
            if case == "bad_digest":
                # bypass the client's own validation to reach the server with a 5-byte digest
                ch = _channel(kit, running.address)
                call = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)
                hdr = pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=ENVELOPE_VERSION, round_id=1,
                                                              model_digest=b"short", expected_count=4))
                try:
                    call(iter([hdr.SerializeToString()]))
                except grpc.RpcError as exc:
                    raise ShufflerError(exc.code(), exc.details()) from None
            c.submit(round_id=1, key_epoch=kw.get("key_epoch", 0), model_digest=kw.get("model_digest", kit.digest),
                     envelopes=envs)
        assert (info.value.code, info.value.reason) == (code, reason)
        # the service is still up and takes an honest batch afterwards
        assert c.submit(round_id=9, key_epoch=0, model_digest=kit.digest,
                        envelopes=[kit.seal(i, round_id=9) for i in range(3)]).n_accepted == 3


def test_binding_reuse_and_unknown_batch(kit, running) -> None:
    envs = [kit.seal(i) for i in range(4)]
    att = _submit(kit, running, envs)
    with pytest.raises(ShufflerError) as info:
        _submit(kit, running, envs[:3])
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.ALREADY_EXISTS, "binding_used")
    with kit.client(running.address) as c:
        fake = type(att)(**{**att.__dict__, "batch_id": b"\x01" * 16})
        with pytest.raises(ShufflerError) as info:
            c.fetch_all(fake)
        assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_a_protocol_1_batch_is_sealed_fetched_and_checked_with_its_own_digest(kit, running) -> None:
    """An older peer's batch (header protocol_version 1, SHA-256 envelopes) is accepted and attested as format
    v2; ShufflerClient.fetch checks it with the format's own digest (per-item SHA-256), so such batches stay
    fetchable after an upgrade."""
    from shuffledp.shuffler.attestation import Attestation

    envs = [kit.seal(i, round_id=4, version=1) for i in range(4)] + [kit.seal(4, round_id=4)]
    ch = _channel(kit, running.address)
    call = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)
    msgs = [pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=1, key_epoch=kit.key_epoch, round_id=4,
                                                    model_digest=kit.digest, expected_count=5)).SerializeToString()]
    msgs += [pb.SubmitRequest(envelope=e).SerializeToString() for e in envs]
    resp = pb.SubmitResponse.FromString(call(iter(msgs)))
    ch.close()
    att = Attestation.verify(resp.statement, resp.signature, kit.verify_key)
    assert (att.protocol_version, att.format, att.n_accepted) == (1, "shuffledp-attestation/v2", 4)
    assert att.dropped["wrong_version"] == 1  # the version-2 envelope in a version-1 batch
    with kit.client(running.address) as c:
        got = sorted(open_inner(x, server_private_key=kit.server_sk, key_epoch=kit.key_epoch, round_id=4, version=1)
                     for x in c.fetch_all(att))
    assert got == sorted(kit.payload(i) for i in range(4))


def test_the_client_refuses_an_attestation_of_another_protocol_version(kit, running, monkeypatch) -> None:
    """A faulty shuffler that attests a version-2 submission as protocol 1 (a consistent, signed format-v2
    statement) is refused by ShufflerClient.submit: the server would otherwise open the batch as the wrong
    version."""
    from shuffledp.shuffler.attestation import Attestation

    real = Attestation.build_statement

    def as_protocol_1(**kw: object) -> bytes:
        return real(**{**kw, "protocol_version": 1})

    monkeypatch.setattr(Attestation, "build_statement", staticmethod(as_protocol_1))
    with pytest.raises(AttestationError, match="attestation protocol version 1; this submission used 2"):
        _submit(kit, running, [kit.seal(i, round_id=5) for i in range(3)], round_id=5)


def test_protocol_violations(kit, running) -> None:
    env0 = kit.seal(0)
    ch = _channel(kit, running.address)
    call = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)
    hdr = pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=ENVELOPE_VERSION, round_id=1,
                                                  model_digest=kit.digest, expected_count=3)).SerializeToString()
    cases = {
        "empty stream": [],
        "envelope first": [pb.SubmitRequest(envelope=env0).SerializeToString()],
        "second header": [hdr, hdr],
        "unset oneof": [hdr, b""],
        "wrong version": [pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=3, round_id=1,
                                                                  model_digest=kit.digest,
                                                                  expected_count=3)).SerializeToString()],
    }
    for name, msgs in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            call(iter(msgs))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    # garbage that is not a protobuf at all
    with pytest.raises(grpc.RpcError) as info:
        call(iter([b"\xff\xff\xff\xff garbage"]))
    # gRPC itself answers INTERNAL ("Exception deserializing request!") before the handler runs
    assert info.value.code() == grpc.StatusCode.INTERNAL
    ch.close()
    assert _submit(kit, running, [kit.seal(i) for i in range(3)]).n_accepted == 3


def test_oversized_message_is_refused_by_transport(kit, running) -> None:
    envs = [kit.seal(i) for i in range(3)] + [b"\x01" * ((1 << 20) + 4096)]
    # the client's own send limit would stop this first; a raw channel with a larger limit reaches the server
    ch = grpc.secure_channel(
        running.address,
        grpc.ssl_channel_credentials(kit.ca, kit.app_key, kit.app_cert),
        options=[("grpc.max_send_message_length", 8 << 20)],
    )
    call = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)
    msgs = [pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=ENVELOPE_VERSION, round_id=1,
                                                    model_digest=kit.digest, expected_count=4)).SerializeToString()]
    msgs += [pb.SubmitRequest(envelope=e).SerializeToString() for e in envs]
    with pytest.raises(grpc.RpcError) as info:
        call(iter(msgs))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ch.close()
    assert _submit(kit, running, envs[:3]).n_accepted == 3


def test_peer_without_certificate_or_from_another_ca_is_rejected(kit, running) -> None:
    # server-auth-only TLS (no client certificate)
    ch = grpc.secure_channel(running.address, grpc.ssl_channel_credentials(root_certificates=kit.ca))
    with pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    ch.close()
    other_ca, other_key = tls.create_ca("rogue CA")
    cert, key = tls.issue_certificate(other_ca, other_key, "serverapp", is_server=False, is_client=True)
    with _channel(kit, running.address, cert, key) as ch:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # plaintext to a TLS port fails too
    with grpc.insecure_channel(running.address) as ch:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_certificate_with_other_common_name_is_denied(kit, running) -> None:
    ca_key = (kit.d.tls_dir / "ca.key").read_bytes()
    cert, key = tls.issue_certificate(kit.ca, ca_key, "intruder", is_server=False, is_client=True)
    c = ShufflerClient(running.address, root_certificate=kit.ca, client_certificate=cert, client_key=key,
                       shuffler_verify_key=kit.verify_key, max_message_bytes=1 << 20)
    with pytest.raises(ShufflerError) as info:
        c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=[kit.seal(i) for i in range(3)])
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(ShufflerError) as info:
        c.stats()
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    c.close()
    with _channel(kit, running.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="shuffledp.shuffler.v1.Shuffler"), timeout=5
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_client_verifies_attestation_with_pinned_key(kit, running) -> None:
    envs = [kit.seal(i) for i in range(3)]
    wrong = ShufflerClient(running.address, root_certificate=kit.ca, client_certificate=kit.app_cert,
                           client_key=kit.app_key, shuffler_verify_key=keys.generate_keypair("ed25519")[1],
                           max_message_bytes=1 << 20)
    with pytest.raises(AttestationError, match="pinned shuffler key"):
        wrong.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=envs)
    wrong.close()
    with kit.client(running.address) as c:
        att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=envs)
        # a fetch that does not match the attested digest is detected
        forged = type(att)(**{**att.__dict__, "output_digest": bytes(32)})
        with pytest.raises(AttestationError, match="output digest"):
            c.fetch_all(forged)
        short = type(att)(**{**att.__dict__, "n_accepted": 2})
        with pytest.raises(AttestationError, match="more items"):
            c.fetch_all(short)


def test_client_parameter_validation(kit) -> None:
    with pytest.raises(ValueError, match="loopback"):
        ShufflerClient("10.0.0.1:5", root_certificate=None, client_certificate=None, client_key=None,
                       shuffler_verify_key=kit.verify_key, max_message_bytes=4096)
    with pytest.raises(ValueError, match="all of"):
        ShufflerClient("127.0.0.1:5", root_certificate=kit.ca, client_certificate=None, client_key=None,
                       shuffler_verify_key=kit.verify_key, max_message_bytes=4096)
    with pytest.raises(ValueError, match="shuffler_verify_key"):
        ShufflerClient("127.0.0.1:5", root_certificate=None, client_certificate=None, client_key=None,
                       shuffler_verify_key=b"x", max_message_bytes=4096)
    with kit.client("127.0.0.1:5", tls=False) as c, pytest.raises(ValueError, match="model_digest"):
        c.submit(round_id=1, key_epoch=0, model_digest=b"short", envelopes=[])


def test_announced_length_releases_the_honest_reports_and_oversized_are_skipped(kit, running) -> None:
    """Finding 3: with envelope_length in the header, an odd-length envelope is a counted drop and an envelope
    too large for the channel is not sent (a placeholder is counted instead) -- the honest rest is released."""
    envs = [kit.seal(i, size=64) for i in range(4)]
    odd = kit.seal(4, size=80)
    huge = b"\x01" * (2 << 20)  # above the 1 MiB channel limit: would abort the whole stream
    with kit.client(running.address) as c:
        att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=envs[:2] + [odd, huge] + envs[2:],
                       envelope_length=len(envs[0]))
        assert att.n_received == 6 and att.n_accepted == 4 and att.dropped["wrong_length"] == 1
        assert att.dropped["empty"] == 1  # the placeholder for the envelope too large to send
        assert c.skipped_oversized == 1 and att.envelope_length == len(envs[0])
        got = [open_inner(x, server_private_key=kit.server_sk, key_epoch=0, round_id=1) for x in c.fetch_all(att)]
    assert sorted(got) == sorted(kit.payload(i, 64) for i in range(4))


def test_attestation_counts_must_add_up_and_lengths_must_follow(kit) -> None:
    # Cheap cross-checks a malicious or faulty shuffler could otherwise slip past the server's accountant.
    from shuffledp.shuffler.attestation import DROP_REASONS, Attestation, sign_statement

    base = dict(batch_id=bytes(16), protocol_version=1, key_epoch=0, round_id=1, model_digest=kit.digest, k=2,
                n_received=5, n_accepted=3, inner_length=100, output_digest=bytes(32),
                dropped={DROP_REASONS[0]: 2}, envelope_length=266)

    def verify(**changes: object) -> Attestation:
        statement = Attestation.build_statement(**{**base, **changes})
        return Attestation.verify(statement, sign_statement(statement, kit.signing_sk), kit.verify_key)

    assert verify().n_accepted == 3  # 3 + 2 == 5; 266 - 166 == 100
    with pytest.raises(AttestationError, match="do not add up"):
        verify(n_accepted=4)  # 4 + 2 != 5: more accepted than the envelopes allow
    with pytest.raises(AttestationError, match="does not follow from envelope_length"):
        verify(inner_length=99)


def test_fetch_refuses_a_batch_that_repeats_a_report(kit, running) -> None:
    # A shuffler that serves one report twice inflates n_accepted (and the amplification the server credits).
    envs = [kit.seal(i) for i in range(3)]
    with kit.client(running.address) as c:
        att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=envs)
        items = c.fetch_all(att)
        c._fetch_raw = lambda request, timeout=None: iter([pb.FetchResponse(inner=[items[0], items[0], items[1]])
                                                          .SerializeToString()])
        with pytest.raises(AttestationError, match="repeats an inner ciphertext"):
            c.fetch_all(att)


def test_two_enrolled_clients_wrapping_one_report_cannot_stop_the_run(kit, tmp_path) -> None:
    """A real shuffler process: two enrolled clients (colluders, or one device enrolled twice) submit the same inner
    ciphertext under their own signatures. The copy is dropped as a replay, the attested count is the number of
    distinct reports, and the batch is fetched (before, the fetch raised on the repeated inner ciphertext and a
    resubmission without the copy was refused as binding_used, so every round could be stopped)."""
    from shuffledp.shuffler.envelope import open_outer

    from ._fixtures_adv import craft_envelope, process, write_service_config  # noqa: TID252 - helpers beside the tests

    envs = [kit.seal(i) for i in range(6)]
    inner = bytes(open_outer(envs[0], shuffler_private_key=kit.shuffler_sk, key_epoch=kit.key_epoch, round_id=1,
                             model_digest=kit.digest).inner)
    copy = craft_envelope(b"", server_pk=kit.server_pk, shuffler_pk=kit.shuffler_pk, signing_sk=kit.client_sks[6],
                          key_epoch=kit.key_epoch, round_id=1, digest=kit.digest, inner=inner)
    shuffler = process(kit, write_service_config(kit, tmp_path / "shuffler.toml"))
    shuffler.start()
    try:
        with kit.client(shuffler.address) as c:
            att = c.submit(round_id=1, key_epoch=kit.key_epoch, model_digest=kit.digest, envelopes=envs + [copy])
            assert att.n_accepted == 6 and att.n_received == 7 and att.dropped["replay"] == 1
            opened = [open_inner(x, server_private_key=kit.server_sk, key_epoch=kit.key_epoch, round_id=1)
                      for x in c.fetch_all(att)]
            assert sorted(opened) == sorted(kit.payload(i) for i in range(6))
    finally:
        shuffler.stop()
