"""Server optimizers over the model's list of numpy arrays, and the O(model) round accumulator.

The server never holds a round's batch of reports: each opened report is added into one running sum
(:class:`ReportAccumulator`, one float64 vector of the model's size) and forgotten; at the end of the round the
optimizer takes one step with the mean as pseudo-gradient. That is the FedOpt scheme (Reddi et al., "Adaptive
Federated Optimization", ICLR 2021, Algorithm 1) with the client average replaced by the average of the shuffled
eps0-LDP reports. With plain SGD it is the same as applying every report in the shuffled order as its own step
of size ``lr / n`` at the round's model (Algorithm 1, lines 7-11, of seed 000: Chen, Cao, Ge, "Rényi DP in the
shuffle model: enhanced amplification bounds", ICASSP 2024; when every client of the round computes at the same
model).

* ``sgd``:      w <- w - lr * g
* ``momentum``: v <- mu * v + g ;  w <- w - lr * v                         (heavy ball, as torch.optim.SGD)
* ``adam``:     m <- b1 m + (1 - b1) g ; v <- b2 v + (1 - b2) g^2 ;
                w <- w - lr * m_hat / (sqrt(v_hat) + eps)                   (Kingma and Ba, ICLR 2015, Alg. 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ServerOptimizer", "ReportAccumulator", "flatten", "unflatten", "num_parameters"]


def num_parameters(shapes: Sequence[tuple[int, ...]]) -> int:
    """Total number of scalars in arrays of the given shapes."""
    return int(sum(math.prod(shape) for shape in shapes))


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate the arrays (C order) into one float64 vector."""
    if not arrays:
        return np.zeros(0, dtype=np.float64)
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def unflatten(vector: np.ndarray, shapes: Sequence[tuple[int, ...]], dtype: Any = np.float64) -> list[np.ndarray]:
    """Split a flat vector back into arrays of ``shapes`` (the inverse of :func:`flatten`).

    Raises:
        ValueError: the vector's length is not the total size of ``shapes``.
    """
    total = num_parameters(shapes)
    if vector.ndim != 1 or vector.shape[0] != total:
        raise ValueError(f"cannot split a vector of shape {vector.shape} into arrays of shapes {list(shapes)} "
                         f"({total} values)")
    out: list[np.ndarray] = []
    offset = 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(np.asarray(vector[offset : offset + size], dtype=dtype).reshape(shape).copy())
        offset += size
    return out


