"""The shuffler's duties, tested on the transport-free core (one test per duty)."""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

import shuffledp.shuffler.builder as buildermod
import shuffledp.shuffler.seal as sealmod
import shuffledp.shuffler.staging as stagingmod
from shuffledp.shuffler.attestation import Attestation, OutputDigest
from shuffledp.shuffler.core import Refused, ShufflerCore
from shuffledp.shuffler.envelope import model_digest, open_inner, open_outer


@pytest.fixture
def disk_core(kit, tmp_path: Path):
    """A core whose every batch takes the disk staging path (staging_memory_limit = 0)."""
    c = ShufflerCore(kit.core_config(tmp_path / "disk-journal", staging_memory_limit=0))
    yield c
    c.close()


def _run(core: ShufflerCore, kit, envelopes: list[bytes], *, round_id: int = 1, **hdr: object):
    b = core.begin(kit.header(len(envelopes), round_id=round_id, **hdr))
    for e in envelopes:
        b.add(e)
    return b.finish()


def _verify(kit, sealed) -> Attestation:
    return Attestation.verify(sealed.statement, sealed.signature, kit.verify_key)


def _payloads(core: ShufflerCore, kit, sealed, round_id: int = 1) -> list[bytes]:
    return [
        open_inner(x, server_private_key=kit.server_sk, key_epoch=kit.key_epoch, round_id=round_id)
        for x in core.read_batch(sealed.batch_id)
    ]


def test_honest_batch_is_released_whole_and_attested(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(5)]
    sealed = _run(core, kit, envs)
    att = _verify(kit, sealed)
    assert (att.n_received, att.n_accepted, att.round_id, att.key_epoch) == (5, 5, 1, 0)
    assert att.model_digest == kit.digest and att.k == kit.k and sum(att.dropped.values()) == 0
    out = list(core.read_batch(sealed.batch_id))
    d = OutputDigest()
    for x in out:
        d.update(x)
    assert d.digest() == att.output_digest
    assert sorted(_payloads(core, kit, sealed)) == sorted(kit.payload(i) for i in range(5))
    # the output holds inner ciphertexts only: none of the submitted envelope bytes appear in it
    blob = b"".join(out)
    assert all(e[5:40] not in blob for e in envs)
    assert list(core.journal.staging_dir.iterdir()) == []


def test_failed_verification_is_dropped_and_counted_by_reason(core: ShufflerCore, kit) -> None:
    honest = [kit.seal(i) for i in range(4)]
    stranger = ed25519.Ed25519PrivateKey.generate().private_bytes_raw()
    flipped = bytearray(kit.seal(4))
    flipped[60] ^= 1
    bad = [
        b"",  # empty (a placeholder)
        honest[0][:100],  # malformed (truncated below the overhead)
        honest[0][:-3],  # undecryptable (truncated)
        bytes(flipped),  # undecryptable (bit flip)
        kit.seal(5, round_id=2),  # undecryptable (wrong round)
        kit.seal(5, digest=model_digest([b"other model"])),  # undecryptable (wrong model)
        kit.seal(5, key_epoch=9),  # wrong_epoch
        b"\x07" + honest[1][1:],  # wrong_version
        kit.seal(0, signing_key=stranger),  # unknown_signer
        b"\x00" * ((1 << 20) + 1),  # oversized
    ]
    sealed = _run(core, kit, honest[:2] + bad + honest[2:])
    att = _verify(kit, sealed)
    assert att.n_accepted == 4 and att.n_received == 4 + len(bad)
    assert att.dropped == {
        "empty": 1,
        "malformed": 1,
        "undecryptable": 4,
        "wrong_epoch": 1,
        "wrong_version": 1,
        "unknown_signer": 1,
        "oversized": 1,
        "bad_signature": 0,
        "duplicate_signer": 0,
        "replay": 0,
        "wrong_length": 0,
    }
    assert sorted(_payloads(core, kit, sealed)) == sorted(kit.payload(i) for i in range(4))
    stats = core.stats()
    assert stats["dropped"]["undecryptable"] == 4 and stats["reports_accepted"] == 4


