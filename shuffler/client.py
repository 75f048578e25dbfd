"""``ShufflerClient``: what the ServerApp uses to submit a round's envelopes and fetch the shuffled batch.

``submit`` streams the header and the envelopes (client-streaming, one envelope per message) and returns an
:class:`~shuffledp.shuffler.attestation.Attestation` verified with the pinned shuffler verify key and checked against
what was sent (round, key epoch, model digest, count). ``fetch`` streams the sealed batch and checks each
length, the count and the output digest against the attestation; a mismatch raises
:class:`~shuffledp.shuffler.attestation.AttestationError` at the end of the stream, so apply nothing until the iterator
has finished (or use :meth:`ShufflerClient.fetch_all`).
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import shuffler_pb2_grpc as pb_grpc
from shuffledp.shuffler import wire
from shuffledp.shuffler.attestation import Attestation, AttestationError, OutputDigest
from shuffledp.shuffler.config import is_loopback
from shuffledp.shuffler.service import FRAMING_SLACK, grpc_options, message_limit, packing_for
from shuffledp.shuffler.validation import is_int, require_int

__all__ = ["ShufflerClient", "SubmitStream", "ShufflerError", "Attestation", "AttestationError"]

#: Full gRPC method names (shuffler.proto), for callers that send or read pre-encoded messages.
SUBMIT_METHOD = "/shuffledp.shuffler.v1.Shuffler/Submit"
FETCH_METHOD = "/shuffledp.shuffler.v1.Shuffler/Fetch"
_KEEPALIVE = pb.SubmitRequest(keepalive=pb.Keepalive()).SerializeToString()
_END = object()  # ends the request stream
#: envelopes buffered between the sender and gRPC's request thread (back-pressure: send() waits beyond this)
_QUEUE_ITEMS = 32
#: deadline of the Stats call that opens a Submit (it asks the shuffler's message limit): a hung shuffler fails
#: the round after this long rather than after the whole stream's timeout
STATS_TIMEOUT_SECONDS = 30.0


class ShufflerError(RuntimeError):
    """The shuffler refused a request or could not be reached.

    ``code`` is the ``grpc.StatusCode``; ``reason`` the shuffler's reason tag (e.g. ``below_threshold``) when it
    sent one, else ``""``.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"shuffler: {code.name}: {details}")
        self.code = code
        self.details = details
        head = details.split(":", 1)[0] if ":" in details else ""
        self.reason = head if head and " " not in head else ""


