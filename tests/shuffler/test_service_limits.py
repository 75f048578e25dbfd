"""The gRPC service under load: worker slots, idle, duration and stall timeouts, and packing to each peer's limit."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler.client import ShufflerClient
from shuffledp.shuffler.envelope import ENVELOPE_VERSION, open_inner

from ._fixtures_adv import FETCH, SUBMIT  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
from ._service_calls import _channel, _health, _service  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


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
