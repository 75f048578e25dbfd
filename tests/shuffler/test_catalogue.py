"""Catalogue of hostile and malformed inputs against a real shuffler process (mTLS, 127.0.0.1, port 0).

One shuffler subprocess (``shuffledp.shuffler.process.ShufflerProcess``) serves each catalogue module; every case uses
its own round id. Each case is one of:

* a **drop**: the hostile envelopes ride in a batch with four honest reports. The attestation must count each
  hostile envelope under one specific reason (every other reason 0), the Stats counters must grow by exactly
  that, and the server must open exactly the honest payloads (as a multiset) from the fetched batch;
* a **refusal**: the request gets one specific gRPC status code (and, where the shuffler sends one, the reason
  tag at the head of the details). A refused batch releases nothing and consumes nothing, so the honest
  envelopes of that same batch, resubmitted alone, must then be accepted and released unharmed.

After every case the process must still be the same process (no restart) and answer health SERVING.

This module holds the drops; the refusals are in ``test_catalogue_refusals.py``; the harness (the service fixture,
the outcomes, the per-case context) in ``_service_harness.py``.
"""

from __future__ import annotations

import secrets
from collections import Counter
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

from shuffledp.shuffler.attestation import DROP_REASONS
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, ENVELOPE_VERSION, model_digest, seal

from ._catalogue_harness import (  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)
    MAX_ENVELOPE,
    Catalogue,
    Ctx,
    Drop,
    Svc,
    _assert_alive,
    _released,
    catalogue_service,  # noqa: F401 - the fixture svc (this module's shuffler process), found by pytest
)
from ._fixtures_adv import craft_envelope  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)

CASES: Catalogue[Drop] = Catalogue()
case = CASES.add


def _flip(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    b = bytearray(data)
    b[pos] ^= mask
    return bytes(b)


def _drop(ctx: Ctx, hostile: list[bytes], drops: dict[str, int]) -> Drop:
    envs, payloads = ctx.honest()
    # hostile envelopes are interleaved with the honest ones, not appended, so position tells nothing
    mixed = envs[:2] + hostile + envs[2:]
    return Drop(mixed, drops, payloads)


def _stranger() -> bytes:
    return ed25519.Ed25519PrivateKey.generate().private_bytes_raw()


# ------------------------------------------------------------------------------------ per-envelope drops
@case
def truncated_below_overhead(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4)[: ENVELOPE_OVERHEAD - 1]], {"malformed": 1})


@case
def truncated_to_prefix(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4)[:5], ctx.seal(5)[:3]], {"malformed": 2})


@case
def truncated_by_one_byte(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4)[:-1]], {"undecryptable": 1})


@case
def empty_envelope_message(ctx: Ctx) -> Drop:
    # a zero-length envelope is the submitter's placeholder for a missing report: counted as its own reason
    return _drop(ctx, [b""], {"empty": 1})


@case
def oversized_envelope_within_transport_limit(ctx: Ctx) -> Drop:
    # a genuinely sealed envelope from an enrolled client, one byte above max_envelope_bytes
    big = ctx.seal(4, size=MAX_ENVELOPE + 1 - ENVELOPE_OVERHEAD)
    assert len(big) == MAX_ENVELOPE + 1
    return _drop(ctx, [big], {"oversized": 1})


@case
def bitflip_version_prefix(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), 0, 0x02)], {"wrong_version": 1})


@case
def bitflip_epoch_prefix(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), 4)], {"wrong_epoch": 1})


@case
def bitflip_encapsulated_key(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), 5 + 7)], {"undecryptable": 1})


@case
def bitflip_ciphertext_body(ctx: Ctx) -> Drop:
    e = ctx.seal(4)
    return _drop(ctx, [_flip(e, len(e) // 2, 0x80)], {"undecryptable": 1})


@case
def bitflip_aead_tag(ctx: Ctx) -> Drop:
    return _drop(ctx, [_flip(ctx.seal(4), -1)], {"undecryptable": 1})


@case
def wrong_key_epoch_envelope(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4, key_epoch=ctx.kit.key_epoch + 1)], {"wrong_epoch": 1})


@case
def wrong_round_envelope(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4, round_id=ctx.r + 1), ctx.seal(5, round_id=ctx.r - 1)], {"undecryptable": 2})


