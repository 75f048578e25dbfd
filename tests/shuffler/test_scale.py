"""Large batches: the compact per-report state (shuffledp.shuffler.tags), the permutation drawn from os.urandom,
the compact commit record, and a submitter that streams from an iterable.

The memory test runs batches of two sizes through the core and bounds the Python-heap growth per report; with one
Python ``set`` entry per report and tag (the layout before the compact arrays) it is about 700 bytes per report.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from shuffledp.shuffler import seal as sealmod
from shuffledp.shuffler.batch import Header, envelope_fingerprint, request_digest
from shuffledp.shuffler.builder import BatchBuilder
from shuffledp.shuffler.core import ShufflerCore
from shuffledp.shuffler.envelope import open_inner, seal
from shuffledp.shuffler.journal import Journal
from shuffledp.shuffler.tags import TagSet, sorted_packed


# ------------------------------------------------------------------------------------------------------ TagSet
def test_tagset_is_an_exact_set_in_insertion_order() -> None:
    keys = [os.urandom(32) for _ in range(3000)]
    # near misses: one byte apart, common prefixes, trailing zeros (a set keyed by a prefix would merge these)
    keys += [bytes(31) + bytes([i]) for i in range(200)] + [b"\x01" * 31 + bytes([i]) for i in range(200)]
    s = TagSet(32)  # grows from the smallest index
    assert all(s.add(k) for k in keys)
    assert len(s) == len(keys) and not any(s.add(k) for k in keys[::7])
    assert all(s.index(k) == i for i, k in enumerate(keys))
    assert all(k in s for k in keys)
    assert os.urandom(32) not in s and bytes(31) + b"\xf0" not in s and bytes(30) + b"\x05\x00" not in s
    assert s.index(b"short") == -1 and list(s) == keys and s.packed() == b"".join(keys)
    with pytest.raises(ValueError, match="32 bytes"):
        s.add(b"x" * 31)
    assert s.nbytes <= len(keys) * (32 + 4 * 4)  # the members, and an index of 4-byte entries at least a quarter full


def test_tagset_update_packed_and_sorted_order_match_python() -> None:
    keys = list({os.urandom(16) for _ in range(500)} | {bytes(15) + bytes([i]) for i in range(20)})
    s = TagSet(16, capacity=len(keys))
    s.update_packed(b"".join(keys))
    assert len(s) == len(keys) and s.packed_sorted() == b"".join(sorted(keys))
    assert sorted_packed(b"".join(keys), 16) == b"".join(sorted(keys)) and sorted_packed(b"", 16) == b""
    with pytest.raises(ValueError):
        sorted_packed(b"x" * 17, 16)


def test_tagset_positions_do_not_follow_python_hash_alone() -> None:
    """Two sets hold the same members at different index positions (a random multiplier per set), so a fixed
    ``hash`` (PYTHONHASHSEED) does not let a submitter aim tags at one probe chain."""
    keys = [os.urandom(32) for _ in range(64)]
    a, b = TagSet(32, 64), TagSet(32, 64)
    for k in keys:
        a.add(k)
        b.add(k)
    assert list(a._table[0]) != list(b._table[0])


# ----------------------------------------------------------------------------------------------- permutation
def test_permutation_comes_from_urandom_and_ties_are_redrawn(monkeypatch: pytest.MonkeyPatch) -> None:
    import shuffledp.shuffler.builder as buildermod

    draws: list[int] = []
    keys = [bytes(8) * 5, struct.pack("<5Q", 50, 10, 40, 20, 30)]  # first draw: all keys tie; second: distinct

    def fake_urandom(n: int) -> bytes:
        draws.append(n)
        return keys[len(draws) - 1]

    monkeypatch.setattr(buildermod.os, "urandom", fake_urandom)
    perm = BatchBuilder.draw_permutation(5)
    assert draws == [40, 40]  # 8 bytes per slot, drawn again after the tie
    assert list(perm) == [1, 3, 4, 2, 0] and perm.typecode == "I"  # the order of the keys


def test_permutation_is_a_permutation_of_every_size() -> None:
    for n in (0, 1, 2, 3, 1000):
        perm = BatchBuilder.draw_permutation(n)
        assert sorted(perm) == list(range(n))
    assert list(BatchBuilder.draw_permutation(1000)) != list(BatchBuilder.draw_permutation(1000))


# ------------------------------------------------------------------------------------------- request digest
def _legacy_request_digest(header: Header, fingerprints: list[bytes]) -> bytes:
    """The request digest as written before the compact state: sorted Python list of fingerprints."""
    h = hashlib.sha256(b"shuffledp/request/v1")
    h.update(struct.pack(">BIQI", header.protocol_version, header.key_epoch, header.round_id, header.expected_count))
    h.update(header.model_digest)
    if header.envelope_length:
        h.update(struct.pack(">Q", header.envelope_length))
    for fp in sorted(fingerprints):
        h.update(fp)
    return h.digest()


def test_request_digest_is_unchanged_by_the_packed_fingerprints() -> None:
    """Journals written before keep matching identical resubmissions: the digest is the same function."""
    envs = [os.urandom(300) for _ in range(50)] + [b"", b"x" * 40]
    fps = [envelope_fingerprint(e) for e in envs]
    for length in (0, 300):
        h = Header(protocol_version=2, key_epoch=3, round_id=9, model_digest=os.urandom(32),
                   expected_count=len(envs), envelope_length=length)
        assert request_digest(h, b"".join(fps)) == _legacy_request_digest(h, fps)
        assert request_digest(h, b"".join(reversed(fps))) == _legacy_request_digest(h, fps)


# -------------------------------------------------------------------------------------------- many reports
@pytest.fixture(scope="module")
def crowd(tmp_path_factory: pytest.TempPathFactory, kit) -> dict[str, object]:
    """4,000 enrolled clients (raw signing keys) and their enrolment."""
    sks = [ed25519.Ed25519PrivateKey.generate() for _ in range(4000)]
    return {
        "sks": [k.private_bytes_raw() for k in sks],
        "enrolment": {f"client-{i}": k.public_key().public_bytes_raw() for i, k in enumerate(sks)},
    }


def _seal_many(kit, crowd, n: int, round_id: int, size: int = 42) -> list[bytes]:
    sks = crowd["sks"]
    return [seal(i.to_bytes(4, "big") + bytes(size - 4), server_public_key=kit.server_pk,
                 shuffler_public_key=kit.shuffler_pk, signing_key=sks[i], key_epoch=kit.key_epoch,
                 round_id=round_id, model_digest=kit.digest) for i in range(n)]


def _grown(core: ShufflerCore, kit, envs: list[bytes], round_id: int) -> int:
    """Python-heap bytes a builder holds after taking ``envs`` (before its seal)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        b = core.begin(kit.header(len(envs), round_id=round_id, envelope_length=len(envs[0])))
        for i in range(0, len(envs), 500):
            b.add_many(envs[i : i + 500])
        b.settle()
        assert b.n_accepted == len(envs)
        grown = tracemalloc.get_traced_memory()[0] - base
        b.abort()
        return grown
    finally:
        tracemalloc.stop()