def test_at_most_one_report_per_client_per_round(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(4)] + [kit.seal(0, payload=kit.payload(99))]
    att = _verify(kit, _run(core, kit, envs))
    assert att.n_accepted == 4 and att.dropped["duplicate_signer"] == 1


def _seal_with_report_id(kit, monkeypatch, i: int, report_id: bytes, **kw: object) -> bytes:
    import shuffledp.shuffler.envelope as envmod

    with monkeypatch.context() as m:
        m.setattr(envmod.secrets, "token_bytes", lambda n: report_id if n == 16 else bytes(n))
        return kit.seal(i, **kw)


def test_replay_within_a_batch_is_dropped(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(4)]
    att = _verify(kit, _run(core, kit, envs + [envs[1], envs[1]]))
    assert att.n_accepted == 4 and att.dropped["replay"] == 2 and att.dropped["duplicate_signer"] == 0


def test_replay_cache_on_report_id_is_persisted_across_restarts(kit, tmp_path: Path, monkeypatch) -> None:
    jdir = tmp_path / "journal"
    rid = b"R" * 16
    core = ShufflerCore(kit.core_config(jdir))
    envs = [_seal_with_report_id(kit, monkeypatch, 0, rid, round_id=1)] + [kit.seal(i) for i in range(1, 4)]
    assert _verify(kit, _run(core, kit, envs)).n_accepted == 4
    core.close()
    core = ShufflerCore(kit.core_config(jdir))  # cache rebuilt from the journal
    again = [_seal_with_report_id(kit, monkeypatch, 0, rid, round_id=2)]
    again += [kit.seal(i, round_id=2) for i in range(1, 4)]
    att = _verify(kit, _run(core, kit, again, round_id=2))
    assert att.dropped["replay"] == 1 and att.n_accepted == 3
    # same report id twice inside one batch (different clients) is also a replay
    dup = [_seal_with_report_id(kit, monkeypatch, i, b"S" * 16, round_id=3) for i in range(2)]
    att = _verify(kit, _run(core, kit, dup + [kit.seal(i, round_id=3) for i in range(2, 5)], round_id=3))
    assert att.dropped["replay"] == 1 and att.n_accepted == 4
    core.close()


def test_replay_cache_is_per_key_epoch(kit, tmp_path: Path, monkeypatch) -> None:
    """A report id seen in epoch 0 does not poison epoch 1 (caches are flushed by rotation)."""
    rid = b"Q" * 16
    core = ShufflerCore(kit.core_config(tmp_path / "j"))
    envs = [_seal_with_report_id(kit, monkeypatch, 0, rid)] + [kit.seal(i) for i in range(1, 4)]
    _run(core, kit, envs)
    core.close()
    core = ShufflerCore(kit.core_config(tmp_path / "j", key_epoch=1))
    envs = [_seal_with_report_id(kit, monkeypatch, 0, rid, key_epoch=1)] + [
        kit.seal(i, key_epoch=1) for i in range(1, 4)
    ]
    att = _verify(kit, _run(core, kit, envs, key_epoch=1))
    assert att.n_accepted == 4 and att.dropped["replay"] == 0 and att.key_epoch == 1
    core.close()


def test_binding_used_once_but_identical_resubmission_is_idempotent(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(4)]
    first = _run(core, kit, envs)
    again = _run(core, kit, list(reversed(envs)))  # same multiset, other order: same batch
    assert (again.batch_id, again.statement, again.signature) == (first.batch_id, first.statement, first.signature)
    with pytest.raises(Refused) as info:
        _run(core, kit, envs[:3])
    assert (info.value.code, info.value.reason) == ("already_exists", "binding_used")
    with pytest.raises(Refused) as info:
        _run(core, kit, envs + [kit.seal(4)])
    assert info.value.code == "already_exists"
    # another model digest under the same (epoch, round) is still the same round: refused
    with pytest.raises(Refused):
        _run(core, kit, [kit.seal(i, digest=model_digest([b"x"])) for i in range(4)], model_digest=model_digest([b"x"]))
    assert core.stats()["batches_sealed"] == 1


