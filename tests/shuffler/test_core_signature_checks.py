"""The core's signature checks: pipelined on the verify pool or inline, with the same outcome, bounds and aborts."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

import shuffledp.shuffler.builder as buildermod
from shuffledp.shuffler.core import Refused, ShufflerCore
from shuffledp.shuffler.envelope import open_outer

from ._core_batches import _run, _verify  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def _hostile_mix(kit, round_id: int) -> list[bytes]:
    """Honest reports interleaved with every drop the post-decryption checks can produce, in an order where the
    first of two competing reports must win (replay, duplicate signer)."""
    from ._fixtures_adv import craft_envelope  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)

    stranger = ed25519.Ed25519PrivateKey.generate().private_bytes_raw()
    forged = craft_envelope(
        kit.payload(6), server_pk=kit.server_pk, shuffler_pk=kit.shuffler_pk, signing_sk=stranger,
        key_epoch=kit.key_epoch, round_id=round_id, digest=kit.digest, claimed_signer_pk=kit.enrolment["client-6"],
    )
    honest = [kit.seal(i, round_id=round_id) for i in range(6)]
    return [
        honest[0], honest[1],
        honest[0],  # replay of an accepted envelope
        kit.seal(1, round_id=round_id),  # the same client twice
        forged,  # bad signature
        kit.seal(0, round_id=round_id, signing_key=stranger),  # unknown signer
        b"junk",  # malformed: dropped before decryption
        honest[2], honest[3],
        kit.seal(2, round_id=round_id, key_epoch=5),  # wrong epoch
        honest[4], honest[5],
    ]


@pytest.mark.parametrize("groups", [None, (3, 1, 5, 3)])
@pytest.mark.parametrize("verify_threads", [1, 2])
def test_pipelined_checks_accept_the_same_reports_at_the_same_slots_as_inline(kit, tmp_path: Path, monkeypatch,
                                                                               verify_threads: int,
                                                                               groups: tuple[int, ...] | None) -> None:
    """Acceptance, drop counts and slot assignment do not depend on where signatures are checked: the same
    envelopes and the same permutation give byte-identical output inline (one add() per envelope) and pipelined
    (with one or two workers, whose checks may finish out of order), whether the envelopes arrive one per
    message or several per message (add_many: one job per message)."""
    import itertools
    import threading
    import time
    from array import array

    import shuffledp.shuffler.envelope as envmod
    from shuffledp.shuffler.core import BatchBuilder

    perm = array("I", [7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 6, 4])
    monkeypatch.setattr(BatchBuilder, "draw_permutation", staticmethod(lambda n: array("I", perm[:n])))
    # every other check is slow, so that with two workers later checks finish before earlier ones
    real_verify = envmod.OuterOpener.verify
    lock = threading.Lock()
    started, finished = itertools.count(), []

    def uneven_verify(self, decrypted):
        with lock:
            index = next(started)
        try:
            if index % 2 == 0:
                time.sleep(0.02)
            return real_verify(self, decrypted)
        finally:
            with lock:
                finished.append(index)

    monkeypatch.setattr(envmod.OuterOpener, "verify", uneven_verify)
    envs = _hostile_mix(kit, round_id=3)
    assert len(envs) == len(perm)
    results = []
    for vt in (0, verify_threads):
        c = ShufflerCore(kit.core_config(tmp_path / f"j{vt}", verify_threads=vt))
        started, finished[:] = itertools.count(), []
        try:
            assert (c.verify_pool is None) is (vt == 0)
            if vt and groups:
                b = c.begin(kit.header(len(envs), round_id=3))
                at = 0
                for n in groups:
                    b.add_many(envs[at : at + n])
                    at += n
                sealed = b.finish()
            else:
                sealed = _run(c, kit, envs, round_id=3)
            results.append((list(c.read_batch(sealed.batch_id)), _verify(kit, sealed)))
        finally:
            c.close()
    assert len(finished) == 10  # every envelope but the junk and the wrong-epoch one was checked
    if verify_threads > 1 and not groups:
        assert finished != sorted(finished)  # checks did complete out of order
    (out0, att0), (out1, att1) = results
    # the same ciphertexts at the same positions: the same reports won and went to the same slots
    assert out0 == out1 and att0.output_digest == att1.output_digest
    assert att0.n_accepted == att1.n_accepted == 6
    expected_drops = {"replay": 1, "duplicate_signer": 1, "bad_signature": 1, "unknown_signer": 1, "malformed": 1,
                      "wrong_epoch": 1}
    nonzero = [{k: v for k, v in att.dropped.items() if v} for att in (att1, att0)]
    assert nonzero[0] == nonzero[1] == expected_drops
    # The first of the competing reports won, and the j-th accepted report went to slot perm[j]: accepted in
    # order honest[0..5] = envs[0, 1, 7, 8, 10, 11] to slots 7, 2, 11, 0, 5, 9; the squeezed output follows slot
    # order 0, 2, 5, 7, 9, 11, i.e. accepted #3, #1, #4, #0, #5, #2.
    inner = {i: bytes(open_outer(envs[i], shuffler_private_key=kit.shuffler_sk, key_epoch=kit.key_epoch, round_id=3,
                                 model_digest=kit.digest).inner) for i in (0, 1, 7, 8, 10, 11)}
    assert out1 == [inner[i] for i in (8, 1, 10, 0, 11, 7)]


def test_pipelined_checks_run_on_the_verify_pool_and_stay_bounded(core: ShufflerCore, kit, monkeypatch) -> None:
    import threading
    import time

    import shuffledp.shuffler.core as coremod
    import shuffledp.shuffler.envelope as envmod

    threads: set[str] = set()
    real_verify = envmod.OuterOpener.verify

    def slow_verify(self, decrypted):
        threads.add(threading.current_thread().name)
        time.sleep(0.002)  # checks pile up behind the submitting thread
        return real_verify(self, decrypted)

    monkeypatch.setattr(envmod.OuterOpener, "verify", slow_verify)
    envs = [kit.seal(i % kit.n_clients) for i in range(40)]  # 8 accepted, 32 duplicate signers
    b = core.begin(kit.header(len(envs)))
    in_flight = []
    for e in envs:
        b.add(e)
        in_flight.append(len(b._pending))
    assert max(in_flight) == coremod.PIPELINE_MAX_REPORTS  # reached, never exceeded
    sealed = b.finish()
    assert b._pending == type(b._pending)() and _verify(kit, sealed).n_accepted == kit.n_clients
    assert threads and all(name.startswith("shuffler-verify") for name in threads)
    # the byte bound: with at most 1 KiB in flight, a submit never has two reports pending
    monkeypatch.setattr(buildermod, "PIPELINE_MAX_BYTES", 1024)
    b = core.begin(kit.header(6, round_id=2))
    for i in range(6):
        b.add(kit.seal(i, round_id=2, size=2048))
        assert len(b._pending) <= 1
    assert _verify(kit, b.finish()).n_accepted == 6


def test_only_large_envelopes_are_pipelined(core: ShufflerCore, kit, monkeypatch) -> None:
    """With the production threshold, small envelopes are checked inline and large ones on the pool; a small
    envelope after large ones waits for their checks, so acceptance stays in arrival order."""

    monkeypatch.setattr(buildermod, "PIPELINE_MIN_JOB_BYTES", 256 << 10)
    submitted: list[int] = []
    real_submit = core.verify_pool.submit

    def submit(fn, *args):  # (verify_job, opener, job): the legacy path (no envelope_length announced)
        submitted.extend(len(d.outer_plaintext) for d in args[-1])
        return real_submit(fn, *args)

    monkeypatch.setattr(core.verify_pool, "submit", submit)
    assert _verify(kit, _run(core, kit, [kit.seal(i) for i in range(4)])).n_accepted == 4
    assert submitted == []
    big = 300 << 10
    envs = [kit.seal(0, round_id=2, size=big), kit.seal(1, round_id=2, size=big), kit.seal(1, round_id=2),
            kit.seal(2, round_id=2, size=big)]
    att = _verify(kit, _run(core, kit, envs, round_id=2))
    assert len(submitted) == 3 and all(n > big for n in submitted)
    # client 1's large report was accepted before its small one was looked at: the small one is the duplicate
    # (had it been accepted first, the large one would be the duplicate and the batch refused for mixed lengths)
    assert att.n_accepted == 3 and att.dropped["duplicate_signer"] == 1 and att.inner_length > big


def test_abort_with_checks_in_flight_releases_everything(kit, tmp_path: Path, monkeypatch) -> None:
    import threading

    import shuffledp.shuffler.envelope as envmod

    gate = threading.Event()
    real_verify = envmod.OuterOpener.verify
    monkeypatch.setattr(envmod.OuterOpener, "verify", lambda self, d: (gate.wait(5), real_verify(self, d))[1])
    core = ShufflerCore(kit.core_config(tmp_path / "j", verify_threads=1))  # one worker: one check in flight
    try:
        b = core.begin(kit.header(5))
        for i in range(4):
            b.add(kit.seal(i))
        assert len(b._pending) == 4 and b.n_accepted == 0
        futures = [f for f, *_ in b._pending]
        b.abort()
        gate.set()
        # the one check that was running (a single worker) finishes; the three queued behind it never start
        assert [f.cancelled() for f in futures] == [False, True, True, True]
        assert len(b._pending) == 0 and b.staging_buffer is None
        assert list(core.journal.staging_dir.iterdir()) == []
        with pytest.raises(RuntimeError, match="already finished"):
            b.add(kit.seal(4))
        # nothing of the aborted stream was recorded: the same round and reports seal afterwards
        assert _verify(kit, _run(core, kit, [kit.seal(i) for i in range(5)])).n_accepted == 5
    finally:
        core.close()


def test_an_unexpected_error_in_a_pipelined_check_aborts_the_batch(core: ShufflerCore, kit, monkeypatch) -> None:
    """A failure that is not a drop (a bug) propagates from add() or finish(); finish() then releases the batch
    itself (add() leaves that to its caller, as with inline checks: the service aborts the stream)."""
    import threading

    import shuffledp.shuffler.envelope as envmod

    gate = threading.Event()
    real_verify = envmod.OuterOpener.verify

    def broken(self, decrypted):
        gate.wait(5)
        raise RuntimeError("bug in verify")

    monkeypatch.setattr(envmod.OuterOpener, "verify", broken)
    b = core.begin(kit.header(3))
    for i in range(3):
        b.add(kit.seal(i))
    gate.set()
    with pytest.raises(RuntimeError, match="bug in verify"):
        b.finish()
    assert b._done and b.staging_buffer is None and list(core.journal.staging_dir.iterdir()) == []
    assert core.stats()["batches_sealed"] == 0
    monkeypatch.setattr(envmod.OuterOpener, "verify", real_verify)
    assert _verify(kit, _run(core, kit, [kit.seal(i) for i in range(3)])).n_accepted == 3


def test_verify_threads_is_validated(kit, tmp_path: Path) -> None:
    for bad in (-1, 65, True, 1.0, "1"):
        with pytest.raises(ValueError, match=r"verify_threads must be an int in \[0, 64\]"):
            kit.core_config(tmp_path / "x", verify_threads=bad)


def test_staging_starts_before_the_first_envelope_is_verified(core: ShufflerCore, kit, monkeypatch) -> None:
    """Staging (and a staging refusal) happens at the first envelope that passes the public length checks, before
    any signature check: it cannot tell the submitter whether that envelope verifies. Before, it happened at the
    first *accepted* report, so a refusal (or the zero-fill's delay) answered "this envelope is valid"."""
    import errno

    import shuffledp.shuffler.envelope as envmod

    checked: list[int] = []
    real_verify = envmod.OuterOpener.verify
    monkeypatch.setattr(envmod.OuterOpener, "verify", lambda self, d: (checked.append(1), real_verify(self, d))[1])
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOMEM, "no")))
    tampered = bytearray(kit.seal(0))
    tampered[-1] ^= 1  # fails the outer open: never accepted
    for first in (kit.seal(0), bytes(tampered)):
        b = core.begin(kit.header(kit.k))
        b.add(b"")  # a placeholder passes no length check: nothing is staged yet
        with pytest.raises(Refused) as info:
            b.add(first)
        assert (info.value.code, info.value.reason) == ("resource_exhausted", "staging_memory")
    assert checked == []  # refused before any signature check, valid or not
    assert core.stats()["batches_refused"] == 2 and list(core.journal.staging_dir.iterdir()) == []


