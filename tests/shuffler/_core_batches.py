"""Helpers for the core tests: run a whole batch through a core, verify its attestation, open its released reports,
digest an output."""

from __future__ import annotations

from collections.abc import Iterable

from shuffledp.shuffler.attestation import Attestation, OutputDigest
from shuffledp.shuffler.core import ShufflerCore
from shuffledp.shuffler.envelope import open_inner


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


def _output_digest(items: Iterable[bytes]) -> bytes:
    """The output digest of ``items`` in their order, as the attestation states it (one update per item)."""
    d = OutputDigest()
    for x in items:
        d.update(x)
    return d.digest()
