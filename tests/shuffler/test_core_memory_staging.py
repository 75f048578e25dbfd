"""The core's memory staging path: buffer, output write, reuse, fault-in, refusals; the output digest on both paths."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

import shuffledp.shuffler.staging as stagingmod
from shuffledp.shuffler.core import Refused, ShufflerCore
from shuffledp.shuffler.envelope import open_inner

from ._core_batches import _output_digest, _payloads, _run, _verify  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def _spy_disk_writes(monkeypatch) -> list[tuple[int, int]]:
    """Record (offset, length) of every pwrite the core issues."""

    writes: list[tuple[int, int]] = []
    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        writes.append((offset, len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return writes


def test_memory_path_writes_the_output_once_in_output_order(core: ShufflerCore, kit, monkeypatch) -> None:
    """Memory path (default limit): nothing reaches the disk while reports arrive (the output-to-be stays
    empty, space is only reserved); at seal the holes are squeezed out in memory and the output is written
    once, in offset order, then fsynced, made read-only and renamed. Same output semantics as the disk path:
    the multiset of payloads, the attested digest, the sealed size."""
    import os
    import stat


    writes = _spy_disk_writes(monkeypatch)
    syncs: list[str] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append("fdatasync"), real_fdatasync(fd))[1])
    envs = [kit.seal(i) for i in range(6)]
    mixed = envs[:3] + [b"junk", envs[3][:-1]] + envs[3:]  # two holes to squeeze out
    b = core.begin(kit.header(len(mixed)))
    for e in mixed:
        b.add(e)
    b.settle()
    L = b.inner_length
    assert b.in_memory is True and b.staging_buffer is not None
    # the slots from the buffer's first byte on, rounded up for O_DIRECT
    assert len(mixed) * L <= len(b.staging_buffer) < len(mixed) * L + 4096
    assert writes == [] and syncs == []  # no report bytes (and no zero-fill) on disk before seal
    (stage,) = list(core.journal.staging_dir.iterdir())
    assert stage.stat().st_size == len(mixed) * L and stage.stat().st_blocks * 512 >= len(mixed) * L  # reserved
    assert not any(stage.read_bytes())  # ... but holds no data (unwritten extents read as zeros)
    buf = b.staging_buffer
    sealed = b.finish()
    assert b.staging_buffer is None and not buf.closed  # let go at seal, retained by the core for reuse
    assert core.take_buffer(len(buf)) is buf
    # one sequential write of the squeezed output (with O_DIRECT rounded up to 4 KiB, then truncated)
    assert len(writes) == 1 and writes[0][0] == 0 and 6 * L <= writes[0][1] < 6 * L + 4096
    att = _verify(kit, sealed)
    assert (att.n_received, att.n_accepted, att.inner_length) == (8, 6, L)
    assert att.dropped["malformed"] == 1 and att.dropped["undecryptable"] == 1
    out = list(core.read_batch(sealed.batch_id))
    assert _output_digest(out) == att.output_digest
    assert sorted(_payloads(core, kit, sealed)) == sorted(kit.payload(i) for i in range(6))
    st = os.stat(sealed.output)
    assert st.st_size == 6 * L and stat.S_IMODE(st.st_mode) == 0o400
    assert list(core.journal.staging_dir.iterdir()) == []
    # identical resubmission, replay cache and binding behave exactly as on the disk path
    again = _run(core, kit, list(reversed(mixed)))
    assert (again.batch_id, again.statement) == (sealed.batch_id, sealed.statement)
    with pytest.raises(Refused) as info:
        _run(core, kit, envs[:5])
    assert info.value.reason == "binding_used"


def test_memory_and_disk_paths_seal_the_same_batch_semantics(core: ShufflerCore, disk_core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(5)] + [kit.seal(0)]  # one duplicate signer dropped
    a, b = _run(core, kit, envs), _run(disk_core, kit, envs)
    va, vb = _verify(kit, a), _verify(kit, b)
    for f in ("n_received", "n_accepted", "inner_length", "dropped", "round_id", "k"):
        assert getattr(va, f) == getattr(vb, f), f
    assert sorted(core.read_batch(a.batch_id)) == sorted(disk_core.read_batch(b.batch_id))  # same multiset


def test_the_announced_size_selects_the_staging_path(kit, tmp_path: Path) -> None:
    from shuffledp.shuffler.core import stages_in_memory

    env_len = len(kit.seal(0))
    L = env_len - 166  # inner length = envelope_length - 166, known from the header when it is announced
    for limit, expect_memory in ((6 * L, True), (6 * L - 1, False), (0, False)):
        c = ShufflerCore(kit.core_config(tmp_path / f"j{limit}", staging_memory_limit=limit))
        try:
            assert stages_in_memory(6, L, limit) is expect_memory
            b = c.begin(kit.header(6, envelope_length=env_len))
            assert b.in_memory is None and b.staging_buffer is None  # nothing chosen or allocated at the header
            for i in range(6):
                b.add(kit.seal(i))
            b.settle()
            assert b.inner_length == L and b.in_memory is expect_memory
            assert (b.staging_buffer is not None) is expect_memory
            sealed = b.finish()
            assert sorted(_payloads(c, kit, sealed)) == sorted(kit.payload(i) for i in range(6))
        finally:
            c.close()
    with pytest.raises(ValueError, match="staging_memory_limit must be an int in"):
        kit.core_config(tmp_path / "x", staging_memory_limit=-1)
    with pytest.raises(ValueError, match="staging_memory_limit must be an int in"):
        kit.core_config(tmp_path / "x", staging_memory_limit=True)


def test_refused_batches_release_their_staging_memory(core: ShufflerCore, kit, monkeypatch) -> None:
    import errno


    # refused at seal (below threshold): the buffer is unmapped, nothing is left on disk
    b = core.begin(kit.header(kit.k))
    b.add(kit.seal(0))
    b.settle()
    buf = b.staging_buffer
    assert buf is not None and not buf.closed
    for _ in range(kit.k - 1):
        b.add(b"junk")
    with pytest.raises(Refused) as info:
        b.finish()
    assert info.value.reason == "below_threshold" and buf.closed and b.staging_buffer is None
    # refused mid-stream (count mismatch) and on a full disk after the buffer was allocated
    b = core.begin(kit.header(kit.k, round_id=2))
    for i in range(kit.k):
        b.add(kit.seal(i, round_id=2))
    b.settle()
    buf = b.staging_buffer
    with pytest.raises(Refused):
        b.add(kit.seal(kit.k, round_id=2))
    assert buf.closed
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    allocated: list = []
    real_mmap = mmap.mmap
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: (allocated.append(real_mmap(*a, **k)), allocated[-1])[1])
    b = core.begin(kit.header(kit.k, round_id=3))
    with pytest.raises(Refused) as info:
        b.add(kit.seal(0, round_id=3))
        b.settle()
    assert (info.value.code, info.value.reason) == ("resource_exhausted", "disk_full")
    assert len(allocated) == 1 and allocated[0].closed
    # an allocation failure is a clear refusal, never a silent fall-back to the disk path
    calls: list = []
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: calls.append(a))

    def no_memory(*a, **k):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_memory)
    before = core.stats()["batches_refused"]
    b = core.begin(kit.header(kit.k, round_id=4))
    with pytest.raises(Refused) as info:
        b.add(kit.seal(0, round_id=4))
        b.settle()
    assert (info.value.code, info.value.reason) == ("resource_exhausted", "staging_memory")
    assert str(kit.k) in str(info.value) and calls == []  # no disk staging was started
    assert core.stats()["batches_refused"] == before + 1
    assert list(core.journal.staging_dir.iterdir()) == [] and list(core.journal.batches_dir.iterdir()) == []
    # nothing was consumed: the same round seals once memory is available again
    monkeypatch.undo()
    envelopes = [kit.seal(i, round_id=4) for i in range(kit.k)]
    assert _verify(kit, _run(core, kit, envelopes, round_id=4)).n_accepted == kit.k


def test_memory_path_output_order_is_uniform(kit, tmp_path: Path, monkeypatch) -> None:
    """Output position of the j-th accepted arrival on the memory path, without and with a dropped envelope
    (a hole squeezed out in memory), against the scaled Pearson statistic of tests/shuffler/test_permutation.py
    ((n-1)/n X^2 ~ chi2((n-1)^2) for a sum of permutation matrices); alpha 1e-3 per table."""
    from scipy import stats

    import shuffledp.shuffler.journal as journalmod
    import shuffledp.shuffler.seal as sealmod
    from shuffledp.shuffler.envelope import open_outer

    for mod in (sealmod, journalmod):  # durability is the crash tests' subject; keep this fast
        monkeypatch.setattr(mod.os, "fsync", lambda fd: None)
    monkeypatch.setattr(sealmod, "fsync_dir", lambda p: None)
    n, n_cores, rounds = 4, 20, 20
    cores = [ShufflerCore(kit.core_config(tmp_path / f"u{i}")) for i in range(n_cores)]
    tables = {hole: [[0] * n for _ in range(n)] for hole in (False, True)}
    try:
        for hole in (False, True):
            for r in range(1, rounds + 1):
                good = [kit.seal(i, round_id=r) for i in range(n)]
                inners = [
                    bytes(open_outer(e, shuffler_private_key=kit.shuffler_sk, key_epoch=kit.key_epoch, round_id=r,
                                     model_digest=kit.digest).inner)
                    for e in good
                ]
                envs = good[:2] + [b"junk"] + good[2:] if hole else good
                for c in cores:
                    b = c.begin(kit.header(len(envs), round_id=r))
                    for e in envs:
                        b.add(e)
                    b.settle()
                    assert b.in_memory
                    sealed = b.finish()
                    out = list(c.read_batch(sealed.batch_id))
                    for j, x in enumerate(inners):
                        tables[hole][j][out.index(x)] += 1
            for c in cores:  # fresh cores for the second table (bindings and replay caches are per core)
                c.close()
            cores = [ShufflerCore(kit.core_config(tmp_path / f"u{i}-{hole}")) for i in range(n_cores)]
    finally:
        for c in cores:
            c.close()
    for hole, t in tables.items():
        expected = rounds * n_cores / n
        x2 = sum((t[i][j] - expected) ** 2 / expected for i in range(n) for j in range(n)) * (n - 1) / n
        p = float(stats.chi2.sf(x2, (n - 1) ** 2))
        assert p > 1e-3, f"memory path, hole={hole}: scaled X^2 = {x2:.1f}, p = {p:.2e}, table {t}"


def test_memory_path_output_without_o_direct(core: ShufflerCore, kit, monkeypatch) -> None:
    """Where the filesystem refuses O_DIRECT writes (tmpfs: EINVAL), the same bytes go through the page cache."""
    import errno


    real = os.pwrite
    direct_fds: list[int] = []
    refused: list[int] = []
    real_open = os.open

    def open_(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.append(fd)
        return fd

    def pwrite(fd: int, data, offset: int) -> int:
        if fd in direct_fds:
            direct_fds.remove(fd)
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "pwrite", pwrite)
    envs = [kit.seal(i) for i in range(5)]
    sealed = _run(core, kit, envs[:2] + [b"junk"] + envs[2:])
    att = _verify(kit, sealed)
    assert _output_digest(core.read_batch(sealed.batch_id)) == att.output_digest
    assert sealed.output.stat().st_size == 5 * att.inner_length
    assert sorted(_payloads(core, kit, sealed)) == sorted(kit.payload(i) for i in range(5))
    assert len(refused) == (1 if hasattr(os, "O_DIRECT") else 0)  # the direct write was tried once


@pytest.mark.parametrize("path", ["memory", "disk"])
def test_attested_output_digest_is_the_documented_formula_over_the_output_bytes(
    core: ShufflerCore, disk_core: ShufflerCore, kit, path: str
) -> None:
    """The digest sealed from the per-slot hashes kept at add() equals the documented formula recomputed from
    the output file's bytes, with holes squeezed out (drops in the middle) and without: format v3 (per-item
    BLAKE3) for a batch of envelope version 2, format v2 (per-item SHA-256) for a batch of version 1."""
    import hashlib
    import struct

    import blake3

    c = core if path == "memory" else disk_core
    envs = [kit.seal(i) for i in range(6)]
    v1 = [kit.seal(i, round_id=3, version=1) for i in range(6)]
    for round_id, batch, version in ((1, envs[:2] + [b"", b"junk"] + envs[2:], 2),
                                     (2, [kit.seal(i, round_id=2) for i in range(6)], 2),
                                     (3, v1[:3] + [kit.seal(6, round_id=3)] + v1[3:], 1)):
        sealed = _run(c, kit, batch, round_id=round_id, protocol_version=version)
        att = _verify(kit, sealed)
        assert (att.protocol_version, att.format) == (version, f"shuffledp-attestation/v{version + 1}")
        out = list(c.read_batch(sealed.batch_id))
        assert len(out) == att.n_accepted == 6
        if version == 1:  # the version-2 envelope in the version-1 batch is dropped, not opened as version 1
            assert att.dropped["wrong_version"] == 1
        h = hashlib.sha256(f"shuffledp/batch-output/v{version + 1}".encode())
        for x in out:
            item = hashlib.sha256(x).digest() if version == 1 else blake3.blake3(x).digest()
            h.update(struct.pack(">Q", len(x)) + item)
        assert att.output_digest == h.digest()
        opened = sorted(open_inner(x, server_private_key=kit.server_sk, key_epoch=kit.key_epoch, round_id=round_id,
                                   version=version) for x in out)
        assert opened == sorted(kit.payload(i, 64) for i in range(6))


def test_a_sealed_batchs_staging_buffer_is_reused_and_leaks_nothing_into_the_next(kit, tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """retain_staging_buffer (default): the next memory-path batch writes into the same mapping instead of
    faulting in fresh pages; its output holds only its own reports even where the old batch's bytes sit in its
    holes; a buffer too small for the next batch is unmapped and replaced; with the option off, or after a
    refusal, the buffer is unmapped."""
    import shuffledp.shuffler.output as outmod

    maps: list = []
    real_mmap = mmap.mmap
    def counting_mmap(*a, **k):  # staging buffers only, not the fetch's read buffer
        m = real_mmap(*a, **k)
        if a[1] != outmod._READ_CHUNK:
            maps.append(m)
        return m

    monkeypatch.setattr(mmap, "mmap", counting_mmap)
    c = ShufflerCore(kit.core_config(tmp_path / "j"))
    try:
        first = _run(c, kit, [kit.seal(i) for i in range(6)])
        old_inners = set(c.read_batch(first.batch_id))
        assert len(maps) == 1 and not maps[0].closed  # retained
        batch = [kit.seal(i, round_id=2) for i in range(6)]
        b = c.begin(kit.header(8, round_id=2))
        for e in batch[:3] + [b"junk", b""] + batch[3:]:  # two holes, over stale slots of the first batch
            b.add(e)
        b.settle()
        assert b.staging_buffer is maps[0] and len(maps) == 1  # the same mapping, no new one
        second = b.finish()
        out = list(c.read_batch(second.batch_id))
        assert len(out) == _verify(kit, second).n_accepted == 6 and not set(out) & old_inners
        assert sorted(_payloads(c, kit, second, round_id=2)) == sorted(kit.payload(i) for i in range(6))
        # larger reports: the retained buffer is too small, so it is unmapped and a fresh one is mapped
        bigger = [kit.seal(i, round_id=3, size=8192) for i in range(6)]
        _run(c, kit, bigger, round_id=3)
        assert len(maps) == 2 and maps[0].closed and not maps[1].closed
        # a refused batch unmaps its buffer (even the retained one it took)
        b = c.begin(kit.header(kit.k, round_id=4))
        b.add(kit.seal(0, round_id=4))
        b.settle()
        assert b.staging_buffer is maps[1]
        for _ in range(kit.k - 1):
            b.add(b"junk")
        with pytest.raises(Refused):
            b.finish()
        assert maps[1].closed
    finally:
        c.close()
    off = ShufflerCore(kit.core_config(tmp_path / "j-off", retain_staging_buffer=False))
    try:
        _run(off, kit, [kit.seal(i, round_id=5) for i in range(6)], round_id=5)
        assert maps[-1].closed
    finally:
        off.close()
    with pytest.raises(ValueError, match="retain_staging_buffer must be a bool"):
        kit.core_config(tmp_path / "x", retain_staging_buffer=1)


def test_slot_hashes_refuse_a_hash_of_the_wrong_length(core: ShufflerCore, kit, monkeypatch) -> None:
    """A per-slot hash that is not 32 bytes must fail loudly, not shift every later slot's hash."""
    import dataclasses

    import shuffledp.shuffler.envelope as envmod

    real_verify = envmod.OuterOpener.verify
    monkeypatch.setattr(envmod.OuterOpener, "verify",
                        lambda self, d: dataclasses.replace(real_verify(self, d), inner_sha256=b"short"))
    b = core.begin(kit.header(kit.k))
    with pytest.raises((ValueError, TypeError)):
        b.add(kit.seal(0))
        b.settle()
    b.abort()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("advice", ["populate", "fallback"])
