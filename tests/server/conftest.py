"""Fixtures for the server tests: a key directory, a REAL shuffler process, and a fake Grid.

The fake Grid delivers each ``train.shuffled`` message to a per-node behaviour (honest, silent, refusing,
garbage, tagged); its replies are pulled as with ``flwr.serverapp.Grid.push_messages`` / ``pull_messages``. Honest nodes
run the clients package's pure core function (``shuffledp.clients.core.make_envelope``) on their digits partition, so
what the server opens is what a real ClientApp sends.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from shuffledp.clients import messages as M
from shuffledp.server.config import ServerConfig, parse_run_config
from shuffledp.shuffler import keys as keyfiles

N_CLIENTS = 12
K = 8


@pytest.fixture(autouse=True, scope="session")
def single_torch_thread() -> None:
    """Tiny models: torch's thread pool only adds contention on a 2-core machine (as in the simulation's actors)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Flower's Message constructor needs the task identity that the ServerApp runtime sets."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@dataclass
class Keys:
    """A key directory and the loaded keys a test client needs."""

    d: keyfiles.KeyDirectory

    def __post_init__(self) -> None:
        self.server_pk = keyfiles.load_public_key(self.d.server_hpke_pub, "x25519")
        self.shuffler_pk = keyfiles.load_public_key(self.d.shuffler_hpke_pub, "x25519")
        self.tls = (self.d.ca_cert.read_bytes(), self.d.serverapp_cert.read_bytes(),
                    self.d.serverapp_tls_key.read_bytes())

    def client_key(self, i: int) -> bytes:
        return keyfiles.load_private_key(self.d.client_key(i), "ed25519")


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    d = keyfiles.init_key_directory(tmp_path / "keys", N_CLIENTS, key_epoch=0, k=K)
    return Keys(d)


@pytest.fixture
def shuffler_service(keys: Keys) -> Iterator[Any]:
    """A real shuffler process (``shuffledp shuffler serve``) on a free port, with mTLS."""
    from shuffledp.shuffler.process import ShufflerProcess

    root, cert, key = keys.tls
    with ShufflerProcess(keys.d.config, root_certificate=root, client_certificate=cert, client_key=key,
                         startup_timeout=120.0) as proc:
        yield proc


@pytest.fixture
def shuffler_client(keys: Keys, shuffler_service: Any) -> Iterator[Any]:
    from shuffledp.shuffler.client import ShufflerClient

    root, cert, key = keys.tls
    client = ShufflerClient(
        shuffler_service.address,
        root_certificate=root,
        client_certificate=cert,
        client_key=key,
        shuffler_verify_key=keyfiles.load_public_key(keys.d.shuffler_signing_pub, "ed25519"),
        max_message_bytes=8 * 1024 * 1024,
    )
    yield client
    client.close()


def make_config(tmp_path: Path, keys: Keys, **overrides: Any) -> ServerConfig:
    """A small, fast configuration for round tests (k = K, unlimited budget unless overridden)."""
    raw: dict[str, Any] = {
        "num-server-rounds": 3,
        "min-reports": K,
        "reply-timeout": 0.5,  # only silent nodes make a round wait this long
        "eps0": 8.0,
        "clip-l1": 1.0,
        "server-lr": 0.5,
        "pca-components": 0,  # the fake clients below train on the raw 64 pixels
        "keys-dir": str(keys.d.root),
        "output-dir": str(tmp_path / "outputs"),
        "run-name": "t",
        "budget-epsilon": "inf",
    }
    raw.update(overrides)
    return parse_run_config(raw)


# -- clients -------------------------------------------------------------------------------------------------

Behaviour = Callable[[Message, int], "Message | None"]