@case
def wrong_model_digest_tagging(ctx: Ctx) -> Drop:
    # a server that sends client 4 a tagged model: that client's envelope no longer opens in the round's batch
    tagged = model_digest([b"model-v1", b"tag-for-client-4"])
    return _drop(ctx, [ctx.seal(4, digest=tagged)], {"undecryptable": 1})


@case
def sealed_to_another_shuffler_key(ctx: Ctx) -> Drop:
    other = x25519.X25519PrivateKey.generate().public_key().public_bytes_raw()
    kit = ctx.kit
    e = seal(kit.payload(4), server_public_key=kit.server_pk, shuffler_public_key=other,
             signing_key=kit.client_sks[4], key_epoch=kit.key_epoch, round_id=ctx.r, model_digest=kit.digest)
    return _drop(ctx, [e], {"undecryptable": 1})


@case
def random_bytes_with_valid_prefix(ctx: Ctx) -> Drop:
    n = len(ctx.seal(4))
    junk = bytes([ENVELOPE_VERSION]) + ctx.kit.key_epoch.to_bytes(4, "big") + secrets.token_bytes(n - 5)
    return _drop(ctx, [junk], {"undecryptable": 1})


@case
def replayed_envelope_in_same_batch(ctx: Ctx) -> Drop:
    envs, payloads = ctx.honest()
    return Drop(envs[:2] + [envs[1], envs[0]] + envs[2:] + [envs[3]], {"replay": 3}, payloads)


@case
def replayed_report_id_under_fresh_encryption(ctx: Ctx) -> Drop:
    # client 4 reuses honest client 0's report id: a fresh HPKE enc, but the report-id replay key catches it
    rid = secrets.token_bytes(16)
    first = ctx.craft(0, report_id=rid)
    envs, payloads = ctx.honest((1, 2, 3))
    return Drop([first] + envs[:1] + [ctx.craft(4, report_id=rid)] + envs[1:], {"replay": 1},
                [ctx.kit.payload(0)] + payloads)


@case
def replayed_envelope_from_a_sealed_round(ctx: Ctx) -> Drop:
    # seal round r-1 first, then replay one of its envelopes in round r: bound to another round, it cannot open
    old, old_payloads = ctx.honest(r=ctx.r - 1)
    att = ctx.submit(old, round_id=ctx.r - 1)
    assert att.n_accepted == len(old)
    return _drop(ctx, [old[0]], {"undecryptable": 1})


@case
def same_client_twice_different_envelopes(ctx: Ctx) -> Drop:
    envs, payloads = ctx.honest()
    second = ctx.seal(0, payload=ctx.kit.payload(999))  # client 0 again, other payload: the first is kept
    return Drop(envs + [second], {"duplicate_signer": 1}, payloads)


@case
def unknown_signer(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.seal(4, signing_key=_stranger()), ctx.seal(5, signing_key=_stranger())],
                 {"unknown_signer": 2})


@case
def bad_signature_enrolled_key_signed_by_another(ctx: Ctx) -> Drop:
    # claims to be enrolled client 4, but the signature is made with a stranger's key
    forged = craft_envelope(
        ctx.kit.payload(4), server_pk=ctx.kit.server_pk, shuffler_pk=ctx.kit.shuffler_pk, signing_sk=_stranger(),
        key_epoch=ctx.kit.key_epoch, round_id=ctx.r, digest=ctx.kit.digest,
        claimed_signer_pk=ctx.kit.enrolment["client-4"],
    )
    return _drop(ctx, [forged], {"bad_signature": 1})


@case
def signature_over_another_round(ctx: Ctx) -> Drop:
    from ._fixtures_adv import doc_binding  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)

    other = doc_binding(ctx.kit.key_epoch, ctx.r + 7, ctx.kit.digest)
    return _drop(ctx, [ctx.craft(4, sign_binding=other)], {"bad_signature": 1})


@case
def signature_over_another_report_id(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.craft(4, sign_report_id=secrets.token_bytes(16))], {"bad_signature": 1})


@case
def wrong_version_inside_outer_layer(ctx: Ctx) -> Drop:
    # version 1 is a version the shuffler speaks, but not this envelope's (2): the two must agree
    return _drop(ctx, [ctx.craft(4, outer_version=1)], {"wrong_version": 1})


