"""The per-node index of Flower's in-memory LinkState (clients/flower_sim.py): same answers as Flower's scan, and
a sweep over N nodes checks each message once instead of N times."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState, RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from shuffledp.clients import flower_sim

RUN_ID = 4242


def _federation(n_nodes: int) -> tuple[InMemoryLinkState, InMemoryGrid, dict[int, int]]:
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=RUN_ID)
    run.primary_task_id, run.federation_id = 7, NOOP_FEDERATION_ID
    state.run_ids[RUN_ID] = RunRecord(run=run)
    state.task_store[7] = Task(task_id=7, run_id=RUN_ID)  # as flwr.simulation.run_simulation registers a run
    nodes = vce_api._register_nodes(n_nodes, factory)
    grid = InMemoryGrid(factory)
    grid.set_run(run)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SUPERLINK_NODE_ID, 7  # as run_simulation
    return state, grid, nodes


def _push(grid: InMemoryGrid, node_ids: list[int], group: str = "1", ttl: float | None = None) -> list[str]:
    msgs = [Message(RecordDict(), dst_node_id=n, message_type="train", group_id=group, ttl=ttl) for n in node_ids]
    return list(grid.push_messages(msgs))


@pytest.fixture(autouse=True)
def _installed() -> None:
    assert flower_sim.install() is True  # this Flower (1.42) is one the index was written for
    assert flower_sim.install() is True  # idempotent


def test_each_node_gets_its_own_messages_in_order_once() -> None:
    state, grid, nodes = _federation(3)
    a, b, c = sorted(nodes)
    ids = _push(grid, [a, b, a])
    assert state.get_message_ins(node_id=c, limit=1) == []
    first = state.get_message_ins(node_id=a, limit=1)
    assert [m.metadata.message_id for m in first] == [ids[0]] and first[0].metadata.delivered_at != ""
    assert [m.metadata.message_id for m in state.get_message_ins(node_id=a, limit=None)] == [ids[2]]
    assert state.get_message_ins(node_id=a, limit=1) == []  # delivered messages are not handed out twice
    assert [m.metadata.message_id for m in state.get_message_ins(node_id=b, limit=5)] == [ids[1]]
    with pytest.raises(AssertionError):
        state.get_message_ins(node_id=a, limit=0)


def test_messages_stored_before_the_index_existed_are_found() -> None:
    state, grid, nodes = _federation(2)
    a = min(nodes)
    ids = _push(grid, [a])
    state.__dict__.pop(flower_sim._INDEX, None)  # as if stored before install(): rebuilt from the store
    assert [m.metadata.message_id for m in state.get_message_ins(node_id=a, limit=1)] == ids


def test_an_expired_message_is_deleted_not_handed_out() -> None:
    state, grid, nodes = _federation(1)
    (a,) = nodes
    (mid,) = _push(grid, [a], ttl=0.05)
    time.sleep(0.1)
    assert state.get_message_ins(node_id=a, limit=1) == []
    assert mid not in state.message_ins_store  # Flower's own check deleted it


def test_a_sweep_checks_each_message_once_not_once_per_node() -> None:
    n = 300
    state, grid, nodes = _federation(n)
    _push(grid, sorted(nodes))
    checks = 0
    original = state._check_stored_messages

    def counting(message_ids: set[str], run_id: int | None = None) -> None:
        nonlocal checks
        checks += len(message_ids)
        original(message_ids, run_id)

    state._check_stored_messages = counting  # type: ignore[method-assign] - a counting wrapper on this instance
    out: queue.Queue[Message] = queue.Queue()
    stop = threading.Event()
    sweeper = threading.Thread(target=vce_api.add_messages_to_queue, args=(state, out, nodes, stop))
    sweeper.start()
    deadline = time.monotonic() + 30
    while out.qsize() < n and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    sweeper.join(5)
    got = [out.get_nowait() for _ in range(out.qsize())]
    assert sorted(m.metadata.dst_node_id for m in got) == sorted(nodes)  # one message per node, each once
    assert checks == n  # Flower's scan checks every stored message for every node: n * n = 90,000


def test_replied_names_only_the_messages_whose_reply_arrived() -> None:
    state, grid, nodes = _federation(3)
    a, b, c = sorted(nodes)
    ids = _push(grid, [a, b, c])
    (msg_b,) = state.get_message_ins(node_id=b, limit=1)
    reply = Message(RecordDict(), reply_to=msg_b)
    reply.metadata.__dict__["_message_id"] = "reply-b"
    assert state.store_message_res(reply) is not None
    assert flower_sim.replied(grid, set(ids)) == {ids[1]}
    assert [m.metadata.reply_to_message_id for m in grid.pull_messages(flower_sim.replied(grid, set(ids)))] == [ids[1]]
    assert flower_sim.replied(grid, set(ids)) == set()  # pulled: its ins and reply are deleted
    assert flower_sim.replied(object(), set(ids)) is None  # not Flower's in-memory grid: ask about every id
