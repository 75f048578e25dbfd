"""Server optimizers and the O(model) report accumulator."""

from __future__ import annotations

import numpy as np
import pytest

from shuffledp.server.optim import ReportAccumulator, ServerOptimizer, flatten, unflatten

SHAPES = [(3, 2), (2,)]


def _params() -> list[np.ndarray]:
    return [np.arange(6, dtype=np.float32).reshape(3, 2), np.array([1.0, -1.0], dtype=np.float32)]


def test_flatten_unflatten_round_trip() -> None:
    params = _params()
    back = unflatten(flatten(params), SHAPES, np.float32)
    for a, b in zip(params, back):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="cannot split a vector of shape"):
        unflatten(np.zeros(7), SHAPES)


def test_sgd_step_matches_formula_and_keeps_dtype() -> None:
    params = _params()
    grad = np.linspace(-1, 1, 8)
    new = ServerOptimizer("sgd", 0.5).step(params, grad)
    np.testing.assert_allclose(flatten(new), flatten(params) - 0.5 * grad, rtol=0, atol=1e-6)
    assert all(n.dtype == np.float32 for n in new)
    np.testing.assert_array_equal(params[0], np.arange(6, dtype=np.float32).reshape(3, 2))  # not mutated


def test_momentum_accumulates_velocity() -> None:
    opt = ServerOptimizer("momentum", 1.0, momentum=0.5)
    params = [np.zeros(2)]
    g = np.array([1.0, 2.0])
    p1 = opt.step(params, g)
    p2 = opt.step(p1, g)
    # v1 = g, v2 = 0.5 g + g
    np.testing.assert_allclose(p2[0], -(g + 1.5 * g))


def test_adam_first_step_is_lr_times_sign() -> None:
    opt = ServerOptimizer("adam", 0.01)
    g = np.array([3.0, -0.2, 0.0])
    out = opt.step([np.zeros(3)], g)[0]
    # bias-corrected first step: m_hat = g, v_hat = g^2 -> update = g / (|g| + eps)
    np.testing.assert_allclose(out, -0.01 * g / (np.abs(g) + 1e-8), rtol=1e-12)


def test_state_dict_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(0)  # test data only, not privacy randomness
    grads = [rng.normal(size=8) for _ in range(4)]
    a = ServerOptimizer("adam", 0.1)
    pa = _params()
    for g in grads[:2]:
        pa = a.step(pa, g)
    meta, bufs = a.state_dict()
    b = ServerOptimizer.from_state_dict(meta, bufs)
    pb = [p.copy() for p in pa]
    for g in grads[2:]:
        pa = a.step(pa, g)
        pb = b.step(pb, g)
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x, y)


def test_optimizer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="sgd, momentum, adam"):
        ServerOptimizer("lbfgs", 0.1)
    with pytest.raises(ValueError, match="learning rate"):
        ServerOptimizer("sgd", 0.0)
    opt = ServerOptimizer("sgd", 0.1)
    with pytest.raises(ValueError, match="does not match 8 parameters"):
        opt.step(_params(), np.zeros(7))
    with pytest.raises(ValueError, match="NaN"):
        opt.step(_params(), np.full(8, np.nan))
    with pytest.raises(ValueError, match="needs 1 buffers"):
        ServerOptimizer.from_state_dict({**opt.state_dict()[0], "kind": "momentum", "steps": 3}, [])


def test_accumulator_mean_and_rejections() -> None:
    acc = ReportAccumulator(3)
    with pytest.raises(ValueError, match="nothing to average"):
        acc.mean()
    acc.add(np.array([1.0, 2.0, 3.0]))
    acc.add(np.array([3.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        acc.add(np.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        acc.add(np.array([np.inf, 0, 0]))
    assert acc.count == 2  # rejected reports are not counted
    np.testing.assert_array_equal(acc.mean(), [2.0, 2.0, 2.0])
