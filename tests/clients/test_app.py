"""The ClientApp (Flower glue) and its pure core, with real keys and shuffledp.shuffler.envelope."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from shuffledp.clients.app import STATE_ENVELOPE, STATE_REQUEST, app, train_shuffled
from shuffledp.clients.core import make_envelope, make_payload
from shuffledp.clients.messages import (
    ERR_BAD_REQUEST,
    ERR_CLIENT_SETUP,
    ERR_PINNED_MISMATCH,
    MESSAGE_TYPE,
    RequestError,
    TrainConfig,
    arrays_digest,
    envelope_from_record,
)
from shuffledp.clients.models import initial_arrays
from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer
from shuffledp.clients.report import decode_report_full
from shuffledp.clients.settings import PinnedMismatchError, PinnedSettings

shuffler_keys = pytest.importorskip("shuffledp.shuffler.keys")
envelope = pytest.importorskip("shuffledp.shuffler.envelope")

EPS0, CLIP = 2.0, 1.0
N_PART = 3
PID = 1


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return shuffler_keys.init_key_directory(tmp_path_factory.mktemp("k") / "keys", N_PART)


@pytest.fixture(scope="module")
def model() -> list[np.ndarray]:
    return initial_arrays("logreg", 64, 10)


def _msg(arrays, cfg: dict | TrainConfig, *, group: str | None = None) -> Message:
    cfgd = cfg.to_dict() if isinstance(cfg, TrainConfig) else cfg
    content = RecordDict({"arrays": ArrayRecord(arrays), "config": ConfigRecord(cfgd)})
    md = Metadata(
        run_id=1, message_id=f"m{time.monotonic_ns()}", src_node_id=1, dst_node_id=7, reply_to_message_id="",
        group_id=group if group is not None else str(cfgd.get("round", "")), created_at=time.time(), ttl=600.0,
        message_type=MESSAGE_TYPE,
    )
    return Message(content, metadata=md)


def _ctx(keys, **run_overrides) -> Context:
    run = {"eps0": EPS0, "clip-l1": CLIP, "keys-dir": str(keys.root), "pca-components": 0}  # model uses 64 pixels
    run.update(run_overrides)
    return Context(run_id=1, node_id=7, node_config={"partition-id": PID, "num-partitions": N_PART},
                   state=RecordDict(), run_config=run)


def _cfg(rnd: int = 1, **kw) -> TrainConfig:
    base = {"round": rnd, "key_epoch": 0, "eps0": EPS0, "clip_l1": CLIP}
    base.update(kw)
    return TrainConfig(**base)


def _open(keys, env: bytes, rnd: int, digest: bytes) -> bytes:
    load = shuffler_keys.load_private_key
    opened = envelope.open_outer(env, shuffler_private_key=load(keys.shuffler_hpke_key), key_epoch=0,
                                 round_id=rnd, model_digest=digest)
    enrol = shuffler_keys.load_enrolment(keys.enrolment)
    assert opened.signer_public_key == enrol[shuffler_keys.client_id(PID)]  # signed with client PID's key
    return envelope.open_inner(opened.inner, server_private_key=load(keys.server_hpke_key), key_epoch=0,
                               round_id=rnd)


def test_reply_is_only_the_envelope_and_opens_to_a_valid_report(keys, model) -> None:
    ctx = _ctx(keys)
    rep = train_shuffled(_msg(model, _cfg(1)), ctx)
    assert not rep.has_error()
    assert list(rep.content.keys()) == ["envelope"]
    assert list(rep.content.array_records["envelope"].keys()) == ["ct"]
    assert not rep.content.metric_records and not rep.content.config_records
    env = envelope_from_record(rep.content["envelope"])
    payload = _open(keys, env, 1, arrays_digest(model))
    report = decode_report_full(payload, expected_dim=650)
    assert report.eps_used <= EPS0
    # the envelope is bound to the model digest: a tagged (different) model digest does not open
    other = [model[0] + np.float32(1.0), model[1]]
    with pytest.raises(envelope.EnvelopeError):
        _open(keys, env, 1, arrays_digest(other))


def test_retry_returns_the_same_bytes_and_only_one_report_per_round(keys, model) -> None:
    ctx = _ctx(keys)
    first = envelope_from_record(train_shuffled(_msg(model, _cfg(5)), ctx).content["envelope"])
    again = envelope_from_record(app(_msg(model, _cfg(5)), ctx).content["envelope"])  # via ClientApp dispatch
    assert again == first
    # same round, different model: refused (a second report would spend privacy twice)
    other = [model[0] * 0, model[1]]
    r = train_shuffled(_msg(other, _cfg(5)), ctx)
    assert r.has_error() and r.error.code == ERR_BAD_REQUEST and "already answered" in r.error.reason
    # same round, same model, different report kind: refused too
    r = train_shuffled(_msg(model, _cfg(5, report="delta")), ctx)
    assert r.has_error() and r.error.code == ERR_BAD_REQUEST
    # a new round gets fresh bytes and replaces the cache; then the old round is stale
    nxt = envelope_from_record(train_shuffled(_msg(model, _cfg(6)), ctx).content["envelope"])
    assert nxt != first
    assert ctx.state.config_records[STATE_REQUEST]["round"] == 6
    assert len(ctx.state.array_records) == 1 and STATE_ENVELOPE in ctx.state.array_records
    r = train_shuffled(_msg(model, _cfg(5)), ctx)
    assert r.has_error() and "stale round" in r.error.reason


@pytest.mark.parametrize("field,value", [("eps0", 4.0), ("eps0", 2.0000001), ("clip_l1", 10.0)])
def test_refuses_a_request_for_other_privacy_parameters(keys, model, field: str, value: float) -> None:
    ctx = _ctx(keys)
    r = train_shuffled(_msg(model, _cfg(1, **{field: value})), ctx)
    assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH
    assert "pinned" in r.error.reason
    assert STATE_ENVELOPE not in ctx.state.array_records  # nothing computed, nothing cached


def test_what_is_read_once_per_model_never_skips_a_requests_checks(keys, model) -> None:
    """The model is read once per content in a process (every client of a round receives the same one), the
    pinned settings and keys per node: a request for other privacy parameters is refused on every reply, also
    right after the same model was answered, and each node signs with its own key."""
    assert not train_shuffled(_msg(model, _cfg(1)), _ctx(keys)).has_error()
    for cfg in (_cfg(1, eps0=EPS0 * 2), _cfg(1, clip_l1=CLIP / 2), _cfg(1, mechanism="duchi", clip_l2=1.0)):
        ctx = _ctx(keys)
        r = train_shuffled(_msg(model, cfg), ctx)
        assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH, r
        assert STATE_ENVELOPE not in ctx.state
    r = train_shuffled(_msg(model, _cfg(1)), _ctx(keys, eps0=EPS0 / 2))  # the node pins another eps0
    assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH
    load = shuffler_keys.load_private_key
    enrol = shuffler_keys.load_enrolment(keys.enrolment)
    for pid in (0, 2, 0):
        ctx = _ctx(keys)
        ctx.node_config["partition-id"] = pid
        env = envelope_from_record(train_shuffled(_msg(model, _cfg(1)), ctx).content["envelope"])
        opened = envelope.open_outer(env, shuffler_private_key=load(keys.shuffler_hpke_key), key_epoch=0,
                                     round_id=1, model_digest=arrays_digest(model))
        assert opened.signer_public_key == enrol[shuffler_keys.client_id(pid)]


def test_work_beyond_the_pinned_limits_is_refused_on_the_request_alone(keys, model, monkeypatch) -> None:
    """The server cannot push the local work past what the client pinned (so past a reply-floor chosen to cover
    it): more local epochs, or smaller batches, than the pinned limits are refused before any data is loaded."""
    import shuffledp.clients.data
    def no_data(*a, **k):  # pragma: no cover - must not be reached
        raise AssertionError("the data was loaded for a request the limits refuse")

    ctx = _ctx(keys, **{"max-local-epochs": 3, "min-batch-size": 8})
    with monkeypatch.context() as m:
        m.setattr(shuffledp.clients.data, "load_partition", no_data)
        for over in ({"local_epochs": 4}, {"batch_size": 7}):
            r = train_shuffled(_msg(model, _cfg(1, report="delta", **{"local_epochs": 3, "batch_size": 8, **over})),
                               ctx)
            assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH
            assert "max-local-epochs=3, min-batch-size=8" in r.error.reason
    assert STATE_ENVELOPE not in ctx.state.array_records  # nothing computed, nothing cached
    # at the limits the request is answered; a gradient report does no local epochs, so they do not apply
    assert not train_shuffled(_msg(model, _cfg(1, report="delta", local_epochs=3, batch_size=8)), ctx).has_error()
    assert not train_shuffled(_msg(model, _cfg(2, local_epochs=50, batch_size=1)), ctx).has_error()
    # defaults: 10 epochs, batches of 1
    default = _ctx(keys)
    assert train_shuffled(_msg(model, _cfg(1, report="delta", local_epochs=11)), default).has_error()
    # the model's size scales the work per sample, and the server chooses it: a larger model is refused too
    small = _ctx(keys, **{"max-model-parameters": 649})  # the logreg on 64 pixels has 650
    with monkeypatch.context() as m:
        m.setattr(shuffledp.clients.data, "load_partition", no_data)
        r = train_shuffled(_msg(model, _cfg(1)), small)
    assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH
    assert "the model has 650 parameters; this client's limit is max-model-parameters=649" in r.error.reason
    assert not train_shuffled(_msg(model, _cfg(1)), _ctx(keys, **{"max-model-parameters": 650})).has_error()


def test_bad_requests_are_error_replies(keys, model) -> None:
    ctx = _ctx(keys)
    good = _cfg(1).to_dict()
    missing = dict(good)
    del missing["key-epoch"]
    for msg in (
        _msg(model, missing),
        _msg(model, good, group="2"),  # group_id must be str(round)
        _msg(model, {**good, "report": "weights"}),
        _msg([np.zeros((3, 3), np.float32)], good),  # not a known model
    ):
        r = train_shuffled(msg, ctx)
        assert r.has_error() and r.error.code == ERR_BAD_REQUEST, r.error
    no_keys = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 3},
                      state=RecordDict(), run_config={"eps0": EPS0, "clip-l1": CLIP, "pca-components": 0})
    r = train_shuffled(_msg(model, good), no_keys)
    assert r.has_error() and r.error.code == ERR_CLIENT_SETUP and "keys-dir" in r.error.reason


def test_deployment_node_config_pins_override_run_config(keys, model) -> None:
    node = {
        "eps0": 4.0,
        "clip-l1": 0.5,
        "client-key": str(keys.client_key(PID)),
        "server-public-key": str(keys.server_hpke_pub),
        "shuffler-public-key": str(keys.shuffler_hpke_pub),
        "partition-id": PID,
        "num-partitions": N_PART,
        "pca-components": 0,  # the device's data settings (the model takes 64 pixels)
    }
    # the simulation values in run_config are ignored in deployment
    ctx = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(),
                  run_config={"eps0": 2.0, "clip-l1": 1.0, "pca-components": 0})
    r = train_shuffled(_msg(model, _cfg(1)), ctx)
    assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH
    r = train_shuffled(_msg(model, _cfg(1, eps0=4.0, clip_l1=0.5)), ctx)
    assert not r.has_error()
    payload = _open(keys, envelope_from_record(r.content["envelope"]), 1, arrays_digest(model))
    assert decode_report_full(payload, expected_dim=650).eps_used <= 4.0


def test_core_without_flower(keys, model) -> None:
    load = shuffler_keys.load_private_key
    pinned = PinnedSettings(
        eps0=EPS0, clip_l1=CLIP, client_key=load(keys.client_key(0)),
        server_public_key=shuffler_keys.load_public_key(keys.server_hpke_pub),
        shuffler_public_key=shuffler_keys.load_public_key(keys.shuffler_hpke_pub),
        partition_id=0, num_partitions=N_PART,
    )
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)  # fixture data
    y = np.arange(5) % 10
    env = make_envelope(model, _cfg(9, report="delta", local_epochs=2, batch_size=2).to_dict(), pinned, (x, y))
    assert len(env) == len(make_payload(model, _cfg(9), pinned, (x, y))) + envelope.ENVELOPE_OVERHEAD
    with pytest.raises(PinnedMismatchError):
        make_envelope(model, _cfg(9, eps0=8.0), pinned, (x, y))
    with pytest.raises(PinnedMismatchError, match="max-model-parameters=100"):
        make_envelope(model, _cfg(9), dataclasses.replace(pinned, max_model_parameters=100), (x, y))
    with pytest.raises(RequestError):
        make_envelope(model, {"round": 1}, pinned, (x, y))


def test_pinned_settings_resolution_errors(keys) -> None:
    from shuffledp.clients.settings import ClientSetupError, data_settings_from_configs, pinned_from_configs

    node = {"partition-id": 0, "num-partitions": N_PART}
    run = {"eps0": EPS0, "clip-l1": CLIP, "keys-dir": str(keys.root), "pca-components": 0}  # model uses 64 pixels
    p = pinned_from_configs(node, run)
    assert (p.eps0, p.clip_l1, p.partition_id, p.log2_grid) == (EPS0, CLIP, 0, None)
    assert p.client_key == shuffler_keys.load_private_key(keys.client_key(0))
    assert "client_key" not in repr(p)  # the private key is never printed
    with pytest.raises(ClientSetupError, match="'clip-l1'"):
        pinned_from_configs(node, {"eps0": EPS0, "keys-dir": str(keys.root)})
    with pytest.raises(ClientSetupError, match="must be a number"):
        pinned_from_configs(node, {**run, "eps0": "2.0"})
    with pytest.raises(ClientSetupError, match="finite number > 0"):
        pinned_from_configs(node, {**run, "eps0": -1.0})
    with pytest.raises(ClientSetupError, match="keys"):
        pinned_from_configs({"partition-id": 99, "num-partitions": 100}, run)  # no key file for client 99
    with pytest.raises(ClientSetupError, match="num-partitions"):
        pinned_from_configs({"partition-id": 0}, run)
    with pytest.raises(ClientSetupError, match="partition-id must be in"):
        pinned_from_configs({"partition-id": 2, "num-partitions": 2}, run)
    with pytest.raises(ClientSetupError, match="log2-grid"):
        pinned_from_configs(node, {**run, "log2-grid": 1.5})
    # the grid may only be the one the server decodes with (a report on another stands out of the shuffled batch)
    grid = DiscreteLaplaceRandomizer(EPS0, CLIP).log2_grid
    assert pinned_from_configs(node, {**run, "log2-grid": grid}).log2_grid == grid
    for other in (grid - 1, grid + 3):
        with pytest.raises(ClientSetupError, match=f"pinned log2-grid={other}: the grid must be the one the server "
                                                   f"decodes with, {grid} for eps0="):
            pinned_from_configs(node, {**run, "log2-grid": other})
    for key, bad in (("max-local-epochs", 0), ("max-local-epochs", 10_001), ("max-local-epochs", 2.0),
                     ("min-batch-size", 0), ("min-batch-size", True)):
        with pytest.raises(ClientSetupError, match=f"pinned {key} must be an int in"):
            pinned_from_configs(node, {**run, key: bad})
    limits = pinned_from_configs(node, {**run, "max-local-epochs": 2, "min-batch-size": 16})
    assert (limits.max_local_epochs, limits.min_batch_size) == (2, 16)
    assert (p.max_local_epochs, p.min_batch_size, p.max_model_parameters) == (10, 1, 1_000_000)
    with pytest.raises(ClientSetupError, match="pinned max-model-parameters must be an int in \\[1, 268435456\\]"):
        pinned_from_configs(node, {**run, "max-model-parameters": 2**28 + 1})
    # settings only the randomizer refuses are setup errors too, found before any request uses the data (they
    # raised ValueError -> "bad request" after compute_update had run)
    with pytest.raises(ClientSetupError, match="eps0=100.0.*<= 64"):
        pinned_from_configs(node, {**run, "eps0": 100.0})
    with pytest.raises(ClientSetupError, match="clip-l1=4398046511104.0"):
        pinned_from_configs(node, {**run, "clip-l1": 2.0**42})
    dep = {"eps0": 1.0, "clip-l1": 1.0, "client-key": str(keys.root / "missing.key"),
           "server-public-key": str(keys.server_hpke_pub), "shuffler-public-key": str(keys.shuffler_hpke_pub),
           "partition-id": 0, "num-partitions": 1}
    with pytest.raises(ClientSetupError, match="cannot load"):
        pinned_from_configs(dep, {})
    # a missing path must not be read as "." ("cannot load the client's keys: . has mode 777")
    for absent in ("client-key", "shuffler-public-key"):
        with pytest.raises(ClientSetupError, match=f"has no \\['{absent}'\\]"):
            pinned_from_configs({k: v for k, v in dep.items() if k != absent}, {})
    assert data_settings_from_configs(node, {}) == {"dataset": "digits", "data_dir": None, "pca_components": 10,
                                                    "scheme": "iid", "alpha": 0.5, "seed": 0}
    assert data_settings_from_configs(node, {"pca-components": 0})["pca_components"] is None
    for key, bad in (("dataset", 3), ("data-dir", 1.0), ("pca-components", 2.5), ("pca-components", -1),
                     ("pca-components", True), ("partition", "zipf"), ("dirichlet-alpha", 0.0),
                     ("dirichlet-alpha", float("nan")), ("dirichlet-alpha", "0.5"), ("seed", -3)):
        with pytest.raises(ClientSetupError, match=f"run_config\\['{key}'\\] must be"):
            data_settings_from_configs(node, {key: bad})


def _deployment_node(keys, **data) -> dict:
    return {"eps0": EPS0, "clip-l1": CLIP, "client-key": str(keys.client_key(PID)),
            "server-public-key": str(keys.server_hpke_pub), "shuffler-public-key": str(keys.shuffler_hpke_pub),
            "partition-id": PID, "num-partitions": N_PART, **data}


def test_deployment_reads_the_data_its_node_config_names_not_the_servers(keys, model, tmp_path,
                                                                        monkeypatch) -> None:
    """In a deployment the server chose which files the device read (``data-dir``, ``dataset`` in its run
    config): it could point the client at any folder and tell from the reply (report, or "could not be
    loaded") whether a loadable dataset was there. Now the device's node config says; the run's dataset and
    PCA must agree with it, and the run's data-dir and partition settings are not read."""
    import shuffledp.clients.data
    loads: list[dict] = []
    real = shuffledp.clients.data.load_partition

    def recording(pid, n, **kw):
        loads.append(kw)
        return real(pid, n, dataset="digits", pca_components=None)

    monkeypatch.setattr(shuffledp.clients.data, "load_partition", recording)
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)  # a server-chosen folder holding a dataset
    node = _deployment_node(keys, **{"pca-components": 0, "data-dir": "/device/data", "seed": 3})
    # the run names the device's dataset and PCA, and its own data-dir and partition: a report, read as pinned
    run = {"pca-components": 0, "dataset": "digits", "data-dir": str(tmp_path), "partition": "dirichlet",
           "seed": 11}
    r = train_shuffled(_msg(model, _cfg(1)), Context(run_id=1, node_id=7, node_config=node, state=RecordDict(),
                                                     run_config=run))
    assert not r.has_error(), r.error
    assert loads == [{"dataset": "digits", "data_dir": "/device/data", "pca_components": None, "scheme": "iid",
                      "alpha": 0.5, "seed": 3}]
    # another dataset or PCA than the device's: refused on the configs alone, nothing loaded
    for other in ({**run, "dataset": "mnist"}, {**run, "pca-components": 10}):
        r = train_shuffled(_msg(model, _cfg(1)), Context(run_id=1, node_id=7, node_config=node,
                                                         state=RecordDict(), run_config=other))
        assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH, r.error
        assert "this device's data is pinned to" in r.error.reason
    # a node config without data settings pins the defaults (digits, PCA 10), which the run must then use
    r = train_shuffled(_msg(model, _cfg(1)), Context(run_id=1, node_id=7, node_config=_deployment_node(keys),
                                                     state=RecordDict(), run_config=run))
    assert r.has_error() and r.error.code == ERR_PINNED_MISMATCH and "pca-components=10" in r.error.reason
    # a data setting of the wrong type in the node config is the device's setup error
    bad = _deployment_node(keys, **{"pca-components": "ten"})
    r = train_shuffled(_msg(model, _cfg(1)), Context(run_id=1, node_id=7, node_config=bad, state=RecordDict(),
                                                     run_config={}))
    assert r.has_error() and r.error.code == ERR_CLIENT_SETUP and "node_config['pca-components']" in r.error.reason
    assert len(loads) == 1


