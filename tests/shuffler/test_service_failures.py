"""The gRPC service when storage fails: a damaged output, a failed journal, a full disk, refused staging memory."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler.client import ShufflerError

from ._fixtures_adv import FETCH  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
from ._service_calls import _channel, _health, _service, _submit  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


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