def test_below_threshold_releases_nothing_and_consumes_nothing(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(kit.k)]
    with pytest.raises(Refused) as info:  # k envelopes but one is garbage: k-1 distinct signers
        _run(core, kit, envs[:-1] + [b"garbage"])
    assert (info.value.code, info.value.reason) == ("failed_precondition", "below_threshold")
    with pytest.raises(Refused) as info:  # header announcing fewer than k is refused up front
        core.begin(kit.header(kit.k - 1))
    assert info.value.reason == "below_threshold"
    assert list(core.journal.batches_dir.iterdir()) == []
    # the refusal did not burn the binding or the replay cache: the full batch is accepted afterwards
    att = _verify(kit, _run(core, kit, envs))
    assert att.n_accepted == kit.k
    assert core.stats()["batches_refused"] == 2


def test_mixed_lengths_reject_the_batch(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i, size=64) for i in range(4)] + [kit.seal(4, size=65)]
    with pytest.raises(Refused) as info:
        _run(core, kit, envs)
    assert (info.value.code, info.value.reason) == ("invalid_argument", "mixed_lengths")
    assert list(core.journal.batches_dir.iterdir()) == [] and list(core.journal.staging_dir.iterdir()) == []


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_without_an_announced_length_an_odd_dropped_envelope_is_only_a_drop_wherever_it_stands(
    core: ShufflerCore, kit, where: str
) -> None:
    # Without envelope_length, the first envelope that passes the public checks fixes the slots' length even if it
    # is then dropped. A junk envelope of another length sent first must not refuse the honest batch: the staging
    # is made anew at the first accepted report's length, and every accepted report is in its slot.
    junk = kit.seal(0, size=64)[:-1] + bytes(40)  # the right prefix, another length; it does not open
    honest = [kit.seal(i, size=64) for i in range(1, 5)]
    envs = {"first": [junk] + honest, "middle": honest[:2] + [junk] + honest[2:], "last": honest + [junk]}[where]
    sealed = _run(core, kit, envs)
    att = _verify(kit, sealed)
    assert att.n_accepted == 4 and sum(att.dropped.values()) == 1
    assert sorted(_payloads(core, kit, sealed)) == sorted(kit.payload(i, 64) for i in range(1, 5))
    assert list(core.journal.staging_dir.iterdir()) == []


def test_without_an_announced_length_accepted_reports_of_two_lengths_still_refuse(core: ShufflerCore, kit) -> None:
    junk = kit.seal(0, size=64)[:-1] + bytes(40)
    envs = [junk] + [kit.seal(i, size=64) for i in range(1, 4)] + [kit.seal(4, size=65)]
    with pytest.raises(Refused) as info:
        _run(core, kit, envs)
    assert (info.value.code, info.value.reason) == ("invalid_argument", "mixed_lengths")
    assert list(core.journal.batches_dir.iterdir()) == [] and list(core.journal.staging_dir.iterdir()) == []


def _rewrap(kit, envelope: bytes, *, signer: int, tamper_tail: bool = False) -> bytes:
    """``envelope``'s inner ciphertext (its last byte flipped with ``tamper_tail``) in a new outer layer signed by
    enrolled client ``signer``."""
    from ._fixtures_adv import craft_envelope  # noqa: TID252 - a helper module next to the tests (not a package)

    opened = open_outer(envelope, shuffler_private_key=kit.shuffler_sk, key_epoch=kit.key_epoch, round_id=1,
                        model_digest=kit.digest)
    inner = bytes(opened.inner)
    if tamper_tail:
        inner = inner[:-1] + bytes([inner[-1] ^ 1])
    return craft_envelope(b"", server_pk=kit.server_pk, shuffler_pk=kit.shuffler_pk, signing_sk=kit.client_sks[signer],
                          key_epoch=kit.key_epoch, round_id=1, digest=kit.digest, inner=inner)