def test_reply_floor_holds_every_reply_after_pinning(keys, model, caplog) -> None:
    """With a pinned reply-floor, a report, a cached retry and a refusal all leave no earlier than the floor, so
    the reply time does not tell the server how long the local work took; work slower than the floor is sent
    with a warning. Requests refused before the pinned settings are read (malformed) are not held."""
    import logging

    floor = 1.0
    ctx = _ctx(keys, **{"reply-floor": floor})
    for msg in (_msg(model, _cfg(1)), _msg(model, _cfg(1)), _msg(model, _cfg(1, eps0=4.0))):
        t0 = time.monotonic()
        r = train_shuffled(msg, ctx)
        assert time.monotonic() - t0 >= floor, r
        # the reply's own timestamp, which the SuperLink passes on to the server, is the padded time too (a reply
        # built before the sleep carried created_at = when the work ended, and a ttl counted from it)
        assert r.metadata.created_at - msg.metadata.created_at >= floor
        assert r.metadata.ttl <= msg.metadata.ttl - floor
    assert not train_shuffled(_msg(model, _cfg(1)), ctx).has_error()  # the cached report (second message)
    t0 = time.monotonic()
    r = train_shuffled(_msg(model, {"round": "x"}), ctx)
    assert r.has_error() and r.error.code == ERR_BAD_REQUEST and time.monotonic() - t0 < floor
    with caplog.at_level(logging.WARNING, logger="shuffledp.client"):
        r = train_shuffled(_msg(model, _cfg(2)), _ctx(keys, **{"reply-floor": 1e-6}))
    assert not r.has_error() and "more than reply-floor" in caplog.text
    node = {"partition-id": 0, "num-partitions": N_PART}
    run = {"eps0": EPS0, "clip-l1": CLIP, "keys-dir": str(keys.root)}
    from shuffledp.clients.settings import ClientSetupError, pinned_from_configs

    assert pinned_from_configs(node, run).reply_floor == 0.0
    assert pinned_from_configs(node, {**run, "reply-floor": 2}).reply_floor == 2.0
    for bad in (-1.0, 3601.0, float("nan"), True, "1"):
        with pytest.raises(ClientSetupError, match="reply-floor"):
            pinned_from_configs(node, {**run, "reply-floor": bad})
    r = train_shuffled(_msg(model, _cfg(3)), _ctx(keys, **{"reply-floor": -1.0}))
    assert r.has_error() and r.error.code == ERR_CLIENT_SETUP and "reply-floor" in r.error.reason


