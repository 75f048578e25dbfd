"""A per-node index for the in-memory LinkState of Flower's simulation engine, so that a round of N simulated
clients costs O(N), not O(N^2).

Flower 1.42's simulation runtime (``flwr/server/superlink/fleet/vce/vce_api.py``) hands messages to its workers
from a thread (``add_messages_to_queue``) that, every 0.1 s, calls ``state.get_message_ins(node_id, limit=1)``
once for every registered node; ``InMemoryLinkState.get_message_ins`` answers by scanning every stored
instruction message (each checked for expiry and federation membership), delivered or not. With N nodes and the N
messages of a round in the store, one sweep is N^2 checks under the state's lock: 3 s of the simulation
process's CPU per sweep at 1,000 nodes and 11 s at 2,000 (measured on a loaded 2-core machine), some 300 s at
10,000, all the while holding the GIL that the ServerApp thread and the engine's workers need.

:func:`install` changes three things, in the process that runs the engine (``flwr-simulation``):

* ``InMemoryLinkState.store_message_ins`` / ``get_message_ins``: each instance keeps the ids of each node's
  undelivered messages, in store order. ``get_message_ins(node_id, limit)`` looks at that node's messages only,
  with the same checks and the same answer as the scan (messages expired or outside the federation are deleted
  by Flower's own ``_check_stored_messages``; the ones returned are marked delivered, as before). The index is
  built from the store the first time an instance is asked, so messages stored before :func:`install` are found
  too; an id whose message has since left the store (delivered, replied to, deleted) is dropped when met.
* ``vce_api.add_messages_to_queue``: the same sweep (at most one message per node per sweep, then 0.1 s), over
  the nodes that have undelivered messages instead of all N registered nodes (10,000 calls every 0.1 s cost a
  fifth of a core at 10,000 nodes). On a state without the index it is Flower's loop.
* ``vce_api.worker``: Flower's engine runs one Ray task per message (``RayBackend.process_message``: submit to an
  idle actor, ``ray.get``), and Ray's per-task work (submitting, scheduling, the actor's task execution, the
  reply's transfer) cost about 1 ms of the simulation process's CPU and 1 to 2 ms of the actor's per message, more
  than the ClientApp itself. The worker takes up to :data:`BATCH_MAX` messages from the queue (no two for the same
  node, about an equal share per actor: :func:`batch_limit`; fewer once they reach :data:`BATCH_BYTES`) and sends
  them as one task to Flower's own ``ClientAppActor.run``, whose app is :class:`BatchAppFn`: the actor runs the
  ClientApp on each (message, context) in turn, exactly as ``run`` does for one. Each (message, context) pair, and
  each (reply, context) pair back, is pickled on its own, so that the messages of a batch share no object (each
  has its own copy of the model, as with one task per message). Each message still gets the reply or the error
  reply Flower's worker gives it (an exception of the ClientApp on one message is that message's
  ``CLIENT_APP_RAISED_EXCEPTION`` reply, the others are unaffected; a failed task is an error reply for each of its
  messages, with Flower's codes), each node's context is updated as Flower's worker updates it, and each reply gets
  a fresh id and goes to the state on its own. On a backend other than Flower's ``RayBackend`` it is Flower's worker.

A deployment's SuperLink uses its SQL state and never runs any of these. Only the Flower versions this was read
against (:data:`VERSIONS`) are changed; on another, Flower's own code stays and :func:`install` returns False.
The ClientApp module installs it when loaded (clients/app.py): Flower's engine imports the ClientApp in its main
thread just before it starts the sweep thread and its workers, so the sweep and the workers are these. The ServerApp
installs it too (idempotent).
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import time
import traceback
from queue import Empty
from typing import Any
from uuid import uuid4

__all__ = ["install", "replied", "batch_limit", "BatchAppFn", "VERSIONS", "BATCH_MAX", "BATCH_BYTES"]

#: Flower versions whose ``InMemoryLinkState``, ``add_messages_to_queue`` and ``worker`` this replaces.
VERSIONS = ("1.41.", "1.42.")
#: Seconds between sweeps, as in Flower's ``add_messages_to_queue``.
SWEEP_SECONDS = 0.1
#: Most messages one Ray task carries to an actor: at ~1.5 ms of ClientApp per message a task of 32 takes ~50 ms,
#: and Ray's ~2 to 3 ms of CPU per task (both processes) is then ~0.1 ms per message. shuffledp's train messages
#: (~3 to 5 KB pickled with their context) reach :data:`BATCH_BYTES` first, at 14 to 20 per task.
BATCH_MAX = 32
#: A batch takes no further message once its pickled messages reach this many bytes: Ray passes a task's arguments
#: and result inline up to 100 KiB (``max_direct_call_object_size``), larger ones through its object store (a put
#: and the raylet's bookkeeping per object). A message larger than this alone is a batch of one.
BATCH_BYTES = 64 * 1024

_log = logging.getLogger("shuffledp.client")
_lock = threading.Lock()
_INDEX = "_shuffledp_pending"


def _index(state: Any) -> dict[int, list[str]]:
    """The instance's per-node index of undelivered message ids (caller holds ``state.lock``), built from the store
    on first use."""
    index = state.__dict__.get(_INDEX)
    if index is None:
        index = {}
        for msg_id, msg in list(state.message_ins_store.items()):
            if msg.metadata.delivered_at == "":
                index.setdefault(int(msg.metadata.dst_node_id), []).append(msg_id)
        state.__dict__[_INDEX] = index
    return index


def _patched_state(cls: type) -> tuple[Any, Any]:
    original_store = cls.store_message_ins

    def store_message_ins(self: Any, message: Any) -> str | None:
        with self.lock:
            known = message.metadata.message_id in self.message_ins_store
            msg_id = original_store(self, message)
            if msg_id and not known:
                _index(self).setdefault(int(message.metadata.dst_node_id), []).append(msg_id)
        return msg_id

    def get_message_ins(self: Any, node_id: int, limit: int | None, *, run_id: int | None = None) -> list[Any]:
        if limit is not None and limit < 1:
            raise AssertionError("`limit` must be >= 1")
        with self.lock:
            index = _index(self)
            pending = index.get(node_id)
            if not pending:
                return []
            found: list[Any] = []
            keep: list[str] = []
            for msg_id in pending:
                if limit and len(found) == limit:
                    keep.append(msg_id)
                    continue
                self._check_stored_messages({msg_id})  # Flower's: deletes an expired or out-of-federation message
                msg = self.message_ins_store.get(msg_id)
                if msg is None or msg.metadata.delivered_at != "" or msg.metadata.dst_node_id != node_id:
                    continue  # gone or delivered: leaves the index
                if run_id is not None and msg.metadata.run_id != run_id:
                    keep.append(msg_id)
                    continue
                found.append(msg)
            if keep:
                index[node_id] = keep
            else:
                del index[node_id]
        from flwr.supercore.date import now

        delivered_at = now().isoformat()
        for msg in found:
            msg.metadata.delivered_at = delivered_at
        return found

    store_message_ins.__doc__ = original_store.__doc__
    get_message_ins.__doc__ = "Get the node's undelivered Messages (per-node index; shuffledp.clients.flower_sim)."
    return store_message_ins, get_message_ins


def _make_sweep(original: Any) -> Any:
    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: dict[int, int], f_stop: threading.Event) -> None:
        """Flower's sweep over the nodes that have undelivered messages (shuffledp.clients.flower_sim)."""
        if not getattr(type(state), "_shuffledp_indexed", False):
            original(state, queue, nodes_mapping, f_stop)
            return
        while not f_stop.is_set():
            with state.lock:
                nodes = [n for n in _index(state) if n in nodes_mapping]
            for node_id in nodes:
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(SWEEP_SECONDS)

    return add_messages_to_queue


