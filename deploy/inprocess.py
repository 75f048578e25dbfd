"""In-process simulation of the round protocol for studies (benchmarks, sweeps), on the apps' own code.

One round, as the apps run it, with every step taken from the module the apps use, for ``chunk`` clients at a
time (the server side keeps O(model) memory: each chunk's reports are decoded into the running sum and dropped):

1. each client computes its report at the round's model: the average gradient or the local delta
   (:func:`shuffledp.clients.core.compute_update`, or :func:`batched_updates`, which computes the same updates
   for many clients at once with ``torch.func.vmap`` over the same loss, :func:`shuffledp.clients.models.local_loss`);
2. the clients' report path clips and randomizes it with the pinned mechanism
   (:func:`shuffledp.clients.core.payloads_from_updates`, the batch form of the apps'
   :func:`shuffledp.clients.core.payload_from_update`: ``make_mechanism(...).randomize_batch``, of which the apps'
   ``randomize`` is the batch of one; the noise comes from the mechanism's ChaCha20 CSPRNG, keyed from
   ``os.urandom``);
3. optionally (``through_shuffler``) the reports are sealed as the apps seal them and go through a real shuffler
   process (:mod:`shuffledp.deploy.sweep_shuffler`), and the server opens the permuted inner layer;
4. the server decodes the reports with the run's mechanism (``make_mechanism(...).decode_batch``, of which the
   apps' ``decode`` is the batch of one) into the O(model) running sum
   (:meth:`shuffledp.server.optim.ReportAccumulator.add_batch`) and takes one
   :class:`shuffledp.server.optim.ServerOptimizer` step with the mean;
5. central evaluation (:func:`shuffledp.clients.models.evaluate`) on the public split (validation: what studies
   choose hyper-parameters on) and on the test split (reported only).

Left out by default, because they change neither the numbers nor their distribution: the shuffler (it only
permutes the reports, and the server's mean does not depend on their order), the envelopes' encryption and
signatures, and Flower's transport. The privacy accounting is the project's: ``shuffledp.accounting.bounds.epsilon``
for the rounds as run (n = the number of clients, every one reporting every round), ``bounds.calibrate`` for a run
planned from a target epsilon. :class:`PhaseTimes` says where the time went.

``seed`` fixes only the simulation setup (data splits, partition, initial model:
:func:`shuffledp.clients.data.load_data`, :func:`shuffledp.clients.data.partition`,
:func:`shuffledp.clients.models.initial_arrays`); the mechanisms' noise is never seeded (``rng`` exists for tests
that compare this path with the apps' report by report, and takes a keyed ChaCha20 stream, never numpy).

Usage::

    from shuffledp.deploy.inprocess import simulate
    r = simulate(dataset="digits", mechanism="privunit2", target_epsilon=4.0, rounds=100, clip=1.0, server_lr=10)
    print(r.test_accuracy[-1], r.public_accuracy[-1], r.epsilon.value, r.epsilon.kind, r.epsilon.family)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shuffledp.accounting import Bound, bounds
from shuffledp.accounting.families import resolve_family
from shuffledp.clients.core import compute_update
from shuffledp.clients.data import Dataset, load_data, partition
from shuffledp.clients.mechanism import L2_MECHANISMS, Mechanism, check_mechanism_name, make_mechanism
from shuffledp.clients.messages import TrainConfig
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.settings import DEFAULT_MAX_LOCAL_EPOCHS, PinnedSettings
from shuffledp.deploy.sweep_round import PhaseTimes, ReportExchange, report_round
from shuffledp.server.optim import ServerOptimizer

__all__ = ["Setup", "SimResult", "PhaseTimes", "ReportExchange", "DEFAULT_CHUNK", "build_setup", "plan_eps0",
           "study_config", "batched_updates", "client_updates", "run_round", "simulate"]

#: Families that are CLT approximations: calibrated and evaluated with ``allow_approximate=True``, labelled so.
APPROXIMATE_FAMILIES = frozenset({"ccg-rdp", "ccg-gdp", "canonical-gdp"})
_NO_KEY = bytes(32)  # the simulation seals nothing: the pinned key fields are placeholders
#: Clients per chunk: the reports of this many clients are computed, randomized and decoded together.
DEFAULT_CHUNK = 10_000


@dataclass(frozen=True)
class Setup:
    """The simulation setup a seed fixes: the dataset's splits, the clients' partitions and the initial model.

    Attributes:
        dataset: the :class:`shuffledp.clients.data.Dataset` (train / public / test).
        parts: the clients' training-row indices (:func:`shuffledp.clients.data.partition`).
        initial: the round-1 model (:func:`shuffledp.clients.models.initial_arrays`).
        model: ``"logreg"`` or ``"mlp"``.
        seed: the seed.
    """

    dataset: Dataset
    parts: tuple[np.ndarray, ...]
    initial: tuple[np.ndarray, ...]
    model: str
    seed: int

    @property
    def num_clients(self) -> int:
        """The number of clients (one report each per round)."""
        return len(self.parts)

    @property
    def dim(self) -> int:
        """The model's number of parameters (the report's dimension)."""
        return int(sum(a.size for a in self.initial))

    @functools.cached_property
    def groups(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """The clients grouped by partition size: ``(client ids ascending, their row indices (m, size))`` each."""
        sizes = np.array([len(p) for p in self.parts])
        return tuple((ids, np.stack([self.parts[i] for i in ids]).reshape(ids.size, int(size)))
                     for size in np.unique(sizes) for ids in [np.flatnonzero(sizes == size)])


def build_setup(dataset: str = "digits", *, num_clients: int | None = None, pca_components: int | None = 10,
                model: str = "logreg", hidden: int = 64, scheme: str = "iid", alpha: float = 0.5, seed: int = 0,
                data_dir: str | None = None) -> Setup:
    """The setup of a simulation (deterministic in ``seed``; no privacy randomness).

    Args:
        dataset: ``"digits"``, ``"mnist5k"`` or ``"mnist"`` (:func:`shuffledp.clients.data.load_data`).
        num_clients: number of clients; None: one per training sample.
        pca_components: PCA components fitted on the public split (None: none).
        model: ``"logreg"`` or ``"mlp"``.
        hidden: the mlp's hidden width.
        scheme: ``"iid"`` or ``"dirichlet"`` partition.
        alpha: the Dirichlet concentration.
        seed: fixes the splits, the partition and the initial model (the apps' ``seed`` setting).
        data_dir: the MNIST folder (``mnist`` only).

    Returns:
        A :class:`Setup`.
    """
    from shuffledp.clients.models import initial_arrays

    ds = load_data(dataset, data_dir=data_dir, pca_components=pca_components, seed=seed)
    n = len(ds.y_train) if num_clients is None else num_clients
    parts = tuple(partition(ds.y_train, n, scheme=scheme, alpha=alpha, seed=seed))
    init = tuple(initial_arrays(model, ds.n_features, ds.n_classes, hidden=hidden, seed=seed))
    return Setup(ds, parts, init, model, seed)


@functools.lru_cache(maxsize=256)
def plan_eps0(target_epsilon: float, *, n: int, rounds: int, delta: float = 1e-6, family: str = "clones") -> Bound:
    """The largest eps0 whose ``rounds`` rounds of ``n`` reports stay within ``target_epsilon`` at ``delta`` (a
    deterministic search, remembered per process: a sweep plans each (target, n, rounds) once).

    Args:
        target_epsilon: the epsilon to stay within.
        n: reports per round.
        rounds: planned rounds.
        delta: the target delta.
        family: the accounting family (:data:`shuffledp.accounting.FAMILIES`; CLT families are allowed to answer
            and their kind says ``approximate``).

    Returns:
        The :class:`shuffledp.accounting.Bound` of :func:`shuffledp.accounting.bounds.calibrate` (value: eps0).
    """
    return bounds.calibrate(family, target_epsilon, delta, n, rounds, allow_approximate=family in APPROXIMATE_FAMILIES)


def plan_and_account(eps0: float | None, target_epsilon: float | None, *, n: int, rounds: int, delta: float,
                     family: str) -> tuple[float, Bound | None, Bound]:
    """The eps0 of a study (given, or planned from ``target_epsilon`` with :func:`plan_eps0`) and the family's
    epsilon of ``rounds`` rounds of ``n`` reports at it.

    Returns:
        ``(eps0, the calibration or None, the epsilon)``.
    """
    calibration = None
    if target_epsilon is not None:
        calibration = plan_eps0(target_epsilon, n=n, rounds=rounds, delta=delta, family=family)
        eps0 = calibration.value
    if eps0 is None:
        raise ValueError("give eps0 or target_epsilon")
    eps = bounds.epsilon(family, eps0, n, delta, rounds, allow_approximate=family in APPROXIMATE_FAMILIES)
    return eps0, calibration, eps


def study_config(mechanism: str, eps0: float, clip: float, *, report: str = "gradient", local_epochs: int = 1,
                 local_lr: float = 0.1, batch_size: int = 32) -> tuple[TrainConfig, PinnedSettings]:
    """The round's request config and the clients' pinned settings, as the apps build them.

    ``clip`` is the mechanism's clip: ``clip-l1`` for ``laplace``, ``clip-l2`` for the L2 mechanisms (whose
    ``clip-l1`` is then an unused placeholder, 1). The key fields are placeholders: nothing is sealed here.

    Returns:
        ``(TrainConfig, PinnedSettings)``.
    """
    check_mechanism_name(mechanism)
    l2 = mechanism in L2_MECHANISMS
    clip_l1, clip_l2 = (1.0, float(clip)) if l2 else (float(clip), None)
    cfg = TrainConfig(round=1, key_epoch=0, eps0=float(eps0), clip_l1=clip_l1, mechanism=mechanism, clip_l2=clip_l2,
                      report=report, local_epochs=local_epochs, local_lr=local_lr, batch_size=batch_size)
    pinned = PinnedSettings(eps0=float(eps0), clip_l1=clip_l1, client_key=_NO_KEY, server_public_key=_NO_KEY,
                            shuffler_public_key=_NO_KEY, mechanism=mechanism, clip_l2=clip_l2,
                            max_local_epochs=max(DEFAULT_MAX_LOCAL_EPOCHS, local_epochs))
    return cfg, pinned


def batched_updates(arrays: Sequence[np.ndarray], cfg: TrainConfig, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The updates of k clients with s rows each, computed at once: row i equals
    ``compute_update(arrays, cfg, x[i], y[i])`` (:func:`shuffledp.clients.core.compute_update`) to float32 rounding.

    ``torch.func.vmap`` of ``torch.func.grad`` of the apps' loss (:func:`shuffledp.clients.models.local_loss` on
    the model :func:`shuffledp.clients.models.model_from_arrays` rebuilds). ``"delta"`` runs ``local_epochs``
    full-batch steps ``w <- w - lr g`` in float32 (torch's SGD step): the apps' local SGD when ``s <= batch_size``
    (one minibatch per epoch, whose order does not matter); larger partitions are refused (use
    :func:`client_updates`, which falls back to the per-client code).

    Args:
        arrays: the round's model.
        cfg: the round's config (``report``, ``local_epochs``, ``local_lr``, ``batch_size``).
        x: features, shape ``(k, s, features)``.
        y: labels, shape ``(k, s)``.

    Returns:
        float64 array ``(k, model parameters)``, parameters flattened in order as the apps do.

    Raises:
        ValueError: ``"delta"`` with ``s > batch_size``.
    """
    import torch
    from torch.func import functional_call, grad, vmap

    from shuffledp.clients.models import local_loss, model_from_arrays

    k, s = y.shape
    if cfg.report == "delta" and s > cfg.batch_size:
        raise ValueError(f"batched delta needs partitions of at most batch-size={cfg.batch_size} rows, got {s}")
    model = model_from_arrays(arrays)
    names = [name for name, _ in model.named_parameters()]
    params = {name: p.detach() for name, p in model.named_parameters()}
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.asarray(y, dtype=np.int64))

    def loss(p: dict[str, Any], xi: Any, yi: Any) -> Any:
        return local_loss(lambda inp: functional_call(model, p, (inp,)), xi, yi)  # type: ignore[arg-type] - a callable stands in for the module

    g = grad(loss)
    if cfg.report == "gradient":
        out = vmap(g, in_dims=(None, 0, 0))(params, xt, yt)
        # one float32 concatenation, then one exact widening to float64 (the same values as widening each part)
        return torch.cat([out[name].reshape(k, -1) for name in names], dim=1).numpy().astype(np.float64)
    else:
        def run(p: dict[str, Any], xi: Any, yi: Any) -> dict[str, Any]:
            for _ in range(cfg.local_epochs):
                step = g(p, xi, yi)
                p = {name: torch.add(p[name], step[name], alpha=-cfg.local_lr) for name in names}
            return p

        out = vmap(run, in_dims=(None, 0, 0))(params, xt, yt)
        parts = [(out[name].double() - params[name].double().unsqueeze(0)).reshape(k, -1) for name in names]
    return torch.cat(parts, dim=1).numpy()