def test_memory_per_report_is_a_few_fixed_width_arrays(kit, crowd, tmp_path: Path) -> None:
    """The per-report state of a batch grows by fixed-width array entries only (about 200 bytes per report,
    against about 700 with a Python set entry per tag): measured as the growth between 1,000 and 4,000 reports,
    so fixed costs cancel."""
    core = ShufflerCore(kit.core_config(tmp_path / "j", enrolment=crowd["enrolment"], k=3,
                                        max_batch_reports=10_000))
    try:
        small = _grown(core, kit, _seal_many(kit, crowd, 1000, 1), 1)
        large = _grown(core, kit, _seal_many(kit, crowd, 4000, 2), 2)
    finally:
        core.close()
    per_report = (large - small) / 3000
    assert 0 < per_report < 300, per_report


def _payload_index(kit, inner: bytes, round_id: int) -> int:
    return int.from_bytes(open_inner(bytes(inner), server_private_key=kit.server_sk, key_epoch=kit.key_epoch,
                                     round_id=round_id)[:4], "big")


@pytest.mark.parametrize("limit", [0, 1 << 30], ids=["disk", "memory"])
def test_a_staged_batch_with_drops_returns_exactly_the_accepted_multiset(kit, crowd, tmp_path: Path,
                                                                         limit: int) -> None:
    """Both staging paths, with holes: every accepted report comes out once, no dropped one, no other bytes."""
    core = ShufflerCore(kit.core_config(tmp_path / "j", enrolment=crowd["enrolment"], k=3, max_batch_reports=10_000,
                                        staging_memory_limit=limit))
    try:
        envs = _seal_many(kit, crowd, 600, 5)
        bad = [e[:-1] + bytes([e[-1] ^ 1]) for e in envs[::10]]  # undecryptable
        dup = envs[1::50]  # replays of accepted envelopes
        submitted = envs[:300] + bad + envs[300:] + dup
        b = core.begin(kit.header(len(submitted), round_id=5, envelope_length=len(envs[0])))
        b.add_many(submitted)
        sb = b.finish()
        got = [_payload_index(kit, x, 5) for x in core.read_batch(sb.batch_id)]
        assert Counter(got) == Counter(range(600)) and sb.n == 600
        assert sorted(got) != got  # shuffled
        assert Counter(b.drops) == Counter({"undecryptable": len(bad), "replay": len(dup)})
    finally:
        core.close()


