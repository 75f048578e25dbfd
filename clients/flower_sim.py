"""A per-node index for the in-memory LinkState of Flower's simulation engine, so that a round of N simulated
clients costs O(N), not O(N^2).

Flower 1.42's simulation runtime (``flwr/server/superlink/fleet/vce/vce_api.py``) hands messages to its workers
from a thread (``add_messages_to_queue``) that, every 0.1 s, calls ``state.get_message_ins(node_id, limit=1)``
once for every registered node; ``InMemoryLinkState.get_message_ins`` answers by scanning every stored
instruction message (each checked for expiry and federation membership), delivered or not. With N nodes and the N
messages of a round in the store, one sweep is N^2 checks under the state's lock: 3 s of the simulation
process's CPU per sweep at 1,000 nodes and 11 s at 2,000 (measured on a loaded 2-core machine), some 300 s at
10,000, all the while holding the GIL that the ServerApp thread and the engine's workers need.

:func:`install` changes two things, in the process that runs the engine (``flwr-simulation``):

* ``InMemoryLinkState.store_message_ins`` / ``get_message_ins``: each instance keeps the ids of each node's
  undelivered messages, in store order. ``get_message_ins(node_id, limit)`` looks at that node's messages only,
  with the same checks and the same answer as the scan (messages expired or outside the federation are deleted
  by Flower's own ``_check_stored_messages``; the ones returned are marked delivered, as before). The index is
  built from the store the first time an instance is asked, so messages stored before :func:`install` are found
  too; an id whose message has since left the store (delivered, replied to, deleted) is dropped when met.
* ``vce_api.add_messages_to_queue``: the same sweep (at most one message per node per sweep, then 0.1 s), over
  the nodes that have undelivered messages instead of all N registered nodes (10,000 calls every 0.1 s cost a
  fifth of a core at 10,000 nodes). On a state without the index it is Flower's loop.

A deployment's SuperLink uses its SQL state and never runs either. Only the Flower versions this was read
against (:data:`VERSIONS`) are changed; on another, Flower's own code stays and :func:`install` returns False.
The ClientApp module installs it when loaded (clients/app.py): Flower's engine imports the ClientApp in its main
thread just before it starts the sweep thread, so the sweep is the indexed one. The ServerApp installs it too
(idempotent).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["install", "replied", "VERSIONS"]

#: Flower versions whose ``InMemoryLinkState`` and ``add_messages_to_queue`` this replaces.
VERSIONS = ("1.41.", "1.42.")
#: Seconds between sweeps, as in Flower's ``add_messages_to_queue``.
SWEEP_SECONDS = 0.1

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


def install() -> bool:
    """Give Flower's simulation engine the per-node index (module docstring); idempotent.

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
