"""Models (PyTorch) and the local computations a client reports.

* ``logreg``: multinomial logistic regression, parameters ``[W (classes x features), b (classes)]``.
* ``mlp``: one hidden ReLU layer and a softmax output, as in Table 2 of Chen, Cao, Ge (ICASSP 2024) (input 60
  PCA components on MNIST, cross-entropy loss); the hidden width is not given there, ours defaults to 64.
  Parameters ``[W1 (hidden x features), b1, W2 (classes x hidden), b2]`` (torch ``nn.Linear`` layout).

Parameters travel as a list of float32 numpy arrays in that order. The architecture is recovered from the array
shapes (:func:`model_from_arrays`), so a client needs no extra configuration to rebuild the server's model.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from shuffledp.clients.validation import require_int

__all__ = [
    "MODEL_KINDS",
    "build_model",
    "initial_arrays",
    "model_from_arrays",
    "get_arrays",
    "set_arrays",
    "local_loss",
    "average_gradient",
    "local_delta",
    "evaluate",
]

MODEL_KINDS = ("logreg", "mlp")
DEFAULT_HIDDEN = 64


def build_model(
    kind: str, n_features: int, n_classes: int, *, hidden: int = DEFAULT_HIDDEN, seed: int = 0
) -> nn.Module:
    """A fresh model; weights initialised by torch's defaults under ``torch.manual_seed``-style ``seed``."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model {kind!r}; allowed: {MODEL_KINDS}")
    for name, v in (("n_features", n_features), ("n_classes", n_classes), ("hidden", hidden)):
        require_int(name, v, 1)
    if n_classes < 2:
        raise ValueError(f"n_classes must be >= 2, got {n_classes}")
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)  # model initialisation: simulation setup, not privacy randomness
        if kind == "logreg":
            model: nn.Module = nn.Sequential(nn.Linear(n_features, n_classes))
        else:
            model = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(torch.float32)


def initial_arrays(
    kind: str, n_features: int, n_classes: int, *, hidden: int = DEFAULT_HIDDEN, seed: int = 0
) -> list[np.ndarray]:
    """The initial parameters as numpy arrays (what the server sends in round 1)."""
    return get_arrays(build_model(kind, n_features, n_classes, hidden=hidden, seed=seed))


def get_arrays(model: nn.Module) -> list[np.ndarray]:
    """Parameters as float32 numpy arrays, in parameter order (copies)."""
    return [p.detach().cpu().numpy().astype(np.float32, copy=True) for p in model.parameters()]


def set_arrays(model: nn.Module, arrays: Sequence[np.ndarray]) -> None:
    """Load parameters from numpy arrays; shapes must match exactly."""
    params = list(model.parameters())
    if len(params) != len(arrays):
        raise ValueError(f"model has {len(params)} parameter arrays, got {len(arrays)}")
    with torch.no_grad():
        for i, (p, a) in enumerate(zip(params, arrays)):
            a = np.asarray(a)
            if tuple(p.shape) != a.shape:
                raise ValueError(f"parameter {i}: shape {tuple(p.shape)} expected, got {a.shape}")
            a32 = _float32(i, a)
            # a received model's arrays are read-only; torch takes writeable memory (copy_ copies anyway)
            p.copy_(torch.from_numpy(a32 if a32.flags.writeable else a32.copy()))


def _float32(i: int, a: np.ndarray, *, copy: bool = False) -> np.ndarray:
    """Parameter ``i`` as a C-contiguous float32 array (a new one with ``copy``); ValueError unless it is
    floating-point and finite as float32."""
    if a.dtype.kind != "f":  # complex, integer, bool, datetime, text or structured: not a model's weights
        raise ValueError(f"parameter {i} has dtype {a.dtype}; a floating-point type (float32) is expected")
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: refused just below
        a32 = np.array(a, dtype=np.float32, order="C") if copy else np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a32).all():
        raise ValueError(f"parameter {i} has non-finite values (as float32)")
    return a32


def _uninitialised_linear(n_in: int, n_out: int) -> nn.Linear:
    """A float32 ``nn.Linear`` for :func:`set_arrays` to overwrite at once: built with torch's default
    initialisation from its global generator (values discarded), without :func:`build_model`'s seeding and the
    save/restore of the generator around it, which cost more than the layer on every client reply."""
    return nn.Linear(n_in, n_out, dtype=torch.float32)


