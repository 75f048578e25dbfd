"""Studies over the in-process simulation: many runs (in worker processes), hyper-parameters chosen on the public
(validation) split, the test split reported for the chosen setting only.

A *trial* is one simulated run: a group (what is compared, e.g. mechanism and target epsilon), a setting (the
hyper-parameters searched) and a seed. :func:`grid_trials` builds them from a grid, :func:`run_trials` runs them;
:func:`choose` picks, within each group, the setting with the highest mean public accuracy after the last round
over the seeds, and reports that setting's test accuracy (mean, min, max over the same seeds). The test split never
takes part in the choice. ``shuffledp sweep`` (:mod:`shuffledp.deploy.sweep`) and ``benchmarks/tradeoff.py`` are
built on these.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Trial", "Outcome", "Choice", "grid_trials", "run_trials", "choose", "spread"]


@dataclass(frozen=True)
class Trial:
    """One run to do.

    Attributes:
        group: what the run is compared within (e.g. ``("privunit2", 4.0)``).
        setting: the searched hyper-parameters, as sorted ``(name, value)`` pairs.
        seed: the setup's seed.
        kwargs: the keyword arguments of the run function (``simulate`` or ``simulate_adaptive``).
        adaptive: run :func:`shuffledp.deploy.inprocess_adaptive.simulate_adaptive` instead of ``simulate``.
    """

    group: Hashable
    setting: tuple[tuple[str, Any], ...]
    seed: int
    kwargs: tuple[tuple[str, Any], ...]
    adaptive: bool = False


@dataclass(frozen=True)
class Outcome:
    """What a trial gave: final public and test accuracy, eps0 and the epsilon Bound's value, kind and family."""

    trial: Trial
    public: float
    test: float
    eps0: float
    epsilon: float
    kind: str
    family: str
    seconds: float


@dataclass
class Choice:
    """The chosen setting of a group and its figures over the seeds."""

    group: Hashable
    setting: dict[str, Any]
    public_mean: float
    test: list[float] = field(default_factory=list)
    eps0: float = math.nan
    epsilon: float = math.nan
    kind: str = ""
    family: str = ""
    seconds: float = math.nan

    @property
    def test_mean(self) -> float:
        """Mean test accuracy over the seeds."""
        return sum(self.test) / len(self.test)


@functools.lru_cache(maxsize=4)
def _setup(dataset: str, pca: int | None, seed: int, num_clients: int | None, data_dir: str | None) -> Any:
    from shuffledp.deploy.inprocess import build_setup

    return build_setup(dataset, pca_components=pca, seed=seed, num_clients=num_clients, data_dir=data_dir)


def _run(trial: Trial) -> Outcome:
    from shuffledp.deploy.inprocess import simulate
    from shuffledp.deploy.inprocess_adaptive import simulate_adaptive

    kw = dict(trial.kwargs)
    setup = _setup(kw.pop("dataset"), kw.pop("pca_components"), trial.seed, kw.pop("num_clients", None),
                   kw.pop("data_dir", None))
    r = (simulate_adaptive if trial.adaptive else simulate)(setup, **kw)
    return Outcome(trial, r.public_accuracy[-1], r.test_accuracy[-1], r.eps0, r.epsilon.value, r.epsilon.kind,
                   r.epsilon.family, r.seconds)


def grid_trials(groups: Mapping[str, Sequence[Any]], searched: Mapping[str, Sequence[Any]], seeds: Iterable[int],
                fixed: Mapping[str, Any]) -> list[Trial]:
    """The trials of a grid: every combination of the group axes (what is compared; the group is the tuple of their
    values, in ``groups``' order) and of the searched settings (chosen within each group by :func:`choose`), for
    each seed.

    Args:
        groups: axis name -> values, e.g. ``{"mechanism": [...], "target_epsilon": [...], "rounds": [...]}``.
        searched: setting name -> values, e.g. ``{"server_lr": [...], "clip": [...]}``.
        seeds: the setups' seeds.
        fixed: the other keyword arguments of :func:`shuffledp.deploy.inprocess.simulate`; ``dataset`` and
            ``pca_components`` (and optionally ``num_clients``, ``data_dir``) build the setup.

    Returns:
        The trials, group by group, setting by setting, seed by seed.
    """
    names = sorted(searched)
    seeds = list(seeds)
    out = []
    for group in itertools.product(*groups.values()):
        for values in itertools.product(*(searched[n] for n in names)):
            setting = tuple(zip(names, values))
            kwargs = {**fixed, **dict(zip(groups, group)), **dict(setting)}
            out.extend(Trial(group, setting, seed, tuple(sorted(kwargs.items()))) for seed in seeds)
    return out


def run_trials(trials: Sequence[Trial], *, jobs: int = 1,
               progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run the trials, ``jobs`` at a time in worker processes (1: in this process); ``progress`` sees each outcome.

    Returns:
        The outcomes, in the order of ``trials``.
    """
    if jobs <= 1:
        out = []
        for t in trials:
            out.append(_run(t))
            if progress:
                progress(out[-1])
        return out
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        out = []
        for o in pool.imap(_run, trials):
            out.append(o)
            if progress:
                progress(o)
    return out


def choose(outcomes: Iterable[Outcome]) -> list[Choice]:
    """Per group, the setting with the highest mean public accuracy over its seeds, with its test figures.

    Returns:
        One :class:`Choice` per group, in the order groups first appear.
    """
    by: dict[Hashable, dict[tuple, list[Outcome]]] = {}
    for o in outcomes:
        by.setdefault(o.trial.group, {}).setdefault(o.trial.setting, []).append(o)
    choices = []
    for group, settings in by.items():
        best = max(settings, key=lambda s: sum(o.public for o in settings[s]) / len(settings[s]))
        runs = settings[best]
        choices.append(Choice(group, dict(best), sum(o.public for o in runs) / len(runs), [o.test for o in runs],
                              runs[0].eps0, max(o.epsilon for o in runs), runs[0].kind, runs[0].family,
                              sum(o.seconds for o in runs) / len(runs)))
    return choices


def spread(values: Sequence[float]) -> str:
    """``"mean [min, max]"`` to three decimals."""
    return f"{sum(values) / len(values):.3f} [{min(values):.3f}, {max(values):.3f}]"
