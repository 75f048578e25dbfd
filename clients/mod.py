"""A Flower client mod: a ClientApp's ``train`` reply (its updated model) becomes one sealed eps0-LDP report.

Put it on any ClientApp whose train handler replies with one ArrayRecord holding the updated model (same array
names, shapes and dtypes as the model it received)::

    from flwr.clientapp import ClientApp
    from shuffledp.clients.mod import shuffle_mod

    app = ClientApp(mods=[shuffle_mod])

    @app.train("shuffled")          # the ServerApp of shuffledp sends "train.shuffled"
    def train(msg, context): ...    # reply Message(RecordDict({"arrays": updated_model}), reply_to=msg)

``shuffle_mod`` takes no parameters: everything that matters for privacy (eps0, clip-l1, keys, reply floor,
work limits) is pinned in the node's own configs (``context.node_config`` in a deployment, ``context.run_config``
in a simulation; see :func:`shuffledp.clients.settings.pinned_from_configs`), never in code the server could choose
and never in the request. :func:`make_shuffle_mod` builds the same mod with another sealing function.

For every ``train`` message (other categories pass through untouched), in this order:

1. the request is validated (``content["arrays"]``, ``content["config"]``, ``group_id = str(round)``, floating-point
   arrays) and the pinned settings are read; failures are error replies sent at once (they do not depend on the
   client's data);
2. the request is refused (error reply) if its eps0 / clip-l1 differ from the pinned ones or it asks for more
   local work than the pinned limits (:func:`shuffledp.clients.settings.check_pinned`); a retry of the request
   answered last gets the same sealed bytes from ``context.state`` (fresh noise on a retry would spend privacy
   twice), another request for an answered round, or for an older round, is refused. The wrapped app has not
   run yet: these refusals never depend on the data;
3. the wrapped app runs (``call_next``). Its error reply is passed on (code and reason): the wrapped app must
   refuse only on the request and on fixed facts of the device, never on its data. If it raises, or its model has
   non-finite values, the report is the zero update (randomized as usual; the cause goes to the client's log
   only): an error reply there could depend on the data, outside the mechanism. A reply whose arrays do not
   match the received model (names, shapes, dtypes), or that holds no or several ArrayRecords, is refused
   (``ERR_CLIENT_SETUP``);
4. the update is computed in float64: ``report = "delta"``: ``w_local - w``; ``report = "gradient"``:
   ``(w - w_local) / local-lr``, the pseudo-gradient of the local work (the average gradient when the wrapped app
   takes one full-batch SGD step at ``local-lr``, as the project's own ClientApp does); then clipped to L1
   clip-l1, randomized with the exact discrete Laplace mechanism (CSPRNG noise, eps0-LDP for any two inputs),
   encoded and sealed (:func:`shuffledp.clients.core.make_envelope`), bound to the round, key epoch and model
   digest;
5. the reply is ``content["envelope"]`` only: nothing of the wrapped app's reply (arrays, metrics, configs).

Once the pinned settings are known, no reply (report, cached retry, refusal, the wrapped app's error) leaves
earlier than the pinned ``reply-floor`` after the request arrived. The wrapped app should read its local work
(``local-epochs``, ``local-lr``, ``batch-size``) from the request's ``content["config"]``, which the mod checked
against the pinned work limits; otherwise pick a ``reply-floor`` that covers the work it does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable, Mod

from shuffledp.clients.core import make_envelope
from shuffledp.clients.messages import (
    ARRAYS_KEY,
    CONFIG_KEY,
    ENVELOPE_KEY,
    ERR_BAD_REQUEST,
    ERR_CLIENT_SETUP,
    ERR_PINNED_MISMATCH,
    RequestError,
    TrainConfig,
    array_to_numpy,
    envelope_from_record,
    envelope_record,
    read_model,
    record_of,
)
from shuffledp.clients.randomizer import flatten_arrays
from shuffledp.clients.settings import (
    ClientSetupError,
    PinnedMismatchError,
    PinnedSettings,
    check_pinned,
    pinned_from_configs,
)

__all__ = ["shuffle_mod", "make_shuffle_mod", "SealFn", "STATE_ENVELOPE", "STATE_REQUEST", "UNEXPECTED_REASON"]

STATE_ENVELOPE = "shuffledp.last-envelope"  # ArrayRecord {"ct": uint8}: the latest sealed reply
STATE_REQUEST = "shuffledp.last-request"  # ConfigRecord: round, key-epoch, model-digest, config
#: The fixed reason of the last-resort error reply (the details, which may be about the data, stay in the log).
UNEXPECTED_REASON = "the client could not answer this request (see the client's log)"

#: Seals an update: ``seal(arrays, config, pinned, update=vector) -> envelope bytes``
#: (:func:`shuffledp.clients.core.make_envelope`'s contract).
SealFn = Callable[..., bytes]

_log = logging.getLogger("shuffledp.client")

# The helpers return the reply's *content* (a RecordDict or an Error), not a Message: Flower stamps a Message with
# its creation time (metadata.created_at, and a ttl counted from it) when it is built, so a reply built before the
# reply-floor's sleep would carry the unpadded work time to the server.
Reply = RecordDict | Error


class _Refusal(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.error = Error(code=code, reason=reason)


def make_shuffle_mod(*, seal: SealFn | None = None) -> Mod:
    """A Flower client mod that turns ``train`` replies into one sealed eps0-LDP report (module docstring).

    Args:
        seal: clips, randomizes, encodes and seals an update, called as ``seal(arrays, config, pinned,
            update=vector)``; default :func:`shuffledp.clients.core.make_envelope`. The project's ClientApp passes
            a function that looks ``make_envelope`` up when called.

    Returns:
        The mod, ``mod(msg, context, call_next) -> Message``, for ``ClientApp(mods=[...])``.
    """
    sealer: SealFn = make_envelope if seal is None else seal

    def shuffle_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        """Reply to a ``train`` message with one sealed report of the wrapped app's update, or a refusal.

        Args:
            msg: the request.
            context: the node's context (pinned settings, state for the retry cache).
            call_next: the wrapped ClientApp (or the next mod).

        Returns:
            The reply: ``content["envelope"]`` only, or an error.
        """
        if msg.metadata.message_type.split(".", 1)[0] != MessageType.TRAIN:
            return call_next(msg, context)
        started = time.monotonic()
        content, floor = _handle(msg, context, call_next, sealer)
        if floor > 0:
            spent = time.monotonic() - started
            if spent > floor:
                _log.warning(
                    "the reply took %.2f s, more than reply-floor %g s: its time may reveal how long the local "
                    "work took; raise reply-floor",
                    spent,
                    floor,
                )
            else:
                time.sleep(floor - spent)
        return Message(content, reply_to=msg)  # built after the floor: its created_at is the padded time

    return shuffle_mod


def _request_key(cfg: TrainConfig, digest: bytes) -> dict[str, Any]:
    canon = ";".join(f"{k}={v!r}" for k, v in sorted(cfg.to_dict().items()))
    return {"round": cfg.round, "key-epoch": cfg.key_epoch, "model-digest": digest, "config": canon}


def _reply(envelope: bytes) -> RecordDict:
    return RecordDict({ENVELOPE_KEY: envelope_record(envelope)})


def _handle(msg: Message, context: Context, call_next: ClientAppCallable, seal: SealFn) -> tuple[Reply, float]:
    """The reply, and the reply floor it is held to (0 before the pinned settings are known: the replies before
    that point, malformed requests and setup errors, do not depend on the client's data)."""
    # 1. the request (the server is the adversary: validate everything)
    try:
        arrays_record = record_of(msg.content, ARRAYS_KEY, ArrayRecord)
        config_record = record_of(msg.content, CONFIG_KEY, ConfigRecord)
        if arrays_record is None or config_record is None:
            raise RequestError(f"request must carry content[{ARRAYS_KEY!r}] and content[{CONFIG_KEY!r}]")
        cfg = TrainConfig.from_mapping(dict(config_record))
        group = msg.metadata.group_id
        if group != str(cfg.round):
            raise RequestError(f"group_id {group!r} != str(round) {str(cfg.round)!r}")
        received = read_model(arrays_record)  # once per model in this process
        names, arrays, digest = list(received.names), list(received.arrays), received.digest
        if not arrays:
            raise RequestError("the request carries no model arrays")
        if any(a.dtype.kind != "f" for a in arrays):
            raise RequestError(f"model arrays must be floating-point (float32), got {[str(a.dtype) for a in arrays]}")
    except (RequestError, TypeError, ValueError) as exc:
        return Error(code=ERR_BAD_REQUEST, reason=f"bad request: {exc}"), 0.0

    # the client's own settings
    try:
        pinned = pinned_from_configs(context.node_config, context.run_config, int(context.run_id))
    except ClientSetupError as exc:
        return Error(code=ERR_CLIENT_SETUP, reason=f"client setup: {exc}"), 0.0
    try:
        return _answer(msg, context, call_next, seal, cfg, names, arrays, digest, pinned), pinned.reply_floor
    except _Refusal as refusal:
        return refusal.error, pinned.reply_floor
    except Exception:  # noqa: BLE001 - the last resort: a clear error under the floor, never Flower's traceback reply
        # Flower would reply at once with the exception's type and text, which may be about the client's data
        _log.exception("round %d: unexpected error while answering", cfg.round)
        return Error(code=ERR_CLIENT_SETUP, reason=UNEXPECTED_REASON), pinned.reply_floor


def _answer(
    msg: Message, context: Context, call_next: ClientAppCallable, seal: SealFn, cfg: TrainConfig,
    names: list[str], arrays: list[np.ndarray], digest: bytes, pinned: PinnedSettings,
) -> Reply:
    """Steps 2 to 5 for a well-formed request (module docstring). Raises :class:`_Refusal`."""
    # 2. the pinned values and work limits, on the request alone; then the retry cache: one report per round
    try:
        check_pinned(cfg, pinned, sum(int(a.size) for a in arrays))
    except PinnedMismatchError as exc:
        raise _Refusal(ERR_PINNED_MISMATCH, f"refused: {exc}") from None
    key = _request_key(cfg, digest)
    last_request = record_of(context.state, STATE_REQUEST, ConfigRecord)
    last_envelope = record_of(context.state, STATE_ENVELOPE, ArrayRecord)
    if last_request is not None and last_envelope is not None:
        last = dict(last_request)
        if last == key:
            return _reply(envelope_from_record(last_envelope))
        if int(last["round"]) == cfg.round:
            raise _Refusal(ERR_BAD_REQUEST, f"round {cfg.round} was already answered for another request")
        if int(last["round"]) > cfg.round:
            raise _Refusal(ERR_BAD_REQUEST, f"stale round {cfg.round}: round {last['round']} was answered")

    # 3. the wrapped app's local work, 4. the update
    update = _update(cfg, names, arrays, _run_wrapped(msg, context, call_next, cfg.round))

    # 4. clip, randomize, encode, seal
    try:
        envelope = seal(arrays, cfg, pinned, update=update)
    except PinnedMismatchError as exc:  # pragma: no cover - checked above
        raise _Refusal(ERR_PINNED_MISMATCH, str(exc)) from None
    except RequestError as exc:
        raise _Refusal(ERR_BAD_REQUEST, f"cannot compute a report for this request: {exc}") from None
    except ValueError as exc:  # may say something about the data: the client's log only
        _log.error("could not compute a report: %s", exc)
        raise _Refusal(ERR_BAD_REQUEST, "cannot compute a report for this request (see the client's log)") from None

    # the envelope first: a failure between the two leaves the old key, which no new request matches
    context.state[STATE_ENVELOPE] = envelope_record(envelope)  # {ENVELOPE_ARRAY: the envelope}
    context.state[STATE_REQUEST] = ConfigRecord(key)
    return _reply(envelope)


def _run_wrapped(msg: Message, context: Context, call_next: ClientAppCallable, rnd: int) -> ArrayRecord | None:
    """The wrapped app's updated model; None if it raised (the zero update). Raises :class:`_Refusal` with the
    wrapped app's own error reply, or when its reply does not hold exactly one ArrayRecord."""
    try:
        out = call_next(msg, context)
    except Exception as exc:  # noqa: BLE001 - a failure of the local work may depend on the data: zero update
        _log.warning("round %d: the ClientApp's local work failed (%s); reporting the zero update, randomized as "
                     "usual", rnd, type(exc).__name__, exc_info=True)
        return None
    if out.has_error():
        raise _Refusal(int(out.error.code), str(out.error.reason))
    records = [r for r in out.content.values() if isinstance(r, ArrayRecord)]
    if len(records) != 1:
        raise _Refusal(ERR_CLIENT_SETUP, "the ClientApp's train reply must hold exactly one ArrayRecord (the updated "
                                         f"model), got {len(records)}")
    return records[0]


def _update(cfg: TrainConfig, names: list[str], arrays: list[np.ndarray], record: ArrayRecord | None) -> np.ndarray:
    """The unclipped report (flat float64) from the received model and the wrapped app's updated one; the zero
    update if the app failed or its model is not finite. Raises :class:`_Refusal` if the updated model does not
    match the received one (names, shapes, dtypes)."""
    n = sum(int(a.size) for a in arrays)
    if record is None:
        return np.zeros(n, dtype=np.float64)
    got = list(record.keys())
    if got != names:
        raise _Refusal(ERR_CLIENT_SETUP, f"the ClientApp's updated model does not match the received model: arrays "
                                         f"{got}, received {names}")
    new = [array_to_numpy(a) for a in record.values()]
    for name, a, b in zip(names, arrays, new):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise _Refusal(ERR_CLIENT_SETUP, f"the ClientApp's updated model does not match the received model: "
                                             f"array {name!r} is {b.dtype} {b.shape}, received {a.dtype} {a.shape}")
    w, w_local = flatten_arrays(arrays), flatten_arrays(new)
    with np.errstate(all="ignore"):  # an overflow gives inf: the zero update below
        vec = w_local - w if cfg.report == "delta" else (w - w_local) / cfg.local_lr
    if not np.all(np.isfinite(vec)):
        _log.warning("round %d: the ClientApp's updated model gives a non-finite update; reporting the zero "
                     "update, randomized as usual", cfg.round)
        return np.zeros(n, dtype=np.float64)
    return vec


#: The mod with the default sealing (:func:`shuffledp.clients.core.make_envelope`): ``ClientApp(mods=[shuffle_mod])``.
shuffle_mod: Mod = make_shuffle_mod()
