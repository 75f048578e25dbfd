"""Thin gRPC layer over :mod:`shuffledp.shuffler.core`: translate requests, map refusals to status codes, serve.

Status codes (the reason tag is the first word of the details string, ``"<reason>: <message>"``):

=====================  ==================================================================================
INVALID_ARGUMENT       no header / header not first / second header, protocol version, model digest not 32
                       bytes, empty batch (expected_count 0), count mismatch, mixed inner lengths (only
                       without envelope_length), envelope_length out of range, bad batch id; non_canonical
                       (a message above 257 KiB not in canonical form), malformed_batch
FAILED_PRECONDITION    key epoch is not the shuffler's, fewer than k distinct enrolled signers (below_threshold)
ALREADY_EXISTS         a different batch was already sealed for this (key epoch, round) (binding_used)
RESOURCE_EXHAUSTED     expected_count above max_batch_reports; disk_full (not enough free space with the journal
                       reserve, or the commit or release record could not be written and was rolled back); busy (too
                       many concurrent Submits, or Fetches); a message above the gRPC size limit (gRPC)
DEADLINE_EXCEEDED      submit_idle: a Submit stream sent nothing for submit_idle_timeout seconds; submit_duration: a
                       Submit stream stayed open longer than submit_max_duration (keepalives do not extend it);
                       fetch_stall: the peer of a Fetch took no message for fetch_stall_timeout seconds
UNAVAILABLE            journal_failed: a failed journal append could not be rolled back; health is
                       NOT_SERVING and every further Submit is refused. journal_write: a Fetch's release record
                       could not be written (rolled back; not for want of space), so nothing was released.
                       (shutting_down is the core's refusal once ShufflerCore.close began; the service closes the core
                       only after gRPC has cancelled every call, so its clients see gRPC's own UNAVAILABLE or CANCELLED)
NOT_FOUND              fetch of an unknown batch id
PERMISSION_DENIED      mTLS peer certificate CN not in ``client_common_names``
INTERNAL               a request that is not a protobuf (gRPC's "Exception deserializing request!");
                       unexpected server error, including a damaged sealed output during Fetch (details
                       never include report data)
UNAVAILABLE            (client side) TLS handshake failed, e.g. a peer without a certificate from the CA
=====================  ==================================================================================

Per-envelope failures are not errors: they are counted drops, reported per reason in the attestation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shuffledp.shuffler import keys as keyfiles
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import shuffler_pb2_grpc as pb_grpc
from shuffledp.shuffler import wire
from shuffledp.shuffler.config import ServiceConfig, load_config
from shuffledp.shuffler.core import DISK_FULL_ERRNOS, CoreConfig, Header, Refused, ShufflerCore
from shuffledp.shuffler.heap import tune_heap
from shuffledp.shuffler.journal import JournalWriteError, write_file_durably
from shuffledp.shuffler.submit_decode import (  # noqa: F401 - re-exported for callers of the service module
    CANONICAL_ABOVE,
    _BatchMessage,
    _EnvelopeMessage,
    _item_kind,
    _submit_request,
    batch_envelopes,
)
from shuffledp.shuffler.validation import is_int
from shuffledp.shuffler.watchdog import _IdleWatchdog, _watched

__all__ = ["SERVICE_NAME", "STATUS_FOR", "ShufflerServicer", "build_server", "serve", "grpc_options"]

log = logging.getLogger("shuffledp.shuffler.service")
SERVICE_NAME = "shuffledp.shuffler.v1.Shuffler"
#: Slack above message_limit's base (the larger of max_envelope_bytes and a packed message) for protobuf framing.
FRAMING_SLACK = 1024

STATUS_FOR: dict[str, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}
#: Worker threads kept free for Stats and health: Submit and Fetch share the others (:func:`worker_split`).
RESERVED_WORKERS = 2


def message_limit(max_envelope_bytes: int) -> int:
    """The gRPC message limit for a given envelope limit: just above the larger of the largest allowed envelope
    and a packed message (``wire.PACKED_MESSAGE_BYTES``), so that small envelopes and inner ciphertexts can
    always be packed into messages of that size, whatever the envelope limit."""
    return max(max_envelope_bytes, wire.PACKED_MESSAGE_BYTES) + FRAMING_SLACK


def packing_for(peer_message_limit: int) -> int:
    """Target bytes per packed message to a peer whose gRPC receive limit is ``peer_message_limit`` (what it
    states in ``FetchRequest.max_message_bytes`` or ``StatsResponse.max_message_bytes``): that limit less framing
    slack, at most our packing size (``wire.PACKED_MESSAGE_BYTES``) and at least the legacy 256 KiB. 0 (a peer too
    old to state one) gives the legacy 256 KiB. Every peer that states a limit accepts 256 KiB packed messages
    (its limit is at least 256 KiB plus the slack), so no honest peer states less; the floor keeps a peer that
    does from making every item travel alone. An item larger than the target travels alone (``wire.packed``)."""
    if peer_message_limit <= 0:
        return wire.LEGACY_PACKED_MESSAGE_BYTES
    return max(wire.LEGACY_PACKED_MESSAGE_BYTES, min(wire.PACKED_MESSAGE_BYTES, peer_message_limit - FRAMING_SLACK))


def grpc_options(max_envelope_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options: send and receive limits of :func:`message_limit`."""
    limit = message_limit(max_envelope_bytes)
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