def test_key_files_are_read_once_per_identity_and_again_after_a_change(tmp_path, monkeypatch) -> None:
    """Keys are cached by file identity: a second request does not re-read them, a rotated key file is picked
    up, and loosened permissions on the private key are refused (the 0600 check is not bypassed by the cache)."""
    import os

    import shuffledp.shuffler.keys as shuffler_keys
    from shuffledp.clients.settings import ClientSetupError, _load_key_file, _load_keys

    _load_key_file.cache_clear()
    calls = {"n": 0}
    real = shuffler_keys.load_private_key

    def counting(path, kind):
        calls["n"] += 1
        return real(path, kind)

    monkeypatch.setattr(shuffler_keys, "load_private_key", counting)
    own = shuffler_keys.init_key_directory(tmp_path / "keys", 1)  # this test rotates and chmods its own keys
    ck = own.client_key(0)
    args = (ck, own.server_hpke_pub, own.shuffler_hpke_pub)
    first = _load_keys(*args)
    assert _load_keys(*args) == first and calls["n"] == 1

    # rotation: a new key file at the same path (new inode and mtime) is read again
    new_key = os.urandom(32)
    fresh = ck.with_name(ck.name + ".new")
    shuffler_keys.save_private_key(fresh, new_key, "ed25519")
    os.replace(fresh, ck)
    rotated = _load_keys(*args)
    assert calls["n"] == 2 and rotated[0] == new_key != first[0]

    # loosened permissions change the identity: the file is re-checked and refused
    os.chmod(ck, 0o644)
    with pytest.raises(ClientSetupError, match="cannot load"):
        _load_keys(*args)