# ------------------------------------------------------------------------------------------- commit record
def test_commit_record_is_compact_and_recovery_is_exactly_once(kit, crowd, tmp_path: Path) -> None:
    """The record holds each kind of replay tag as one sorted base64 string; after a restart without close (a
    crash), the replay cache, the binding and an identical resubmission's attestation are as before."""
    journal = tmp_path / "j"
    cfg = kit.core_config(journal, enrolment=crowd["enrolment"], k=3, max_batch_reports=10_000)
    core = ShufflerCore(cfg)
    envs = _seal_many(kit, crowd, 200, 7)
    b = core.begin(kit.header(len(envs), round_id=7, envelope_length=len(envs[0])))
    b.add_many(envs)
    sb = b.finish()
    out = list(core.read_batch(sb.batch_id))
    core.journal.close()  # no ShufflerCore.close(): as after a crash
    rec = [r for r in Journal(journal).records if r.get("type") == "batch"][0]
    assert "replay_enc" not in rec and "replay_report_ids" not in rec
    encs = base64.b64decode(rec["replay_enc_sorted"])
    assert len(encs) == 200 * 32 and encs == sorted_packed(encs, 32)
    assert {encs[i : i + 32] for i in range(0, len(encs), 32)} == {e[5:37] for e in envs}
    again = ShufflerCore(cfg)
    try:
        assert all(e[5:37] in again._seen_enc[kit.key_epoch] for e in envs) and len(again._seen_rid[0]) == 200
        b2 = again.begin(kit.header(len(envs), round_id=7, envelope_length=len(envs[0])))
        b2.add_many(list(reversed(envs)))
        same = b2.finish()
        assert (same.batch_id, same.statement, same.signature) == (sb.batch_id, sb.statement, sb.signature)
        assert list(again.read_batch(sb.batch_id)) == out
    finally:
        again.close()


