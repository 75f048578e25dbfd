"""Sending one round's messages and collecting the replies: the ``train.shuffled`` messages
(:func:`build_messages`, with the app's own train config and array names checked once, :func:`check_train_config`,
:func:`check_array_names`), waiting for nodes, sampling them, taking each reply's envelope and streaming it to the
shuffler as it arrives (:func:`collect_into_stream`), the reply and its metadata dropped at once."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import blake3
import numpy as np

from shuffledp.clients import flower_sim
from shuffledp.clients import messages as M
from shuffledp.clients.mechanism import L2_MECHANISMS
from shuffledp.server.config import ConfigError, ServerConfig
from shuffledp.server.outcome import GridLike, RoundOutcome, ShufflerLike

__all__ = ["train_config", "check_array_names", "check_train_config", "build_messages", "wait_for_nodes",
           "sample_nodes", "envelope_of", "collect_into_stream", "poll_pause",
           "PULL_INTERVAL_SECONDS", "POLL_COST_RATIO", "MAX_POLL_PAUSE_SECONDS", "FULL_POLL_SECONDS",
           "FLUSH_SECONDS", "KEEPALIVE_SECONDS", "SUBMIT_MARGIN_SECONDS"]

#: Seconds between polls for replies on a grid that does not say (Flower's simulation grid has pull_interval).
PULL_INTERVAL_SECONDS = 1.0
#: After a poll that took t seconds, wait at least this many times t before the next: a poll asks about every
#: outstanding message (Flower's in-memory state checks each one, about 10 us apiece), so with 10,000 outstanding
#: a poll every 0.1 s would take half a core of the process that also runs the simulated clients' engine; at 20 t
#: the polls take at most about 5% of it.
POLL_COST_RATIO = 20.0
#: ... but never more than this (the set shrinks as replies arrive, and so does the pause).
MAX_POLL_PAUSE_SECONDS = 5.0
#: On Flower's simulation grid, polls between full ones ask only about the messages whose reply has arrived
#: (:func:`shuffledp.clients.flower_sim.replied`); a full poll (every outstanding id, which also turns an expired
#: message or a departed node into Flower's error reply) runs at least this often.
FULL_POLL_SECONDS = 10.0
#: Forward the envelopes collected so far to the shuffler at least this often (or once a packed message is full).
FLUSH_SECONDS = 1.0
#: Replies asked for per ``pull_messages`` call, in bytes of envelopes: a grid returns every ready reply among the
#: ids it is asked about, so a pull's replies are held together; slices keep that O(slice), not O(N x envelope).
PULL_SLICE_BYTES = 8 << 20
#: Send a Keepalive on the Submit stream after this long without an envelope (the shuffler's default idle
#: timeout is 60 s).
KEEPALIVE_SECONDS = 5.0
#: The Submit stream's deadline is reply-timeout plus this margin (time for the shuffler to seal the batch).
SUBMIT_MARGIN_SECONDS = 600.0


def train_config(cfg: ServerConfig, round_id: int) -> M.TrainConfig:
    """The protocol's train config of round ``round_id``, from the run config (a client checks it against its pinned
    settings).

    Returns:
        :class:`shuffledp.clients.messages.TrainConfig`.
    """
    return M.TrainConfig(
        round=round_id,
        key_epoch=cfg.key_epoch,
        eps0=cfg.eps0,
        clip_l1=cfg.clip_l1,
        mechanism=cfg.mechanism,
        clip_l2=cfg.clip_l2 if cfg.mechanism in L2_MECHANISMS else None,
        report=cfg.report,
        local_epochs=cfg.local_epochs,
        local_lr=cfg.local_lr,
        batch_size=cfg.batch_size,
    )


def check_array_names(names: Sequence[str] | None, n_arrays: int) -> list[str]:
    """The names of the model's arrays in the train messages.

    Returns:
        ``names`` as a list, or "0", "1", ... (Flower's names for an ArrayRecord built from a list) when None.

    Raises:
        ConfigError: not one distinct non-empty string per array.
    """
    if names is None:
        return [str(i) for i in range(n_arrays)]
    names = list(names)
    if len(names) != n_arrays or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"array_names must be {n_arrays} distinct non-empty strings, one per array of the model; "
                          f"got {names!r}")
    return names


def check_train_config(extra: Mapping[str, Any] | None, cfg: ServerConfig) -> dict[str, Any]:
    """The app's own entries for the clients' train config, next to the protocol's (:func:`train_config`).

    Returns:
        ``extra`` as a dict (empty for None).

    Raises:
        ConfigError: a key of the protocol's own train config (those come from the run config, where the clients'
            pinned values are checked against them), or a value a Flower ConfigRecord cannot hold.
    """
    from flwr.app import ConfigRecord

    extra = dict(extra or {})
    protocol = set(train_config(cfg, 1).to_dict())
    for key in extra:
        if key in protocol:
            raise ConfigError(f"train_config key {key!r} is part of the protocol's train config "
                              f"({sorted(protocol)}): set it in the run config instead")
    try:
        ConfigRecord(extra)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"train_config is not a valid Flower ConfigRecord: {exc}") from None
    return extra


def build_messages(nodes: Sequence[int], round_id: int, arrays: Sequence[np.ndarray], names: Sequence[str],
                   cfg: ServerConfig, extra: Mapping[str, Any]) -> list[Any]:
    """The ``train.shuffled`` message of round ``round_id`` for each node: the model (``arrays`` under ``names``)
    and the train config (the app's ``extra`` entries and the protocol's), one message group per round.

    Every message holds the same content object (one ``RecordDict`` of the model and the config, built once: its
    type checks cost ~10 us per message otherwise). Nothing on the server side changes a message's content once
    built; a deployment's grid sends each message's content as bytes, and the simulation's engine pickles each
    message on its own for the actor that runs the ClientApp (``shuffledp.clients.flower_sim``), so every client
    still receives its own copy.

    Returns:
        One ``flwr.app.Message`` per node, in the order of ``nodes``.
    """
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

    config_record = ConfigRecord({**extra, **train_config(cfg, round_id).to_dict()})
    arrays_record = ArrayRecord({name: Array.from_numpy_ndarray(np.ascontiguousarray(a))
                                 for name, a in zip(names, arrays)})
    content = RecordDict({M.ARRAYS_KEY: arrays_record, M.CONFIG_KEY: config_record})
    group = str(round_id)
    return [Message(content, dst_node_id=int(node), message_type=M.MESSAGE_TYPE, group_id=group) for node in nodes]


def wait_for_nodes(grid: GridLike, min_nodes: int, *, node_wait: float, settle: float) -> list[int]:
    """The connected node ids, sorted, once at least ``min_nodes`` are connected and their count has not changed
    for ``settle`` seconds, or whatever is connected after ``node_wait`` seconds (the caller decides whether that
    is enough). Polls ``grid.get_node_ids()`` every 0.5 s at most."""
    deadline = time.monotonic() + node_wait
    last_count, stable_since = -1, time.monotonic()
    while True:
        nodes = sorted(set(int(n) for n in grid.get_node_ids()))
        now = time.monotonic()
        if len(nodes) != last_count:
            last_count, stable_since = len(nodes), now
        if (len(nodes) >= min_nodes and now - stable_since >= settle) or now >= deadline:
            return nodes
        time.sleep(min(0.5, max(0.0, deadline - now)))


def sample_nodes(node_ids: Sequence[int], fraction: float, rng: secrets.SystemRandom | None = None) -> list[int]:
    """Sample ``max(1, floor(fraction * N))`` distinct nodes uniformly with a CSPRNG (all of them if fraction=1).

    Raises:
        ValueError: ``fraction`` is not in (0, 1] or there are no nodes.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    nodes = sorted(set(int(n) for n in node_ids))
    if not nodes:
        raise ValueError("there are no connected nodes to sample from")
    if fraction == 1.0:
        return nodes
    count = max(1, int(math.floor(fraction * len(nodes))))
    return (rng or secrets.SystemRandom()).sample(nodes, count)