def test_two_signers_wrapping_one_inner_ciphertext_count_once(core: ShufflerCore, kit) -> None:
    """Two enrolled signers (colluders, or one device enrolled twice) wrap the same inner ciphertext: the copy is
    a replay drop, the first is kept, and the attested count is the number of distinct reports."""
    envs = [kit.seal(i, size=64) for i in range(6)]
    copy = _rewrap(kit, envs[0], signer=6)  # another enrolled signer, the same inner ciphertext
    sealed = _run(core, kit, envs + [copy])
    att = _verify(kit, sealed)
    assert att.n_accepted == 6 and att.dropped["replay"] == 1
    payloads = _payloads(core, kit, sealed)
    assert len(payloads) == 6 and len(set(payloads)) == 6


def test_an_inner_ciphertext_with_a_reused_encapsulated_key_is_a_replay(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i, size=64) for i in range(6)]
    copy = _rewrap(kit, envs[0], signer=6, tamper_tail=True)  # same inner HPKE enc, other ciphertext bytes
    att = _verify(kit, _run(core, kit, envs + [copy]))
    assert att.n_accepted == 6 and att.dropped["replay"] == 1


@pytest.mark.parametrize(
    "over,code,reason",
    [
        (dict(protocol_version=3), "invalid_argument", "protocol_version"),
        (dict(protocol_version=0), "invalid_argument", "protocol_version"),
        (dict(key_epoch=5), "failed_precondition", "key_epoch"),
        (dict(model_digest=b"short"), "invalid_argument", "model_digest"),
        (dict(expected_count=0), "invalid_argument", "empty_batch"),
        (dict(expected_count=10**9), "resource_exhausted", "batch_too_large"),
    ],
)
def test_header_refusals(core: ShufflerCore, kit, over: dict, code: str, reason: str) -> None:
    hdr = kit.header(4)
    fields = {**hdr.__dict__, **over}
    with pytest.raises(Refused) as info:
        core.begin(type(hdr)(**fields))
    assert (info.value.code, info.value.reason) == (code, reason)


def test_count_mismatch(core: ShufflerCore, kit) -> None:
    b = core.begin(kit.header(5))
    for i in range(4):
        b.add(kit.seal(i))
    with pytest.raises(Refused) as info:
        b.finish()
    assert info.value.reason == "count_mismatch"
    b = core.begin(kit.header(3))
    for i in range(3):
        b.add(kit.seal(i))
    with pytest.raises(Refused) as info:
        b.add(kit.seal(3))
    assert info.value.reason == "count_mismatch"
    b.abort()
    assert list(core.journal.staging_dir.iterdir()) == []


def test_output_order_is_not_arrival_order(core: ShufflerCore, kit) -> None:
    """Each batch is permuted: over 12 batches of 8 the output is never the arrival order every time."""
    identity = 0
    for r in range(12):
        envs = [kit.seal(i, round_id=r + 10) for i in range(8)]
        sealed = _run(core, kit, envs, round_id=r + 10)
        payloads = _payloads(core, kit, sealed, round_id=r + 10)
        identity += payloads == [kit.payload(i) for i in range(8)]
    assert identity <= 1  # P(identity) = 1/8! per batch


def test_fetch_is_idempotent_and_unknown_batch(core: ShufflerCore, kit) -> None:
    sealed = _run(core, kit, [kit.seal(i) for i in range(4)])
    assert list(core.read_batch(sealed.batch_id)) == list(core.read_batch(sealed.batch_id))
    with pytest.raises(Refused) as info:
        core.read_batch(b"\x00" * 16)
    assert info.value.code == "not_found"
    with pytest.raises(Refused) as info:
        core.read_batch(b"\x00" * 3)
    assert info.value.code == "invalid_argument"