@case
def outer_plaintext_too_short(ctx: Ctx) -> Drop:
    return _drop(ctx, [ctx.craft(4, truncate_outer_pt=60)], {"malformed": 1})


@case
def kitchen_sink(ctx: Ctx) -> Drop:
    envs, payloads = ctx.honest()
    hostile = [
        b"",
        ctx.seal(4)[:-2],
        _flip(ctx.seal(5), 0, 0x04),
        ctx.seal(6, key_epoch=9),
        ctx.seal(7, signing_key=_stranger()),
        envs[2],
        ctx.seal(1, payload=ctx.kit.payload(77)),  # after client 1's honest one: duplicate
    ]
    return Drop(envs[:2] + hostile + envs[2:] + [envs[0]], {
        "empty": 1, "undecryptable": 1, "wrong_version": 1, "wrong_epoch": 1, "unknown_signer": 1,
        "replay": 2, "duplicate_signer": 1,
    }, payloads)


# ------------------------------------------------------------------ with the round's envelope length announced
def _announced(ctx: Ctx, hostile: list[bytes], drops: dict[str, int]) -> Drop:
    d = _drop(ctx, hostile, drops)
    d.envelope_length = len(d.envelopes[0])
    return d


@case
def announced_length_drops_a_valid_envelope_of_another_length(ctx: Ctx) -> Drop:
    # enrolled, correctly sealed and signed, but longer: unannounced this refuses the batch (mixed_lengths)
    return _announced(ctx, [ctx.seal(4, size=80)], {"wrong_length": 1})


@case
def announced_length_drops_truncated_and_padded(ctx: Ctx) -> Drop:
    e = ctx.seal(4)
    return _announced(ctx, [e[:-1], e + b"\0", b""], {"wrong_length": 2, "empty": 1})


@case
def announced_length_oversized_is_still_oversized(ctx: Ctx) -> Drop:
    big = ctx.seal(4, size=MAX_ENVELOPE + 1 - ENVELOPE_OVERHEAD)
    return _announced(ctx, [big], {"oversized": 1})


@case
def envelope_too_large_for_the_channel_becomes_a_counted_drop(ctx: Ctx) -> Drop:
    # the ShufflerClient does not let one huge envelope abort the stream: it sends an empty placeholder
    huge = secrets.token_bytes(MAX_ENVELOPE + 4096)
    d = _drop(ctx, [huge], {"empty": 1})

    def check() -> None:
        assert ctx.last_client.skipped_oversized == 1

    d.after = check
    return d


# --------------------------------------------------------------------------------------------------- runner
def _stats(svc: Svc) -> dict[str, Any]:
    with svc.client() as c:
        return c.stats()


@pytest.mark.parametrize("name", list(CASES))
def test_catalogue(svc: Svc, name: str) -> None:
    r = next(svc.rounds) * 10  # spaced round ids: cases may use r-1 .. r+9
    ctx = Ctx(svc, r)
    outcome = CASES[name](ctx)
    before = _stats(svc)
    att = ctx.submit(outcome.envelopes, envelope_length=outcome.envelope_length)
    expected = {reason: outcome.drops.get(reason, 0) for reason in DROP_REASONS}
    assert set(outcome.drops) <= set(DROP_REASONS)
    assert dict(att.dropped) == expected
    assert att.n_received == len(outcome.envelopes)
    assert att.n_accepted == len(outcome.payloads)
    assert Counter(_released(ctx, att, r)) == Counter(outcome.payloads)
    after = _stats(svc)
    for reason in DROP_REASONS:
        assert after["dropped"][reason] - before["dropped"][reason] == expected[reason], reason
    assert after["reports_accepted"] - before["reports_accepted"] == len(outcome.payloads)
    if outcome.after is not None:
        outcome.after()
    _assert_alive(svc)


def test_crafted_honest_envelopes_follow_the_documented_format(svc: Svc) -> None:
    """The independent implementation of docs/shuffler.md in _fixtures_adv is accepted (so the forged variants
    above differ from an honest envelope only where they say)."""
    ctx = Ctx(svc, next(svc.rounds) * 10)
    envs = [ctx.craft(i) for i in range(6)]
    att = ctx.submit(envs)
    assert att.n_accepted == 6 and sum(att.dropped.values()) == 0
    assert Counter(_released(ctx, att, ctx.r)) == Counter(ctx.kit.payload(i) for i in range(6))


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 20