def _pinned(keys) -> PinnedSettings:
    load = shuffler_keys.load_private_key
    return PinnedSettings(
        eps0=EPS0, clip_l1=CLIP, client_key=load(keys.client_key(0)),
        server_public_key=shuffler_keys.load_public_key(keys.server_hpke_pub),
        shuffler_public_key=shuffler_keys.load_public_key(keys.shuffler_hpke_pub),
        partition_id=0, num_partitions=N_PART,
    )


def test_whether_a_report_is_sent_never_depends_on_the_data(keys) -> None:
    """A server that picks a model whose logits overflow only when some record's feature exceeds a threshold,
    or a model with fewer classes than some record's label, must not learn that from an error reply: the
    client reports the zero update instead, randomized as usual (same rng -> byte-identical report)."""
    from shuffledp.clients.noise import ChaCha20Rng
    from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer

    def zero_report(dim: int) -> bytes:  # what the mechanism makes of the zero update with the same rng
        return DiscreteLaplaceRandomizer(EPS0, CLIP, rng=ChaCha20Rng(bytes(32))).encode(np.zeros(dim))

    pinned = _pinned(keys)
    w, b = initial_arrays("logreg", 64, 10)
    w = np.zeros_like(w)
    w[0, 40] = np.float32(3.4e38 / 20.0)  # logit 0 overflows float32 iff x[:, 40] > 20
    calm = np.zeros((4, 64), np.float32)
    calm[:, 40] = 10.0
    hot = calm.copy()
    hot[3, 40] = 30.0  # one record differs
    y = np.arange(4) % 10
    for cfg in (_cfg(1), _cfg(1, report="delta", local_epochs=1, batch_size=2)):
        fine = make_payload([w, b], cfg, pinned, (calm, y), rng=ChaCha20Rng(bytes(32)))
        assert len(fine) == len(zero_report(650)) and fine != zero_report(650)  # a real update
        assert make_payload([w, b], cfg, pinned, (hot, y), rng=ChaCha20Rng(bytes(32))) == zero_report(650)
    # a label (9) beyond a 5-class model: torch raises inside the loss; the report is the zero update's
    w5, b5 = initial_arrays("logreg", 64, 5)
    y9 = np.array([0, 1, 2, 9])
    assert make_payload([w5, b5], _cfg(1), pinned, (calm, y9), rng=ChaCha20Rng(bytes(32))) == zero_report(325)
    # and through the ClientApp: a report, not an error
    ctx = _ctx(keys)
    r = train_shuffled(_msg([w5, b5], _cfg(1)), ctx)
    assert not r.has_error()