def envelope_of(reply: Any, *, max_bytes: int) -> tuple[bytes | None, str]:
    """The envelope bytes of one reply, or ``None`` and why not: ``("error")`` for an error reply (e.g. a client
    refusing the request), ``("malformed")`` for no or an ill-formed ``content["envelope"]`` or an oversized
    one. Nothing else of the reply (node id, timestamps, message ids) is returned."""
    try:
        if reply.has_error():
            return None, "error"
        content = reply.content
        if set(content.keys()) != {M.ENVELOPE_KEY}:
            return None, "malformed"
        envelope = M.envelope_from_record(content[M.ENVELOPE_KEY])
    except Exception:  # noqa: BLE001 - any defect in one reply only drops that reply
        return None, "malformed"
    if len(envelope) > max_bytes:
        return None, "malformed"
    return envelope, "ok"


def pulled(grid: GridLike, ids: Any, per_pull: int, spent: list[float] | None = None) -> Any:
    """The replies among ``ids``, pulled ``per_pull`` ids at a time: only one pull's replies are held at once.
    ``spent[0]``, if given, gains the seconds spent in the pulls themselves (not in handling the replies).

    Returns:
        An iterator over the replies, in the grid's order within each pull.
    """
    ids = list(ids)
    for start in range(0, len(ids), per_pull):
        began = time.monotonic()
        batch = list(grid.pull_messages(set(ids[start : start + per_pull])))
        if spent is not None:
            spent[0] += time.monotonic() - began
        batch.reverse()
        while batch:  # each reply dropped here once handed out
            yield batch.pop()


