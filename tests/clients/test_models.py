"""Models and the local computations (clients/models.py)."""

from __future__ import annotations

import numpy as np
import pytest

from shuffledp.clients.data import load_data
from shuffledp.clients.models import (
    average_gradient,
    build_model,
    evaluate,
    get_arrays,
    initial_arrays,
    local_delta,
    model_from_arrays,
    set_arrays,
)


def _toy(n: int = 30, f: int = 5, c: int = 3) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(1)  # fixture data
    return gen.standard_normal((n, f)).astype(np.float32), np.arange(n) % c


def test_shapes_and_round_trip() -> None:
    lr = initial_arrays("logreg", 64, 10)
    assert [a.shape for a in lr] == [(10, 64), (10,)] and all(a.dtype == np.float32 for a in lr)
    mlp = initial_arrays("mlp", 60, 10, hidden=32)
    assert [a.shape for a in mlp] == [(32, 60), (32,), (10, 32), (10,)]
    m = model_from_arrays(mlp)
    assert all(np.array_equal(a, b) for a, b in zip(get_arrays(m), mlp))
    # deterministic initialisation from the seed
    assert all(np.array_equal(a, b) for a, b in zip(initial_arrays("logreg", 64, 10), lr))
    with pytest.raises(ValueError, match="neither"):
        model_from_arrays([np.zeros((3, 2)), np.zeros(2)])
    with pytest.raises(ValueError, match="shape"):
        set_arrays(build_model("logreg", 4, 3), [np.zeros((3, 5)), np.zeros(3)])
    with pytest.raises(ValueError, match="non-finite"):
        model_from_arrays([np.full((3, 4), np.nan), np.zeros(3)])
    # the model itself refuses what is not a float, and what is not finite as float32
    for odd in (np.zeros((3, 4), np.complex64), np.zeros((3, 4), np.int64), np.zeros((3, 4), bool),
                np.zeros((3, 4), "U2"), np.zeros((3, 4), [("a", "<f4")])):
        with pytest.raises(ValueError, match="a floating-point type \\(float32\\) is expected"):
            model_from_arrays([odd, np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="non-finite values \\(as float32\\)"):
        model_from_arrays([np.full((3, 4), 1e300), np.zeros(3)])
    assert np.array_equal(get_arrays(model_from_arrays([np.ones((3, 4)), np.zeros(3)]))[0], np.ones((3, 4)))
    with pytest.raises(ValueError, match="unknown model"):
        build_model("cnn", 4, 3)


def test_logreg_gradient_matches_closed_form() -> None:
    """Cross-entropy gradient of softmax regression: (softmax(xW^T + b) - onehot(y))^T x / n."""
    x, y = _toy()
    arrays = initial_arrays("logreg", 5, 3, seed=2)
    w, b = arrays
    logits = x.astype(np.float64) @ w.T.astype(np.float64) + b
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    gw = p.T @ x / len(y)
    gb = p.mean(axis=0)
    got = average_gradient(arrays, x, y)
    assert np.allclose(got[0], gw, atol=1e-6) and np.allclose(got[1], gb, atol=1e-6)
    assert np.array_equal(arrays[0], w)  # the received model is not modified


def test_mlp_gradient_matches_finite_differences() -> None:
    x, y = _toy()
    arrays = initial_arrays("mlp", 5, 3, hidden=4, seed=3)
    grads = average_gradient(arrays, x, y)
    h = 1e-3
    for k, idx in [(0, (1, 2)), (1, (3,)), (2, (2, 1)), (3, (0,))]:
        plus = [a.astype(np.float64).copy() for a in arrays]
        minus = [a.astype(np.float64).copy() for a in arrays]
        plus[k][idx] += h
        minus[k][idx] -= h
        lp, _ = evaluate([a.astype(np.float32) for a in plus], x, y)
        lm, _ = evaluate([a.astype(np.float32) for a in minus], x, y)
        assert grads[k][idx] == pytest.approx((lp - lm) / (2 * h), abs=2e-3)


def test_local_delta_descends_and_one_full_batch_step_equals_gradient_step() -> None:
    x, y = _toy()
    arrays = initial_arrays("logreg", 5, 3, seed=4)
    g = average_gradient(arrays, x, y)
    d = local_delta(arrays, x, y, epochs=1, lr=0.5, batch_size=len(y))  # one full-batch step
    assert all(np.allclose(di, -0.5 * gi, atol=1e-6) for di, gi in zip(d, g))
    d5 = local_delta(arrays, x, y, epochs=5, lr=0.5, batch_size=4)
    new = [a + di for a, di in zip(arrays, d5)]
    assert evaluate([a.astype(np.float32) for a in new], x, y)[0] < evaluate(arrays, x, y)[0]
    with pytest.raises(ValueError):
        local_delta(arrays, x, y, epochs=0, lr=0.5, batch_size=4)


def test_central_evaluation_on_digits() -> None:
    ds = load_data()
    arrays = initial_arrays("logreg", ds.n_features, ds.n_classes)
    loss0, acc0 = evaluate(arrays, ds.x_test, ds.y_test)
    assert 0.0 <= acc0 <= 1.0 and loss0 > 0
    # a few full-batch gradient steps on the training data improve test accuracy well above chance
    for _ in range(30):
        arrays = [a + di.astype(np.float32) for a, di in
                  zip(arrays, local_delta(arrays, ds.x_train, ds.y_train, epochs=1, lr=0.5, batch_size=2000))]
    loss1, acc1 = evaluate(arrays, ds.x_test, ds.y_test)
    assert loss1 < loss0 and acc1 > 0.85


def _module_reference(arrays: list[np.ndarray], x: np.ndarray, y: np.ndarray, *, epochs: int = 0, lr: float = 0.0,
                      batch_size: int = 0, seed: int = 0) -> list[np.ndarray]:
    """The local computations on a torch module (model_from_arrays, backward into .grad): the average gradient,
    or with ``epochs`` the delta of SGD with the minibatch order drawn from ``seed``."""
    import torch

    from shuffledp.clients.models import local_loss

    model = model_from_arrays(arrays)
    xt, yt = torch.from_numpy(np.ascontiguousarray(x, np.float32)), torch.from_numpy(y.astype(np.int64))
    if not epochs:
        local_loss(model, xt, yt).backward()
        return [p.grad.numpy().astype(np.float64) for p in model.parameters()]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(yt), generator=gen)
        for start in range(0, len(yt), batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad()
            local_loss(model, xt[idx], yt[idx]).backward()
            opt.step()
    return [p.detach().numpy().astype(np.float64) - np.asarray(a, np.float64)
            for p, a in zip(model.parameters(), arrays)]


@pytest.mark.parametrize("kind", ["logreg", "mlp"])
def test_local_computations_equal_those_of_a_torch_module_bit_for_bit(kind: str, monkeypatch) -> None:
    """The local computations run on the parameters alone (no module per reply): the same operations, the same
    bits as the module they replace, and the received arrays are never written (read-only ones included)."""
    import secrets

    x, y = _toy(n=37, f=5, c=3)
    for seed in range(3):
        arrays = initial_arrays(kind, 5, 3, hidden=6, seed=seed)
        arrays = [a + np.float32(0.1) * np.sign(a) for a in arrays]  # away from the initialisation
        frozen = [np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape) for a in arrays]  # read-only
        for given in (arrays, frozen, [a.astype(np.float64) for a in arrays]):
            before = [a.copy() for a in given]
            got = average_gradient(given, x, y)
            assert all(np.array_equal(g, r) for g, r in zip(got, _module_reference(given, x, y)))
            monkeypatch.setattr(secrets, "randbits", lambda k, s=seed: 1234 + s)  # the same order in both
            got = local_delta(given, x, y, epochs=2, lr=0.3, batch_size=8)
            want = _module_reference(given, x, y, epochs=2, lr=0.3, batch_size=8, seed=1234 + seed)
            assert all(np.array_equal(g, r) for g, r in zip(got, want))
            assert all(np.array_equal(a, b) for a, b in zip(given, before))
    for bad, match in (([np.zeros((3, 2)), np.zeros(2)], "neither"),
                       ([np.full((3, 5), np.nan, np.float32), np.zeros(3, np.float32)], "non-finite"),
                       ([np.zeros((3, 5), np.int64), np.zeros(3, np.float32)], "floating-point")):
        with pytest.raises(ValueError, match=match):
            average_gradient(bad, x, y)
        with pytest.raises(ValueError, match=match):
            local_delta(bad, x, y, epochs=1, lr=0.1, batch_size=4)
