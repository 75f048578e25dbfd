"""The client mod around a ClientApp that is not the project's: a numpy "model" with its own train function."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, Metadata, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from shuffledp.clients.core import local_model
from shuffledp.clients.messages import (
    ERR_BAD_REQUEST,
    ERR_CLIENT_SETUP,
    ERR_PINNED_MISMATCH,
    MESSAGE_TYPE,
    TrainConfig,
    arrays_digest,
    envelope_from_record,
)
from shuffledp.clients.mod import STATE_ENVELOPE, shuffle_mod
from shuffledp.clients.randomizer import clip_l1, flatten_arrays
from shuffledp.clients.report import decode_report

shuffler_keys = pytest.importorskip("shuffledp.shuffler.keys")
envelope = pytest.importorskip("shuffledp.shuffler.envelope")

EPS0, CLIP = 64.0, 1.0  # the largest eps0: the decoded report is the clipped update up to noise of scale 1/32
DIM = 8
TOL = 0.4  # P[|Laplace(1/32)| > 0.4] = exp(-12.8) per coordinate


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return shuffler_keys.init_key_directory(tmp_path_factory.mktemp("k") / "keys", 1)


def _record(model: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array.from_numpy_ndarray(np.ascontiguousarray(v)) for k, v in model.items()})


def _model() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(3, 2) / 10, "b": np.array([0.5, -0.5], np.float32)}


STEP = {"w": np.array([[0.2, -0.1], [0.0, 0.05], [0.3, 0.0]], np.float32), "b": np.array([-0.1, 0.25], np.float32)}


class Custom:
    """A ClientApp of its own: train adds STEP (or what ``make`` returns) to the model, and counts its calls."""

    def __init__(self, make=None) -> None:
        self.calls = 0
        self.app = ClientApp(mods=[shuffle_mod])
        self.make = make or (lambda model: {k: v + STEP[k] for k, v in model.items()})

        @self.app.train("shuffled")
        def train(msg: Message, context: Context) -> Message:
            self.calls += 1
            model = {k: a.numpy() for k, a in msg.content.array_records["arrays"].items()}
            out = self.make(model)
            if isinstance(out, Error):
                return Message(out, reply_to=msg)
            metrics = MetricRecord({"loss": 0.25, "num-examples": 17})
            return Message(RecordDict({"arrays": _record(out), "metrics": metrics,
                                       "echo": ConfigRecord({"secret": "local"})}), reply_to=msg)


def _cfg(rnd: int = 1, **kw) -> TrainConfig:
    return TrainConfig(**{"round": rnd, "key_epoch": 0, "eps0": EPS0, "clip_l1": CLIP, "report": "delta", **kw})


def _msg(model: dict[str, np.ndarray], cfg: TrainConfig, message_type: str = MESSAGE_TYPE) -> Message:
    content = RecordDict({"arrays": _record(model), "config": cfg.to_config_record()})
    md = Metadata(run_id=1, message_id=f"m{time.monotonic_ns()}", src_node_id=1, dst_node_id=7,
                  reply_to_message_id="", group_id=str(cfg.round), created_at=time.time(), ttl=600.0,
                  message_type=message_type)
    return Message(content, metadata=md)


def _ctx(keys, **run) -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                   run_config={"eps0": EPS0, "clip-l1": CLIP, "keys-dir": str(keys.root), **run})


def _open(keys, reply: Message, model: dict[str, np.ndarray], rnd: int) -> np.ndarray:
    load = shuffler_keys.load_private_key
    env = envelope_from_record(reply.content["envelope"])
    outer = envelope.open_outer(env, shuffler_private_key=load(keys.shuffler_hpke_key), key_epoch=0, round_id=rnd,
                                model_digest=arrays_digest(list(model.values())))
    payload = envelope.open_inner(outer.inner, server_private_key=load(keys.server_hpke_key), key_epoch=0,
                                  round_id=rnd)
    return decode_report(payload, expected_dim=DIM)


def _delta() -> np.ndarray:
    model = _model()
    return flatten_arrays([(model[k] + STEP[k]).astype(np.float64) - model[k] for k in model])


def test_the_reply_is_the_envelope_only_and_opens_to_the_clipped_delta(keys) -> None:
    app = Custom()
    reply = app.app(_msg(_model(), _cfg(1)), _ctx(keys))
    assert not reply.has_error(), reply.error
    assert list(reply.content.keys()) == ["envelope"]  # no arrays, metrics or configs of the wrapped app
    assert list(reply.content.array_records["envelope"].keys()) == ["ct"]
    assert not reply.content.metric_records and not reply.content.config_records
    report = _open(keys, reply, _model(), 1)
    assert report.shape == (DIM,)
    expected = clip_l1(_delta(), CLIP)
    assert np.abs(_delta()).sum() > CLIP  # the update was clipped
    assert np.max(np.abs(report - expected)) < TOL
    assert app.calls == 1


def test_a_gradient_report_is_the_pseudo_gradient_of_the_local_step(keys) -> None:
    lr = 0.5
    step = {"w": np.full((3, 2), -0.01, np.float32), "b": np.array([0.05, 0.0], np.float32)}
    app = Custom(lambda model: {k: v + step[k] for k, v in model.items()})
    reply = app.app(_msg(_model(), _cfg(2, report="gradient", local_lr=lr)), _ctx(keys))
    expected = -flatten_arrays([step["w"], step["b"]]) / lr  # (w - w_local) / local-lr
    assert np.max(np.abs(_open(keys, reply, _model(), 2) - clip_l1(expected, CLIP))) < TOL


def test_a_request_refused_by_the_pinned_settings_never_runs_the_wrapped_app(keys) -> None:
    app = Custom()
    ctx = _ctx(keys, **{"max-local-epochs": 2})
    for cfg in (_cfg(1, eps0=8.0), _cfg(1, clip_l1=2.0), _cfg(1, local_epochs=3)):
        reply = app.app(_msg(_model(), cfg), ctx)
        assert reply.has_error() and reply.error.code == ERR_PINNED_MISMATCH, reply
    bad_group = _msg(_model(), _cfg(1))
    bad_group.metadata.group_id = "2"
    reply = app.app(bad_group, ctx)
    assert reply.has_error() and reply.error.code == ERR_BAD_REQUEST
    reply = app.app(_msg(_model(), _cfg(1)), _ctx(keys, **{"max-model-parameters": DIM - 1}))
    assert reply.has_error() and reply.error.code == ERR_PINNED_MISMATCH
    assert app.calls == 0
    assert STATE_ENVELOPE not in ctx.state.array_records


@pytest.mark.parametrize("change", ["shape", "dtype", "names", "records"])
def test_a_reply_that_does_not_match_the_received_model_is_refused(keys, change: str) -> None:
    def wrong(model: dict[str, np.ndarray]):
        if change == "shape":
            return {"w": np.zeros((2, 3), np.float32), "b": model["b"]}
        if change == "dtype":
            return {"w": model["w"].astype(np.float64), "b": model["b"]}
        return {"weights": model["w"], "b": model["b"]}

    app = Custom(wrong)
    if change == "records":  # a reply with metrics only, no ArrayRecord
        app.app = ClientApp(mods=[shuffle_mod])

        @app.app.train("shuffled")
        def train(msg: Message, context: Context) -> Message:
            app.calls += 1
            return Message(RecordDict({"metrics": MetricRecord({"loss": 1.0})}), reply_to=msg)

    ctx = _ctx(keys)
    reply = app.app(_msg(_model(), _cfg(1)), ctx)
    assert app.calls == 1
    assert reply.has_error() and reply.error.code == ERR_CLIENT_SETUP
    assert "ArrayRecord" in reply.error.reason or "does not match the received model" in reply.error.reason
    assert not reply.has_content()
    assert STATE_ENVELOPE not in ctx.state.array_records


def test_a_retry_gets_the_cached_envelope_without_running_the_wrapped_app(keys) -> None:
    app = Custom()
    ctx = _ctx(keys)
    first = app.app(_msg(_model(), _cfg(3)), ctx)
    again = app.app(_msg(_model(), _cfg(3)), ctx)
    assert envelope_from_record(again.content["envelope"]) == envelope_from_record(first.content["envelope"])
    assert app.calls == 1
    other = app.app(_msg({k: v * 0 for k, v in _model().items()}, _cfg(3)), ctx)
    assert other.has_error() and "already answered" in other.error.reason and app.calls == 1


def test_a_failing_wrapped_app_reports_the_zero_update_and_its_refusals_are_passed_on(keys, caplog) -> None:
    """A failure of the local work may depend on the data: the report is the zero update, randomized as usual,
    never an error reply. A refusal the wrapped app replies with is its own decision and is passed on."""
    import logging

    def boom(model):
        raise FloatingPointError("record 17 overflows")

    with caplog.at_level(logging.WARNING, logger="shuffledp.client"):
        reply = Custom(boom).app(_msg(_model(), _cfg(1)), _ctx(keys))
    assert not reply.has_error() and "FloatingPointError" in caplog.text
    assert np.max(np.abs(_open(keys, reply, _model(), 1))) < TOL
    inf = Custom(lambda model: {k: np.full_like(v, np.inf) for k, v in model.items()})
    reply = inf.app(_msg(_model(), _cfg(1)), _ctx(keys))
    assert not reply.has_error() and np.max(np.abs(_open(keys, reply, _model(), 1))) < TOL
    refusing = Custom(lambda model: Error(code=ERR_BAD_REQUEST, reason="this app trains no such model"))
    reply = refusing.app(_msg(_model(), _cfg(1)), _ctx(keys))
    assert reply.has_error() and (reply.error.code, reply.error.reason) == (ERR_BAD_REQUEST,
                                                                             "this app trains no such model")


def test_other_message_categories_pass_through(keys) -> None:
    app = ClientApp(mods=[shuffle_mod])

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"m": MetricRecord({"x": 1.0})}), reply_to=msg)

    reply = app(_msg(_model(), _cfg(1), message_type="query"), _ctx(keys))
    assert list(reply.content.keys()) == ["m"]


def test_the_projects_training_function_gives_todays_report(monkeypatch) -> None:
    """The project's ClientApp is the mod around train_model: the update the mod derives from local_model's model is
    compute_update's delta bit for bit, and its average gradient up to the rounding of the model to float32."""
    import shuffledp.clients.core as core
    from shuffledp.clients.data import load_partition
    from shuffledp.clients.models import initial_arrays

    x, y = load_partition(0, 3, dataset="digits", pca_components=None)
    w = initial_arrays("logreg", 64, 10)
    w64 = flatten_arrays(w)
    computed = {}
    real = core.compute_update

    def recording(arrays, cfg, x_, y_):  # two trainings differ (minibatch order): compare with the same one
        computed[cfg.report] = real(arrays, cfg, x_, y_)
        return computed[cfg.report]

    monkeypatch.setattr(core, "compute_update", recording)
    delta_cfg = _cfg(1, local_epochs=2, batch_size=16, local_lr=0.1)
    new = local_model(w, delta_cfg, x, y)
    assert [a.dtype for a in new] == [a.dtype for a in w] and [a.shape for a in new] == [a.shape for a in w]
    assert np.array_equal(flatten_arrays(new) - w64, computed["delta"])
    grad_cfg = _cfg(1, report="gradient", local_lr=0.5)
    derived = (w64 - flatten_arrays(local_model(w, grad_cfg, x, y))) / 0.5
    assert np.max(np.abs(derived - computed["gradient"])) <= max(np.max(np.spacing(np.abs(a))) for a in w) / 0.5
    assert np.max(np.abs(computed["gradient"])) > 1e-3  # a real gradient