def server_options(max_envelope_bytes: int) -> list[tuple[str, int]]:
    """Server options: the message limits plus HTTP/2 keepalive, so dead peers are detected and closed."""
    return grpc_options(max_envelope_bytes) + [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_connection_idle_ms", 300_000),
    ]


class ShufflerServicer(pb_grpc.ShufflerServicer):
    """The Shuffler service. Never forwards peer, time, identity or position."""

    def __init__(
        self,
        core: ShufflerCore,
        client_common_names: tuple[str, ...] | None,
        *,
        max_concurrent_submits: int = 4,
        max_concurrent_fetches: int = 4,
        submit_idle_timeout: float = 60.0,
        submit_max_duration: float = 21600.0,
        fetch_stall_timeout: float = 60.0,
        fetch_min_rate: float = 65536.0,
    ) -> None:
        self.core = core
        self.allowed = set(client_common_names) if client_common_names else None
        self._submit_slots = threading.BoundedSemaphore(max(1, max_concurrent_submits))
        self._fetch_slots = threading.BoundedSemaphore(max(1, max_concurrent_fetches))
        self.submit_idle_timeout = submit_idle_timeout
        self.submit_max_duration = submit_max_duration
        self.fetch_stall_timeout = fetch_stall_timeout
        self.fetch_min_rate = fetch_min_rate

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.allowed is None:
            return
        names = {n.decode(errors="replace") for n in context.auth_context().get("x509_common_name", [])}
        if not names & self.allowed:
            raise Refused("permission_denied", "client_not_allowed", "client certificate is not allowed here")

    @staticmethod
    def _abort(context: grpc.ServicerContext, exc: Refused) -> None:
        context.abort(STATUS_FOR[exc.code], f"{exc.reason}: {exc}")

    @staticmethod
    @contextlib.contextmanager
    def _slot(slots: threading.BoundedSemaphore, context: grpc.ServicerContext, calls: str) -> Iterator[None]:
        """Hold one of ``slots`` for the ``with`` block, or abort RESOURCE_EXHAUSTED ``busy`` if none is free; the
        slot is given back whatever happens inside (also if a watchdog thread cannot start)."""
        if not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: too many concurrent {calls}; retry later")
        try:
            yield
        finally:
            slots.release()

    def Submit(self, request_iterator: Iterator[pb.SubmitRequest], context: grpc.ServicerContext) -> pb.SubmitResponse:
        """Take one batch's Submit stream (header, then packed envelopes); seal it and return the attestation.

        At most ``max_concurrent_submits`` run at once (the rest get RESOURCE_EXHAUSTED ``busy``); a stream idle for
        ``submit_idle_timeout`` seconds, or open longer than ``submit_max_duration``, is cancelled. A refusal ends the
        call with its status code and reason.
        """
        with self._slot(self._submit_slots, context, "submissions"), _IdleWatchdog(
            context, self.submit_idle_timeout, "submit_idle", "no message", max_duration=self.submit_max_duration
        ) as dog:
            return self._submit(_watched(request_iterator, dog), context, dog)

    def _submit(
        self, request_iterator: Iterator[pb.SubmitRequest], context: grpc.ServicerContext, dog: _IdleWatchdog
    ) -> pb.SubmitResponse:
        builder = None
        refusal: Refused | None = None
        try:
            self._authorize(context)
            first = next(request_iterator, None)
            if first is None or _item_kind(first) != "header":
                raise Refused("invalid_argument", "no_header", "the first message of Submit must be a SubmitHeader")
            h = first.header
            builder = self.core.begin(
                Header(
                    protocol_version=h.protocol_version,
                    key_epoch=h.key_epoch,
                    round_id=h.round_id,
                    model_digest=bytes(h.model_digest),
                    expected_count=h.expected_count,
                    envelope_length=h.envelope_length,
                )
            )
            for req in request_iterator:
                item = _item_kind(req)
                if item == "envelope":
                    builder.add(req.envelope)  # bytes or a memoryview into the received message
                elif item == "batch":
                    # at most one beyond the room left: that one is refused (count_mismatch), the rest never
                    # become objects
                    builder.add_many(batch_envelopes(req, builder.room + 1))
                elif item != "keepalive":  # a keepalive only resets the idle timer (done by _watched)
                    raise Refused("invalid_argument", "not_envelope",
                                  "only envelopes, batches and keepalives may follow the header")
            if not context.is_active():  # cancelled by the client (gRPC may end the iterator before saying so)
                log.info("submit: stream cancelled by the client")
                return pb.SubmitResponse()
            sealed = builder.finish()
            return pb.SubmitResponse(batch_id=sealed.batch_id, statement=sealed.statement, signature=sealed.signature)
        except Refused as exc:
            refusal = exc
        except JournalWriteError as exc:  # the commit was rolled back: nothing sealed, nothing consumed
            if exc.errno not in DISK_FULL_ERRNOS:
                log.error("submit: journal write failed and was rolled back")
                context.abort(grpc.StatusCode.INTERNAL, "internal error: the batch was not committed")
            refusal = Refused("resource_exhausted", "disk_full", "no space left to commit the batch; retry later")
        except Exception as exc:  # noqa: BLE001 - the edge: log the type only, never report data
            if dog.fired:
                if dog.fired_reason == "submit_duration":
                    log.info("submit: cancelled after %g s open in all", self.submit_max_duration)
                else:
                    log.info("submit: cancelled after %g s without a message", self.submit_idle_timeout)
                return pb.SubmitResponse()
            if not context.is_active():
                log.info("submit: stream ended by the client (%s)", type(exc).__name__)
                return pb.SubmitResponse()
            log.error("submit: internal error (%s)", type(exc).__name__)
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if builder is not None:
                builder.abort()
        self._abort(context, refusal)  # type: ignore[arg-type] - set whenever this line is reached; raises
        return pb.SubmitResponse()

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Stream the sealed batch; each message is a serialised ``FetchResponse{inner: [...]}``.

        At most ``max_concurrent_fetches`` run at once (the rest get RESOURCE_EXHAUSTED ``busy``), and a peer
        that takes no message for ``fetch_stall_timeout`` seconds is cancelled (DEADLINE_EXCEEDED
        ``fetch_stall``): a Fetch that is never read must not hold a worker thread for good. A message gets its
        transfer time at ``fetch_min_rate`` bytes/s on top, so a slow but steady reader is never cancelled.
        """
        with self._slot(self._fetch_slots, context, "fetches"):
            try:
                self._authorize(context)
                # FetchResponse{inner: [...]}: consecutive inner ciphertexts, packed up to the peer's limit
                messages = self.core.read_batch_messages(bytes(request.batch_id),
                                                         packing_for(request.max_message_bytes))
            except Refused as exc:
                self._abort(context, exc)
                return
            with _IdleWatchdog(context, self.fetch_stall_timeout, "fetch_stall", "the peer took no message") as dog:
                try:
                    for message in messages:
                        # gRPC resumes this generator once the peer has taken the message (all but a window of it)
                        dog.wait_begins(len(message) / self.fetch_min_rate)
                        yield message
                        dog.wait_ends()
                except Exception as exc:  # noqa: BLE001 - e.g. a sealed output damaged on disk; never report data
                    log.error("fetch: internal error (%s)", type(exc).__name__)
                    context.abort(grpc.StatusCode.INTERNAL, "internal error: the sealed output cannot be read")
                finally:
                    messages.close()  # type: ignore[attr-defined] - a generator: frees its buffers now

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        """Return the shuffler's aggregate counters, key epoch and Submit message limit to an authorised caller."""
        try:
            self._authorize(context)
        except Refused as exc:
            self._abort(context, exc)
        s = self.core.stats()
        return pb.StatsResponse(
            batches_sealed=s["batches_sealed"],
            batches_released=s["batches_released"],
            batches_refused=s["batches_refused"],
            reports_accepted=s["reports_accepted"],
            dropped=s["dropped"],
            key_epoch=s["key_epoch"],
            epoch_batches_released=s["epoch_batches_released"],
            max_message_bytes=message_limit(self.core.config.max_envelope_bytes),
            last_seal_seconds=s["last_seal_seconds"],
            last_seal_write_seconds=s["last_seal_write_seconds"],
        )


