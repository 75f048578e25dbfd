"""The gRPC service over mTLS on 127.0.0.1: end to end, status codes, wire format, authentication."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shuffledp.shuffler import keys, tls
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler.attestation import AttestationError
from shuffledp.shuffler.client import ShufflerClient, ShufflerError
from shuffledp.shuffler.envelope import ENVELOPE_VERSION, open_inner

SUBMIT = "/shuffledp.shuffler.v1.Shuffler/Submit"
FETCH = "/shuffledp.shuffler.v1.Shuffler/Fetch"


def _channel(kit, address: str, cert: bytes | None = None, key: bytes | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=kit.ca, private_key=key or kit.app_key, certificate_chain=cert or kit.app_cert
    )
    return grpc.secure_channel(address, creds, options=[("grpc.max_receive_message_length", 4 << 20)])


def _submit(kit, running, envs, **kw):
    with kit.client(running.address) as c:
        return c.submit(round_id=kw.pop("round_id", 1), key_epoch=kw.pop("key_epoch", 0),
                        model_digest=kw.pop("model_digest", kit.digest), envelopes=envs)


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


def test_stalled_submits_cannot_starve_health_fetch_or_the_workers(kit, tmp_path) -> None:
    """Finding 2: as many stalled Submit streams as there are worker threads. Health and Fetch must still
    answer at once, Submits beyond the cap get RESOURCE_EXHAUSTED (busy), and a stalled stream is cancelled
    with DEADLINE_EXCEEDED after the idle timeout, freeing its slot."""
    import threading
    import time

    server, core, address = _service(kit, tmp_path, max_workers=6, idle=1.0)  # 2 Submit slots, 2 Fetch slots
    gate = threading.Event()
    header = pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=ENVELOPE_VERSION, key_epoch=0, round_id=7,
                                                     model_digest=kit.digest, expected_count=5)).SerializeToString()

    def stalled():
        yield header
        gate.wait(30)

    chans = [_channel(kit, address) for _ in range(4)]
    try:
        with kit.client(address) as c:
            att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=[kit.seal(i) for i in range(4)])
        futs = [ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None).future(
            stalled(), timeout=30) for ch in chans]
        time.sleep(0.3)
        t0 = time.monotonic()
        assert _health(kit, address) == health_pb2.HealthCheckResponse.SERVING
        with kit.client(address) as c:
            assert len(c.fetch_all(att)) == 4
        assert time.monotonic() - t0 < 1.0  # answered at once, not after the idle timeout
        codes = []
        for f in futs:
            with pytest.raises(grpc.RpcError) as info:
                f.result(timeout=10)
            codes.append((info.value.code(), (info.value.details() or "").split(":")[0]))
        assert sorted(codes, key=str).count((grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")) == 2, codes
        assert codes.count((grpc.StatusCode.DEADLINE_EXCEEDED, "submit_idle")) == 2, codes
        _assert_submit_slots_free(kit, address)
    finally:
        gate.set()
        _stop(server, core, chans)


def _assert_submit_slots_free(kit, address: str) -> None:
    """An honest Submit of a new round goes through: the stalled streams gave their slots back."""
    with kit.client(address) as c:
        assert c.submit(round_id=2, key_epoch=0, model_digest=kit.digest,
                        envelopes=[kit.seal(i, round_id=2) for i in range(4)]).n_accepted == 4


def _stop(server, core, chans) -> None:
    for ch in chans:
        ch.close()
    server.stop(grace=None).wait()
    core.close()


def test_a_stream_of_keepalives_cannot_hold_a_submit_slot_forever(kit, tmp_path) -> None:
    """Keepalives reset the idle timer, so a Submit that sends only keepalives would hold its slot with no end.
    ``submit_max_duration`` bounds the whole stream (DEADLINE_EXCEEDED submit_duration) and frees the slot."""
    import threading
    import time

    server, core, address = _service(kit, tmp_path, max_workers=6, idle=1.0, max_duration=2.5)  # 2 Submit slots
    gate = threading.Event()
    header = pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=ENVELOPE_VERSION, key_epoch=0, round_id=7,
                                                     model_digest=kit.digest, expected_count=5)).SerializeToString()
    keepalive = pb.SubmitRequest(keepalive=pb.Keepalive()).SerializeToString()

    def keepalives():
        yield header
        while not gate.wait(0.3):  # well inside the 1 s idle timeout
            yield keepalive

    chans = [_channel(kit, address) for _ in range(2)]
    try:
        t0 = time.monotonic()
        futs = [ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None).future(
            keepalives(), timeout=30) for ch in chans]
        for f in futs:
            with pytest.raises(grpc.RpcError) as info:
                f.result(timeout=20)
            assert (info.value.code(), (info.value.details() or "").split(":")[0]) == (
                grpc.StatusCode.DEADLINE_EXCEEDED, "submit_duration")
        assert 2.5 <= time.monotonic() - t0 < 10
        _assert_submit_slots_free(kit, address)
    finally:
        gate.set()
        _stop(server, core, chans)


def test_unread_fetches_cannot_starve_health_stats_or_submit(kit, tmp_path) -> None:
    """More Fetches than worker threads, none of them read (their peer never takes a message, so gRPC's flow
    control blocks each handler thread). Health, Stats and Submit must still answer at once; Fetches beyond
    the cap get RESOURCE_EXHAUSTED (busy); a Fetch whose peer takes nothing for fetch_stall_timeout is
    cancelled with DEADLINE_EXCEEDED (fetch_stall), which frees its slot for a reader."""
    import time

    server, core, address = _service(kit, tmp_path, max_workers=6, stall=1.0,  # 2 Submit slots, 2 Fetch slots
                                     max_envelope_bytes=4 << 20)
    size = 3_000_000  # 24 MB per batch: far more than a stream's flow-control window, even after BDP growth
    chans = [_channel(kit, address) for _ in range(6)]

    def big_client() -> ShufflerClient:
        return ShufflerClient(address, root_certificate=kit.ca, client_certificate=kit.app_cert,
                              client_key=kit.app_key, shuffler_verify_key=kit.verify_key, max_message_bytes=4 << 20)

    try:
        with big_client() as c:
            att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest,
                           envelopes=[kit.seal(i, size=size) for i in range(8)])
        request = pb.FetchRequest(batch_id=att.batch_id).SerializeToString()
        unread = [ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)(request, timeout=30)
                  for ch in chans]  # six calls, never read: as many as the server has worker threads
        time.sleep(0.3)
        t0 = time.monotonic()
        assert _health(kit, address) == health_pb2.HealthCheckResponse.SERVING
        with kit.client(address) as c:
            assert c.stats()["batches_sealed"] == 1
            assert c.submit(round_id=2, key_epoch=0, model_digest=kit.digest,
                            envelopes=[kit.seal(i, round_id=2) for i in range(4)]).n_accepted == 4
        assert time.monotonic() - t0 < 1.0  # answered at once, not after the stall timeout
        time.sleep(2.0)  # past the stall timeout
        codes = []
        for call in unread:
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            codes.append((info.value.code(), (info.value.details() or "").split(":")[0]))
        assert codes.count((grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")) == 4, codes
        assert codes.count((grpc.StatusCode.DEADLINE_EXCEEDED, "fetch_stall")) == 2, codes
        with big_client() as c:  # the slots are free again, and a reader gets the whole batch
            assert sorted(open_inner(x, server_private_key=kit.server_sk, key_epoch=0, round_id=1)
                          for x in c.fetch_all(att)) == sorted(kit.payload(i, size) for i in range(8))
    finally:
        _stop(server, core, chans)


def test_fetch_of_a_damaged_output_is_internal(kit, running) -> None:
    att = _submit(kit, running, [kit.seal(i) for i in range(4)])
    out = running.core.lookup(att.batch_id).output
    out.chmod(0o600)
    out.write_bytes(out.read_bytes()[:-1])
    running.core.take_buffer(0).close()  # a later batch took the buffer that holds the good output: read the file
    with kit.client(running.address) as c, pytest.raises(ShufflerError) as info:
        c.fetch_all(att)
    assert info.value.code == grpc.StatusCode.INTERNAL


def test_journal_failure_turns_health_not_serving_and_refuses_submits(kit, tmp_path, monkeypatch) -> None:
    import errno

    import shuffledp.shuffler.journal as jmod

    server, core, address = _service(kit, tmp_path)
    try:
        real_write = jmod.os.write
        monkeypatch.setattr(jmod.os, "write", lambda fd, d: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
                            if fd == core.journal._fd else real_write(fd, d))
        real_trunc = jmod.os.ftruncate
        monkeypatch.setattr(jmod.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "EIO"))
                            if fd == core.journal._fd else real_trunc(fd, n))
        with kit.client(address) as c, pytest.raises(ShufflerError) as info:
            c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=[kit.seal(i) for i in range(4)])
        assert (info.value.code, info.value.reason) == (grpc.StatusCode.UNAVAILABLE, "journal_failed")
        monkeypatch.undo()
        assert _health(kit, address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with kit.client(address) as c, pytest.raises(ShufflerError) as info:
            c.submit(round_id=2, key_epoch=0, model_digest=kit.digest,
                     envelopes=[kit.seal(i, round_id=2) for i in range(4)])
        assert info.value.reason == "journal_failed"
    finally:
        server.stop(grace=None).wait()
        core.close()


def test_rolled_back_commit_on_a_full_disk_is_disk_full(kit, running, monkeypatch) -> None:
    import errno

    import shuffledp.shuffler.journal as jmod

    real_write = jmod.os.write
    monkeypatch.setattr(jmod.os, "write", lambda fd, d: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
                        if fd == running.core.journal._fd else real_write(fd, d))
    with pytest.raises(ShufflerError) as info:
        _submit(kit, running, [kit.seal(i) for i in range(4)])
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "disk_full")
    monkeypatch.undo()
    assert _submit(kit, running, [kit.seal(i) for i in range(4)]).n_accepted == 4  # nothing was consumed
    assert _health(kit, running.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_release_that_cannot_be_recorded_is_refused_with_nothing_streamed(kit, running, monkeypatch) -> None:
    import errno

    import shuffledp.shuffler.journal as jmod

    att = _submit(kit, running, [kit.seal(i) for i in range(4)])
    real_write = jmod.os.write
    monkeypatch.setattr(jmod.os, "write", lambda fd, d: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
                        if fd == running.core.journal._fd else real_write(fd, d))
    with _channel(kit, running.address) as ch:
        call = ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)(
            pb.FetchRequest(batch_id=att.batch_id).SerializeToString()
        )
        got: list[bytes] = []
        with pytest.raises(grpc.RpcError) as info:
            for msg in call:
                got.append(msg)
    assert got == [] and info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (info.value.details() or "").startswith("disk_full")
    monkeypatch.undo()
    with kit.client(running.address) as c:
        assert c.stats()["batches_released"] == 0
        assert len(c.fetch_all(att)) == 4 and c.stats()["batches_released"] == 1


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


def test_config_staging_memory_limit_reaches_the_core(kit, tmp_path) -> None:
    """`staging_memory_limit` in the service config is what the core uses to choose memory or disk staging."""
    from shuffledp.shuffler.config import load_config
    from shuffledp.shuffler.service import core_from_config

    from .conftest import write_config

    for limit in (0, 12345):
        path = write_config(kit, tmp_path / f"s{limit}.toml", journal=str(tmp_path / f"j{limit}"))
        text = path.read_text()
        # top-level key: insert before the first table header
        head, sep, tail = text.partition("[tls]")
        path.write_text(f"{head}staging_memory_limit = {limit}\n{sep}{tail}")
        core = core_from_config(load_config(path))
        assert core.config.staging_memory_limit == limit


def test_refusals_and_errors_from_pipelined_checks_reach_the_client(kit, running, monkeypatch) -> None:
    """In-process server with every envelope pipelined (tests/shuffler/conftest.py): a staging refusal that
    surfaces in a later add() or in finish(), and a bug in a worker's check, get their status codes, the service
    stays up, and nothing is consumed."""
    import errno

    import shuffledp.shuffler.core as coremod
    import shuffledp.shuffler.envelope as envmod

    real_mmap, real_verify = coremod.mmap.mmap, envmod.OuterOpener.verify
    monkeypatch.setattr(coremod.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOMEM, "no")))
    with pytest.raises(ShufflerError) as info:
        _submit(kit, running, [kit.seal(i) for i in range(4)])
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "staging_memory")
    monkeypatch.setattr(coremod.mmap, "mmap", real_mmap)

    def broken(self, decrypted):
        raise RuntimeError("bug in verify")

    monkeypatch.setattr(envmod.OuterOpener, "verify", broken)
    with pytest.raises(ShufflerError) as info:
        _submit(kit, running, [kit.seal(i) for i in range(4)])
    assert info.value.code == grpc.StatusCode.INTERNAL
    monkeypatch.setattr(envmod.OuterOpener, "verify", real_verify)
    assert _submit(kit, running, [kit.seal(i) for i in range(4)]).n_accepted == 4
    assert _health(kit, running.address) == health_pb2.HealthCheckResponse.SERVING
    assert list(running.core.journal.staging_dir.iterdir()) == []


def test_small_envelopes_travel_packed_even_with_a_tight_envelope_limit(kit, tmp_path, monkeypatch) -> None:
    """The gRPC message limit is max(max_envelope_bytes, the packing size) + slack, so a shuffler configured for
    small envelopes still receives them packed, one signature-check job per message, and streams its output
    packed; a message above that limit is still refused."""
    from shuffledp.shuffler import wire
    from shuffledp.shuffler.config import load_config
    from shuffledp.shuffler.core import BatchBuilder
    from shuffledp.shuffler.service import build_server, core_from_config, message_limit

    from .conftest import write_config  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)

    max_envelope = 4096
    cfg = load_config(write_config(kit, tmp_path / "shuffler.toml", max_envelope_bytes=max_envelope))
    core = core_from_config(cfg)
    server, port, _ = build_server(cfg, core, max_workers=4)
    jobs: list[int] = []
    real_add_many = BatchBuilder.add_many

    def add_many(self, envs):
        jobs.append(len(envs))
        return real_add_many(self, envs)

    monkeypatch.setattr(BatchBuilder, "add_many", add_many)
    try:
        address = f"127.0.0.1:{port}"
        envs = [kit.seal(i, size=1000) for i in range(kit.n_clients)]
        with ShufflerClient(address, root_certificate=kit.ca, client_certificate=kit.app_cert, client_key=kit.app_key,
                            shuffler_verify_key=kit.verify_key, max_message_bytes=max_envelope) as c:
            att = c.submit(round_id=1, key_epoch=kit.key_epoch, model_digest=kit.digest, envelopes=envs)
        assert jobs == [len(envs)]  # all envelopes in one packed message, checked as one job
        assert att.n_accepted == len(envs)
        with _channel(kit, address) as ch:
            fetch = ch.unary_stream("/shuffledp.shuffler.v1.Shuffler/Fetch", request_serializer=None,
                                    response_deserializer=None)
            messages = [list(pb.FetchResponse.FromString(m).inner)
                        for m in fetch(pb.FetchRequest(batch_id=att.batch_id).SerializeToString(), timeout=10)]
            assert [len(m) for m in messages] == [len(envs)]  # one packed Fetch message
            # a message beyond the limit is refused by gRPC itself, before any handler runs
            submit = ch.stream_unary("/shuffledp.shuffler.v1.Shuffler/Submit", request_serializer=None,
                                     response_deserializer=None)
            huge = wire.encode_bytes_field(2, bytes(message_limit(max_envelope) + 16))
            head = pb.SubmitRequest(header=pb.SubmitHeader(protocol_version=ENVELOPE_VERSION, key_epoch=kit.key_epoch,
                                                           round_id=2, model_digest=kit.digest, expected_count=kit.k))
            with pytest.raises(grpc.RpcError) as info:
                submit(iter([head.SerializeToString(), huge]), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert message_limit(max_envelope) == wire.PACKED_MESSAGE_BYTES + 1024
        assert message_limit(8 << 20) == (8 << 20) + 1024
    finally:
        server.stop(grace=None).wait()
        core.close()


def test_packing_follows_the_limit_each_peer_states(kit, running, tmp_path, monkeypatch) -> None:
    """Fetch packs up to the limit the fetcher states (FetchRequest.max_message_bytes), and the legacy 256 KiB when
    it states none; a submitter packs up to the limit the shuffler states in its Stats, and 256 KiB to a shuffler
    that states none (older versions of either side accept nothing larger)."""
    from shuffledp.shuffler import wire
    from shuffledp.shuffler.core import BatchBuilder
    from shuffledp.shuffler.service import FRAMING_SLACK, ShufflerServicer, message_limit

    size = 60 * 1024
    envs = [kit.seal(i, size=size) for i in range(kit.n_clients)]
    jobs: list[int] = []
    real_add_many = BatchBuilder.add_many
    monkeypatch.setattr(BatchBuilder, "add_many", lambda self, e: (jobs.append(len(e)), real_add_many(self, e))[1])
    with kit.client(running.address) as c:
        assert c.stats()["max_message_bytes"] == message_limit(1 << 20)  # the fixture's max_envelope_bytes
        att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=envs)
        assert jobs == [len(envs)]  # 8 x 60 KiB: one message under the 1 MiB packing
        seal_time = c.stats()  # and how long the seal took, of which the output's write (the core's figures)
        assert seal_time["last_seal_seconds"] >= seal_time["last_seal_write_seconds"] > 0, seal_time
        stated: list[int] = []
        message_lengths: list[int] = []
        fetch_raw = c._fetch_raw

        def recording_fetch_raw(request, **kw):
            stated.append(request.max_message_bytes)
            for message in fetch_raw(request, **kw):
                message_lengths.append(len(message))
                yield message

        c._fetch_raw = recording_fetch_raw
        assert sorted(open_inner(x, server_private_key=kit.server_sk, key_epoch=0, round_id=1)
                      for x in c.fetch_all(att)) == sorted(kit.payload(i, size=size) for i in range(kit.n_clients))
        # the client stated its receive limit, and the whole batch came in one message
        assert stated == [message_limit(c._max)] and len(message_lengths) == 1, (stated, message_lengths)

    def fetched(stated: int | None) -> list[bytes]:
        request = pb.FetchRequest(batch_id=att.batch_id)
        if stated is not None:
            request.max_message_bytes = stated
        with _channel(kit, running.address) as ch:
            return list(ch.unary_stream(FETCH, request_serializer=None, response_deserializer=None)(
                request.SerializeToString(), timeout=10))

    per_item = att.inner_length + 4  # tag byte and a 3-byte varint length
    legacy = fetched(None)  # a fetcher older than the field
    assert [len(m) // per_item for m in legacy] == [4, 4]  # 4 x 60 KiB fit in 256 KiB, 5 do not
    assert all(len(m) <= wire.LEGACY_PACKED_MESSAGE_BYTES for m in legacy)
    assert [len(m) // per_item for m in fetched(message_limit(1 << 20))] == [8]
    # no peer is packed below the legacy size: every peer accepts it, and a fetcher stating a
    # tiny limit must not make each item travel alone
    tiny = fetched(1)
    assert [len(m) // per_item for m in tiny] == [4, 4]
    # a fetcher whose limit less the 1 KiB slack leaves room for exactly five items (11 framing bytes budgeted
    # per item), and one with a byte less
    five = 5 * (att.inner_length + wire.FIELD_OVERHEAD) + FRAMING_SLACK
    assert [len(m) // per_item for m in fetched(five)] == [5, 3]
    assert [len(m) // per_item for m in fetched(five - 1)] == [4, 4]
    assert b"".join(legacy) == b"".join(fetched(message_limit(1 << 20))) == b"".join(tiny)  # same bytes, same order

    # a shuffler too old to state its limit: the submitter falls back to the packing every shuffler accepts
    real_stats = ShufflerServicer.Stats

    def old_stats(self, request, context):
        response = real_stats(self, request, context)
        response.ClearField("max_message_bytes")
        return response

    monkeypatch.setattr(ShufflerServicer, "Stats", old_stats)  # before the server binds its handlers
    (tmp_path / "old").mkdir()
    server, core, address = _service(kit, tmp_path / "old")  # its own journal
    try:
        jobs.clear()
        with kit.client(address) as c:
            assert c.stats()["max_message_bytes"] == 0
            with c.open_submit(round_id=1, key_epoch=0, model_digest=kit.digest, count=len(envs)) as stream:
                assert stream.batch_bytes == wire.LEGACY_PACKED_MESSAGE_BYTES
                stream.send_many(envs)
                assert stream.close().n_accepted == len(envs)
        assert jobs == [4, 4]
    finally:
        server.stop(grace=None).wait()
        core.close()


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


def test_the_idle_timeout_counts_only_time_spent_waiting_for_the_stream(kit, tmp_path, monkeypatch) -> None:
    """A slow seal after the last message (fsyncs of a large batch, a wait for the core's lock) is the
    shuffler's own time: the idle watchdog used to fire during it (DEADLINE_EXCEEDED, although the batch was
    sealed), which the ServerApp treats as fatal."""
    import time

    import shuffledp.shuffler.core as coremod

    real_finish = coremod.BatchBuilder.finish

    def slow_finish(self):
        time.sleep(2.0)  # twice the idle timeout
        return real_finish(self)

    monkeypatch.setattr(coremod.BatchBuilder, "finish", slow_finish)
    server, core, address = _service(kit, tmp_path, max_workers=4, idle=1.0)
    try:
        with kit.client(address) as c:
            att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=[kit.seal(i) for i in range(4)])
            assert att.n_accepted == 4 and len(c.fetch_all(att)) == 4
    finally:
        server.stop(grace=None).wait()
        core.close()


def test_a_large_message_gets_its_transfer_time_at_the_minimum_rate() -> None:
    """The stall clock of a Fetch message allows timeout + size / fetch_min_rate: a reader that is slow but
    steady is not cancelled while gRPC pushes a message bigger than its flow-control window (a
    1 MB/s link with 6 MB reports must not be cancelled after 1 s), and a reader that stops still is, later."""
    import time

    from shuffledp.shuffler.service import _IdleWatchdog

    class Ctx:
        cancelled: list[str] = []

        class _rpc_event:  # noqa: N801 - mirrors grpc's private attribute
            class call:  # noqa: N801 - mirrors grpc's private attribute
                @staticmethod
                def cancel(code, details):
                    Ctx.cancelled.append(details)

    dog = _IdleWatchdog(Ctx(), 0.2, "fetch_stall", "the peer took no message")  # type: ignore[arg-type] - a stand-in
    try:
        dog.wait_begins(6_000_000 / 6_000_000)  # a 6 MB message at a minimum rate of 6 MB/s: 1 s more
        time.sleep(0.6)
        assert not dog.fired and Ctx.cancelled == []  # past the bare timeout, within the allowance
        dog.wait_ends()
        dog.wait_begins()
        deadline = time.monotonic() + 5
        while not dog.fired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dog.fired and Ctx.cancelled == ["fetch_stall: the peer took no message for 0.2 s"]
    finally:
        dog.stop()


def test_worker_split_keeps_threads_for_health_and_is_validated() -> None:
    from shuffledp.shuffler.service import RESERVED_WORKERS, worker_split

    for workers in range(RESERVED_WORKERS + 2, 40):
        submits, fetches = worker_split(workers)
        assert submits >= 1 and fetches >= 1 and submits + fetches + RESERVED_WORKERS == workers
    assert worker_split(10) == (4, 4)  # the service's default, as docs/shuffler.md states
    for bad in (RESERVED_WORKERS + 1, True, 8.0):
        with pytest.raises(ValueError, match="max_workers must be an integer"):
            worker_split(bad)  # type: ignore[arg-type] - the wrong type on purpose


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