def test_request_checks_that_need_no_data_still_refuse(keys, model) -> None:
    pinned = _pinned(keys)
    x = np.zeros((3, 64), np.float32)
    y = np.arange(3)
    bad = [a.copy() for a in model]
    bad[0][0, 0] = np.inf
    with pytest.raises(RequestError, match="non-finite"):
        make_payload(bad, _cfg(1), pinned, (x, y))
    narrow = initial_arrays("logreg", 32, 10)
    with pytest.raises(RequestError, match="32 features"):
        make_payload(narrow, _cfg(1), pinned, (x, y))


def test_refusals_carry_nothing_about_the_clients_data(keys, model, tmp_path, caplog) -> None:
    """The server can provoke these replies at will (a model of the wrong width, server-chosen data settings):
    their reasons must not carry the client's dataset size, paths or file sizes. Before, the width refusal said
    "this client's data has shape (172, 64)", the row count being the local sample count."""
    import logging

    from shuffledp.clients.data import load_partition

    n_local = len(load_partition(PID, N_PART, dataset="digits", pca_components=None)[1])
    r = train_shuffled(_msg(initial_arrays("logreg", 32, 10), _cfg(1)), _ctx(keys))
    assert r.has_error() and r.error.code == ERR_BAD_REQUEST and "64 features" in r.error.reason
    assert str(n_local) not in r.error.reason
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"\0\0\x08\x03" + bytes(1000))
    with caplog.at_level(logging.ERROR, logger="shuffledp.client"):
        r = train_shuffled(_msg(model, _cfg(1)), _ctx(keys, dataset="mnist", **{"data-dir": str(tmp_path)}))
    assert r.has_error() and r.error.code == ERR_CLIENT_SETUP
    assert str(tmp_path) not in r.error.reason and "client's log" in r.error.reason
    assert str(tmp_path) in caplog.text  # the detail stays on the client
    # a data setting of the wrong type is a refusal too, not an exception (TypeError escaped the handler)
    r = train_shuffled(_msg(model, _cfg(1)), _ctx(keys, **{"pca-components": [10]}))
    assert r.has_error() and r.error.code == ERR_CLIENT_SETUP