def client_updates(arrays: Sequence[np.ndarray], cfg: TrainConfig, setup: Setup, *, batched: bool = True,
                   clients: slice | None = None) -> np.ndarray:
    """The clients' unclipped updates at ``arrays``: :func:`batched_updates` per group of equal partition size
    where it applies, else the apps' per-client :func:`shuffledp.clients.core.compute_update`.

    Args:
        arrays: the round's model; cfg: the round's config; setup: the simulation setup.
        batched: use :func:`batched_updates` where it applies (False: the per-client code).
        clients: a range of client ids (``slice(lo, hi)``); None: all of them.

    Returns:
        float64 array ``(clients, model parameters)``, rows in client order.
    """
    ds = setup.dataset
    lo, hi, _ = (clients or slice(None)).indices(setup.num_clients)
    out = np.empty((max(hi - lo, 0), setup.dim), dtype=np.float64)
    for ids, rows in setup.groups:
        a, b = np.searchsorted(ids, [lo, hi])
        if a == b:
            continue
        members, idx = ids[a:b] - lo, rows[a:b]
        if batched and (cfg.report == "gradient" or idx.shape[1] <= cfg.batch_size):
            out[members] = batched_updates(arrays, cfg, ds.x_train[idx], ds.y_train[idx])
        else:
            for i, r in zip(members, idx):
                out[i] = compute_update(arrays, cfg, ds.x_train[r], ds.y_train[r])
    return out


