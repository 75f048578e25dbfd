"""The in-process simulation runs the apps' own report path: equal updates, equal reports and decode (chunks of one
client are the apps' path report for report; larger chunks are the batch path of tests/clients/test_batch_reports.py),
the planned eps0 within the target, the seed fixing the setup but never the noise, and the optional real shuffler
releasing the very reports it was given."""

from __future__ import annotations

import numpy as np
import pytest

from shuffledp.accounting import bounds
from shuffledp.clients.core import compute_update, make_payload
from shuffledp.clients.mechanism import make_mechanism
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.deploy.inprocess import (
    PhaseTimes,
    batched_updates,
    build_setup,
    client_updates,
    plan_eps0,
    run_round,
    simulate,
    study_config,
)
from shuffledp.deploy.inprocess_adaptive import secret_order, simulate_adaptive
from shuffledp.server.optim import ReportAccumulator, ServerOptimizer

KEY = bytes(range(32))


@pytest.fixture(scope="module")
def small():
    return build_setup("digits", num_clients=40, pca_components=5, seed=3)


@pytest.mark.parametrize("report", ["gradient", "delta"])
@pytest.mark.parametrize("model", ["logreg", "mlp"])
def test_batched_updates_equal_the_apps_per_client_update(report, model):
    setup = build_setup("digits", num_clients=60, pca_components=5, model=model, hidden=8, seed=1)
    cfg, _ = study_config("laplace", 1.0, 1.0, report=report, local_epochs=3, local_lr=0.3, batch_size=64)
    arrays = list(setup.initial)
    got = client_updates(arrays, cfg, setup)
    ds = setup.dataset
    want = np.stack([compute_update(arrays, cfg, ds.x_train[p], ds.y_train[p]) for p in setup.parts])
    assert got.shape == want.shape == (60, setup.dim)
    assert np.abs(want).max() > 1e-3  # a real update, not zeros
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # float32 rounding of the same computation


def test_delta_with_several_minibatches_falls_back_to_the_apps_code(small):
    cfg, _ = study_config("laplace", 1.0, 1.0, report="delta", local_epochs=1, local_lr=0.1, batch_size=8)
    arrays = list(small.initial)
    ds = small.dataset
    idx = np.stack([small.parts[0][:16], small.parts[1][:16]])
    with pytest.raises(ValueError, match="batch-size"):
        batched_updates(arrays, cfg, ds.x_train[idx], ds.y_train[idx])
    got = client_updates(arrays, cfg, small)  # ~36 rows per client, batches of 8: the per-client local SGD
    assert got.shape == (40, small.dim)
    assert np.all(np.isfinite(got)) and np.all(np.abs(got).max(axis=1) > 0)


@pytest.mark.parametrize("mechanism", ["laplace", "duchi", "privunit2"])
def test_a_round_is_the_apps_report_decode_mean_and_step(mechanism):
    """With one keyed ChaCha20 stream on both sides, a round in chunks of one client gives the very model of the apps'
    path: make_payload per client (compute, clip, randomize), the server's decode, the accumulator's mean, the step."""
    setup = build_setup("digits", num_clients=30, pca_components=5, seed=3)
    cfg, pinned = study_config(mechanism, 2.0, 0.5)
    decoder = make_mechanism(mechanism, eps0=2.0, clip_l1=cfg.clip_l1, clip_l2=cfg.clip_l2)
    arrays = list(setup.initial)
    ds = setup.dataset
    key = bytes(range(32))

    acc = ReportAccumulator(setup.dim)
    rng = ChaCha20Rng(key)
    for p in setup.parts:
        acc.add(decoder.decode(make_payload(arrays, cfg, pinned, (ds.x_train[p], ds.y_train[p]), rng=rng), setup.dim))
    want = ServerOptimizer("sgd", 3.0).step(arrays, acc.mean())

    updates = client_updates(arrays, cfg, setup, batched=False)
    times = PhaseTimes()
    got = run_round(arrays, updates, cfg, pinned, decoder, ServerOptimizer("sgd", 3.0), rng=ChaCha20Rng(key),
                    chunk=1, times=times)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert np.array_equal(g, w)
    assert not np.array_equal(got[0], arrays[0])  # the round moved the model
    assert times.randomize > 0 and times.decode > 0 and times.step > 0 and times.shuffle == 0


