"""The core's commit and shutdown: journal-append rollback, output sync, fsync waits, close and drain, seal stats."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import shuffledp.shuffler.seal as sealmod
from shuffledp.shuffler.core import Refused, ShufflerCore

from ._core_batches import _payloads, _run, _verify  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def _fail_journal_writes(monkeypatch, core: ShufflerCore, *, partial: int, also_truncate: bool = False) -> None:
    """The next journal append writes ``partial`` bytes, then fails with ENOSPC (as a full disk would)."""
    import errno
    import os as _os

    import shuffledp.shuffler.journal as jmod

    real_write, real_trunc = _os.write, _os.ftruncate
    state = {"partial_done": False}

    def write(fd: int, data: bytes) -> int:
        if fd == core.journal._fd:
            if partial and not state["partial_done"] and len(data) > partial:
                state["partial_done"] = True  # a short write first, as a filling disk does
                return real_write(fd, bytes(data[:partial]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def ftruncate(fd: int, length: int) -> None:
        if also_truncate and fd == core.journal._fd:
            raise OSError(errno.EIO, "Input/output error")
        real_trunc(fd, length)

    monkeypatch.setattr(jmod.os, "write", write)
    monkeypatch.setattr(jmod.os, "ftruncate", ftruncate)


def test_failed_journal_append_is_rolled_back_and_an_acknowledged_batch_survives_restart(
    kit, tmp_path: Path, monkeypatch
) -> None:
    """Finding 1: B's commit record is cut short by a full disk. It must be rolled back, so that the next
    acknowledged batch C is not mistaken for a torn tail at restart (which would forget C's binding and replay
    tags and let the server obtain a second, different release of C's round)."""
    import errno

    from shuffledp.shuffler.journal import JournalWriteError

    core = ShufflerCore(kit.core_config(tmp_path / "j"))
    a = _run(core, kit, [kit.seal(i, round_id=1) for i in range(5)], round_id=1)
    size = core.journal.path.stat().st_size
    _fail_journal_writes(monkeypatch, core, partial=45)
    with pytest.raises(JournalWriteError) as info:
        _run(core, kit, [kit.seal(i, round_id=2) for i in range(6)], round_id=2)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert core.journal.path.stat().st_size == size  # nothing of B remains
    assert sorted(p.name for p in core.journal.batches_dir.iterdir()) == [a.output.name]  # B's output removed
    c = _run(core, kit, [kit.seal(i, round_id=3) for i in range(5)], round_id=3)  # acknowledged
    core.close()
    core = ShufflerCore(kit.core_config(tmp_path / "j"))
    try:
        assert core.journal.torn_bytes == 0
        assert sorted(_payloads(core, kit, core.lookup(c.batch_id), 3)) == sorted(kit.payload(i) for i in range(5))
        with pytest.raises(Refused) as info2:  # C's binding is still used: no second release of round 3
            _run(core, kit, [kit.seal(i, round_id=3) for i in range(4)], round_id=3)
        assert info2.value.reason == "binding_used"
        assert list(core.read_batch(a.batch_id))
        # B was never committed: its round can still be sealed once
        assert _verify(kit, _run(core, kit, [kit.seal(i, round_id=2) for i in range(6)], round_id=2)).n_accepted == 6
    finally:
        core.close()


def test_failed_rollback_makes_the_core_unhealthy_and_refuse_everything(kit, tmp_path: Path, monkeypatch) -> None:
    core = ShufflerCore(kit.core_config(tmp_path / "j"))
    hooks: list[int] = []
    core.on_unhealthy.append(lambda: hooks.append(1))
    _fail_journal_writes(monkeypatch, core, partial=0, also_truncate=True)
    with pytest.raises(Refused) as info:
        _run(core, kit, [kit.seal(i) for i in range(5)])
    assert (info.value.code, info.value.reason) == ("unavailable", "journal_failed")
    monkeypatch.undo()
    assert not core.healthy and hooks == [1]
    with pytest.raises(Refused) as info:  # every further submission is refused, even with the disk back
        core.begin(kit.header(5, round_id=2))
    assert info.value.reason == "journal_failed"
    core.close()
    core = ShufflerCore(kit.core_config(tmp_path / "j"))  # the unrecorded output is quarantined, not deleted
    try:
        assert core.healthy and list(core.journal.batches_dir.iterdir()) == []
        assert len(list(core.journal.quarantine_dir.iterdir())) == 1
    finally:
        core.close()


def test_sealed_output_mode_is_synced_before_the_rename(core: ShufflerCore, kit, monkeypatch) -> None:

    events: list[str] = []
    real = {n: getattr(os, n) for n in ("fchmod", "chmod", "fsync", "replace")}
    for name in real:
        monkeypatch.setattr(os, name, lambda *a, _n=name, **k: (events.append(_n), real[_n](*a, **k))[1])
    _run(core, kit, [kit.seal(i) for i in range(4)])
    assert "chmod" not in events
    i = events.index("replace")
    assert "fchmod" in events[:i] and events.index("fsync", events.index("fchmod")) < i


def test_close_waits_for_an_open_batch_and_refuses_new_ones(kit, tmp_path: Path) -> None:
    """Graceful stop: a batch still open when the core is closed is committed normally (the journal stays open
    until it finishes), and a batch begun after close started is refused UNAVAILABLE."""
    import threading
    import time

    jdir = tmp_path / "journal"
    core = ShufflerCore(kit.core_config(jdir))
    b = core.begin(kit.header(5))
    for i in range(5):
        b.add(kit.seal(i))
    result: list[bool] = []
    closer = threading.Thread(target=lambda: result.append(core.close(drain_timeout=30.0)))
    closer.start()
    deadline = time.monotonic() + 5
    while not core._closing and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(Refused) as exc:
        core.begin(kit.header(5, round_id=2))
    assert (exc.value.code, exc.value.reason) == ("unavailable", "shutting_down")
    closer.join(0.2)
    assert closer.is_alive()  # still waiting for the open batch
    sealed = b.finish()
    closer.join(5)
    assert not closer.is_alive() and result == [True]
    reopened = ShufflerCore(kit.core_config(jdir))
    try:
        assert reopened.lookup(sealed.batch_id).statement == sealed.statement
        assert len(list(reopened.read_batch(sealed.batch_id))) == 5
    finally:
        reopened.close()


def test_close_gives_up_on_a_batch_left_open_past_the_drain_timeout(kit, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    jdir = tmp_path / "journal"
    core = ShufflerCore(kit.core_config(jdir))
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="drain_timeout"):
            core.close(drain_timeout=bad)
    assert not core._closing  # a refused argument leaves the core open
    b = core.begin(kit.header(5))
    for i in range(5):
        b.add(kit.seal(i))
    with caplog.at_level(logging.WARNING, logger="shuffledp.shuffler.core"):
        assert core.close(drain_timeout=0.05) is False
    assert "1 batch(es) still open after 0.05 s" in caplog.text
    with pytest.raises(Refused) as exc:  # the core closed before it was sealed: nothing is committed
        b.finish()
    assert (exc.value.code, exc.value.reason) == ("unavailable", "shutting_down")
    assert core.healthy  # a refusal at shutdown is not a journal failure
    reopened = ShufflerCore(kit.core_config(jdir))
    try:
        assert reopened.stats()["batches_sealed"] == 0
        assert list(reopened.journal.staging_dir.iterdir()) == []
    finally:
        reopened.close()


def _hold_commit_in_fsync(monkeypatch):
    """Make a commit block in its first directory fsync: returns (entered, release) events."""
    import threading


    entered, release = threading.Event(), threading.Event()
    real_fsync_dir = sealmod.fsync_dir

    def slow_fsync_dir(path):
        entered.set()
        release.wait(10)
        return real_fsync_dir(path)

    monkeypatch.setattr(sealmod, "fsync_dir", slow_fsync_dir)
    return entered, release


def test_stats_and_begin_do_not_wait_for_a_commits_fsyncs(core: ShufflerCore, kit, monkeypatch) -> None:
    """A commit holds the commit lock through its output write and fsyncs; the counters and the start of
    another batch must not wait for them (they did: stats() and begin() took the lock the commit held)."""
    import threading

    entered, release = _hold_commit_in_fsync(monkeypatch)
    sealed: list[object] = []
    committing = threading.Thread(target=lambda: sealed.append(_run(core, kit, [kit.seal(i) for i in range(4)])))
    committing.start()
    try:
        assert entered.wait(10), "the commit never reached its fsync"
        answers: list[object] = []

        def probe() -> None:
            answers.append(core.stats())
            other = core.begin(kit.header(4, round_id=2))
            other.abort()
            answers.append(other)

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join(2.0)
        assert not prober.is_alive(), "stats()/begin() waited for the commit's fsyncs"
        assert answers[0]["batches_sealed"] == 0  # the batch is not sealed until its journal record is written
    finally:
        release.set()
        committing.join(10)
    assert len(sealed) == 1 and core.stats()["batches_sealed"] == 1


def test_close_waits_for_a_commit_in_its_fsyncs(kit, tmp_path: Path, monkeypatch) -> None:
    """close() past its drain timeout, while a commit is in its fsyncs: the journal is closed only after the
    commit (which holds the commit lock); the batch is sealed and survives a reopen. Closing under the state
    lock alone let the commit's journal append fail ("journal failed for good") and lose the batch."""
    import threading

    core = ShufflerCore(kit.core_config(tmp_path / "journal"))
    entered, release = _hold_commit_in_fsync(monkeypatch)
    b = core.begin(kit.header(4))
    for i in range(4):
        b.add(kit.seal(i))
    outcome: list[object] = []
    committing = threading.Thread(target=lambda: outcome.append(b.finish()))
    committing.start()
    assert entered.wait(10)
    closer = threading.Thread(target=lambda: core.close(drain_timeout=0.05))
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() did not wait for the commit"
    release.set()
    committing.join(10)
    closer.join(10)
    monkeypatch.undo()
    assert len(outcome) == 1 and outcome[0].n == 4  # type: ignore[attr-defined] - a SealedBatch
    reopened = ShufflerCore(kit.core_config(tmp_path / "journal"))
    try:
        assert reopened.stats()["batches_sealed"] == 1
    finally:
        reopened.close()


def test_failures_after_the_rename_leave_at_most_one_output_without_a_record(kit, tmp_path: Path, monkeypatch) -> None:
    # A batch open when the journal failed must not rename its output into batches/, and an error between the
    # rename and the append (here EIO from a directory fsync) must not leave its output there while the shuffler
    # keeps serving: two such outputs would make the next start refuse as "records were lost".
    import errno


    core = ShufflerCore(kit.core_config(tmp_path / "j"))
    real = sealmod.fsync_dir

    def flaky(path):
        if Path(path) == core.journal.staging_dir:
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(sealmod, "fsync_dir", flaky)
    for rnd in (1, 2):
        with pytest.raises(OSError):
            _run(core, kit, [kit.seal(i, round_id=rnd) for i in range(5)], round_id=rnd)
    monkeypatch.undo()
    assert list(core.journal.batches_dir.iterdir()) == []  # nothing committed, nothing left behind
    assert _run(core, kit, [kit.seal(i, round_id=3) for i in range(5)], round_id=3).n == 5
    a = core.begin(kit.header(5, round_id=4))
    b = core.begin(kit.header(5, round_id=5))  # open while the journal is still healthy
    for i in range(5):
        a.add(kit.seal(i, round_id=4))
        b.add(kit.seal(i, round_id=5))
    _fail_journal_writes(monkeypatch, core, partial=0, also_truncate=True)
    with pytest.raises(Refused):
        a.finish()  # JournalFailed: its output is kept (the one output without a record)
    monkeypatch.undo()
    with pytest.raises(Refused) as info:
        b.finish()  # refused before its output reaches batches/
    assert info.value.reason == "journal_failed"
    core.close()
    restarted = ShufflerCore(kit.core_config(tmp_path / "j"))  # starts: one output without a record
    try:
        assert len(restarted.journal.quarantined) == 1  # round 4's output, moved aside
        assert len(list(restarted.journal.batches_dir.iterdir())) == 1  # round 3's batch, served as before
    finally:
        restarted.close()


@pytest.mark.parametrize("path", ["memory", "disk"])
def test_stats_report_how_long_the_last_seal_took_and_its_output_write(
    kit, tmp_path: Path, monkeypatch, path: str
) -> None:
    """Stats say how long the last commit took and how much of it was the output's writes and fsync (0.0 before
    the first seal), on both staging paths: an output fsync made slower by 0.2 s shows in both figures, the write
    never exceeds the whole commit, and a commit that fails (its journal record rolled back) leaves them as
    they were."""
    import time

    from shuffledp.shuffler.journal import JournalWriteError

    core = ShufflerCore(kit.core_config(tmp_path / "j", **({"staging_memory_limit": 0} if path == "disk" else {})))
    try:
        assert (core.stats()["last_seal_seconds"], core.stats()["last_seal_write_seconds"]) == (0.0, 0.0)
        real_fchmod = sealmod.os.fchmod
        slowed: list[int] = []

        def slow_fchmod(fd: int, mode: int) -> None:  # seal.commit's fchmod comes right before the output's fsync
            slowed.append(mode)
            time.sleep(0.2)
            real_fchmod(fd, mode)

        monkeypatch.setattr(sealmod.os, "fchmod", slow_fchmod)
        sealed = _run(core, kit, [kit.seal(i) for i in range(4)])
        monkeypatch.setattr(sealmod.os, "fchmod", real_fchmod)
        stats = core.stats()
        assert slowed == [0o400] and 0.2 <= stats["last_seal_write_seconds"] <= stats["last_seal_seconds"], stats
        assert (sealed.n, core.stats()["batches_sealed"]) == (4, 1)
        assert (core._spare_buffer is not None) == (path == "memory")  # the memory path retains its buffer
        _run(core, kit, [kit.seal(i, round_id=2) for i in range(4)], round_id=2)
        again = core.stats()
        assert 0.0 < again["last_seal_write_seconds"] <= again["last_seal_seconds"], again
        assert again["last_seal_write_seconds"] != stats["last_seal_write_seconds"]
        _fail_journal_writes(monkeypatch, core, partial=45)
        with pytest.raises(JournalWriteError):
            _run(core, kit, [kit.seal(i, round_id=3) for i in range(4)], round_id=3)
        monkeypatch.undo()
        failed = core.stats()
        assert (failed["last_seal_seconds"], failed["last_seal_write_seconds"], failed["batches_sealed"]) == (
            again["last_seal_seconds"], again["last_seal_write_seconds"], 2)
    finally:
        core.close()
