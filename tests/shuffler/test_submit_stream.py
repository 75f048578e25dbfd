"""SubmitStream: envelopes sent while they arrive, keepalives, placeholders, cancel, early refusal."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from shuffledp.shuffler.client import ShufflerError, SubmitStream
from shuffledp.shuffler.envelope import open_inner

from ._service_calls import _service  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def _open(c, kit, count: int, round_id: int = 1, **kw):
    return c.open_submit(round_id=round_id, key_epoch=0, model_digest=kit.digest, count=count, **kw)


def _payloads(kit, c, att, round_id: int = 1) -> list[bytes]:
    return sorted(open_inner(x, server_private_key=kit.server_sk, key_epoch=0, round_id=round_id)
                  for x in c.fetch_all(att))


def test_keepalives_hold_a_slow_stream_open_past_the_idle_timeout(kit, tmp_path) -> None:
    server, core, address = _service(kit, tmp_path, idle=1.0)
    try:
        with kit.client(address) as c:
            with _open(c, kit, 5) as s:
                s.send(kit.seal(0))
                for _ in range(8):  # 2.4 s with nothing to forward: 2.4x the idle timeout
                    time.sleep(0.3)
                    s.keepalive()
                for i in range(1, 5):
                    s.send(kit.seal(i))
                att = s.close()
            assert att.n_accepted == 5 and att.n_received == 5
            assert _payloads(kit, c, att) == sorted(kit.payload(i) for i in range(5))
            # the same pause without keepalives is cancelled by the shuffler's idle watchdog
            with _open(c, kit, 5, round_id=2) as s:
                s.send(kit.seal(0, round_id=2))
                time.sleep(2.5)
                with pytest.raises(ShufflerError) as info:
                    s.close()
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and info.value.reason == "submit_idle"
    finally:
        server.stop(grace=None).wait()
        core.close()


def test_placeholders_keep_the_count_and_are_counted_as_empty(kit, running) -> None:
    with kit.client(running.address) as c:
        with _open(c, kit, 7, envelope_length=len(kit.seal(0))) as s:
            for i in range(5):
                s.send(kit.seal(i))
            s.send(b"")
            s.send(b"")
            att = s.close()
        assert att.n_received == 7 and att.n_accepted == 5
        assert att.dropped["empty"] == 2 and sum(att.dropped.values()) == 2
        assert _payloads(kit, c, att) == sorted(kit.payload(i) for i in range(5))


def test_a_cancelled_stream_seals_nothing_and_leaves_the_binding_unused(kit, running) -> None:
    envs = [kit.seal(i) for i in range(5)]
    with kit.client(running.address) as c:
        s = _open(c, kit, 5)
        s.send(envs[0])
        s.send(envs[1])
        s.cancel()
        s.cancel()  # idempotent
        with pytest.raises(RuntimeError, match="closed or cancelled"):
            s.send(envs[2])
        time.sleep(0.2)
        assert c.stats()["batches_sealed"] == 0
        # the same round, later, with the whole batch (the two envelopes sent before were not consumed)
        att = c.submit(round_id=1, key_epoch=0, model_digest=kit.digest, envelopes=envs)
        assert att.n_accepted == 5 and att.dropped["replay"] == 0
    # an exception inside the context manager cancels too
    with kit.client(running.address) as c:
        with pytest.raises(KeyError), _open(c, kit, 5, round_id=3) as s:
            s.send(kit.seal(0, round_id=3))
            raise KeyError("the caller failed")
        assert c.stats()["batches_sealed"] == 1


def test_a_refusal_mid_stream_surfaces_on_the_next_call(kit, running) -> None:
    with kit.client(running.address) as c:
        with _open(c, kit, kit.k) as s:  # announce k, send more: the shuffler refuses at envelope k + 1
            with pytest.raises(ShufflerError) as info:
                for i in range(200):
                    s.send(kit.seal(i % kit.n_clients))
                    time.sleep(0.01)
                s.close()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.reason == "count_mismatch"
        assert s.sent < 200  # noticed while sending, not only at close()


def test_close_checks_the_count_sent(kit, running) -> None:
    with kit.client(running.address) as c:
        with _open(c, kit, 5) as s:
            for i in range(4):
                s.send(kit.seal(i))
            with pytest.raises(ShufflerError) as info:  # the shuffler refuses: received 4 of 5
                s.close()
        assert info.value.reason == "count_mismatch"


def test_a_refused_source_stream_raises_the_refusal_not_the_closed_iterator(kit, running) -> None:
    # gRPC closes the request iterator when the shuffler ends the call early; the GeneratorExit that this raises
    # inside the stream's source reader is gRPC's doing, and the refusal must stay what close() raises
    closed = threading.Event()
    envelope = kit.seal(0)

    def endless() -> Iterator[bytes]:
        try:
            while True:
                yield envelope
        finally:
            closed.set()

    with kit.client(running.address) as c:
        stream = SubmitStream(c, round_id=1, key_epoch=1, model_digest=kit.digest, count=10**6,
                              envelope_length=None, timeout=30.0, source=endless())
        closed.wait(10.0)  # set once gRPC has closed the stream's source reader (and with it, ``endless``)
        with pytest.raises(ShufflerError) as info:
            stream.close()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
