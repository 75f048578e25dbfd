"""The Flower ClientApp: ``train.shuffled`` -> one sealed envelope, nothing else.

Flower glue only; the work is :func:`shuffledp.clients.core.make_envelope` (signature documented in clients/core.py)::

    make_envelope(arrays, config, pinned, data, *, rng=None) -> bytes

Per request: resolve the pinned settings (node_config in deployment, run_config in simulation, see
:func:`shuffledp.clients.core.pinned_from_configs`), load this node's partition, parse the request, refuse (error reply)
if its eps0 / clip-l1 differ from the pinned ones or it asks for more local work than the pinned limits
(:func:`shuffledp.clients.core.check_pinned`) or, in a deployment, for another dataset or PCA than the device's
(:func:`shuffledp.clients.core.data_settings_from_configs`: the device's node config says which data it reads), and
reply ``content["envelope"] = ArrayRecord({"ct": uint8})``,
no earlier than the pinned ``reply-floor`` after the request arrived (see :func:`train_shuffled`).

Retries: the reply for the latest round is cached in ``context.state``. A request for the same round, key
epoch, model digest and config returns the same sealed bytes (fresh noise on a retry would spend privacy
twice). A different request for an already-answered round, or a request for an older round, is refused: one
report per round, never two.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from threadpoolctl import threadpool_limits

from shuffledp.clients.core import (
    ClientSetupError,
    PinnedMismatchError,
    PinnedSettings,
    check_pinned,
    data_settings_from_configs,
    make_envelope,
    pinned_from_configs,
)
from shuffledp.clients.messages import (
    ARRAYS_KEY,
    CONFIG_KEY,
    ENVELOPE_ARRAY,
    ENVELOPE_KEY,
    ERR_BAD_REQUEST,
    ERR_CLIENT_SETUP,
    ERR_PINNED_MISMATCH,
    RequestError,
    TrainConfig,
    arrays_digest,
    envelope_from_record,
    envelope_record,
)

__all__ = ["app", "train_shuffled", "STATE_ENVELOPE", "STATE_REQUEST"]

STATE_ENVELOPE = "shuffledp.last-envelope"  # ArrayRecord {"ct": uint8}: the latest sealed reply
STATE_REQUEST = "shuffledp.last-request"  # ConfigRecord: round, key-epoch, model-digest, config

# One BLAS thread in the process that loads this app, as for the ServerApp (see server/app.py: OpenBLAS hangs
# for good when a thread forks during a multi-threaded matrix product; these products are small anyway).
threadpool_limits(limits=1, user_api="blas")

app = ClientApp()
_log = logging.getLogger("shuffledp.client")


# _handle and its helpers return the reply's *content* (a RecordDict or an Error), not a Message: Flower stamps a
# Message with its creation time (metadata.created_at, and a ttl counted from it) when it is built, so a reply
# built before the reply-floor's sleep would carry the unpadded work time to the server.
Reply = RecordDict | Error


def _error(code: int, reason: str) -> Error:
    return Error(code=code, reason=reason)


def _request_key(cfg: TrainConfig, digest: bytes) -> dict[str, Any]:
    canon = ";".join(f"{k}={v!r}" for k, v in sorted(cfg.to_dict().items()))
    return {"round": cfg.round, "key-epoch": cfg.key_epoch, "model-digest": digest, "config": canon}


def _reply(envelope: bytes) -> RecordDict:
    return RecordDict({ENVELOPE_KEY: envelope_record(envelope)})


@app.train("shuffled")
def train_shuffled(msg: Message, context: Context) -> Message:
    """Handle one ``train.shuffled`` request (see the module docstring).

    With a pinned ``reply-floor`` of T seconds, no reply leaves earlier than T seconds after the request
    arrived: the time the local work takes grows with the local dataset (and the model), and the server sees
    when each node replies, so an unpadded reply time tells it about the client's data outside the eps0-LDP
    guarantee. A reply whose work took longer than T is sent when ready, with a warning in the client's log.
    """
    started = time.monotonic()
    content, floor = _handle(msg, context)
    if floor > 0:
        spent = time.monotonic() - started
        if spent > floor:
            _log.warning(
                "the reply took %.2f s, more than reply-floor %g s: its time may reveal how long the local work "
                "took; raise reply-floor",
                spent,
                floor,
            )
        else:
            time.sleep(floor - spent)
    return Message(content, reply_to=msg)  # built after the floor: its created_at is the padded time


def _handle(msg: Message, context: Context) -> tuple[Reply, float]:
    """The reply, and the reply floor it is held to (0 before the pinned settings are known: the replies before
    that point, malformed requests and setup errors, do not depend on the client's data)."""
    # 1. the request (the server is the adversary: validate everything)
    try:
        if ARRAYS_KEY not in msg.content.array_records or CONFIG_KEY not in msg.content.config_records:
            raise RequestError(f"request must carry content[{ARRAYS_KEY!r}] and content[{CONFIG_KEY!r}]")
        cfg = TrainConfig.from_mapping(dict(msg.content.config_records[CONFIG_KEY]))
        group = msg.metadata.group_id
        if group != str(cfg.round):
            raise RequestError(f"group_id {group!r} != str(round) {str(cfg.round)!r}")
        arrays = [np.asarray(a) for a in msg.content.array_records[ARRAYS_KEY].to_numpy_ndarrays()]
        if not arrays:
            raise RequestError("the request carries no model arrays")
        if any(a.dtype.kind != "f" for a in arrays):
            raise RequestError(f"model arrays must be floating-point (float32), got {[str(a.dtype) for a in arrays]}")
        digest = arrays_digest(arrays)
    except (RequestError, TypeError, ValueError) as exc:
        return _error(ERR_BAD_REQUEST, f"bad request: {exc}"), 0.0

    # 2. the client's own settings
    try:
        pinned = pinned_from_configs(context.node_config, context.run_config)
    except ClientSetupError as exc:
        return _error(ERR_CLIENT_SETUP, f"client setup: {exc}"), 0.0
    try:
        return _answer(context, cfg, arrays, digest, pinned), pinned.reply_floor
    except Exception:  # noqa: BLE001 - the last resort: a clear error under the floor, never Flower's traceback reply
        # Flower would reply at once with the exception's type and text, which may be about the client's data
        _log.exception("round %d: unexpected error while answering", cfg.round)
        return _error(ERR_CLIENT_SETUP, "the client could not answer this request (see the client's log)"), \
            pinned.reply_floor


def _answer(
    context: Context, cfg: TrainConfig, arrays: list[np.ndarray], digest: bytes, pinned: PinnedSettings
) -> Reply:
    """Steps 2 (the pinned values) to 4 for a well-formed request."""
    try:
        check_pinned(cfg, pinned, sum(int(a.size) for a in arrays))
        # in a deployment, the device's own (node config); the run's dataset and PCA must be the device's
        settings = data_settings_from_configs(context.node_config, context.run_config)
    except PinnedMismatchError as exc:
        return _error(ERR_PINNED_MISMATCH, f"refused: {exc}")
    except ClientSetupError as exc:
        return _error(ERR_CLIENT_SETUP, f"client setup: {exc}")

    # 3. retry cache: at most one report per round
    key = _request_key(cfg, digest)
    if STATE_REQUEST in context.state.config_records and STATE_ENVELOPE in context.state.array_records:
        last = dict(context.state.config_records[STATE_REQUEST])
        if last == key:
            return _reply(envelope_from_record(context.state.array_records[STATE_ENVELOPE]))
        if int(last["round"]) == cfg.round:
            return _error(ERR_BAD_REQUEST, f"round {cfg.round} was already answered for another request")
        if int(last["round"]) > cfg.round:
            return _error(ERR_BAD_REQUEST, f"stale round {cfg.round}: round {last['round']} was answered")

    # 4. compute, clip, randomize, encode, seal
    try:
        from shuffledp.clients.data import load_partition

        data = load_partition(pinned.partition_id, pinned.num_partitions, **settings)
    except (ValueError, TypeError, OSError) as exc:
        # The details (paths, file sizes, shapes) are about the client's data: they go to its own log only.
        _log.error("could not load this client's data: %s", exc)
        return _error(ERR_CLIENT_SETUP, "client data: the local dataset could not be loaded (see the client's log)")
    try:
        envelope = make_envelope(arrays, cfg, pinned, data)
    except PinnedMismatchError as exc:  # pragma: no cover - checked above
        return _error(ERR_PINNED_MISMATCH, str(exc))
    except RequestError as exc:  # about the request (and the data's feature count, a property of the dataset)
        return _error(ERR_BAD_REQUEST, f"cannot compute a report for this request: {exc}")
    except ValueError as exc:  # may say something about the data: the client's log only
        _log.error("could not compute a report: %s", exc)
        return _error(ERR_BAD_REQUEST, "cannot compute a report for this request (see the client's log)")

    # the envelope first: a failure between the two leaves the old key, which no new request matches
    context.state[STATE_ENVELOPE] = ArrayRecord({ENVELOPE_ARRAY: envelope_record(envelope)[ENVELOPE_ARRAY]})
    context.state[STATE_REQUEST] = ConfigRecord(key)
    return _reply(envelope)