def test_sealed_batch_survives_restart_byte_identical(kit, tmp_path: Path) -> None:
    jdir = tmp_path / "journal"
    core = ShufflerCore(kit.core_config(jdir))
    sealed = _run(core, kit, [kit.seal(i) for i in range(5)])
    before = list(core.read_batch(sealed.batch_id))
    core.close()
    core = ShufflerCore(kit.core_config(jdir))
    assert list(core.read_batch(sealed.batch_id)) == before
    assert core.lookup(sealed.batch_id).statement == sealed.statement
    core.close()


def test_logs_never_name_clients_or_reports(core: ShufflerCore, kit, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    envs = [kit.seal(i) for i in range(4)] + [kit.seal(0, payload=kit.payload(9)), b"junk"]
    sealed = _run(core, kit, envs)
    with pytest.raises(Refused):
        _run(core, kit, envs[:2], round_id=77)
    text = caplog.text
    assert "batch sealed" in text and "batch refused" in text
    assert "client-" not in text
    for cid, pk in kit.enrolment.items():
        assert pk.hex() not in text
    opened_ids = core._seen_rid[kit.key_epoch]
    assert all(r.hex() not in text for r in opened_ids)
    assert all(x.hex()[:16] not in text for x in core.read_batch(sealed.batch_id))


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


def test_core_config_validation(kit, tmp_path: Path) -> None:
    from shuffledp.shuffler.core import CoreConfig

    with pytest.raises(ValueError, match="exceeds the 8 enrolled clients"):
        kit.core_config(tmp_path / "j", k=9)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        kit.core_config(tmp_path / "j", k=0)
    with pytest.raises(ValueError, match="enrolment is empty"):
        kit.core_config(tmp_path / "j", enrolment={})
    with pytest.raises(ValueError, match="max_envelope_bytes"):
        kit.core_config(tmp_path / "j", max_envelope_bytes=10)
    # every integer field refuses a bool (True is an int to Python) and says what is allowed
    for field, allowed in (("key_epoch", r"in \[0, 4294967295\]"), ("k", ">= 1"),
                           ("max_envelope_bytes", ">= 214"), ("max_batch_reports", r"in \[1, 1000000\]"),
                           ("staging_memory_limit", r"in \[0, 1099511627776\]"), ("verify_threads", r"in \[0, 64\]")):
        with pytest.raises(ValueError, match=rf"{field} must be an int {allowed}, got True"):
            kit.core_config(tmp_path / "j", **{field: True})
    with pytest.raises(ValueError, match=r"key_epoch must be an int in \[0, 4294967295\], got 4294967296"):
        kit.core_config(tmp_path / "j", key_epoch=2**32)
    assert isinstance(kit.core_config(tmp_path / "j"), CoreConfig)


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


def test_wrong_length_envelope_is_a_counted_drop_when_the_length_is_announced(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i, size=64) for i in range(4)]
    odd = kit.seal(4, size=65)
    sealed = _run(core, kit, envs[:2] + [odd] + envs[2:], envelope_length=len(envs[0]))
    att = _verify(kit, sealed)
    assert att.n_accepted == 4 and att.dropped["wrong_length"] == 1 and att.envelope_length == len(envs[0])
    assert sorted(_payloads(core, kit, sealed)) == sorted(kit.payload(i, 64) for i in range(4))
    assert core.stats()["dropped"]["wrong_length"] == 1
    with pytest.raises(Refused) as info:
        core.begin(kit.header(4, round_id=2, envelope_length=10))
    assert (info.value.code, info.value.reason) == ("invalid_argument", "envelope_length")