def test_duchi_rounds_in_chunks_are_the_apps_round():
    """duchi consumes the stream client after client: any chunking gives the apps' reports, hence their model (up to
    the order of the float additions of the mean)."""
    setup = build_setup("digits", num_clients=30, pca_components=5, seed=3)
    cfg, pinned = study_config("duchi", 2.0, 0.5)
    decoder = make_mechanism("duchi", eps0=2.0, clip_l2=0.5)
    arrays = list(setup.initial)
    updates = client_updates(arrays, cfg, setup)
    models = [run_round(arrays, updates, cfg, pinned, decoder, ServerOptimizer("sgd", 3.0), rng=ChaCha20Rng(KEY),
                        chunk=chunk) for chunk in (1, 7, 30)]
    for other in models[1:]:
        for g, w in zip(other, models[0]):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)  # float32 model: the mean's rounding only
    diff = [np.abs(g - a).max() for g, a in zip(models[0], arrays)]
    assert max(diff) > 1e-3


class _Recording:
    """The run's decoder, keeping every decoded batch."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.batches = []

    def decode_batch(self, reports, dim):
        out = self.decoder.decode_batch(reports, dim)
        self.batches.append(out.values.copy())
        return out


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_chunk_is_decoded_once_into_the_mean_whatever_the_threads(workers):
    setup = build_setup("digits", num_clients=30, pca_components=5, seed=3)
    cfg, pinned = study_config("laplace", 2.0, 0.5)
    decoder = _Recording(make_mechanism("laplace", eps0=2.0, clip_l1=0.5))
    arrays = list(setup.initial)
    times = PhaseTimes()
    got = run_round(arrays, client_updates(arrays, cfg, setup), cfg, pinned, decoder, ServerOptimizer("sgd", 3.0),
                    chunk=7, times=times, workers=workers)
    assert sorted(len(b) for b in decoder.batches) == [2, 7, 7, 7, 7]  # threads may finish in any order
    want = ServerOptimizer("sgd", 3.0).step(arrays, np.vstack(decoder.batches).mean(axis=0))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert times.randomize > 0 and times.decode > 0
    with pytest.raises(ValueError, match="workers"):
        run_round(arrays, client_updates(arrays, cfg, setup), cfg, pinned, decoder, ServerOptimizer("sgd", 3.0),
                  workers=0)


def test_client_updates_in_ranges_are_the_rows_of_all_clients():
    setup = build_setup("digits", num_clients=50, pca_components=5, seed=2)  # partitions of 28 and 29 rows
    cfg, _ = study_config("laplace", 1.0, 1.0)
    arrays = list(setup.initial)
    whole = client_updates(arrays, cfg, setup)
    parts = [client_updates(arrays, cfg, setup, clients=slice(lo, lo + 13)) for lo in range(0, 50, 13)]
    np.testing.assert_array_equal(np.vstack(parts), whole)
    assert len({len(p) for p in setup.parts}) == 2  # two groups of partition sizes, both cut by the ranges


def test_simulate_reports_where_the_time_went(small):
    r = simulate(small, mechanism="laplace", eps0=2.0, rounds=2, clip=1.0, server_lr=1.0, chunk=16)
    ph = r.phases.as_dict()
    assert set(ph) == {"updates", "randomize", "shuffle", "decode", "step", "evaluate"}
    assert all(ph[k] > 0 for k in ("updates", "randomize", "decode", "step", "evaluate")) and ph["shuffle"] == 0
    assert len(r.round_seconds) == 2 and sum(ph.values()) <= sum(r.round_seconds) <= r.seconds
    with pytest.raises(ValueError, match="chunk"):
        simulate(small, mechanism="laplace", eps0=2.0, rounds=1, chunk=0)


def test_through_a_real_shuffler_the_server_opens_the_reports_it_was_given():
    """20 clients: the payloads sealed, shuffled by a real shuffler process and opened are the submitted multiset
    (in the shuffler's order), and a simulated round through the shuffler runs and moves the model."""
    from shuffledp.deploy.sweep_shuffler import ShufflerExchange

    setup = build_setup("digits", num_clients=20, pca_components=5, seed=1)
    cfg, pinned = study_config("duchi", 2.0, 1.0)
    arrays = list(setup.initial)
    reports = [r.tobytes() for r in make_mechanism("duchi", eps0=2.0, clip_l2=1.0).randomize_batch(
        client_updates(arrays, cfg, setup))]
    assert len(set(reports)) == 20
    with ShufflerExchange(20) as shuffler:
        opened = shuffler.exchange(reports, arrays, round_id=1)
        again = shuffler.exchange(reports, arrays, round_id=2)
    assert sorted(opened) == sorted(reports) == sorted(again)
    assert opened != reports or again != reports  # permuted (the identity twice has probability 1 / 20!^2)
    r = simulate(setup, mechanism="duchi", eps0=2.0, rounds=1, clip=1.0, server_lr=1.0, through_shuffler=True)
    assert r.phases.shuffle > 0 and r.settings["through_shuffler"]
    assert not np.array_equal(r.arrays[0], setup.initial[0])


def test_planning_from_a_target_keeps_epsilon_within_it(small):
    result = simulate(small, mechanism="duchi", target_epsilon=1.5, rounds=3, clip=1.0, server_lr=1.0, delta=1e-6)
    assert result.epsilon.value <= 1.5
    assert result.epsilon.value > 1.4  # calibrated, not merely small
    # family "auto", as in the apps: duchi's rigorous default
    assert result.epsilon.family == "blanket-duchi" and result.epsilon.kind == "upper"
    assert result.eps0 == plan_eps0(1.5, n=40, rounds=3, delta=1e-6, family="blanket-duchi").value
    assert result.epsilon_after(1).value < result.epsilon.value
    assert len(result.test_accuracy) == len(result.public_accuracy) == 3


def test_approximate_families_are_labelled():
    plan = plan_eps0(4.0, n=1437, rounds=10, family="ccg-rdp")
    assert plan.kind == "approximate"
    assert bounds.epsilon("ccg-rdp", plan.value, 1437, 1e-6, 10, allow_approximate=True).value <= 4.0


def test_seed_fixes_the_setup_but_not_the_noise(small):
    a = build_setup("digits", num_clients=40, pca_components=5, seed=3)
    other = build_setup("digits", num_clients=40, pca_components=5, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a.initial, small.initial))
    assert all(np.array_equal(x, y) for x, y in zip(a.parts, small.parts))
    assert not all(np.array_equal(x, y) for x, y in zip(other.initial, small.initial))
    runs = [simulate(small, mechanism="laplace", eps0=2.0, rounds=2, clip=1.0, server_lr=1.0) for _ in range(2)]
    assert not np.array_equal(runs[0].arrays[0], runs[1].arrays[0])  # fresh CSPRNG noise in every run