def test_a_fresh_staging_buffer_is_faulted_in_before_any_report(
    core: ShufflerCore, kit, monkeypatch: pytest.MonkeyPatch, advice: str
) -> None:
    # The first write to a page of a fresh buffer pays a page fault, so the time to accept a report would say
    # whether its (secret) slot shares a page with an earlier report's. The whole buffer is faulted in first.
    import mmap


    if advice == "fallback":  # a kernel without MADV_POPULATE_WRITE: the sequential zero write
        monkeypatch.setattr(stagingmod, "_MADV_POPULATE_WRITE", 10_000)
    size = 48 << 20
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    before = _resident_bytes()
    stagingmod.prefault(buf)
    assert _resident_bytes() - before >= size * 0.9
    assert buf[:16] == bytes(16) and buf[-16:] == bytes(16)
    buf.close()
    # the staging path faults in each fresh buffer once, and not a retained one
    calls: list[int] = []
    real = stagingmod.prefault
    monkeypatch.setattr(stagingmod, "prefault", lambda b: (calls.append(len(b)), real(b)))
    for round_id in (1, 2):
        sealed = _run(core, kit, [kit.seal(i, size=64, round_id=round_id) for i in range(4)], round_id=round_id)
        assert sealed.n == 4
    assert len(calls) == 1 and calls[0] >= 4 * 64


def test_a_prefault_that_finds_memory_short_refuses_the_batch(core: ShufflerCore, kit, monkeypatch) -> None:
    # only EINVAL (a kernel without MADV_POPULATE_WRITE) falls back to the zero write; ENOMEM is a
    # staging_memory refusal, not a zero write that invites the OOM killer.
    import errno


    class ShortOfMemory:
        def madvise(self, advice: int) -> None:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

    with pytest.raises(OSError) as info:
        stagingmod.prefault(ShortOfMemory())  # type: ignore[arg-type] - a stand-in buffer
    assert info.value.errno == errno.ENOMEM

    def short(buf):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(stagingmod, "prefault", short)
    builder = core.begin(kit.header(4))
    with pytest.raises(Refused) as refused:
        builder.add(kit.seal(0))
    assert (refused.value.code, refused.value.reason) == ("resource_exhausted", "staging_memory")
    monkeypatch.undo()
    assert _run(core, kit, [kit.seal(i) for i in range(4)]).n == 4  # nothing was consumed