def test_refusals_leak_no_counts_and_refused_drops_stay_out_of_stats(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(kit.k)]
    with pytest.raises(Refused) as info:  # k-1 distinct signers after 3 drops
        _run(core, kit, envs[:-1] + [b"garbage", b"", b"x"])
    assert info.value.reason == "below_threshold"
    assert str(kit.k - 1) not in str(info.value).replace(f"k = {kit.k}", "")
    with pytest.raises(Refused) as info:
        _run(core, kit, [kit.seal(i, size=64) for i in range(4)] + [kit.seal(4, size=65)])
    assert info.value.reason == "mixed_lengths" and not any(ch.isdigit() for ch in str(info.value))
    stats = core.stats()
    assert stats["batches_refused"] == 2 and sum(stats["dropped"].values()) == 0


def test_too_many_envelopes_is_counted_as_a_refusal(core: ShufflerCore, kit) -> None:
    b = core.begin(kit.header(3))
    for i in range(3):
        b.add(kit.seal(i))
    with pytest.raises(Refused) as info:
        b.add(kit.seal(3))
    assert info.value.reason == "count_mismatch" and core.stats()["batches_refused"] == 1
    assert list(core.journal.staging_dir.iterdir()) == []


def test_permutation_is_compact_lazy_and_capped(core: ShufflerCore, kit, tmp_path: Path) -> None:
    from array import array

    from shuffledp.shuffler.core import MAX_BATCH_REPORTS_CAP, BatchBuilder

    b = core.begin(kit.header(5))
    assert b._perm is None  # nothing allocated at header time
    b.add(kit.seal(0))
    b.settle()
    assert isinstance(b._perm, array) and b._perm.typecode == "I" and sorted(b._perm) == list(range(5))
    b.abort()
    perm = BatchBuilder.draw_permutation(1000)
    assert sorted(perm) == list(range(1000)) and list(perm) != list(range(1000))
    with pytest.raises(ValueError, match="max_batch_reports must be an int in"):
        kit.core_config(tmp_path / "x", max_batch_reports=MAX_BATCH_REPORTS_CAP + 1)


def test_sealed_output_mode_is_synced_before_the_rename(core: ShufflerCore, kit, monkeypatch) -> None:

    events: list[str] = []
    real = {n: getattr(os, n) for n in ("fchmod", "chmod", "fsync", "replace")}
    for name in real:
        monkeypatch.setattr(os, name, lambda *a, _n=name, **k: (events.append(_n), real[_n](*a, **k))[1])
    _run(core, kit, [kit.seal(i) for i in range(4)])
    assert "chmod" not in events
    i = events.index("replace")
    assert "fchmod" in events[:i] and events.index("fsync", events.index("fchmod")) < i


# ------------------------------------------------------------------------------------- memory staging path
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
    # the slots from SLOT_BASE on, rounded up for O_DIRECT
    base = stagingmod.SLOT_BASE
    assert base + len(mixed) * L <= len(b.staging_buffer) < base + len(mixed) * L + 4096
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
    d = OutputDigest()
    for x in out:
        d.update(x)
    assert d.digest() == att.output_digest
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
    d = OutputDigest()
    for x in core.read_batch(sealed.batch_id):
        d.update(x)
    assert d.digest() == att.output_digest and sealed.output.stat().st_size == 5 * att.inner_length
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


@pytest.mark.parametrize("inner_length", [1, 100, 4096, 5000, 8192, 20000])
def test_output_is_read_back_exactly_across_direct_read_chunks(tmp_path: Path, monkeypatch, inner_length: int) -> None:
    """Fetch reads the output with O_DIRECT in page-aligned chunks (8 KiB here): items straddling a chunk
    boundary, items longer than a chunk, and a file whose size is not a multiple of 4 KiB come back exactly;
    a truncated file is an error; where O_DIRECT is refused the page cache is used, with the same bytes."""
    import errno
    import os
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
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
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


# ------------------------------------------------------------------------------- pipelined signature checks
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