def test_model_arrays_that_are_not_floats_are_refused_with_a_reason(keys, model) -> None:
    """A text or structured array must not make np.isfinite raise TypeError out of the ClientApp (Flower would
    reply at once with the exception's text, before any reply-floor); complex, integer, bool and datetime arrays
    must not be accepted (the imaginary part dropped); a float64 weight beyond float32's range must not become
    inf after the finiteness check (every report would be the zero update)."""
    w, b = model
    for odd in (w.astype("U8"), w.astype(np.complex64) + 1j, w.astype(np.int32), w > 0,
                w.astype("datetime64[s]"), np.zeros(w.shape, dtype=[("a", "<f4")])):
        r = train_shuffled(_msg([odd, b], _cfg(1)), _ctx(keys))
        assert r.has_error() and r.error.code == ERR_BAD_REQUEST, odd.dtype
        assert "must be floating-point (float32)" in r.error.reason and str(odd.dtype) in r.error.reason
    huge = w.astype(np.float64)
    huge[0, 0] = 1e300  # finite as float64, inf as float32
    r = train_shuffled(_msg([huge, b], _cfg(1)), _ctx(keys))
    assert r.has_error() and r.error.code == ERR_BAD_REQUEST and "non-finite values (as float32)" in r.error.reason
    assert not train_shuffled(_msg([w.astype(np.float64), b], _cfg(1)), _ctx(keys)).has_error()  # float64 is fine