def test_a_record_with_hex_lists_is_still_read(kit, tmp_path: Path) -> None:
    """Records of earlier releases list the replay tags in hex; they load into the same replay cache."""
    encs = sorted(os.urandom(32) for _ in range(3))
    rids = sorted(os.urandom(16) for _ in range(3))
    legacy = {"replay_enc": [e.hex() for e in encs], "replay_report_ids": [r.hex() for r in rids]}
    assert sealmod.replay_tags_of_record(legacy) == (b"".join(encs), b"".join(rids))
    compact = {"replay_enc_sorted": base64.b64encode(b"".join(encs)).decode(),
               "replay_report_ids_sorted": base64.b64encode(b"".join(rids)).decode()}
    assert sealmod.replay_tags_of_record(compact) == sealmod.replay_tags_of_record(legacy)


def test_update_digest_equals_one_update_per_item() -> None:
    from shuffledp.shuffler.attestation import OutputDigest

    hashes = os.urandom(32 * 10)
    occupied = np.array([0, 2, 3, 7, 9], dtype=np.uint32)
    one, bulk = OutputDigest(3), OutputDigest(3)
    for slot in occupied:
        one.update_hashed(1234, hashes[int(slot) * 32 : int(slot) * 32 + 32])
    sealmod.update_digest(bulk, 1234, hashes, occupied)
    assert (bulk.digest(), bulk.count) == (one.digest(), one.count)


# ------------------------------------------------------------------------------------------------ the client
def test_submit_from_an_iterable_that_fails_raises_its_error_and_seals_nothing(kit, running) -> None:
    def envelopes():
        yield kit.seal(0, round_id=31)
        yield kit.seal(1, round_id=31)
        raise OSError("the envelope file went away")

    with kit.client(running.address) as c:
        with pytest.raises(OSError, match="went away"):
            c.submit(round_id=31, key_epoch=0, model_digest=kit.digest, envelopes=envelopes(), count=5)
        assert c.stats()["batches_sealed"] == 0
        att = c.submit(round_id=31, key_epoch=0, model_digest=kit.digest,
                       envelopes=iter([kit.seal(i, round_id=31) for i in range(5)]), count=5)
        assert att.n_accepted == 5 and len(c.fetch_all(att)) == 5



