"""The adaptive shuffled process (Algorithm 1 of Chen, Cao, Ge, "Rényi DP in the shuffle model: enhanced
amplification bounds", ICASSP 2024) in-process, with the honest any-input calibration.

Each epoch, the clients report one after the other in a uniformly random order (drawn from ``secrets``, the
operating system's CSPRNG, so nobody can predict or replay it); each computes its update at the model left by the
previous reports (:func:`shuffledp.clients.core.compute_update`), randomizes it with its pinned mechanism
(:func:`shuffledp.clients.core.payload_from_update`), and the server decodes it (``make_mechanism(...).decode``)
and takes one :class:`shuffledp.server.optim.ServerOptimizer` step with it alone.

Calibration. The seed paper adds Laplace noise of scale 2C/(eps0 m) (one record's sensitivity in a block of m).
Shuffling amplifies only reports that are eps0-LDP for ANY two inputs of their sender, so here every report is the
client's whole clipped update randomized by the project's mechanism at eps0 (for ``laplace``: L1 clip C, noise of
scale 2C/eps0 per coordinate), exactly as in the round-based protocol.

Accounting. One epoch is a sequence of n eps0-LDP randomizers chosen adaptively (each sees the previous outputs),
applied to the clients in a uniformly random order: Feldman, McMillan, Talwar (FOCS 2021, Thm 3.8) bound it by the
clone reduction of their Thm 3.1, the ``clones-focs`` family, the default here; T epochs compose. The erratum of
the stronger clone pair (Feldman, McMillan, Talwar, SODA 2023, the ``clones`` family) restricts its general
theorems to a class of randomizers, which is why ``clones`` is not the default for this adaptive process.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import numpy as np

from shuffledp.clients.core import compute_update, payload_from_update
from shuffledp.clients.mechanism import make_mechanism
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.deploy.inprocess import Setup, SimResult, build_setup, plan_and_account, study_config
from shuffledp.server.optim import ServerOptimizer

__all__ = ["ADAPTIVE_FAMILY", "secret_order", "simulate_adaptive"]

#: The accounting family whose theorem covers adaptively chosen randomizers in a random order (module docstring).
ADAPTIVE_FAMILY = "clones-focs"


def secret_order(n: int) -> list[int]:
    """A uniformly random permutation of ``range(n)`` from ``secrets.SystemRandom`` (the OS CSPRNG).

    Returns:
        The order in which the clients report.
    """
    order = list(range(n))
    secrets.SystemRandom().shuffle(order)
    return order


def simulate_adaptive(dataset: str | Setup = "digits", *, mechanism: str = "laplace", eps0: float | None = None,
                      target_epsilon: float | None = None, epochs: int = 1, clip: float = 1.0, lr: float = 0.01,
                      server_optimizer: str = "sgd", delta: float = 1e-6, family: str = ADAPTIVE_FAMILY,
                      seed: int = 0, pca_components: int | None = 10, num_clients: int | None = None,
                      rng: ChaCha20Rng | None = None,
                      order_fn: Callable[[int], list[int]] = secret_order) -> SimResult:
    """Run ``epochs`` epochs of the adaptive shuffled process (module docstring); evaluate after each epoch.

    Args:
        dataset: a dataset name or a :class:`shuffledp.deploy.inprocess.Setup`.
        mechanism: ``laplace``, ``duchi`` or ``privunit2``.
        eps0: the clients' local epsilon; or target_epsilon: plan it for ``epochs`` epochs of n reports.
        epochs: T, the number of passes over the clients.
        clip: the mechanism's clip (L1 for ``laplace``, L2 otherwise).
        lr: the server step size per report (the paper's eta).
        server_optimizer: the :class:`ServerOptimizer` kind stepping once per report.
        delta, family: the accounting (default :data:`ADAPTIVE_FAMILY`).
        seed, pca_components, num_clients: the setup (ignored for a Setup).
        rng: tests only: a keyed ChaCha20 stream for the mechanism (default: its CSPRNG keyed from os.urandom).
        order_fn: tests only: the order of each epoch (default :func:`secret_order`).

    Returns:
        A :class:`shuffledp.deploy.inprocess.SimResult` (``rounds`` in its settings counts epochs).

    Raises:
        ValueError: both or neither of eps0 and target_epsilon.
    """
    import torch

    from shuffledp.clients.models import evaluate

    if (eps0 is None) == (target_epsilon is None):
        raise ValueError("give exactly one of eps0 and target_epsilon")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    setup = dataset if isinstance(dataset, Setup) else build_setup(
        dataset, num_clients=num_clients, pca_components=pca_components, seed=seed)
    n = setup.num_clients
    eps0, calibration, eps = plan_and_account(eps0, target_epsilon, n=n, rounds=epochs, delta=delta, family=family)
    cfg, pinned = study_config(mechanism, eps0, clip)
    decoder = make_mechanism(mechanism, eps0=eps0, clip_l1=cfg.clip_l1, clip_l2=cfg.clip_l2)
    optimizer = ServerOptimizer(server_optimizer, lr)
    settings = {"dataset": setup.dataset.name, "num_clients": n, "dim": setup.dim, "model": setup.model,
                "seed": setup.seed, "mechanism": mechanism, "eps0": eps0, "rounds": epochs, "clip": clip,
                "server_optimizer": server_optimizer, "server_lr": lr, "report": "gradient", "delta": delta,
                "family": family, "target_epsilon": target_epsilon, "protocol": "adaptive (Algorithm 1)"}
    result = SimResult(settings, float(eps0), calibration, eps)
    ds = setup.dataset
    arrays = [a.copy() for a in setup.initial]
    for _ in range(epochs):
        for i in order_fn(n):
            rows = setup.parts[i]
            update = compute_update(arrays, cfg, ds.x_train[rows], ds.y_train[rows])
            report = decoder.decode(payload_from_update(arrays, cfg, pinned, update, rng=rng), setup.dim)
            arrays = optimizer.step(arrays, np.asarray(report))
        for split, x, y in (("public", ds.x_public, ds.y_public), ("test", ds.x_test, ds.y_test)):
            loss, accuracy = evaluate(arrays, x, y)
            getattr(result, f"{split}_loss").append(loss)
            getattr(result, f"{split}_accuracy").append(accuracy)
    result.arrays = arrays
    result.seconds = time.perf_counter() - t0
    return result
