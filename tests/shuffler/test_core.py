"""The core's duties: release, drops, replay, binding, thresholds, refusals, order, fetch, restart, logs, config."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from shuffledp.shuffler.core import Refused, ShufflerCore
from shuffledp.shuffler.envelope import model_digest, open_outer

from ._core_batches import _output_digest, _payloads, _run, _verify  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def test_honest_batch_is_released_whole_and_attested(core: ShufflerCore, kit) -> None:
    envs = [kit.seal(i) for i in range(5)]
    sealed = _run(core, kit, envs)
    att = _verify(kit, sealed)
    assert (att.n_received, att.n_accepted, att.round_id, att.key_epoch) == (5, 5, 1, 0)
    assert att.model_digest == kit.digest and att.k == kit.k and sum(att.dropped.values()) == 0
    out = list(core.read_batch(sealed.batch_id))
    assert _output_digest(out) == att.output_digest
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
