"""Decoding of Submit messages for the service (:mod:`shuffledp.shuffler.service`): envelopes are sliced out of the
received buffer without a copy, and a batch's items are walked only as far as the batch has room for.

A message above :data:`CANONICAL_ABOVE` bytes must be in canonical form (one ``envelope`` field, or one ``batch``
of ``envelopes`` fields); it is otherwise refused (``non_canonical``) rather than handed to the generated parser,
which builds one object per item.
"""

from __future__ import annotations

import itertools

from google.protobuf.message import DecodeError

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import wire
from shuffledp.shuffler.batch import Refused

__all__ = ["CANONICAL_ABOVE", "submit_request", "item_kind", "batch_envelopes"]


class _EnvelopeMessage:
    """A ``SubmitRequest`` that holds one envelope, decoded without copying it (see :func:`_submit_request`)."""

    __slots__ = ("envelope",)

    def __init__(self, envelope: memoryview) -> None:
        self.envelope = envelope

    @staticmethod
    def WhichOneof(name: str) -> str:  # noqa: N802 - mirrors the protobuf message API
        return "envelope"


class _BatchMessage:
    """A ``SubmitRequest{batch}``, kept as a view of the received buffer: its envelopes are sliced out (without
    copying) only when taken, and only as many as the batch has room for, so a message of many tiny items can
    make the service neither walk nor build one Python object per item (see :func:`batch_envelopes`)."""

    __slots__ = ("raw",)

    def __init__(self, raw: memoryview) -> None:
        self.raw = raw

    @staticmethod
    def WhichOneof(name: str) -> str:  # noqa: N802 - mirrors the protobuf message API
        return "batch"


class _NonCanonical:
    """A Submit message above :data:`CANONICAL_ABOVE` bytes that is not one envelope or one batch in canonical
    form. It is refused (``non_canonical``) instead of parsed: the generated parser builds one object per item,
    about 1 GiB for a 64 MiB message of empty items."""

    __slots__ = ()

    @staticmethod
    def WhichOneof(name: str) -> str:  # noqa: N802 - mirrors the protobuf message API
        return "non_canonical"


#: Submit messages (and batch payloads) above this many bytes must be in canonical form: one ``envelope`` field,
#: or one ``batch`` of ``envelopes`` fields, as every protobuf serialiser writes them. Smaller ones may go through
#: the generated parser. :class:`shuffledp.shuffler.client.ShufflerClient` always writes the canonical form (packed
#: batches of up to ``wire.PACKED_MESSAGE_BYTES``); the bound stays at the legacy packing size, which keeps what the
#: generated parser may be made to build small.
CANONICAL_ABOVE = wire.LEGACY_PACKED_MESSAGE_BYTES + 1024


def _submit_request(raw: bytes) -> "pb.SubmitRequest | _EnvelopeMessage | _BatchMessage | _NonCanonical":
    """Request deserializer for Submit: envelopes are sliced out of the received buffer without a copy.

    Exactly one ``envelope`` field, or one ``batch`` field, becomes a view of the buffer; the batch's items are
    not even counted here (:func:`batch_envelopes` walks only as far as the batch has room for). Anything else
    up to :data:`CANONICAL_ABOVE` bytes (the header, odd encodings, garbage) goes through the generated parser,
    whose failure gRPC reports as INTERNAL, as for any undecodable request; anything else above it is refused.
    """
    view = memoryview(raw)
    envelope = wire.decode_single_bytes_field(view, 2)
    if envelope is not None:
        return _EnvelopeMessage(envelope)  # type: ignore[arg-type] - a view, as raw is one
    batch = wire.decode_single_bytes_field(view, 4)
    if batch is not None:
        return _BatchMessage(batch)  # type: ignore[arg-type] - a view, as raw is one
    if len(raw) > CANONICAL_ABOVE:
        return _NonCanonical()
    return pb.SubmitRequest.FromString(raw)


def _non_canonical() -> Refused:
    return Refused(
        "invalid_argument",
        "non_canonical",
        f"a Submit message above {CANONICAL_ABOVE} bytes must be one envelope or one batch of envelopes in "
        "canonical protobuf encoding",
    )


def _item_kind(request: "pb.SubmitRequest | _EnvelopeMessage | _BatchMessage | _NonCanonical") -> str | None:
    """Which item a Submit message holds; raises :class:`Refused` (``non_canonical``) for a refused encoding."""
    kind = request.WhichOneof("item")
    if kind == "non_canonical":
        raise _non_canonical()
    return kind


def batch_envelopes(request: "pb.SubmitRequest | _BatchMessage", limit: int) -> list[bytes | memoryview]:
    """The first ``limit`` envelopes of a Submit batch message (all of them if it holds fewer).

    A view is walked only up to its ``limit``-th item. A part that is not an ``envelopes`` field before that
    point (an unknown field, another wire type) sends a batch of at most :data:`CANONICAL_ABOVE` bytes through the
    generated parser, which skips unknown fields; a larger one, or one the parser cannot read, is refused
    (``non_canonical`` / ``malformed_batch``).
    """
    if not isinstance(request, _BatchMessage):
        return list(itertools.islice(request.batch.envelopes, limit))
    try:
        return list(itertools.islice(wire.iter_repeated_bytes_field(request.raw, 1), limit))
    except ValueError:
        pass
    if len(request.raw) > CANONICAL_ABOVE:
        raise _non_canonical()
    try:
        parsed = pb.EnvelopeBatch.FromString(bytes(request.raw))
    except DecodeError:
        raise Refused("invalid_argument", "malformed_batch", "a batch message is not a valid EnvelopeBatch") from None
    return list(itertools.islice(parsed.envelopes, limit))


submit_request = _submit_request
item_kind = _item_kind