class _Failed:
    """A message the ClientApp raised on, in a batch: Flower's error code and reason for its error reply."""

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


class _BatchApp:
    """The ClientApp applied to a batch, inside the actor. Flower's ``ClientAppActor.run`` calls it as
    ``app(message=payloads, context=None)``: each payload is one pickled (message, context) pair, unpickled on its
    own, so that no object is shared between the messages of a batch (each gets its own copy of the model, as with
    one task per message); each answer is pickled on its own too."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, message: list[bytes], context: None) -> list[bytes]:
        from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
        from flwr.common.constant import ErrorCode

        out: list[bytes] = []
        for payload in message:
            msg, ctx = pickle.loads(payload)
            try:
                answer = self.app(message=msg, context=ctx)
            except LoadClientAppError as ex:  # Flower's actor lets it fail that message's task
                answer = _Failed(ErrorCode.LOAD_CLIENT_APP_EXCEPTION, str(type(ex)) + ":<'" + str(ex) + "'>")
            except Exception as ex:  # noqa: BLE001 - Flower's actor wraps any other exception of the app, as here
                wrapped = ClientAppException(str(ex))
                reason = str(type(wrapped)) + ":<'" + str(wrapped) + "'>"
                answer = _Failed(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason)
            out.append(pickle.dumps((answer, ctx), protocol=pickle.HIGHEST_PROTOCOL))
        return out


class BatchAppFn:
    """What Flower's ``ClientAppActor.run`` loads its app from, for a batch: Flower's own loader (``app_fn``; a
    ``LoadClientAppError`` fails the whole task, as it fails every message in Flower's worker), wrapped so that the
    app takes a list of pickled (message, context) pairs and returns one pickled (reply or :class:`_Failed`,
    context) pair per message."""

    def __init__(self, app_fn: Any) -> None:
        self.app_fn = app_fn

    def __call__(self) -> _BatchApp:
        """The batch app, around the ClientApp Flower's loader returns.

        Returns:
            A callable taking ``message=`` (the pickled pairs) and ``context=None`` (:class:`_BatchApp`).
        """
        return _BatchApp(self.app_fn())


def batch_limit(queued: int, workers: int) -> int:
    """How many queued messages one worker takes for its next task: an equal share per worker, at least 1, at most
    :data:`BATCH_MAX` (so the last messages of a round are spread over the actors, not left to one).

    Returns:
        ``min(BATCH_MAX, max(1, ceil(queued / workers)))``.
    """
    return min(BATCH_MAX, max(1, math.ceil(queued / max(1, workers))))


def _error_code(ex: BaseException) -> int:
    """Flower's worker's error code for an exception (``vce_api.worker``)."""
    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
    from flwr.common.constant import ErrorCode

    if isinstance(ex, ClientAppException):
        return int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION)
    if isinstance(ex, LoadClientAppError):
        return int(ErrorCode.LOAD_CLIENT_APP_EXCEPTION)
    return int(ErrorCode.UNKNOWN)


def _error_reply(message: Any, ex: BaseException) -> Any:
    """Flower's worker's error reply to ``message`` for an exception, logged as Flower logs it."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.supercore import log

    log(logging.ERROR, ex)
    log(logging.ERROR, "".join(traceback.format_exception(ex)))
    return Message(Error(code=_error_code(ex), reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=message)


class _Batch:
    """The messages of one task, each with its pickled (message, context) pair, or with Flower's error reply when its
    context cannot be retrieved or pickled (it then stays out of the task, as a message whose ``process_message``
    fails in Flower's worker)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.replies: list[Any] = []
        self.sent: list[int] = []
        self.payloads: list[bytes] = []
        self.nodes: set[int] = set()
        self.size = 0

    def add(self, message: Any, node_info_store: Any) -> None:
        """Take ``message`` into the batch."""
        self.nodes.add(message.metadata.dst_node_id)
        self.messages.append(message)
        self.replies.append(None)
        try:
            context = node_info_store[message.metadata.dst_node_id].retrieve_context(run_id=message.metadata.run_id)
            payload = pickle.dumps((message, context), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as ex:  # noqa: BLE001 - Flower's worker answers this message with an error reply
            self.replies[-1] = _error_reply(message, ex)
            return
        self.sent.append(len(self.messages) - 1)
        self.payloads.append(payload)
        self.size += len(payload)


def _take_batch(messageins_queue: Any, first: Any, limit: int, node_info_store: Any) -> tuple[_Batch, Any]:
    """``first`` and more queued messages, up to ``limit`` messages or until the pickled ones reach
    :data:`BATCH_BYTES`, no two for the same node (Flower runs one message of a node at a time: the second would see
    the context before the first's update). Returns the batch and the message that stopped it (a second one for a
    node in the batch: the first of the next batch) or None."""
    batch = _Batch()
    message = first
    while True:
        batch.add(message, node_info_store)
        if len(batch.messages) >= limit or batch.size >= BATCH_BYTES:
            return batch, None
        try:
            message = messageins_queue.get_nowait()
        except Empty:
            return batch, None
        if message.metadata.dst_node_id in batch.nodes:
            return batch, message


def _run_batch(backend: Any, app_fn: BatchAppFn, batch: _Batch, node_info_store: Any) -> None:
    """One Ray task for the batch's pickled messages, as ``RayBackend.process_message`` runs one for a message; fills
    ``batch.replies``: the ClientApp's reply, or Flower's error reply (then its node's context is left as it was).
    Raises if the task fails."""
    if not batch.sent:
        return
    pool = backend.pool
    future = None
    try:
        future = pool.submit(lambda a, a_fn, mssg, cid, state: a.run.remote(a_fn, mssg, cid, state),
                             (app_fn, batch.payloads, "batch", None))
        answers, _ = pool.fetch_result_and_return_actor_to_pool(future)
    except Exception:
        if future is not None:
            pool.add_actor_back_to_pool(future)
        raise
    for i, answer in zip(batch.sent, answers, strict=True):
        message = batch.messages[i]
        result, context = pickle.loads(answer)
        if isinstance(result, _Failed):
            batch.replies[i] = _failed_reply(message, result)
            continue
        try:
            node_info_store[message.metadata.dst_node_id].update_context(message.metadata.run_id, context=context)
        except Exception as ex:  # noqa: BLE001 - Flower's worker answers a failed context update with an error reply
            batch.replies[i] = _error_reply(message, ex)
            continue
        batch.replies[i] = result


def _failed_reply(message: Any, failed: _Failed) -> Any:
    """The error reply to a message the ClientApp raised on (:class:`_Failed`), logged as Flower logs it."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.supercore import log

    log(logging.ERROR, failed.reason)
    return Message(Error(code=failed.code, reason=failed.reason), reply_to=message)


def _make_worker(original: Any) -> Any:
    def worker(messageins_queue: Any, messageres_queue: Any, node_info_store: Any, backend: Any,
               f_stop: threading.Event, metrics: Any) -> None:
        """Flower's worker, one Ray task per batch of messages (shuffledp.clients.flower_sim)."""
        from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

        if not isinstance(backend, RayBackend) or backend.pool is None or backend.app_fn is None:
            original(messageins_queue, messageres_queue, node_info_store, backend, f_stop, metrics)
            return
        app_fn = BatchAppFn(backend.app_fn)
        carry = None
        while not f_stop.is_set():
            if carry is None:
                try:
                    carry = messageins_queue.get(timeout=1.0)
                except Empty:
                    continue
            limit = batch_limit(messageins_queue.qsize() + 1, backend.num_workers)
            batch, carry = _take_batch(messageins_queue, carry, limit, node_info_store)
            started = time.perf_counter()
            try:
                _run_batch(backend, app_fn, batch, node_info_store)
            except Exception as ex:  # noqa: BLE001 - Flower's worker answers each failed message with an error reply
                for i in batch.sent:
                    batch.replies[i] = _error_reply(batch.messages[i], ex)
            metrics.add_clientapp_runtime(time.perf_counter() - started)
            for reply in batch.replies:
                reply.metadata.__dict__["_message_id"] = str(uuid4())
                messageres_queue.put(reply)

    worker.__wrapped__ = original  # type: ignore[attr-defined] - Flower's worker, for tests and on other backends
    return worker


def install() -> bool:
    """Give Flower's simulation engine the per-node index and the batched worker (module docstring); idempotent.

    Returns:
        True if installed (now or before); False if this Flower version is not one of :data:`VERSIONS` or lacks
        the simulation engine (Flower's own code is kept).
    """
    try:
        import flwr
        from flwr.server.superlink.fleet.vce import vce_api
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    except ImportError:
        return False
    with _lock:
        if getattr(InMemoryLinkState, "_shuffledp_indexed", False):
            return True
        version = str(getattr(flwr, "__version__", ""))
        if not version.startswith(VERSIONS):
            _log.warning("Flower %s: the simulation's message hand-out stays Flower's own (O(N^2) per sweep over N "
                         "nodes); shuffledp.clients.flower_sim was written for %s", version, ", ".join(VERSIONS))
            return False
        store, get = _patched_state(InMemoryLinkState)
        InMemoryLinkState.store_message_ins = store
        InMemoryLinkState.get_message_ins = get
        vce_api.add_messages_to_queue = _make_sweep(vce_api.add_messages_to_queue)
        vce_api.worker = _make_worker(vce_api.worker)
        InMemoryLinkState._shuffledp_indexed = True
    return True


def replied(grid: Any, message_ids: set[str]) -> set[str] | None:
    """The ids among ``message_ids`` whose reply is already in the state of Flower's in-memory (simulation) grid,
    found with one dict lookup each; None if ``grid`` is not such a grid with the index installed (then ask the
    grid about every id). Flower's ``get_message_res`` checks every id it is asked about under the state's lock
    (about 20 us each, 0.2 s for 10,000 outstanding); asking only about the replied ones makes a poll cost what
    it returns. The ids of messages that expired or whose node left have no reply here: a full poll now and then
    still asks about them (server/collect.py)."""
    state = getattr(grid, "state", None)
    if state is None or not getattr(type(state), "_shuffledp_indexed", False):
        return None
    table = getattr(state, "message_ins_id_to_message_res_id", None)
    if not isinstance(table, dict):
        return None
    with state.lock:
        return {i for i in message_ids if i in table}