def _architecture(arrays: Sequence[np.ndarray]) -> str:
    """``"logreg"`` or ``"mlp"``, from the arrays' shapes. Raises ValueError."""
    shapes = [np.asarray(a).shape for a in arrays]
    if len(shapes) == 2 and len(shapes[0]) == 2 and shapes[1] == (shapes[0][0],):
        return "logreg"
    if (
        len(shapes) == 4
        and len(shapes[0]) == 2
        and shapes[1] == (shapes[0][0],)
        and len(shapes[2]) == 2
        and shapes[2][1] == shapes[0][0]
        and shapes[3] == (shapes[2][0],)
    ):
        return "mlp"
    raise ValueError(f"arrays with shapes {shapes} are neither a logreg [W, b] nor an mlp [W1, b1, W2, b2]")


def model_from_arrays(arrays: Sequence[np.ndarray]) -> nn.Module:
    """Rebuild the model whose parameters these are (logreg: 2 arrays, mlp: 4 arrays) and load them."""
    shapes = [np.asarray(a).shape for a in arrays]
    if _architecture(arrays) == "logreg":
        n_classes, n_features = shapes[0]
        model: nn.Module = nn.Sequential(_uninitialised_linear(n_features, n_classes))
    else:
        hidden, n_features = shapes[0]
        model = nn.Sequential(_uninitialised_linear(n_features, hidden), nn.ReLU(),
                              _uninitialised_linear(hidden, shapes[2][0]))
    set_arrays(model, arrays)
    return model


def _parameters(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """The parameters of :func:`model_from_arrays`'s model, without the model: float32 leaf tensors that require
    grad, new memory (the arrays are never written), after the same checks (architecture, floating-point,
    finite as float32). For the local computations, which run :func:`_forward` on them: every client of a
    simulation's process would otherwise build a torch module (with its initialisation) only to overwrite its
    weights. Raises ValueError."""
    _architecture(arrays)
    # copies: torch shares their memory, and SGD writes it
    return [torch.from_numpy(_float32(i, np.asarray(a), copy=True)).requires_grad_() for i, a in enumerate(arrays)]


def _forward(params: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The logits of :func:`model_from_arrays`'s model with these parameters: the same operations as its
    ``nn.Sequential`` (``nn.Linear`` is ``F.linear``, ``nn.ReLU`` is ``F.relu``)."""
    if len(params) == 2:
        return nn.functional.linear(x, params[0], params[1])
    return nn.functional.linear(nn.functional.relu(nn.functional.linear(x, params[0], params[1])), params[2],
                                params[3])


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(f"expected x (n, features) and y (n,), got {x.shape} and {y.shape}")
    if len(y) == 0:
        raise ValueError("empty data")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))


def local_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (softmax output) of the model on (x, y)."""
    return nn.functional.cross_entropy(model(x), y)


def average_gradient(arrays: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradient of the mean local loss at ``arrays`` (float64 arrays, parameter order)."""
    params = _parameters(arrays)
    xt, yt = _tensors(x, y)
    grads = torch.autograd.grad(local_loss(lambda inp: _forward(params, inp), xt, yt), params)  # type: ignore[arg-type] - the forward stands in for the module
    return [g.numpy().astype(np.float64) for g in grads]


def local_delta(
    arrays: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray, *, epochs: int, lr: float, batch_size: int
) -> list[np.ndarray]:
    """Model delta (new - received) after ``epochs`` epochs of minibatch SGD on (x, y) at rate ``lr``.

    The minibatch order is drawn from a torch generator seeded with ``secrets`` (not privacy-critical: the
    report is eps0-LDP for any input, but we keep all client randomness unpredictable).
    """
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"need epochs >= 1, batch_size >= 1, lr > 0; got {epochs}, {batch_size}, {lr}")
    params = _parameters(arrays)
    xt, yt = _tensors(x, y)
    gen = torch.Generator().manual_seed(secrets.randbits(63))
    opt = torch.optim.SGD(params, lr=lr)
    n = len(yt)
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            opt.zero_grad()
            local_loss(lambda inp: _forward(params, inp), xt[idx], yt[idx]).backward()  # type: ignore[arg-type] - as above
            opt.step()
    new = [p.detach().numpy().astype(np.float64) for p in params]
    return [n_ - np.asarray(o, dtype=np.float64) for n_, o in zip(new, arrays)]


def evaluate(arrays: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Central evaluation: (mean cross-entropy, accuracy) of the model on (x, y)."""
    model = model_from_arrays(arrays)
    xt, yt = _tensors(x, y)
    with torch.no_grad():
        logits = model(xt)
        loss = float(nn.functional.cross_entropy(logits, yt))
        acc = float((logits.argmax(dim=1) == yt).float().mean())
    return loss, acc