def test_exactly_one_of_eps0_and_target(small):
    with pytest.raises(ValueError, match="exactly one"):
        simulate(small, eps0=1.0, target_epsilon=1.0, rounds=1)
    with pytest.raises(ValueError, match="exactly one"):
        simulate(small, rounds=1)


def test_secret_order_is_a_fresh_permutation():
    orders = [secret_order(50) for _ in range(3)]
    for order in orders:
        assert sorted(order) == list(range(50))
    assert orders[0] != orders[1] or orders[1] != orders[2]


def test_adaptive_process_applies_each_report_at_the_current_model(small):
    """Algorithm 1 with a keyed stream equals the apps' path run client by client in the drawn order."""
    cfg, pinned = study_config("laplace", 2.0, 1.0)
    key = bytes(range(1, 33))
    order = list(range(small.num_clients))[::-1]
    got = simulate_adaptive(small, mechanism="laplace", eps0=2.0, epochs=1, clip=1.0, lr=0.05,
                            rng=ChaCha20Rng(key), order_fn=lambda n: order)
    decoder = make_mechanism("laplace", eps0=2.0, clip_l1=1.0)
    opt = ServerOptimizer("sgd", 0.05)
    arrays = list(small.initial)
    rng = ChaCha20Rng(key)
    ds = small.dataset
    for i in order:
        p = small.parts[i]
        arrays = opt.step(arrays, decoder.decode(make_payload(arrays, cfg, pinned, (ds.x_train[p], ds.y_train[p]),
                                                              rng=rng), small.dim))
    assert all(np.array_equal(g, w) for g, w in zip(got.arrays, arrays))
    assert got.epsilon.value == bounds.epsilon("clones-focs", 2.0, 40, 1e-6, 1).value