def test_a_message_is_one_job_and_small_jobs_are_checked_inline(core: ShufflerCore, kit, monkeypatch) -> None:
    """With the production threshold, the envelopes of one message go to the pool as one job if their plaintext
    reaches PIPELINE_MIN_JOB_BYTES, and are checked inline otherwise; either way the outcome is in order."""

    monkeypatch.setattr(buildermod, "PIPELINE_MIN_JOB_BYTES", 256 << 10)
    jobs: list[int] = []
    real_submit = core.verify_pool.submit
    monkeypatch.setattr(core.verify_pool, "submit",
                        lambda fn, *args: (jobs.append(len(args[-1])), real_submit(fn, *args))[1])  # the job is last
    small = [kit.seal(i, size=1024) for i in range(4)]
    b = core.begin(kit.header(4))
    b.add_many(small)  # 4 KiB of plaintext: inline
    assert jobs == [] and b.n_accepted == 4
    assert _verify(kit, b.finish()).n_accepted == 4
    # 3 x 90 KiB in one message reach the threshold together, though none does alone; a replay inside the job
    # and a junk envelope (dropped before decryption, so not in the job) keep their places
    size = 90 << 10
    e = [kit.seal(i, round_id=2, size=size) for i in range(4)]
    b = core.begin(kit.header(7, round_id=2))
    b.add_many([e[0], b"junk", e[1], e[0]])
    # 180 KiB plus a small report of client 1: inline, after the pending job is concluded, so client 1's large
    # report was accepted first and the small one is the duplicate (the other way round, the batch would be
    # refused for mixed lengths)
    b.add_many([e[2], e[3], kit.seal(1, round_id=2)])
    assert jobs == [3]
    att = _verify(kit, b.finish())
    assert att.n_accepted == 4 and att.inner_length > size
    assert {k: v for k, v in att.dropped.items() if v} == {"replay": 1, "malformed": 1, "duplicate_signer": 1}


