"""The mechanism is pinned like eps0: read from the node's own configs, checked at the boundary, and a request for
another mechanism (or another clip-l2) is refused by the mod before the wrapped app touches the data."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, Metadata, RecordDict
from flwr.clientapp import ClientApp

from shuffledp.clients import mechanism as mechanism_module
from shuffledp.clients import messages
from shuffledp.clients.messages import ERR_CLIENT_SETUP, ERR_PINNED_MISMATCH, MESSAGE_TYPE, RequestError, TrainConfig
from shuffledp.clients.mod import shuffle_mod
from shuffledp.clients.settings import (
    ClientSetupError,
    PinnedMismatchError,
    PinnedSettings,
    check_pinned,
    pinned_from_configs,
)

shuffler_keys = pytest.importorskip("shuffledp.shuffler.keys")
envelope = pytest.importorskip("shuffledp.shuffler.envelope")

EPS0 = 2.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return shuffler_keys.init_key_directory(tmp_path_factory.mktemp("k") / "keys", 1)


def _pinned(**kw) -> PinnedSettings:
    base = {"eps0": EPS0, "clip_l1": 1.0, "client_key": bytes(32), "server_public_key": bytes(32),
            "shuffler_public_key": bytes(32)}
    return PinnedSettings(**{**base, **kw})


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"round": 1, "key_epoch": 0, "eps0": EPS0, "clip_l1": 1.0, **kw})


def test_the_request_schema_names_the_mechanism() -> None:
    assert messages._MECHANISM_NAMES == mechanism_module.MECHANISMS
    plain = _cfg()
    assert plain.mechanism == "laplace" and plain.clip_l2 is None and "clip-l2" not in plain.to_dict()
    old = {k: v for k, v in plain.to_dict().items() if k != "mechanism"}
    assert TrainConfig.from_mapping(old).mechanism == "laplace"  # a request without the key asks for laplace
    l2 = _cfg(mechanism="duchi", clip_l2=0.5)
    assert TrainConfig.from_mapping(l2.to_dict()) == l2
    with pytest.raises(RequestError, match="'mechanism'.* must be one of"):
        TrainConfig.from_mapping({**plain.to_dict(), "mechanism": "gaussian"})
    with pytest.raises(RequestError, match="'clip-l2'.* must be finite and > 0"):
        TrainConfig.from_mapping({**plain.to_dict(), "clip-l2": -1.0})


def test_pinned_settings_check_the_mechanism_at_the_boundary() -> None:
    assert _pinned().mechanism == "laplace"
    duchi = _pinned(mechanism="duchi", clip_l2=0.5)
    assert duchi.local_mechanism().name == "duchi" and duchi.local_mechanism().clip == 0.5
    assert _pinned().local_mechanism().name == "laplace"
    with pytest.raises(ClientSetupError, match="must be one of laplace, duchi, privunit2"):
        _pinned(mechanism="rr")
    with pytest.raises(ClientSetupError, match="needs a pinned clip-l2"):
        _pinned(mechanism="privunit2")
    with pytest.raises(ClientSetupError, match="clip-l2 must be a finite number > 0"):
        _pinned(mechanism="duchi", clip_l2=float("nan"))
    with pytest.raises(ClientSetupError, match="log2-grid belongs to the laplace mechanism"):
        _pinned(mechanism="duchi", clip_l2=1.0, log2_grid=-10)
    with pytest.raises(ClientSetupError, match="eps0 must be <= 64"):
        _pinned(mechanism="duchi", clip_l2=1.0, eps0=100.0)


def test_check_pinned_refuses_another_mechanism_or_clip() -> None:
    duchi = _pinned(mechanism="duchi", clip_l2=0.5)
    check_pinned(_cfg(mechanism="duchi", clip_l2=0.5, clip_l1=3.0), duchi)  # clip-l1 is laplace's, not compared
    for cfg in (_cfg(), _cfg(mechanism="privunit2", clip_l2=0.5), _cfg(mechanism="duchi", clip_l2=0.25),
                _cfg(mechanism="duchi"), _cfg(mechanism="duchi", clip_l2=0.5, eps0=1.0)):
        with pytest.raises(PinnedMismatchError, match="refuses to change"):
            check_pinned(cfg, duchi)
    with pytest.raises(PinnedMismatchError, match="mechanism='laplace'"):
        check_pinned(_cfg(mechanism="duchi", clip_l2=1.0), _pinned())


def test_pinned_from_configs_reads_the_mechanism(keys) -> None:
    run = {"eps0": EPS0, "clip-l1": 1.0, "keys-dir": str(keys.root)}
    node = {"partition-id": 0, "num-partitions": 1}
    assert pinned_from_configs(node, run).mechanism == "laplace"
    sim = pinned_from_configs(node, {**run, "mechanism": "privunit2", "clip-l2": 0.7})
    assert (sim.mechanism, sim.clip_l2) == ("privunit2", 0.7)  # research-only is allowed in simulation
    with pytest.raises(ClientSetupError, match="no 'clip-l2'"):
        pinned_from_configs(node, {**run, "mechanism": "duchi"})
    with pytest.raises(ClientSetupError, match="must be one of"):
        pinned_from_configs(node, {**run, "mechanism": 3})
    device = {**node, "eps0": EPS0, "client-key": str(keys.client_key(0)),
              "server-public-key": str(keys.server_hpke_pub), "shuffler-public-key": str(keys.shuffler_hpke_pub)}
    dev = pinned_from_configs({**device, "mechanism": "duchi", "clip-l2": 0.5}, {})  # no clip-l1 needed
    assert (dev.mechanism, dev.clip_l2) == ("duchi", 0.5)
    with pytest.raises(ClientSetupError, match="research-only"):
        pinned_from_configs({**device, "mechanism": "privunit2", "clip-l2": 0.5}, {})


# -- the mod ------------------------------------------------------------------------------------------------------

MODEL = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)}


def _msg(cfg: TrainConfig) -> Message:
    record = ArrayRecord({k: Array.from_numpy_ndarray(v) for k, v in MODEL.items()})
    content = RecordDict({"arrays": record, "config": cfg.to_config_record()})
    md = Metadata(run_id=1, message_id=f"m{time.monotonic_ns()}", src_node_id=1, dst_node_id=7,
                  reply_to_message_id="", group_id=str(cfg.round), created_at=time.time(), ttl=600.0,
                  message_type=MESSAGE_TYPE)
    return Message(content, metadata=md)


class _App:
    def __init__(self) -> None:
        self.calls = 0
        self.app = ClientApp(mods=[shuffle_mod])

        @self.app.train("shuffled")
        def train(msg: Message, context: Context) -> Message:
            self.calls += 1
            arrays = msg.content.array_records["arrays"]
            out = {k: a.numpy() + np.float32(0.25) for k, a in arrays.items()}
            rec = ArrayRecord({k: Array.from_numpy_ndarray(v) for k, v in out.items()})
            return Message(RecordDict({"arrays": rec}), reply_to=msg)


def _ctx(keys, **run) -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                   run_config={"eps0": EPS0, "clip-l1": 1.0, "keys-dir": str(keys.root), **run})


def test_the_mod_refuses_another_mechanism_before_the_app_runs(keys) -> None:
    app = _App()
    ctx = _ctx(keys, mechanism="duchi", **{"clip-l2": 0.5})
    for cfg in (_cfg(), _cfg(mechanism="privunit2", clip_l2=0.5), _cfg(mechanism="duchi", clip_l2=1.0)):
        reply = app.app(_msg(cfg), ctx)
        assert reply.has_error() and reply.error.code == ERR_PINNED_MISMATCH, reply
    assert app.calls == 0
    # a misconfigured client (L2 mechanism without its clip) is a setup error, also before the app runs
    reply = app.app(_msg(_cfg(mechanism="duchi", clip_l2=0.5)), _ctx(keys, mechanism="duchi"))
    assert reply.has_error() and reply.error.code == ERR_CLIENT_SETUP and "clip-l2" in reply.error.reason
    assert app.calls == 0


@pytest.mark.parametrize("name", ["duchi", "privunit2"])
def test_the_mod_sends_the_pinned_mechanisms_report(keys, name: str) -> None:
    from shuffledp.clients.mechanism import make_mechanism
    from shuffledp.clients.messages import arrays_digest, envelope_from_record

    app = _App()
    reply = app.app(_msg(_cfg(mechanism=name, clip_l2=0.5)), _ctx(keys, mechanism=name, **{"clip-l2": 0.5}))
    assert not reply.has_error(), reply.error
    load = shuffler_keys.load_private_key
    outer = envelope.open_outer(envelope_from_record(reply.content["envelope"]),
                                shuffler_private_key=load(keys.shuffler_hpke_key), key_epoch=0, round_id=1,
                                model_digest=arrays_digest(list(MODEL.values())))
    payload = envelope.open_inner(outer.inner, server_private_key=load(keys.server_hpke_key), key_epoch=0,
                                  round_id=1)
    mech = make_mechanism(name, eps0=EPS0, clip_l2=0.5)
    assert len(payload) == mech.report_length(12)
    estimate = mech.decode(payload, 12)
    assert estimate.shape == (12,) and np.all(np.isfinite(estimate))