class ShufflerClient:
    """Client for the shuffler service.

    ``root_certificate``, ``client_certificate`` and ``client_key`` (PEM bytes) give mutual TLS; all three
    ``None`` means a plaintext channel, which is allowed only to a loopback address (tests). ``max_message_bytes``
    must be at least the envelope size.
    """

    def __init__(
        self,
        address: str,
        *,
        root_certificate: bytes | None,
        client_certificate: bytes | None,
        client_key: bytes | None,
        shuffler_verify_key: bytes,
        max_message_bytes: int,
        timeout: float | None = 600.0,
    ) -> None:
        if not isinstance(address, str) or ":" not in address:
            raise ValueError(f"address must be 'host:port', got {address!r}")
        if not isinstance(shuffler_verify_key, (bytes, bytearray)) or len(shuffler_verify_key) != 32:
            raise ValueError("shuffler_verify_key must be the shuffler's raw 32-byte Ed25519 public key")
        require_int("max_message_bytes", max_message_bytes, 1024)
        tls = (root_certificate, client_certificate, client_key)
        options = grpc_options(max_message_bytes)
        if all(x is None for x in tls):
            if not is_loopback(address):
                raise ValueError("a plaintext channel is only allowed to a loopback address; pass mTLS credentials")
            self._channel = grpc.insecure_channel(address, options=options)
        elif any(x is None for x in tls):
            raise ValueError("mTLS needs all of root_certificate, client_certificate and client_key")
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=root_certificate, private_key=client_key, certificate_chain=client_certificate
            )
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = pb_grpc.ShufflerStub(self._channel)
        # Hot paths with pre-encoded messages (byte-identical to the generated serialisers, see
        # shuffledp.shuffler.wire).
        self._submit_raw = self._channel.stream_unary(
            SUBMIT_METHOD, request_serializer=None, response_deserializer=pb.SubmitResponse.FromString
        )
        self._fetch_raw = self._channel.unary_stream(
            FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString, response_deserializer=None
        )
        self._verify_key = bytes(shuffler_verify_key)
        self._max = max_message_bytes
        self._timeout = timeout
        #: envelopes that submit() did not send because they exceed the message limit (cumulative)
        self.skipped_oversized = 0
        # the largest envelope this client sends (larger ones become placeholders): max_message_bytes plus the
        # framing slack, minus the field's tag and length varint. The channel itself allows
        # message_limit(max_message_bytes), so that packed messages always fit.
        self._send_limit = max_message_bytes + FRAMING_SLACK - 16

    def close(self) -> None:
        """Close the gRPC channel (calls still open on it are cancelled)."""
        self._channel.close()

    def __enter__(self) -> "ShufflerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        *,
        round_id: int,
        key_epoch: int,
        model_digest: bytes,
        envelopes: Iterable[bytes],
        count: int | None = None,
        envelope_length: int | None = None,
    ) -> Attestation:
        """Submit one round's batch; returns the verified attestation. Raises :class:`ShufflerError` on refusal.

        The header announces the number of envelopes: ``count`` if given (then ``envelopes`` may be any
        iterable, e.g. a generator reading from disk, and must yield exactly ``count`` items), else
        ``len(envelopes)`` (a non-sized iterable is materialised first). gRPC's request thread reads the
        envelopes and sends them packed up to the size the shuffler accepts (as :meth:`open_submit` packs), with no
        queue in between.

        ``envelope_length`` (recommended) announces the length every envelope of the round has: an envelope of
        another length is then dropped and counted (``wrong_length``) and the honest rest of the batch is
        released; without it, accepted reports of different lengths refuse the whole batch (``mixed_lengths``).

        An envelope too large for the channel's message limit would make gRPC abort the whole stream, so it is
        not sent: an empty placeholder takes its place (the shuffler counts it as an ``empty`` drop, so the
        announced count still holds) and :attr:`skipped_oversized` is incremented.
        """
        if count is None:
            items: Iterable[bytes] = envelopes if hasattr(envelopes, "__len__") else list(envelopes)
            count = len(items)  # type: ignore[arg-type] - a list, or Sized (hasattr above)
        else:
            items = envelopes
        # gRPC's request thread packs and sends straight from ``items``: no queue and no hand-off between threads
        # per message, as with open_submit, whose envelopes arrive over time
        stream = SubmitStream(self, round_id=round_id, key_epoch=key_epoch, model_digest=model_digest, count=count,
                              envelope_length=envelope_length, timeout=self._timeout, source=items)
        try:
            return stream.close()
        finally:
            stream.cancel()  # no-op once closed; ends the call if the source or a check raised

    def open_submit(
        self,
        *,
        round_id: int,
        key_epoch: int,
        model_digest: bytes,
        count: int,
        envelope_length: int | None = None,
        timeout: float | None = None,
    ) -> "SubmitStream":
        """Start a Submit whose envelopes are sent as they become available (see :class:`SubmitStream`).

        ``count`` is announced in the header: send exactly that many envelopes (an empty ``b""`` is a counted
        placeholder for a report you do not have). ``timeout`` bounds the whole stream (default: the client's
        timeout); a server that streams while it collects replies passes its reply timeout plus a margin.

        Envelopes are packed up to the size the shuffler accepts, which it states in its Stats (one call before the
        stream opens; a shuffler too old to state it gets the legacy 256 KiB). Raises :class:`ShufflerError` if
        that call fails.
        """
        return SubmitStream(self, round_id=round_id, key_epoch=key_epoch, model_digest=model_digest, count=count,
                            envelope_length=envelope_length, timeout=self._timeout if timeout is None else timeout)

    def fetch(self, attestation: Attestation) -> Iterator[bytes]:
        """Stream the batch's inner ciphertexts; verifies lengths, count, that no report repeats (by its HPKE
        encapsulated key) and the output digest (raises at the end)."""
        if not isinstance(attestation, Attestation) or not attestation.signature:
            raise TypeError("fetch needs an Attestation returned by submit() (or Attestation.verify)")
        digest = OutputDigest.for_attestation(attestation)
        seen_enc: set[bytes] = set()  # each report has its own HPKE encapsulated key: a repeat is a duplicate
        try:
            # max_message_bytes: this channel's receive limit, so that the shuffler packs up to 1 MiB per message
            request = pb.FetchRequest(batch_id=attestation.batch_id, max_message_bytes=message_limit(self._max))
            for raw in self._fetch_raw(request, timeout=self._timeout):
                items = wire.decode_repeated_bytes_field(raw, 1)
                if items is None:  # not the canonical form: use the generated parser
                    items = list(pb.FetchResponse.FromString(raw).inner)
                for inner in items:
                    if len(inner) != attestation.inner_length:
                        raise AttestationError(
                            f"fetched item of {len(inner)} bytes; the attestation says {attestation.inner_length}"
                        )
                    if digest.count >= attestation.n_accepted:
                        raise AttestationError("fetched more items than the attestation's n_accepted")
                    enc = bytes(inner[: env.ENC_BYTES])
                    if enc in seen_enc:
                        # a shuffler that repeats reports inflates n_accepted, and so the amplification credited
                        raise AttestationError("the fetched batch repeats an inner ciphertext (same encapsulated key)")
                    seen_enc.add(enc)
                    digest.update(inner)
                    yield inner  # type: ignore[misc] - a bytes-like view; callers take it as bytes
        except grpc.RpcError as exc:
            raise ShufflerError(exc.code(), exc.details() or "") from None
        if digest.count != attestation.n_accepted:
            raise AttestationError(f"fetched {digest.count} items; the attestation says {attestation.n_accepted}")
        if digest.digest() != attestation.output_digest:
            raise AttestationError("fetched batch does not match the attested output digest")

    def fetch_all(self, attestation: Attestation) -> list[bytes]:
        """:meth:`fetch` into a list, returned only once everything verified."""
        return list(self.fetch(attestation))

    def stats(self) -> dict[str, object]:
        """The shuffler's aggregate counters, its key epoch, its Submit message limit (0 from a shuffler too old
        to state it) and how long its last seal took (0.0 before the first seal of the process, and from a shuffler
        too old to state it)."""
        s = self._stats(self._timeout)
        return {
            "batches_sealed": s.batches_sealed,
            "batches_released": s.batches_released,
            "batches_refused": s.batches_refused,
            "reports_accepted": s.reports_accepted,
            "dropped": dict(s.dropped),
            "key_epoch": s.key_epoch,
            "epoch_batches_released": s.epoch_batches_released,
            "max_message_bytes": s.max_message_bytes,
            "last_seal_seconds": s.last_seal_seconds,
            "last_seal_write_seconds": s.last_seal_write_seconds,
        }

    def _stats(self, timeout: float | None) -> pb.StatsResponse:
        try:
            return self._stub.Stats(pb.StatsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise ShufflerError(exc.code(), exc.details() or "") from None


class SubmitStream:
    """One Submit in progress: the header is sent at once, envelopes with :meth:`send` as they become available,
    :meth:`keepalive` while there is nothing to send (the shuffler cancels a stream idle for
    ``submit_idle_timeout`` seconds), and :meth:`close` ends the stream and returns the verified attestation.
    :meth:`cancel` abandons it: the shuffler then discards everything received, seals nothing and the round's
    binding stays unused. Use it as a context manager (an exception inside cancels the stream).

    Not thread-safe: one sender. If the shuffler ends the call early (a refusal such as ``count_mismatch``, or
    ``submit_idle``), the next :meth:`send`, :meth:`keepalive` or :meth:`close` raises :class:`ShufflerError`.
    """

    def __init__(self, client: ShufflerClient, *, round_id: int, key_epoch: int, model_digest: bytes, count: int,
                 envelope_length: int | None, timeout: float | None, source: Iterable[bytes] | None = None) -> None:
        env.binding(key_epoch, round_id, model_digest)  # validates types and ranges
        if not is_int(count) or count < 0:
            raise ValueError(f"count must be a non-negative int, got {count!r}")
        if count >= 2**32:
            raise ValueError("too many envelopes for one batch")
        if envelope_length is not None and (
            not is_int(envelope_length) or envelope_length < 1
        ):
            raise ValueError(f"envelope_length must be a positive int, got {envelope_length!r}")
        self._client = client
        #: target bytes per packed Submit message: within the message limit the shuffler states in its Stats (asked
        #: here, after the arguments are checked and before the stream opens)
        stats_timeout = STATS_TIMEOUT_SECONDS if timeout is None else min(timeout, STATS_TIMEOUT_SECONDS)
        self.batch_bytes = packing_for(int(client._stats(stats_timeout).max_message_bytes))
        self._binding = (round_id, key_epoch, bytes(model_digest))
        self._count = count
        self._envelope_length = envelope_length or 0
        self.sent = 0
        self._done = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE_ITEMS)
        header = pb.SubmitRequest(
            header=pb.SubmitHeader(
                protocol_version=env.ENVELOPE_VERSION,
                key_epoch=key_epoch,
                round_id=round_id,
                model_digest=bytes(model_digest),
                expected_count=count,
                envelope_length=self._envelope_length,
            )
        ).SerializeToString()

        #: an exception raised by ``source`` while gRPC's thread read it (re-raised by :meth:`close`)
        self._source_error: BaseException | None = None

        def requests() -> Iterator[bytes]:
            yield header
            while True:
                item = self._queue.get()
                if item is _END:
                    return
                yield item

        def from_source(items: Iterable[bytes]) -> Iterator[bytes]:
            yield header
            try:
                for group in wire.packed(map(self._sendable, items), self.batch_bytes):
                    yield self._encode_group(group)
            except GeneratorExit:  # gRPC closed this iterator because the call ended: its status is the answer
                raise
            except BaseException as exc:  # gRPC would only log it and cancel the call: keep it for close()
                self._source_error = exc
                raise

        self._source = source is not None
        self._future = client._submit_raw.future(requests() if source is None else from_source(source),
                                                 timeout=timeout)

    def __enter__(self) -> "SubmitStream":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.cancel()

    @property
    def failed(self) -> bool:
        """True if the call already ended before :meth:`close` (the shuffler refused or cancelled it)."""
        return not self._done and self._future.done()

    def _raise_if_failed(self) -> None:
        if self._done:
            raise RuntimeError("this submit stream is closed or cancelled")
        if self._future.done():
            self._finish_queue()
            self._result()  # raises ShufflerError
            raise ShufflerError(grpc.StatusCode.UNKNOWN, "the shuffler ended the stream before close()")

    def _put(self, item: bytes) -> None:
        while True:  # never block forever on a full queue if the call has ended
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def send(self, envelope: bytes) -> None:
        """Queue one envelope (``b""``: a counted placeholder). Too large for the channel: a placeholder is sent
        instead and ``client.skipped_oversized`` grows."""
        self.send_many([envelope])

    def send_many(self, envelopes: Iterable[bytes]) -> None:
        """Queue envelopes, packed into ``EnvelopeBatch`` messages of about :attr:`batch_bytes` (an envelope of
        that size or more travels alone); ``envelopes`` is consumed lazily. Same placeholder rule as
        :meth:`send`."""
        for group in wire.packed(map(self._sendable, envelopes), self.batch_bytes):
            self._send_group(group)

    def _sendable(self, envelope: bytes) -> bytes:
        if len(envelope) > self._client._send_limit:
            self._client.skipped_oversized += 1
            return b""  # a counted drop at the shuffler instead of an aborted stream
        return envelope

    def _encode_group(self, group: list[bytes]) -> bytes:
        """One Submit message of ``group`` (counted in :attr:`sent`)."""
        self.sent += len(group)
        if len(group) == 1:  # == SubmitRequest(envelope=e).SerializeToString(): sliced without a copy on arrival
            return wire.encode_bytes_field(2, group[0])
        return wire.encode_batch_message(4, 1, group)  # == SubmitRequest(batch=EnvelopeBatch(envelopes=group))...

    def _send_group(self, group: list[bytes]) -> None:
        if self._source:
            raise RuntimeError("this submit stream sends from its source; it takes no other envelopes")
        self._put(self._encode_group(group))

    def keepalive(self) -> None:
        """Reset the shuffler's idle timer without sending an envelope."""
        if self._source:
            raise RuntimeError("this submit stream sends from its source; it takes no keepalives")
        self._put(_KEEPALIVE)

    def _finish_queue(self) -> None:
        try:
            self._queue.put_nowait(_END)
        except queue.Full:  # the request thread is gone (call ended) or will drain; unblock it best-effort
            try:
                self._queue.get_nowait()
                self._queue.put_nowait(_END)
            except (queue.Empty, queue.Full):
                pass

    def _result(self) -> Any:
        try:
            return self._future.result()
        except grpc.RpcError as exc:
            raise ShufflerError(exc.code(), exc.details() or "") from None
        except grpc.FutureCancelledError:
            raise ShufflerError(grpc.StatusCode.CANCELLED, "the submit stream was cancelled") from None

    def close(self) -> Attestation:
        """End the stream; returns the attestation, verified and checked against what was sent."""
        if self._source:  # gRPC's thread sends the source to its end: wait for the answer
            if self._done:
                raise RuntimeError("this submit stream is closed or cancelled")
            self._done = True
            try:
                resp = self._result()
            except ShufflerError:
                if self._source_error is not None:
                    raise self._source_error from None
                raise
            return self._checked(resp)
        self._raise_if_failed()
        self._put(_END)
        self._done = True
        return self._checked(self._result())

    def _checked(self, resp: Any) -> Attestation:
        """The attestation of ``resp``, verified with the pinned key and checked against what was sent."""
        att = Attestation.verify(resp.statement, resp.signature, self._client._verify_key)
        if att.batch_id != bytes(resp.batch_id):
            raise AttestationError("attestation batch id differs from the response's batch id")
        if (att.round_id, att.key_epoch, att.model_digest) != self._binding:
            raise AttestationError("attestation binding (round, key epoch, model digest) differs from the submission")
        if att.n_received != self.sent or self.sent != self._count:
            raise AttestationError(f"attestation says {att.n_received} envelopes received; {self.sent} were sent")
        if att.envelope_length != self._envelope_length:
            raise AttestationError(
                f"attestation envelope_length {att.envelope_length}; {self._envelope_length or None} was sent"
            )
        if att.protocol_version != env.ENVELOPE_VERSION:
            raise AttestationError(
                f"attestation protocol version {att.protocol_version}; this submission used {env.ENVELOPE_VERSION}"
            )
        return att

    def cancel(self) -> None:
        """Abandon the stream (idempotent): the shuffler seals nothing and the binding stays unused."""
        if self._done:
            return
        self._done = True
        self._future.cancel()
        self._finish_queue()
