"""The batched worker of Flower's simulation engine (clients/flower_sim.py): one Ray task per batch of messages
answers every message as Flower's one-task-per-message worker does (replies, error replies and their codes, the
nodes' contexts), on Flower's own RayBackend, actor ``run`` and actor pool with a stand-in for Ray's transport."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import LoadClientAppError
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
from flwr.server.superlink.fleet.vce.metrics import VceMetrics
from flwr.simulation.ray_transport import ray_actor
from flwr.simulation.ray_transport.ray_actor import BasicActorPool, VirtualClientEngineActor
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from ray import cloudpickle

from shuffledp.clients import flower_sim

RUN_ID = 4242
FAIL_VALUE = -1
LOAD_FAIL_VALUE = -2

app = ClientApp()


@app.train()
def _train(msg: Message, ctx: Any) -> Message:
    """Counts the messages each node has seen in its context, raises on ``value == FAIL_VALUE`` and marks the record
    every message shares (as the model's): a message that saw the mark would share it with another."""
    value = int(msg.content["config"]["value"])
    seen_mark = "mark" in msg.content["shared"]
    msg.content["shared"]["mark"] = value
    if value == FAIL_VALUE:
        raise ValueError(f"refused value {value}")
    if value == LOAD_FAIL_VALUE:
        raise LoadClientAppError(f"refused value {value}")
    seen = int(ctx.state["count"]["n"]) + 1 if "count" in ctx.state else 1
    ctx.state["count"] = ConfigRecord({"n": seen})
    out = ConfigRecord({"value": value, "seen": seen, "node": ctx.node_id, "mark": seen_mark})
    return Message(RecordDict({"out": out}), reply_to=msg)


def _load_app() -> ClientApp:
    return app


class _Future:
    def __init__(self, payload: bytes | None, error: BaseException | None) -> None:
        self.payload, self.error = payload, error


class _Actor:
    """An actor handle whose ``run.remote`` is Flower's actor ``run``, its arguments and result pickled as Ray
    pickles them; ``tasks`` counts the calls."""

    def __init__(self, broken: bool = False) -> None:
        self.tasks = 0
        self.broken = broken
        self.run = self

    def remote(self, *args: Any) -> _Future:
        self.tasks += 1
        if self.broken:
            return _Future(None, RuntimeError("the actor died"))
        a_fn, mssg, cid, state = cloudpickle.loads(cloudpickle.dumps(args))
        try:
            out = VirtualClientEngineActor().run(a_fn, mssg, cid, state)
        except Exception as ex:  # noqa: BLE001 - Ray raises the task's exception at ray.get
            return _Future(None, ex)
        return _Future(cloudpickle.dumps(out), None)


def _get(future: _Future) -> Any:
    if future.error is not None:
        raise future.error
    return cloudpickle.loads(future.payload)


def _backend(actors: list[_Actor]) -> RayBackend:
    pool = object.__new__(BasicActorPool)  # Flower's pool, without asking Ray for the cluster's size
    pool.client_resources, pool.pool, pool.num_actors, pool._future_to_actor = {}, list(actors), len(actors), {}
    backend = object.__new__(RayBackend)
    backend.pool, backend.app_fn = pool, _load_app
    return backend


def _messages(values: dict[int, list[int]]) -> list[Message]:
    """One message per (node, value), round after round: ``values[node][r]`` is node's value in round r."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SUPERLINK_NODE_ID, 7  # as run_simulation
    out = []
    shared = ConfigRecord({"model": 1})  # one object in every message, as the round's model
    for r in range(max(len(v) for v in values.values())):
        for node, vals in values.items():
            if r < len(vals):
                msg = Message(RecordDict({"config": ConfigRecord({"value": vals[r]}), "shared": shared}),
                              dst_node_id=node, message_type="train", group_id=str(r))
                msg.metadata.__dict__["_message_id"] = f"m{node}-{r}"
                out.append(msg)
    return out


def _run(worker: Any, backend: RayBackend, messages: list[Message], n_workers: int = 2) -> tuple[dict, dict]:
    """Run ``n_workers`` of ``worker`` over ``messages``; returns {message id: answer} and {node: context count}."""
    nodes = {m.metadata.dst_node_id: i for i, m in enumerate(messages)}
    run = Run.create_empty(run_id=RUN_ID)
    stores = vce_api._register_node_info_stores(nodes, run, None)
    q_in: queue.Queue[Message] = queue.Queue()
    q_out: queue.Queue[Message] = queue.Queue()
    for m in messages:
        q_in.put(m)
    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(q_in, q_out, stores, backend, stop, VceMetrics()))
               for _ in range(n_workers)]
    for t in threads:
        t.start()
    replies = []
    deadline = time.monotonic() + 30
    while len(replies) < len(messages) and time.monotonic() < deadline:
        try:
            replies.append(q_out.get(timeout=0.1))
        except queue.Empty:
            pass
    stop.set()
    for t in threads:
        t.join(5)
    answers = {}
    for r in replies:
        assert r.metadata.message_id  # every reply gets a fresh id
        key = r.metadata.reply_to_message_id
        assert key not in answers  # one reply per message
        if r.has_error():
            answers[key] = ("error", r.error.code, "refused value" in (r.error.reason or ""))
        else:
            out = r.content["out"]
            assert not out["mark"]  # no message saw another's change to the record they share
            answers[key] = ("ok", int(out["value"]), int(out["seen"]), int(out["node"]))
    counts = {n: int(s.retrieve_context(RUN_ID).state["count"]["n"]) if "count" in s.retrieve_context(RUN_ID).state
              else 0 for n, s in stores.items()}
    return answers, counts


@pytest.fixture()
def _ray_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_actor.ray, "get", _get)  # Flower's pool fetches with ray.get


@pytest.fixture(autouse=True)
def _installed() -> None:
    assert flower_sim.install() is True


def test_batches_answer_as_flowers_worker_does(_ray_get: None) -> None:
    values = {n: [n, n + 100, n + 200] for n in range(1, 41)}
    values[5] = [5, FAIL_VALUE, 205]  # the ClientApp raises on node 5's second message
    values[9] = [LOAD_FAIL_VALUE, 109, 209]  # and a LoadClientAppError on node 9's first
    flower_actors, our_actors = [_Actor()], [_Actor()]
    # one worker: Flower's workers run two queued messages of one node concurrently (each on the context as it was)
    flower = _run(vce_api.worker.__wrapped__, _backend(flower_actors), _messages(values), n_workers=1)
    ours = _run(vce_api.worker, _backend(our_actors), _messages(values), n_workers=1)
    assert ours == flower
    answers, counts = ours
    assert answers["m5-1"] == ("error", ErrorCode.CLIENT_APP_RAISED_EXCEPTION, True)
    assert answers["m6-1"] == ("ok", 106, 2, 6)
    assert answers["m9-0"] == ("error", ErrorCode.LOAD_CLIENT_APP_EXCEPTION, True) and answers["m9-1"][2] == 1
    assert counts[5] == 2 and counts[6] == 3  # the failed message left node 5's context as it was
    assert sum(a.tasks for a in flower_actors) == 120
    assert sum(a.tasks for a in our_actors) < 120 // 4  # batches of several messages per task


def test_a_failed_task_is_an_error_reply_per_message_and_the_actor_returns(_ray_get: None) -> None:
    values = {n: [n] for n in range(1, 9)}
    flower = _run(vce_api.worker.__wrapped__, _backend([_Actor(broken=True)]), _messages(values), n_workers=1)
    backend = _backend([_Actor(broken=True)])
    ours = _run(vce_api.worker, backend, _messages(values), n_workers=1)
    assert ours == flower
    assert set(ours[0].values()) == {("error", ErrorCode.UNKNOWN, False)}
    assert len(backend.pool.pool) == 1 and not backend.pool._future_to_actor


def test_a_batch_has_one_message_per_node_and_an_equal_share() -> None:
    assert flower_sim.batch_limit(2000, 2) == flower_sim.BATCH_MAX
    assert flower_sim.batch_limit(9, 2) == 5 and flower_sim.batch_limit(1, 2) == 1 and flower_sim.batch_limit(0, 3) == 1
    msgs = _messages({1: [1, 2], 2: [3], 3: [4]})  # node 1, 2, 3 then node 1 again
    stores = vce_api._register_node_info_stores({1: 0, 2: 1, 3: 2}, Run.create_empty(run_id=RUN_ID), None)
    q: queue.Queue[Message] = queue.Queue()
    for m in msgs[1:]:
        q.put(m)
    batch, carry = flower_sim._take_batch(q, msgs[0], 10, stores)
    assert [m.metadata.message_id for m in batch.messages] == ["m1-0", "m2-0", "m3-0"]
    assert carry is msgs[3] and q.empty()  # node 1's second message starts the next batch
    batch, carry = flower_sim._take_batch(q, msgs[3], 10, stores)
    assert [m.metadata.message_id for m in batch.messages] == ["m1-1"] and carry is None


def test_a_batch_stops_at_its_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    msgs = _messages({1: [1], 2: [2], 3: [3]})
    stores = vce_api._register_node_info_stores({1: 0, 2: 1, 3: 2}, Run.create_empty(run_id=RUN_ID), None)
    q: queue.Queue[Message] = queue.Queue()
    for m in msgs[1:]:
        q.put(m)
    one = len(flower_sim._take_batch(queue.Queue(), msgs[0], 1, stores)[0].payloads[0])
    monkeypatch.setattr(flower_sim, "BATCH_BYTES", 2 * one)  # two messages' worth
    batch, carry = flower_sim._take_batch(q, msgs[0], 10, stores)
    assert [m.metadata.message_id for m in batch.messages] == ["m1-0", "m2-0"] and carry is None and q.qsize() == 1


def test_a_message_without_a_context_is_answered_and_left_out_of_the_task(_ray_get: None) -> None:
    msgs = _messages({1: [1], 2: [2]})
    stores = vce_api._register_node_info_stores({1: 0, 2: 1}, Run.create_empty(run_id=RUN_ID), None)
    del stores[2].run_infos[RUN_ID]  # Flower's retrieve_context raises for node 2
    q: queue.Queue[Message] = queue.Queue()
    q.put(msgs[1])
    batch, _ = flower_sim._take_batch(q, msgs[0], 10, stores)
    assert batch.sent == [0] and batch.replies[1].error.code == ErrorCode.UNKNOWN
    flower_sim._run_batch(_backend([_Actor()]), flower_sim.BatchAppFn(_load_app), batch, stores)
    assert not batch.replies[0].has_error() and int(batch.replies[0].content["out"]["value"]) == 1


def test_other_backends_keep_flowers_worker() -> None:
    calls = []

    class Other:
        num_workers = 1

        def process_message(self, message: Message, context: Any) -> Any:
            calls.append(message.metadata.message_id)
            out = ConfigRecord({"value": 0, "seen": 0, "node": message.metadata.dst_node_id, "mark": False})
            return Message(RecordDict({"out": out}), reply_to=message), context

    answers, _ = _run(vce_api.worker, Other(), _messages({1: [1], 2: [2]}), n_workers=1)  # type: ignore[arg-type] - a stand-in backend
    assert sorted(calls) == ["m1-0", "m2-0"] and len(answers) == 2


def test_two_workers_answer_every_message_of_a_round_once(_ray_get: None) -> None:
    actors = [_Actor(), _Actor()]
    answers, counts = _run(vce_api.worker, _backend(actors), _messages({n: [n] for n in range(1, 101)}))
    assert answers == {f"m{n}-0": ("ok", n, 1, n) for n in range(1, 101)}
    assert set(counts.values()) == {1}
    assert sum(a.tasks for a in actors) < 100 // 4