def core_from_config(config: ServiceConfig) -> ShufflerCore:
    """Load keys and enrolment named by the config and open (recover) the journal."""
    return ShufflerCore(
        CoreConfig(
            key_epoch=config.key_epoch,
            k=config.k,
            hpke_private_key=keyfiles.load_private_key(config.hpke_key, "x25519"),
            signing_private_key=keyfiles.load_private_key(config.signing_key, "ed25519"),
            enrolment=keyfiles.load_enrolment(config.enrolment),
            journal_dir=config.journal_dir,
            max_envelope_bytes=config.max_envelope_bytes,
            max_batch_reports=config.max_batch_reports,
            staging_memory_limit=config.staging_memory_limit,
            retain_staging_buffer=config.retain_staging_buffer,
            verify_threads=config.verify_threads,
        )
    )


def worker_split(max_workers: int) -> tuple[int, int]:
    """``(submits, fetches)`` allowed at once with ``max_workers`` gRPC threads: ``RESERVED_WORKERS`` threads
    stay free for Stats and health, the rest are split between Submit and Fetch (Fetch gets the smaller half),
    so that neither kind of stalled call can starve the other or the health checks."""
    if not is_int(max_workers) or max_workers < RESERVED_WORKERS + 2:
        raise ValueError(f"max_workers must be an integer >= {RESERVED_WORKERS + 2}, got {max_workers!r}")
    fetches = (max_workers - RESERVED_WORKERS) // 2
    return max_workers - RESERVED_WORKERS - fetches, fetches