def test_an_unexpected_error_is_a_clear_reply_held_to_the_floor(keys, model, monkeypatch, caplog) -> None:
    """Whatever goes wrong while answering, the server gets a fixed reason (not the exception's text, which may be
    about the client's data) and not before the pinned reply-floor."""
    import logging

    import shuffledp.clients.app as client_app

    def broken(*_args: object, **_kwargs: object) -> bytes:
        raise KeyError("/secret/path/of/the/client/data has 172 rows")

    monkeypatch.setattr(client_app, "make_envelope", broken)
    floor = 0.5
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="shuffledp.client"):
        r = app(_msg(model, _cfg(1)), _ctx(keys, **{"reply-floor": floor}))
    assert time.monotonic() - t0 >= floor
    assert r.has_error() and r.error.code == ERR_CLIENT_SETUP
    assert r.error.reason == "the client could not answer this request (see the client's log)"
    assert "172 rows" in caplog.text  # the details stay in the client's own log


def test_the_app_is_the_mod_around_the_projects_training_function(keys, model) -> None:
    """train_model replies with the updated model (same names, shapes, dtypes); only the mod's envelope leaves."""
    from shuffledp.clients.app import train_model

    ctx = _ctx(keys)
    inner = train_model(_msg(model, _cfg(1, report="delta", local_epochs=1, batch_size=8)), ctx)
    arrays = inner.content.array_records["arrays"]
    assert [a.shape for a in arrays.to_numpy_ndarrays()] == [a.shape for a in model]
    assert [a.dtype for a in arrays.to_numpy_ndarrays()] == [np.float32, np.float32]
    assert not np.array_equal(arrays.to_numpy_ndarrays()[0], model[0])  # trained
    r = app(_msg(model, _cfg(1)), ctx)
    assert list(r.content.keys()) == ["envelope"] and STATE_ENVELOPE in ctx.state.array_records