@dataclass
class FakeGrid:
    """A Grid whose nodes are Python callables. ``behaviours[node_id](msg, partition_id) -> reply | None``.

    Node ids are random 63-bit integers (as Flower's); partition ids are 0..N-1 in node order. Every message
    the server sends is recorded (``sent``) so tests can check what left the server.
    """

    behaviours: dict[int, Behaviour]
    partition: dict[int, int] = field(default_factory=dict)
    sent: list[Message] = field(default_factory=list)
    pending: dict[str, Message] = field(default_factory=dict)
    calls: int = 0
    pull_interval: float = 0.01

    @classmethod
    def build(cls, behaviours: list[Behaviour]) -> FakeGrid:
        ids = sorted({secrets.randbits(63) for _ in range(len(behaviours) * 2)})[: len(behaviours)]
        return cls(behaviours=dict(zip(ids, behaviours)), partition={nid: i for i, nid in enumerate(ids)})

    def get_node_ids(self) -> Iterable[int]:
        return list(self.behaviours)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Like Flower's grids: gives each message an id; the node's behaviour runs at once and its reply (if
        any) waits to be pulled."""
        self.calls += 1
        ids = []
        for i, msg in enumerate(messages):
            mid = f"m{self.calls}-{i}"
            msg.metadata.__dict__["_message_id"] = mid
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            reply = self.behaviours[node](msg, self.partition[node])
            if reply is not None:
                self.pending[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """The replies that are ready for these ids (each returned once, as Flower deletes pulled messages)."""
        return [self.pending.pop(m) for m in list(message_ids) if m in self.pending]


def envelope_reply(msg: Message, envelope: bytes) -> Message:
    return Message(RecordDict({M.ENVELOPE_KEY: M.envelope_record(envelope)}), reply_to=msg)


def silent(msg: Message, pid: int) -> Message | None:
    """A client that drops out (never replies before the timeout)."""
    return None


def refusing(msg: Message, pid: int) -> Message:
    """A client that refuses the request (as for a pinned-eps0 mismatch)."""
    return Message(Error(M.ERR_PINNED_MISMATCH, "eps0 differs from the pinned value"), reply_to=msg)


def garbage_envelope(msg: Message, pid: int) -> Message:
    """A client that replies with random bytes in the right record shape."""
    return envelope_reply(msg, secrets.token_bytes(400))


def garbage_record(msg: Message, pid: int) -> Message:
    """A client that replies with something that is not the envelope schema at all."""
    bad = ArrayRecord({"weights": Array(np.ones(3, dtype=np.float32))})
    return Message(RecordDict({"arrays": bad}), reply_to=msg)


# -- the honest client: the clients package's pure core function ----------------------------------------------


def honest_factory(keys: Keys, n_partitions: int = N_CLIENTS) -> Behaviour:
    """An honest client: ``shuffledp.clients.core.make_envelope`` on its digits partition, with its own pinned settings.

    The pinned eps0 / clip are read from the first request it gets, as if the operator had configured the
    same values as the server (a client pinned to other values is the ``refusing`` behaviour).
    """
    from shuffledp.clients.core import make_envelope
    from shuffledp.clients.data import load_partition
    from shuffledp.clients.settings import PinnedSettings

    def behaviour(msg: Message, pid: int) -> Message:
        cfg = M.TrainConfig.from_mapping(msg.content[M.CONFIG_KEY])
        pinned = PinnedSettings(
            eps0=cfg.eps0,
            clip_l1=cfg.clip_l1,
            client_key=keys.client_key(pid),
            server_public_key=keys.server_pk,
            shuffler_public_key=keys.shuffler_pk,
            partition_id=pid,
            num_partitions=n_partitions,
        )
        arrays = msg.content[M.ARRAYS_KEY].to_numpy_ndarrays()
        data = load_partition(pid, n_partitions)
        return envelope_reply(msg, make_envelope(arrays, msg.content[M.CONFIG_KEY], pinned, data))

    return behaviour


def inner_garbage_factory(keys: Keys) -> Behaviour:
    """A signed, correctly bound envelope whose inner payload is not a valid report (opened, then rejected).

    The payload has a valid report's length (the shuffler refuses a batch whose inner ciphertexts differ in
    length) but a wrong magic.
    """
    from shuffledp.clients.report import report_length
    from shuffledp.shuffler.envelope import seal

    def behaviour(msg: Message, pid: int) -> Message:
        cfg = M.TrainConfig.from_mapping(msg.content[M.CONFIG_KEY])
        arrays = msg.content[M.ARRAYS_KEY].to_numpy_ndarrays()
        dim = sum(a.size for a in arrays)
        envelope = seal(
            b"JUNK" + bytes(report_length(dim) - 4),
            server_public_key=keys.server_pk,
            shuffler_public_key=keys.shuffler_pk,
            signing_key=keys.client_key(pid),
            key_epoch=cfg.key_epoch,
            round_id=cfg.round,
            model_digest=M.arrays_digest(arrays),
        )
        return envelope_reply(msg, envelope)

    return behaviour


def model_arrays() -> list[np.ndarray]:
    """The default model of the main job: logistic regression on digits (64 features, 10 classes)."""
    from shuffledp.clients.models import initial_arrays

    return initial_arrays("logreg", 64, 10)


def digits_evaluator(arrays: Any) -> tuple[float, float]:
    """Central evaluation on the digits test split (as the ServerApp does)."""
    from shuffledp.clients.data import load_data
    from shuffledp.clients.models import evaluate

    ds = load_data("digits")
    return evaluate(arrays, ds.x_test, ds.y_test)


@dataclass
class Harness:
    """Everything a round test needs, bundled as one fixture (test modules cannot import conftest)."""

    tmp_path: Path
    keys: Keys
    shuffler: Any
    service: Any
    K: int = K
    N: int = N_CLIENTS
    silent: Behaviour = staticmethod(silent)  # type: ignore[assignment] - a staticmethod read as a Behaviour
    refusing: Behaviour = staticmethod(refusing)  # type: ignore[assignment] - a staticmethod read as a Behaviour
    garbage_envelope: Behaviour = staticmethod(garbage_envelope)  # type: ignore[assignment] - a staticmethod read as a Behaviour
    garbage_record: Behaviour = staticmethod(garbage_record)  # type: ignore[assignment] - a staticmethod read as a Behaviour
    kit_envelope_reply: Any = staticmethod(envelope_reply)

    def honest(self) -> Behaviour:
        return honest_factory(self.keys)

    def inner_garbage(self) -> Behaviour:
        return inner_garbage_factory(self.keys)

    def config(self, **overrides: Any) -> ServerConfig:
        return make_config(self.tmp_path, self.keys, **overrides)

    def grid(self, behaviours: list[Behaviour]) -> FakeGrid:
        return FakeGrid.build(behaviours)

    def opener(self, cfg: ServerConfig) -> Callable[[bytes, int], bytes]:
        from shuffledp.shuffler.envelope import open_inner

        sk = keyfiles.load_private_key(self.keys.d.server_hpke_key, "x25519")
        return lambda inner, rnd: open_inner(inner, server_private_key=sk, key_epoch=cfg.key_epoch, round_id=rnd)

    def recording_opener(self, cfg: ServerConfig) -> tuple[Callable[[bytes, int], bytes], list[bytes]]:
        """An opener that also keeps every payload it opened (the list it returns with it)."""
        opener, opened = self.opener(cfg), []

        def recording(inner: bytes, round_id: int) -> bytes:
            payload = opener(inner, round_id)
            opened.append(payload)
            return payload

        return recording, opened

    def engine(self, cfg: ServerConfig, grid: FakeGrid, *, ledger: Any = None, store: Any = None,
               evaluator: Any = None, open_inner: Any = None) -> Any:
        from shuffledp.accounting.ledger import Ledger
        from shuffledp.server.rounds import RoundEngine
        from shuffledp.server.state import SqliteCheckpointStore

        out = self.tmp_path / "outputs" / cfg.run_name
        out.mkdir(parents=True, exist_ok=True)
        return RoundEngine(
            cfg,
            grid=grid,
            shuffler=self.shuffler,
            open_inner=open_inner or self.opener(cfg),
            evaluator=evaluator or digits_evaluator,
            initial_arrays=model_arrays(),
            ledger=ledger if ledger is not None else Ledger(out / "ledger.sqlite"),
            store=store if store is not None else SqliteCheckpointStore(out / "state.sqlite"),
        )


@pytest.fixture
def h(tmp_path: Path, keys: Keys, shuffler_client: Any, shuffler_service: Any) -> Harness:
    return Harness(tmp_path=tmp_path, keys=keys, shuffler=shuffler_client, service=shuffler_service)


@pytest.fixture
def kit() -> Any:
    """The module-level helpers of this conftest (test modules cannot import conftest under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        FakeGrid=FakeGrid,
        honest_factory=honest_factory,
        make_config=make_config,
        model_arrays=model_arrays,
        digits_evaluator=digits_evaluator,
        silent=silent,
        envelope_reply=envelope_reply,
        N=N_CLIENTS,
        K=K,
    )