def build_server(
    config: ServiceConfig, core: ShufflerCore, *, max_workers: int = 10
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Create and start the gRPC server; returns ``(server, bound_port, health_servicer)``."""
    submits, fetches = worker_split(max_workers)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shuffler"),
        options=server_options(config.max_envelope_bytes),
        maximum_concurrent_rpcs=4 * max_workers,
    )
    servicer = ShufflerServicer(
        core,
        config.tls.client_common_names if config.tls else None,
        max_concurrent_submits=submits,
        max_concurrent_fetches=fetches,
        submit_idle_timeout=config.submit_idle_timeout,
        submit_max_duration=config.submit_max_duration,
        fetch_stall_timeout=config.fetch_stall_timeout,
        fetch_min_rate=config.fetch_min_rate,
    )
    # Registered by hand (not with the generated add_ShufflerServicer_to_server) so that Fetch can send
    # pre-encoded bytes; Submit and Stats use the generated message classes.
    handlers = {
        "Submit": grpc.stream_unary_rpc_method_handler(
            servicer.Submit,
            request_deserializer=_submit_request,
            response_serializer=pb.SubmitResponse.SerializeToString,
        ),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch, request_deserializer=pb.FetchRequest.FromString, response_serializer=None
        ),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats,
            request_deserializer=pb.StatsRequest.FromString,
            response_serializer=pb.StatsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.insecure:
        port = server.add_insecure_port(config.address)
    else:
        if config.tls is None:
            raise ValueError("a [tls] section is required unless insecure = true")
        creds = grpc.ssl_server_credentials(
            [(config.tls.key.read_bytes(), config.tls.cert.read_bytes())],
            root_certificates=config.tls.ca.read_bytes(),
            require_client_auth=True,
        )
        port = server.add_secure_port(config.address, creds)
    if port == 0:
        raise OSError(f"could not bind {config.address}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING if core.healthy else
                            health_pb2.HealthCheckResponse.NOT_SERVING)

    def unhealthy() -> None:
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    core.on_unhealthy.append(unhealthy)
    return server, port, health_servicer


def serve(config_path: str | os.PathLike[str], *, port_file: str | os.PathLike[str] | None = None) -> int:
    """Run the service until SIGTERM/SIGINT, then stop gracefully. Returns the exit code."""
    config = load_config(config_path)
    if config.heap_tuning:  # before the first message is allocated (see shuffler/heap.py)
        tune_heap(message_limit(config.max_envelope_bytes))
    else:
        log.info("heap tuning off (heap_tuning = false)")
    core = core_from_config(config)
    if core.journal.torn_bytes:
        log.warning("recovered journal: ignored a torn tail of %d bytes", core.journal.torn_bytes)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server, port, health_servicer = build_server(config, core)
    log.info(
        "shuffler serving on port %d (key epoch %d, k=%d, %d enrolled clients, %s, %d sealed batches recovered)",
        port,
        config.key_epoch,
        config.k,
        len(core.config.enrolment),
        "INSECURE (loopback test mode)" if config.insecure else "mTLS",
        len(core._sealed),
    )
    if port_file is not None:
        write_file_durably(port_file, f"{port}\n".encode())
    while not stop.wait(0.5):
        pass
    log.info("shuffler stopping (signal received)")
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=10).wait()
    core.close()
    log.info("shuffler stopped")
    return 0