# ------------------------------------------------------------------------------------ decrypted into the slots
def test_decrypt_into_matches_the_hpke_open_and_refuses_what_it_refuses(kit) -> None:
    """The written-out RFC 9180 open gives the bytes ``cryptography``'s HPKE gives (the head, and the inner
    ciphertext written into the caller's buffer and nowhere else, and the inner hash), and drops tampered envelopes
    with the same reasons."""
    from cryptography.hazmat.primitives.asymmetric import x25519

    from shuffledp.shuffler.envelope import EnvelopeError, OuterOpener, inner_length_for
    from shuffledp.shuffler.keys import load_private_key

    sk = x25519.X25519PrivateKey.from_private_bytes(load_private_key(kit.d.shuffler_hpke_key, "x25519"))
    opener = OuterOpener(sk, key_epoch=kit.key_epoch, round_id=1, model_digest=kit.digest)
    for size in (1, 64, 5000, 300_000):
        e = kit.seal(0, size=size)
        want = opener.open(e)
        L = inner_length_for(len(e))
        buf = bytearray(b"\x33" * (L + 14))  # the buffer holds more than the inner ciphertext: only out is written
        out = memoryview(buf)[7 : 7 + L]
        decrypted = opener.decrypt_into(e, out)
        assert decrypted.inner_hash == want.inner_hash and bytes(decrypted.inner) == bytes(want.inner)
        assert buf[:7] == buf[7 + L :] == b"\x33" * 7 and decrypted.inner.obj is out.obj
        got = opener.verify(decrypted)
        assert bytes(got.inner) == bytes(want.inner) and (got.enc, got.report_id, got.signer_public_key,
                                                            got.inner_hash) == (
            want.enc, want.report_id, want.signer_public_key, want.inner_hash)
        for pos in (6, 40, len(e) // 2, len(e) - 1):  # enc, head, inner, tag
            bad = bytearray(e)
            bad[pos] ^= 1
            with pytest.raises(EnvelopeError) as info:
                opener.decrypt_into(bytes(bad), out)
            assert info.value.reason == "undecryptable"
        other = OuterOpener(sk, key_epoch=kit.key_epoch, round_id=2, model_digest=kit.digest)
        with pytest.raises(EnvelopeError, match="authentication"):
            other.decrypt_into(e, out)  # bound to its round through info
    low_order = bytearray(kit.seal(0, size=64))
    low_order[5:37] = bytes(32)  # enc = a point of small order: no shared secret
    with pytest.raises(EnvelopeError) as info:
        opener.decrypt_into(bytes(low_order), memoryview(bytearray(inner_length_for(len(low_order)))))
    assert info.value.reason == "undecryptable"
    with pytest.raises(ValueError, match=r"inner_out must be 112 bytes \(the inner ciphertext\), got 10"):
        opener.decrypt_into(kit.seal(0, size=64), memoryview(bytearray(10)))


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("size", [64, 5000, 300_000])
def test_reports_decrypted_into_their_slots_leave_holes_that_are_squeezed_out(kit, tmp_path: Path, monkeypatch,
                                                                                size: int, pooled: bool) -> None:
    """Memory path with an announced envelope_length (each envelope claims its slot on arrival and is decrypted
    straight into it, on the submitting thread or on the verify pool's workers): reports dropped after they claimed
    a slot (not opening,
    replay, unknown signer, second report of a signer) leave holes; the output is exactly the accepted reports,
    shuffled."""
    import shuffledp.shuffler.builder as buildermod
    import shuffledp.shuffler.opening as openingmod

    monkeypatch.setattr(buildermod, "PIPELINE_MIN_JOB_BYTES", 0 if pooled else 1 << 40)
    import threading

    opened: list[str] = []  # the thread that opened each envelope
    real = openingmod.open_into_slot
    monkeypatch.setattr(openingmod, "open_into_slot",
                        lambda *a: (opened.append(threading.current_thread().name.split("_")[0]), real(*a))[1])
    stranger = ed25519.Ed25519PrivateKey.generate().private_bytes_raw()
    core = ShufflerCore(kit.core_config(tmp_path / "j", max_envelope_bytes=1 << 20, verify_threads=2))
    try:
        good = [kit.seal(i, size=size, payload=bytes([i]) * size) for i in range(kit.n_clients)]
        unknown = kit.seal(0, size=size, payload=b"u" * size, signing_key=stranger)
        twice = kit.seal(3, size=size, payload=b"d" * size)  # a second report of signer 3
        tampered = bytearray(kit.seal(4, size=size, payload=b"t" * size))
        tampered[-1] ^= 1
        sent = [good[0], unknown, good[1], good[2], good[1]] + good[3:5] + [twice, bytes(tampered)] + good[5:]
        b = core.begin(kit.header(len(sent), envelope_length=len(good[0])))
        for i in range(0, len(sent), 3):
            b.add_many(sent[i : i + 3])
        b.settle()
        assert set(opened) == {"shuffler-verify" if pooled else "MainThread"} and len(opened) == len(sent)
        assert b._into_slots and b._claimed == len(sent) > b.n_accepted == kit.n_clients
        sb = b.finish()
        out = [open_inner(x, server_private_key=kit.server_sk, key_epoch=kit.key_epoch, round_id=1)
               for x in core.read_batch(sb.batch_id)]
        assert sorted(out) == sorted(bytes([i]) * size for i in range(kit.n_clients))
        assert Counter(b.drops) == Counter({"unknown_signer": 1, "replay": 1, "duplicate_signer": 1,
                                            "undecryptable": 1})
    finally:
        core.close()


def test_decrypting_into_a_slot_writes_that_slot_only(kit, tmp_path: Path) -> None:
    """Decrypting into a slot, or failing to (a tampered envelope), leaves every other byte of the staging buffer
    as it was, first slot and last included; and threads opening into neighbouring slots at once each get their own
    slot exactly (the verify pool's workers share the buffer)."""
    import threading

    from shuffledp.shuffler.envelope import EnvelopeError
    from shuffledp.shuffler.opening import open_into_slot

    size = 300
    core = ShufflerCore(kit.core_config(tmp_path / "j"))
    try:
        envs = [kit.seal(i, size=size) for i in range(kit.n_clients)]
        b = core.begin(kit.header(len(envs), envelope_length=len(envs[0])))
        b._begin_staging(len(envs[0]) - 166)
        L, buf, n = b.inner_length, b.staging_buffer, len(envs)
        assert b._into_slots and buf is not None
        noise = os.urandom(len(buf))
        buf[:] = noise
        for slot, e in ((0, envs[0]), (n - 1, envs[1]), (1, envs[2])):
            start = slot * L
            decrypted = open_into_slot(b._opener, buf, slot, L, e)
            assert buf[:start] == noise[:start] and buf[start + L :] == noise[start + L :]
            assert bytes(decrypted.inner) == buf[start : start + L] and len(decrypted.outer_plaintext) == 113
            assert b._opener.verify(decrypted).inner_hash == decrypted.inner_hash
            noise = bytes(buf)  # the slot now holds its inner ciphertext
            del decrypted
        bad = bytearray(envs[3])
        bad[200] ^= 1
        with pytest.raises(EnvelopeError):
            open_into_slot(b._opener, buf, 3, L, bytes(bad))
        start = 3 * L
        assert buf[:start] == noise[:start] and buf[start + L :] == noise[start + L :]
        want = {slot: bytes(b._opener.open(e).inner) for slot, e in enumerate(envs)}
        for _ in range(5):  # even slots on one thread, odd on the other: every neighbour is written concurrently
            buf[:] = os.urandom(len(buf))
            threads = [threading.Thread(target=lambda k: [open_into_slot(b._opener, buf, s, L, envs[s])
                                                          for s in range(k, n, 2)], args=(k,)) for k in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert {s: buf[s * L : (s + 1) * L] for s in range(n)} == want
        b.abort()
    finally:
        core.close()


def test_abort_while_workers_open_envelopes_into_the_slots(kit, tmp_path: Path, monkeypatch) -> None:
    """Aborting a batch while the verify pool's workers are opening its envelopes into the slots: the queued jobs
    never start, the running ones end on their own (a buffer already unmapped refuses them, one still in use is
    unmapped after them), nothing is left behind, and the same round seals afterwards."""
    import threading

    import shuffledp.shuffler.builder as buildermod
    import shuffledp.shuffler.envelope as envmod

    monkeypatch.setattr(buildermod, "PIPELINE_MIN_JOB_BYTES", 0)
    gate = threading.Event()
    real = envmod.OuterOpener.decrypt_into
    monkeypatch.setattr(envmod.OuterOpener, "decrypt_into", lambda self, e, out: (gate.wait(5), real(self, e, out))[1])
    core = ShufflerCore(kit.core_config(tmp_path / "j", verify_threads=2))
    try:
        envs = [kit.seal(i, size=5000) for i in range(6)]
        b = core.begin(kit.header(6, envelope_length=len(envs[0])))
        for e in envs[:5]:
            b.add(e)
        assert b._into_slots and len(b._pending) == 5 and b.n_accepted == 0
        futures = [f for f, *_ in b._pending]
        b.abort()
        gate.set()
        for f in futures:
            if not f.cancelled():
                f.exception(timeout=10)  # ended, whatever it met
        assert sum(f.cancelled() for f in futures) >= 3  # two workers: at most two jobs had started
        assert len(b._pending) == 0 and b.staging_buffer is None
        assert list(core.journal.staging_dir.iterdir()) == []
        monkeypatch.setattr(envmod.OuterOpener, "decrypt_into", real)
        b = core.begin(kit.header(6, envelope_length=len(envs[0])))
        b.add_many(envs)
        assert b.finish().n == 6
    finally:
        core.close()