class ReportAccumulator:
    """Running sum of one round's opened reports: O(model size) memory whatever the number of reports."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"the accumulator needs a model of at least one parameter, got size {size}")
        self._sum = np.zeros(size, dtype=np.float64)
        self.count = 0

    @property
    def size(self) -> int:
        """The model size (number of parameters) the accumulator sums."""
        return int(self._sum.shape[0])

    def add(self, report: np.ndarray) -> None:
        """Add one report (a flat vector of the model's size).

        Raises:
            ValueError: wrong shape or a non-finite value (nothing is added then).
        """
        vec = np.asarray(report, dtype=np.float64)
        if vec.shape != self._sum.shape:
            raise ValueError(f"report has shape {vec.shape}, the model has {self._sum.shape[0]} parameters")
        if not np.all(np.isfinite(vec)):
            raise ValueError("report contains NaN or infinite values")
        self._sum += vec
        self.count += 1

    def add_batch(self, reports: np.ndarray) -> None:
        """Add a batch of reports (``(m, size)``, one per row): the same sum as ``m`` calls of :meth:`add`, up to
        the order of the floating-point additions (which the shuffler's permutation leaves arbitrary anyway).

        Raises:
            ValueError: wrong shape or a non-finite value (nothing is added then).
        """
        batch = np.asarray(reports, dtype=np.float64)
        if batch.ndim != 2 or batch.shape[1] != self._sum.shape[0]:
            raise ValueError(f"a batch of reports has shape {batch.shape}, the model has {self._sum.shape[0]} "
                             "parameters per report")
        if not np.isfinite(batch).all():
            raise ValueError("a report contains NaN or infinite values")
        self._sum += batch.sum(axis=0)
        self.count += batch.shape[0]

    def mean(self) -> np.ndarray:
        """The average of the added reports.

        Raises:
            ValueError: no report was added.
        """
        if self.count == 0:
            raise ValueError("no report was accumulated this round; there is nothing to average")
        return self._sum / self.count


class ServerOptimizer:
    """SGD, heavy-ball momentum or Adam on a list of arrays, with a JSON/npz-friendly state.

    Args:
        kind: ``"sgd"``, ``"momentum"`` or ``"adam"``.
        lr: step size, > 0.
        momentum: the heavy-ball coefficient mu in [0, 1) (``momentum`` only).
        betas: Adam's (beta1, beta2), each in [0, 1).
        eps: Adam's denominator constant, > 0.
    """

    def __init__(
        self,
        kind: str,
        lr: float,
        *,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if kind not in ("sgd", "momentum", "adam"):
            raise ValueError(f"server optimizer must be one of sgd, momentum, adam; got {kind!r}")
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"server learning rate must be a finite number > 0, got {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Adam betas must each be in [0, 1), got {betas!r}")
        if not eps > 0:
            raise ValueError(f"Adam eps must be > 0, got {eps!r}")
        self.kind = kind
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.steps = 0
        self._buffers: list[np.ndarray] = []  # momentum: [v]; adam: [m, v] (flat float64)

    def step(self, params: Sequence[np.ndarray], grad: np.ndarray) -> list[np.ndarray]:
        """Return the parameters after one step with the flat pseudo-gradient ``grad``.

        The returned arrays have the dtypes and shapes of ``params``; ``params`` are not modified.

        Raises:
            ValueError: ``grad`` does not match the parameters or is not finite.
        """
        shapes = [tuple(p.shape) for p in params]
        g = np.asarray(grad, dtype=np.float64)
        if g.shape != (num_parameters(shapes),):
            raise ValueError(f"gradient of shape {g.shape} does not match {num_parameters(shapes)} parameters")
        if not np.all(np.isfinite(g)):
            raise ValueError("gradient contains NaN or infinite values")
        w = flatten(params)
        self.steps += 1
        if self.kind == "sgd":
            update = g
        elif self.kind == "momentum":
            if not self._buffers:
                self._buffers = [np.zeros_like(w)]
            v = self._buffers[0]
            v *= self.momentum
            v += g
            update = v
        else:
            if not self._buffers:
                self._buffers = [np.zeros_like(w), np.zeros_like(w)]
            m, v = self._buffers
            b1, b2 = self.betas
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * g * g
            # bias corrections 1 - b^t computed as -expm1(t log b) (no cancellation for b close to 1)
            c1 = -math.expm1(self.steps * math.log(b1)) if b1 > 0 else 1.0
            c2 = -math.expm1(self.steps * math.log(b2)) if b2 > 0 else 1.0
            update = (m / c1) / (np.sqrt(v / c2) + self.eps)
        w = w - self.lr * update
        return [a.astype(p.dtype, copy=False) for a, p in zip(unflatten(w, shapes), params)]

    def state_dict(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Return (JSON-safe scalars, buffers) so a checkpoint can store the arrays as arrays."""
        meta = {
            "kind": self.kind,
            "lr": self.lr,
            "momentum": self.momentum,
            "betas": list(self.betas),
            "eps": self.eps,
            "steps": self.steps,
            "n_buffers": len(self._buffers),
        }
        return meta, [b.copy() for b in self._buffers]

    @classmethod
    def from_state_dict(cls, meta: dict[str, Any], buffers: Sequence[np.ndarray]) -> ServerOptimizer:
        """Rebuild an optimizer from :meth:`state_dict` output.

        Raises:
            ValueError: the state is inconsistent (wrong number of buffers for the kind).
        """
        opt = cls(
            str(meta["kind"]),
            float(meta["lr"]),
            momentum=float(meta["momentum"]),
            betas=(float(meta["betas"][0]), float(meta["betas"][1])),
            eps=float(meta["eps"]),
        )
        opt.steps = int(meta["steps"])
        expected = {"sgd": 0, "momentum": 1, "adam": 2}[opt.kind]
        if len(buffers) not in (0, expected) or (opt.steps > 0 and len(buffers) != expected):
            raise ValueError(f"optimizer state for {opt.kind!r} after {opt.steps} steps needs {expected} buffers, "
                             f"got {len(buffers)}")
        opt._buffers = [np.asarray(b, dtype=np.float64).copy() for b in buffers]
        return opt