def test_a_message_beyond_the_expected_count_is_refused_after_its_first_envelopes(core: ShufflerCore, kit,
                                                                                  monkeypatch) -> None:
    """add_many with more envelopes than the header left room for: the ones that fit are processed first (a
    staging refusal among them wins, as with one add() per envelope), then count_mismatch aborts the batch."""
    import errno


    envs = [kit.seal(i) for i in range(kit.k + 1)]
    b = core.begin(kit.header(kit.k))
    with pytest.raises(Refused) as info:
        b.add_many(envs)
    assert (info.value.code, info.value.reason) == ("invalid_argument", "count_mismatch")
    assert b.received == kit.k + 1 and b.n_accepted == kit.k  # the first k were checked and staged
    assert b.staging_buffer is None and list(core.journal.staging_dir.iterdir()) == []
    with monkeypatch.context() as m:
        m.setattr(mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOMEM, "no")))
        b = core.begin(kit.header(kit.k))
        with pytest.raises(Refused) as info:
            b.add_many(envs)
        assert (info.value.code, info.value.reason) == ("resource_exhausted", "staging_memory")
    assert core.stats()["batches_refused"] == 2
    # nothing was recorded: the same round and reports seal afterwards
    assert _verify(kit, _run(core, kit, envs[: kit.k])).n_accepted == kit.k