def run_round(arrays: Sequence[np.ndarray], updates: np.ndarray, cfg: TrainConfig, pinned: PinnedSettings,
              decoder: Mechanism, optimizer: ServerOptimizer, *, rng: ChaCha20Rng | None = None,
              chunk: int = DEFAULT_CHUNK, times: PhaseTimes | None = None,
              shuffler: ReportExchange | None = None, workers: int = 1) -> list[np.ndarray]:
    """One round after the local computation: the clients' report path, the server's decode, mean and step, for
    ``chunk`` clients at a time.

    Args:
        arrays: the round's model.
        updates: the clients' unclipped updates, ``(n, parameters)``.
        cfg: the round's config; pinned: the clients' pinned settings.
        decoder: the server's mechanism (``make_mechanism`` for the run's settings).
        optimizer: the server optimizer (its state carries over rounds).
        rng: tests only: a keyed ChaCha20 stream for the clients' mechanism (default: the pinned mechanism's
            CSPRNG, keyed from ``os.urandom``).
        chunk: clients per batch of reports.
        times: where to add the phases' seconds (default: not kept).
        shuffler: send the round's sealed reports through this shuffler (default: none; module docstring).
        workers: threads that randomize and decode chunks (:func:`shuffledp.deploy.sweep_round.report_round`).

    Returns:
        The model after the round.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    parts = (updates[lo:lo + chunk] for lo in range(0, updates.shape[0], chunk))
    return report_round(arrays, parts, updates.shape[1], cfg, pinned, decoder, optimizer, rng=rng,
                  times=times if times is not None else PhaseTimes(), shuffler=shuffler, workers=workers)


@dataclass
class SimResult:
    """What one simulated run gives.

    Attributes:
        settings: the run's settings (mechanism, eps0, rounds, clip, server optimizer and lr, report, data, seed).
        eps0: the local epsilon the clients used (calibrated when a target was given).
        calibration: the calibration's Bound (value eps0), or None when eps0 was given.
        epsilon: the cumulative epsilon after all rounds (a Bound: ``value``, ``kind``, ``family``).
        public_accuracy, test_accuracy, public_loss, test_loss: after each round (index t-1 for round t).
        seconds: wall time.
        arrays: the final model.
        phases: seconds per phase over all rounds (:class:`PhaseTimes`), the one-off setup excluded.
        round_seconds: wall seconds of each round (updates, reports, decode, step, evaluation).
    """

    settings: dict[str, Any]
    eps0: float
    calibration: Bound | None
    epsilon: Bound
    public_accuracy: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)
    public_loss: list[float] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0
    arrays: list[np.ndarray] = field(default_factory=list)
    phases: PhaseTimes = field(default_factory=PhaseTimes)
    round_seconds: list[float] = field(default_factory=list)

    def epsilon_after(self, rounds: int) -> Bound:
        """The cumulative epsilon after the first ``rounds`` rounds (same family, delta and n)."""
        s = self.settings
        return bounds.epsilon(s["family"], self.eps0, s["num_clients"], s["delta"], rounds,
                              allow_approximate=s["family"] in APPROXIMATE_FAMILIES)


def simulate(dataset: str | Setup = "digits", *, mechanism: str = "laplace", eps0: float | None = None,
             target_epsilon: float | None = None, rounds: int = 10, clip: float = 1.0, server_lr: float = 20.0,
             server_optimizer: str = "sgd", server_momentum: float = 0.9, report: str = "gradient",
             local_epochs: int = 1, local_lr: float = 0.1, batch_size: int = 32, delta: float = 1e-6,
             family: str = "auto", seed: int = 0, pca_components: int | None = 10, num_clients: int | None = None,
             model: str = "logreg", hidden: int = 64, batched: bool = True, chunk: int = DEFAULT_CHUNK,
             workers: int = 1, through_shuffler: bool = False, rng: ChaCha20Rng | None = None) -> SimResult:
    """Run ``rounds`` rounds of the protocol in-process (module docstring) and evaluate after each.

    Args:
        dataset: a dataset name, or a :class:`Setup` from :func:`build_setup` (reused over runs).
        mechanism: ``laplace``, ``duchi`` or ``privunit2``.
        eps0: the clients' local epsilon; or
        target_epsilon: plan eps0 from this target instead (:func:`plan_eps0` for ``rounds`` rounds of n reports).
        rounds: number of rounds T.
        clip: the mechanism's clip (L1 for ``laplace``, L2 otherwise).
        server_lr, server_optimizer, server_momentum: the :class:`ServerOptimizer`.
        report: ``"gradient"`` or ``"delta"``; local_epochs, local_lr, batch_size: the delta's local SGD.
        delta: the target delta; family: the accounting family; ``"auto"`` (the apps' default) takes the
            mechanism's rigorous default (:func:`shuffledp.accounting.families.resolve_family`).
        seed, pca_components, num_clients, model, hidden: the setup (:func:`build_setup`; ignored for a Setup).
        batched: compute the updates with :func:`batched_updates` where it applies (False: per-client code).
        chunk: clients whose reports are computed, randomized and decoded together (memory O(chunk x d)).
        workers: threads that randomize and decode chunks while the next chunk's updates are computed
            (:func:`shuffledp.deploy.sweep_round.report_round`; 1: none).
        through_shuffler: seal every round's reports and send them through a real shuffler process (slow: for
            checking the path at small n; :mod:`shuffledp.deploy.sweep_shuffler`).
        rng: tests only (see :func:`run_round`).

    Returns:
        A :class:`SimResult`.

    Raises:
        ValueError: both or neither of eps0 and target_epsilon; RefusedError: no eps0 meets the target.
    """
    import contextlib

    import torch

    from shuffledp.clients.models import evaluate

    if (eps0 is None) == (target_epsilon is None):
        raise ValueError("give exactly one of eps0 and target_epsilon")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    torch.set_num_threads(1)  # tiny models: a thread pool only adds contention
    t0 = time.perf_counter()
    setup = dataset if isinstance(dataset, Setup) else build_setup(
        dataset, num_clients=num_clients, pca_components=pca_components, model=model, hidden=hidden, seed=seed)
    n = setup.num_clients
    family = resolve_family(family, mechanism)
    eps0, calibration, eps = plan_and_account(eps0, target_epsilon, n=n, rounds=rounds, delta=delta, family=family)
    cfg, pinned = study_config(mechanism, eps0, clip, report=report, local_epochs=local_epochs, local_lr=local_lr,
                               batch_size=batch_size)
    decoder = make_mechanism(mechanism, eps0=eps0, clip_l1=cfg.clip_l1, clip_l2=cfg.clip_l2)
    optimizer = ServerOptimizer(server_optimizer, server_lr, momentum=server_momentum)
    settings = {"dataset": setup.dataset.name, "num_clients": n, "dim": setup.dim, "model": setup.model,
                "seed": setup.seed, "mechanism": mechanism, "eps0": eps0, "rounds": rounds, "clip": clip,
                "server_optimizer": server_optimizer, "server_lr": server_lr, "report": report,
                "local_epochs": local_epochs, "local_lr": local_lr, "delta": delta, "family": family,
                "target_epsilon": target_epsilon, "through_shuffler": through_shuffler, "workers": workers}
    result = SimResult(settings, float(eps0), calibration, eps)
    times = result.phases
    ds = setup.dataset
    arrays = [a.copy() for a in setup.initial]
    with contextlib.ExitStack() as stack:
        shuffler = None
        if through_shuffler:
            from shuffledp.deploy.sweep_shuffler import ShufflerExchange

            shuffler = stack.enter_context(ShufflerExchange(n))
        for t in range(rounds):
            t_round = time.perf_counter()
            cfg = dataclasses.replace(cfg, round=t + 1)  # the round id the shuffler binds
            chunks = (client_updates(arrays, cfg, setup, batched=batched, clients=slice(lo, lo + chunk))
                      for lo in range(0, n, chunk))
            arrays = report_round(arrays, chunks, setup.dim, cfg, pinned, decoder, optimizer, rng=rng, times=times,
                                  shuffler=shuffler, workers=workers)
            t1 = time.perf_counter()
            loss, accuracy = evaluate(arrays, ds.x_public, ds.y_public)
            result.public_loss.append(loss)
            result.public_accuracy.append(accuracy)
            loss, accuracy = evaluate(arrays, ds.x_test, ds.y_test)
            result.test_loss.append(loss)
            result.test_accuracy.append(accuracy)
            times.evaluate += time.perf_counter() - t1
            result.round_seconds.append(time.perf_counter() - t_round)
    result.arrays = arrays
    result.seconds = time.perf_counter() - t0
    return result