def poll_pause(interval: float, poll_seconds: float) -> float:
    """Seconds to wait before the next poll: the grid's ``interval``, or :data:`POLL_COST_RATIO` times what the last
    poll took if that is longer, at most :data:`MAX_POLL_PAUSE_SECONDS` (never less than ``interval``)."""
    return max(interval, min(POLL_COST_RATIO * poll_seconds, MAX_POLL_PAUSE_SECONDS))


def collect_into_stream(grid: GridLike, shuffler: ShufflerLike, cfg: ServerConfig, envelope_length: int,
                        messages: list[Any], round_id: int, digest: bytes, out: RoundOutcome) -> Any | None:
    """Send the round's messages and stream each reply's envelope to the shuffler as it arrives.

    The Submit stream announces one slot per message pushed. A reply is dropped as soon as its envelope is
    taken; envelopes are forwarded about once a second (:data:`FLUSH_SECONDS`) or per full packed message.
    An error reply, a malformed one and a duplicate (the same bytes twice) fill their slot with an empty
    placeholder, and so does every node without a reply at ``reply-timeout``. While nothing arrives
    the stream is kept alive (the shuffler cancels idle submissions). Returns the stream with every slot sent,
    ready to close, or ``None`` after cancelling it when fewer than ``min-reports`` envelopes arrived (the
    shuffler then seals nothing and the round's binding stays unused). Fills ``out``'s reply counters.

    The shuffler receives the envelopes in arrival order; it verifies each signer anyway, so the order tells it
    nothing it does not know. The server keeps only a SHA-256 of each envelope (for de-duplication).
    """
    from shuffledp.shuffler.wire import FIELD_OVERHEAD

    # A SuperLink returns "" for a message it could not store (e.g. its node left after get_node_ids): that
    # message has no slot. One slot per distinct id actually pushed, so the count announced to the shuffler
    # is exactly the number of slots sent (else the whole batch is refused as count_mismatch).
    outstanding = {str(i) for i in grid.push_messages(messages) if i}
    out.n_not_pushed = len(messages) - len(outstanding)
    del messages
    stream = shuffler.open_submit(
        round_id=round_id, key_epoch=cfg.key_epoch, model_digest=digest, count=len(outstanding),
        envelope_length=envelope_length, timeout=cfg.reply_timeout + SUBMIT_MARGIN_SECONDS,
    )
    counts = {"error": 0, "malformed": 0, "duplicate": 0}
    seen: set[bytes] = set()
    n_replies = 0
    try:
        deadline = time.monotonic() + cfg.reply_timeout
        # Flower's in-memory (simulation) grid polls every `pull_interval` (0.1 s) in send_and_receive; a
        # deployment's SuperLink is polled less often.
        interval = float(getattr(grid, "pull_interval", PULL_INTERVAL_SECONDS))
        last_sent = time.monotonic()
        # Envelopes and placeholders wait here until about one packed message's worth has arrived or
        # FLUSH_SECONDS have passed: few sends (each wakes gRPC's request thread in this process, which in
        # simulation shares one GIL with Flower's engine), while the shuffler still verifies during the
        # collection.
        pending: list[bytes] = []
        pending_bytes = 0
        next_full = time.monotonic()
        per_pull = max(1, PULL_SLICE_BYTES // (envelope_length + FIELD_OVERHEAD))
        while outstanding:
            polled = time.monotonic()
            ready = None if polled >= next_full else flower_sim.replied(grid, outstanding)
            full = ready is None  # a full poll: every outstanding id; else only the replied ones (simulation)
            spent = [0.0]
            for reply in pulled(grid, list(outstanding) if full else ready, per_pull, spent):
                slot = str(reply.metadata.reply_to_message_id)
                if slot not in outstanding:  # not one of ours, or a second reply for a slot: ignore
                    continue
                outstanding.discard(slot)
                n_replies += 1
                envelope, kind = envelope_of(reply, max_bytes=cfg.max_message_bytes)
                del reply  # the reply and its metadata are gone from here on
                if envelope is not None:
                    fingerprint = blake3.blake3(envelope).digest()  # 12 us per 100 KiB; SHA-256 49
                    if fingerprint in seen:
                        envelope, kind = None, "duplicate"
                    seen.add(fingerprint)
                if envelope is None:
                    counts[kind] += 1
                    envelope = b""
                pending.append(envelope)
                pending_bytes += len(envelope) + FIELD_OVERHEAD
                # flush once the next envelope would not fit in the packed message, so messages stay whole
                if pending_bytes + envelope_length + FIELD_OVERHEAD > stream.batch_bytes:
                    stream.send_many(pending)
                    pending, pending_bytes = [], 0
                    last_sent = time.monotonic()
            if full:  # paced by what the pulls cost, as a poll's cost
                took = spent[0]
                pause = poll_pause(interval, took)
                next_full = time.monotonic() + max(FULL_POLL_SECONDS, POLL_COST_RATIO * took)
            else:  # costs what it returns
                pause = interval
            now = time.monotonic()
            if pending and now - last_sent >= FLUSH_SECONDS:
                stream.send_many(pending)
                pending, pending_bytes = [], 0
                last_sent = now
            if not outstanding or now >= deadline:
                break
            if time.monotonic() - last_sent >= KEEPALIVE_SECONDS:
                stream.keepalive()
                last_sent = time.monotonic()
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        stream.send_many(pending + [b""] * len(outstanding))  # and a placeholder per node without a reply
        del pending
    except BaseException:
        stream.cancel()
        raise
    out.n_replies = n_replies
    out.n_error_replies = counts["error"]
    out.n_malformed_replies = counts["malformed"] + counts["duplicate"]
    out.n_envelopes = n_replies - sum(counts.values())
    if out.n_envelopes < cfg.min_reports:
        stream.cancel()
        return None
    return stream
