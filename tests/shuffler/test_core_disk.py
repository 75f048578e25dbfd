"""The core's disk I/O: disk staging (zero-fill, squeeze), preallocation, free-space refusals, O_DIRECT reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shuffledp.shuffler.core import Refused, ShufflerCore

from ._core_batches import _payloads, _run, _verify  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
from ._direct_io import _refuse_o_direct  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def test_holes_are_squeezed_in_place_and_staging_is_zero_filled_first(
    disk_core: ShufflerCore, kit, monkeypatch
) -> None:
    """Disk path: the staging file is zero-filled in offset order before any report is written to it, and not
    synced (the zeros only need to be dirty pages, so that writeback follows offset order); there is no sync while
    reports arrive; with dropped envelopes the holes are squeezed out in place."""

    events: list[tuple[str, int, int]] = []
    real_pwrite, real_sync, real_fsync = os.pwrite, os.fdatasync, os.fsync

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        events.append(("zero" if not any(bytes(data)) else "data", offset, len(data)))
        return real_pwrite(fd, data, offset)

    def fdatasync(fd: int) -> None:
        events.append(("sync", 0, 0))
        real_sync(fd)

    monkeypatch.setattr(os, "pwrite", pwrite)
    def fsync(fd: int) -> None:
        events.append(("sync", 0, 0))
        real_fsync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "fsync", fsync)
    envs = [kit.seal(i) for i in range(6)]
    mixed = envs[:3] + [b"junk", envs[3][:-1]] + envs[3:]
    b = disk_core.begin(kit.header(len(mixed)))
    for e in mixed:
        b.add(e)
    sealed = b.finish()  # (with pipelined signature checks, the last reports are staged here)
    L = sealed.inner_length
    first_data = next(i for i, e in enumerate(events) if e[0] == "data")
    zeros = [e for e in events[:first_data] if e[0] == "zero"]
    assert [o for _, o, _ in zeros] == sorted(o for _, o, _ in zeros)  # offset order
    assert sum(n for _, _, n in zeros) == len(mixed) * L  # the whole file, before the first report
    first_sync = next(i for i, e in enumerate(events) if e[0] == "sync")
    data = [i for i, e in enumerate(events) if e[0] == "data"]  # the 6 staged reports, then the squeeze's moves
    assert len(data) >= 6
    assert max(data) < first_sync  # no sync while reports arrive: not of the zeros, not in arrival order
    att = _verify(kit, sealed)
    assert att.n_accepted == 6 and att.n_received == 8
    assert sealed.output.stat().st_size == 6 * att.inner_length
    assert sorted(_payloads(disk_core, kit, sealed)) == sorted(kit.payload(i) for i in range(6))
    assert list(disk_core.journal.staging_dir.iterdir()) == []
    sealed2 = _run(disk_core, kit, [kit.seal(i, round_id=2) for i in range(6)], round_id=2)  # no holes
    assert sorted(_payloads(disk_core, kit, sealed2, round_id=2)) == sorted(kit.payload(i) for i in range(6))


def test_staging_is_preallocated_and_a_full_disk_refuses_early(core: ShufflerCore, kit, monkeypatch) -> None:
    import errno


    calls: list[tuple[int, int]] = []
    real = os.posix_fallocate

    def spy(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", spy)
    sealed = _run(core, kit, [kit.seal(i) for i in range(4)])
    assert calls == [(0, 4 * sealed.inner_length)]  # the whole file, before the first write

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    b = core.begin(kit.header(4, round_id=2))
    with pytest.raises(Refused) as info:
        b.add(kit.seal(0, round_id=2))
        b.settle()  # staging starts when the first report is accepted, i.e. once its signature check is in
    b.abort()
    assert (info.value.code, info.value.reason) == ("resource_exhausted", "disk_full")
    assert list(core.journal.staging_dir.iterdir()) == []


def test_free_space_is_checked_with_a_journal_reserve_before_allocating(core: ShufflerCore, kit, monkeypatch) -> None:
    import os as _os

    import shuffledp.shuffler.core as coremod

    calls: list[int] = []
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, o, n: calls.append(n))
    real = _os.statvfs(core.journal.staging_dir)

    class Small:  # room for the batch itself, but not for the journal reserve on top of it
        f_frsize = 4096
        f_bavail = (coremod.JOURNAL_HEADROOM_BYTES // 2) // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Small)
    b = core.begin(kit.header(4))
    with pytest.raises(Refused) as info:
        b.add(kit.seal(0))
        b.settle()
    b.abort()
    assert (info.value.code, info.value.reason) == ("resource_exhausted", "disk_full")
    assert calls == [] and list(core.journal.staging_dir.iterdir()) == []
    monkeypatch.setattr(os, "statvfs", lambda path: real)
    monkeypatch.undo()
    assert _verify(kit, _run(core, kit, [kit.seal(i) for i in range(4)])).n_accepted == 4


@pytest.mark.parametrize("inner_length", [1, 100, 4096, 5000, 8192, 20000])
def test_output_is_read_back_exactly_across_direct_read_chunks(tmp_path: Path, monkeypatch, inner_length: int) -> None:
    """Fetch reads the output with O_DIRECT in page-aligned chunks (8 KiB here): items straddling a chunk
    boundary, items longer than a chunk, and a file whose size is not a multiple of 4 KiB come back exactly;
    a truncated file is an error; where O_DIRECT is refused the page cache is used, with the same bytes."""
    import secrets

    import shuffledp.shuffler.output as outmod

    monkeypatch.setattr(outmod, "_READ_CHUNK", 8192)
    n = 7
    items = [secrets.token_bytes(inner_length) for _ in range(n)]
    path = tmp_path / "out"
    path.write_bytes(b"".join(items))
    assert list(outmod.read_output(path, n, inner_length)) == items
    path.write_bytes(b"".join(items)[:-1])
    with pytest.raises(RuntimeError, match="is truncated"):
        list(outmod.read_output(path, n, inner_length))
    path.write_bytes(b"".join(items))
    _refuse_o_direct(monkeypatch)
    assert list(outmod.read_output(path, n, inner_length)) == items


def test_direct_read_refused_at_the_first_read_falls_back_and_an_abandoned_fetch_stops_its_reader(
        tmp_path: Path, monkeypatch) -> None:
    import errno
    import secrets
    import threading

    import shuffledp.shuffler.output as outmod

    monkeypatch.setattr(outmod, "_READ_CHUNK", 8192)
    items = [secrets.token_bytes(3000) for _ in range(9)]
    path = tmp_path / "out"
    path.write_bytes(b"".join(items))
    # a fetch abandoned after two items: the reader thread ends and its buffers are unmapped
    gen = outmod.read_output(path, 9, 3000)
    assert [next(gen), next(gen)] == items[:2]
    gen.close()
    assert not [t for t in threading.enumerate() if t.name == "shuffler-fetch-read"]
    # O_DIRECT accepted at open but refused at the first read (EINVAL): the same bytes through the page cache
    real_preadv = os.preadv
    calls: list[int] = []

    def refusing_preadv(fd, bufs, pos):
        calls.append(pos)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "preadv", refusing_preadv)
    assert list(outmod.read_output(path, 9, 3000)) == items and calls == [0]
    # a later I/O error is raised, not papered over
    def failing_later(fd, bufs, pos):
        if pos:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, bufs, pos)

    monkeypatch.setattr(os, "preadv", failing_later)
    with pytest.raises(OSError, match="Input/output error"):
        list(outmod.read_output(path, 9, 3000))


def test_fetch_reader_failures_neither_leak_descriptors_nor_hang(tmp_path: Path, monkeypatch) -> None:
    """A reader that cannot start (no thread, no memory) closes the O_DIRECT descriptor; an
    unexpected exception on the reader thread reaches the consumer instead of leaving it waiting forever."""
    import os
    import secrets
    import threading

    import shuffledp.shuffler.output as outmod

    path = tmp_path / "out"
    path.write_bytes(secrets.token_bytes(5 * 3000))

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    fds_before = len(os.listdir("/proc/self/fd"))
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", no_thread)
        for _ in range(10):
            with pytest.raises(RuntimeError, match="can't start new thread"):
                list(outmod.read_output(path, 5, 3000))
    assert len(os.listdir("/proc/self/fd")) == fds_before

    def odd_failure(fd, bufs, pos):
        raise ValueError("not an OSError")

    monkeypatch.setattr(os, "preadv", odd_failure)
    outcome: list = []
    t = threading.Thread(
        target=lambda: outcome.append(pytest.raises(ValueError, list, outmod.read_output(path, 5, 3000)))
    )
    t.start()
    t.join(timeout=10)
    assert not t.is_alive() and outcome  # raised, did not hang
