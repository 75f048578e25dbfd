"""The Flower ClientApp: ``train.shuffled`` -> one sealed envelope, nothing else.

It is :mod:`shuffledp.clients.mod` (the client mod any ClientApp can use) around the project's own training
function, :func:`train_model`::

    app = ClientApp(mods=[mod]); app.train("shuffled")(train_model)
    train_shuffled(msg, context) == mod(msg, context, train_model)   # what the app does for train.shuffled

The mod validates the request, reads the pinned settings (node_config in deployment, run_config in simulation, see
:func:`shuffledp.clients.settings.pinned_from_configs`), refuses a request whose eps0 / clip-l1 differ from the pinned
ones or that asks for more local work than the pinned limits, answers a retry from the cache in ``context.state``
(one report per round, never two), holds every reply after pinning to the pinned ``reply-floor``, and turns the
updated model :func:`train_model` replies with into the report (the model delta, or the average gradient),
clipped, randomized, sealed (:func:`shuffledp.clients.core.make_envelope`) and replied as
``content["envelope"] = ArrayRecord({"ct": uint8})`` only.

:func:`train_model` refuses (error reply, passed on by the mod) a run that asks, in a deployment, for another
dataset or PCA than the device's (:func:`shuffledp.clients.settings.data_settings_from_configs`: the device's node
config says which data it reads), a device whose data cannot be loaded, and a model that is not a logreg / mlp of
the data's feature count; all on the request and fixed facts of the device, never on the records. It then replies
``content["arrays"]``: the model after the local work (:func:`shuffledp.clients.core.local_model`), or the
received model unchanged if the local computation fails (the zero update; an error reply there would depend on
the data).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from threadpoolctl import threadpool_limits

from shuffledp.clients import flower_sim
from shuffledp.clients.core import check_model_fits_data, local_model, make_envelope
from shuffledp.clients.messages import (
    ARRAYS_KEY,
    CONFIG_KEY,
    ERR_BAD_REQUEST,
    ERR_CLIENT_SETUP,
    ERR_PINNED_MISMATCH,
    RequestError,
    TrainConfig,
    array_record,
    read_model,
    record_of,
)
from shuffledp.clients.mod import STATE_ENVELOPE, STATE_REQUEST, make_shuffle_mod
from shuffledp.clients.settings import (
    ClientSetupError,
    PinnedMismatchError,
    data_settings_from_configs,
    pinned_from_configs,
)

__all__ = ["app", "train_shuffled", "train_model", "STATE_ENVELOPE", "STATE_REQUEST"]

# One BLAS thread in the process that loads this app, as for the ServerApp (see server/app.py: OpenBLAS hangs
# for good when a thread forks during a multi-threaded matrix product; these products are small anyway).
threadpool_limits(limits=1, user_api="blas")
# ... and one torch thread: a client's gradient is a product of a few thousand numbers, and torch's intra-op pool
# spinning on a busy machine made each one ~10x slower (27 ms instead of 2.8 ms per reply with two threads on two
# loaded cores). Simulated clients run in parallel as separate processes (Ray actors) anyway.
_warm = False
# Flower's simulation engine loads this module in its own process just before it starts handing out messages:
# from then on that hand-out is O(N) per round instead of O(N^2) (shuffledp.clients.flower_sim). Nothing changes in
# a process without the engine (a SuperNode's ClientApp process, a Ray actor).
flower_sim.install()


def _one_torch_thread() -> None:
    global _warm
    if not _warm:
        import torch

        torch.set_num_threads(1)
        _warm = True


_frozen = False


def _freeze_after_first_reply() -> None:
    """After this process's first reply, move every object alive then (Flower, torch, numpy, the dataset: long-lived)
    out of the cyclic garbage collector's reach (``gc.freeze``). A simulated client's reply allocates enough to set
    off a full collection every few hundred replies, and each walked the ~300,000 objects of those imports (about
    90 ms; 0.4 ms per reply). Objects allocated later are collected as usual."""
    global _frozen
    if not _frozen:
        import gc

        gc.collect()  # what is garbage now is collected, not frozen
        gc.freeze()
        _frozen = True

_log = logging.getLogger("shuffledp.client")


def _seal(arrays: Any, config: Any, pinned: Any, *, update: np.ndarray) -> bytes:
    # make_envelope is looked up when called (tests replace it in this module)
    return make_envelope(arrays, config, pinned, update=update)


class _ClientApp(ClientApp):
    """Flower's ClientApp, pickled by reference (this module's :data:`app`).

    Flower's simulation engine sends the loaded ClientApp to a Ray actor with every message (a closure that returns
    it); pickled by value, that is the app with its mods and handlers, about 3 KB of cloudpickled functions per
    message on the engine's side. By reference, the actor imports this module once and each message carries a
    name.
    """

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _module_app, ()


def _module_app() -> ClientApp:
    return app


_mod = make_shuffle_mod(seal=_seal)
app: ClientApp = _ClientApp(mods=[_mod])


def _refuse(msg: Message, code: int, reason: str) -> Message:
    return Message(Error(code=code, reason=reason), reply_to=msg)


#: (model digest, feature count) pairs that passed :func:`check_model_fits_data` in this process. Every client of a
#: round receives the same model, and a simulation runs thousands of clients per process, so the check (which
#: builds a torch model) runs once per model and dataset width instead of once per reply. The check reads the
#: model and the data's width only (a property of the dataset, never of its records), so a cached pass answers
#: exactly as the check would. At most :data:`_CHECKED_MAX` entries (a few rounds' models).
_checked: dict[tuple[bytes, int], None] = {}
_CHECKED_MAX = 8
_checked_lock = threading.Lock()


def _check_model_fits_data(arrays: list[np.ndarray], x: np.ndarray, digest: bytes) -> None:
    """:func:`check_model_fits_data`, remembered per (model digest, width) once passed; ``digest`` is
    ``arrays_digest(arrays)``. Raises RequestError."""
    if np.ndim(x) != 2:
        check_model_fits_data(arrays, x)  # raises the check's own error
        return
    key = (digest, int(np.shape(x)[1]))
    if key in _checked:
        return
    check_model_fits_data(arrays, x)
    with _checked_lock:
        while len(_checked) >= _CHECKED_MAX:
            _checked.pop(next(iter(_checked)))
        _checked[key] = None


@app.train("shuffled")
def train_model(msg: Message, context: Context) -> Message:
    """The project's local training (the function the mod wraps; the mod has validated the request).

    Args:
        msg: the ``train.shuffled`` request.
        context: the node's context (its data settings).

    Returns:
        ``content["arrays"]``: the model after the local work, same names, shapes and dtypes as received; or an
        error reply for a request this device cannot serve (module docstring).
    """
    _one_torch_thread()
    config_record = record_of(msg.content, CONFIG_KEY, ConfigRecord)
    arrays_record = record_of(msg.content, ARRAYS_KEY, ArrayRecord)
    if config_record is None or arrays_record is None:  # the mod refuses such a request before this runs
        raise KeyError(f"the request has no content[{CONFIG_KEY!r}] or content[{ARRAYS_KEY!r}]")
    cfg = TrainConfig.from_mapping(dict(config_record))
    received = read_model(arrays_record)  # the mod has read it: the same object
    names, arrays = received.names, list(received.arrays)
    try:
        # in a deployment, the device's own (node config); the run's dataset and PCA must be the device's
        settings = data_settings_from_configs(context.node_config, context.run_config)
        pinned = pinned_from_configs(context.node_config, context.run_config, int(context.run_id))
    except PinnedMismatchError as exc:
        return _refuse(msg, ERR_PINNED_MISMATCH, f"refused: {exc}")
    except ClientSetupError as exc:
        return _refuse(msg, ERR_CLIENT_SETUP, f"client setup: {exc}")
    try:
        from shuffledp.clients.data import load_partition

        x, y = load_partition(pinned.partition_id, pinned.num_partitions, **settings)
    except (ValueError, TypeError, OSError) as exc:
        # The details (paths, file sizes, shapes) are about the client's data: they go to its own log only.
        _log.error("could not load this client's data: %s", exc)
        return _refuse(msg, ERR_CLIENT_SETUP, "client data: the local dataset could not be loaded (see the client's "
                                              "log)")
    try:
        # the model, and the data's feature count (a property of the dataset)
        _check_model_fits_data(arrays, x, received.digest)
    except RequestError as exc:
        return _refuse(msg, ERR_BAD_REQUEST, f"cannot compute a report for this request: {exc}")
    try:
        new = local_model(arrays, cfg, x, y)
    except Exception as exc:  # noqa: BLE001 - data-dependent failures must not change the reply: the zero update
        _log.warning("the local update failed (%s); reporting the zero update, randomized as usual",
                     type(exc).__name__)
        new = arrays
    updated = array_record({n: np.ascontiguousarray(a) for n, a in zip(names, new)})
    _freeze_after_first_reply()
    return Message(RecordDict({ARRAYS_KEY: updated}), reply_to=msg)


def train_shuffled(msg: Message, context: Context) -> Message:
    """Handle one ``train.shuffled`` request as :data:`app` does: the mod around :func:`train_model`.

    With a pinned ``reply-floor`` of T seconds, no reply leaves earlier than T seconds after the request
    arrived: the time the local work takes grows with the local dataset (and the model), and the server sees
    when each node replies, so an unpadded reply time tells it about the client's data outside the eps0-LDP
    guarantee. A reply whose work took longer than T is sent when ready, with a warning in the client's log.

    Args:
        msg: the request.
        context: the node's context.

    Returns:
        The reply: ``content["envelope"]`` only, or an error.
    """
    return _mod(msg, context, train_model)
