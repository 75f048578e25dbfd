"""A run planned from a target epsilon: eps0 calibrated before the first round.

With ``target-epsilon`` > 0 the ServerApp does not take ``eps0`` from the run config. Before any round it asks the
accounting family that enforces the budget (the run's ``accounting_family``: with the default ``"auto"``, already
resolved by mechanism, e.g. ``blanket-laplace`` for ``laplace``; :func:`shuffledp.accounting.families.
resolve_family`) for the largest eps0 such that ``num-server-rounds`` rounds of
``min-reports`` reports each stay within ``target-epsilon`` at ``target-delta``
(:func:`shuffledp.accounting.bounds.calibrate`). Every charged round has at least ``min-reports`` attested
reports (a round with fewer is skipped and not charged), and the family's epsilon falls as n grows, so the plan
holds whatever the dropouts: with the default family, an upper bound, the run ends within the target.

The plan is printed with its kind, recorded in report.json (section ``"plan"``) and written to
``<run folder>/plan.json``, where simulated clients read the eps0 they pin
(:func:`shuffledp.clients.run_paths.planned_eps0`). A deployed client pins its eps0 in its node config
(``shuffledp deploy bundle --calibration``, from ``shuffledp account calibrate --json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shuffledp.accounting import RefusedError
from shuffledp.clients.run_paths import PLAN_FILE
from shuffledp.server.config import ConfigError, ServerConfig

__all__ = ["Plan", "plan_from_target", "apply_plan"]


@dataclass(frozen=True)
class Plan:
    """What a planned run pins: ``eps0`` for ``rounds`` rounds of at least ``n_per_round`` reports.

    ``kind`` is the calibrating family's kind (``upper``: the target is certified at this eps0); ``achieved_epsilon``
    is the family's epsilon of the whole plan at ``eps0``, ``first_failing_eps0`` the smallest eps0 tried that
    misses the target.
    """

    target_epsilon: float
    delta: float
    family: str
    kind: str
    eps0: float
    n_per_round: int
    rounds: int
    achieved_epsilon: float
    first_failing_eps0: float | None

    def as_dict(self) -> dict[str, Any]:
        """The plan as a JSON-safe dict (report.json's ``"plan"`` and ``plan.json``)."""
        return asdict(self)

    def describe(self) -> str:
        """One line for the progress output."""
        meaning = "upper bound" if self.kind == "upper" else self.kind
        return (f"planned from target epsilon {self.target_epsilon:g} at delta {self.delta:g}: eps0 = {self.eps0:.6g} "
                f"per report ({self.family}, {meaning}: {self.rounds} rounds of at least {self.n_per_round} reports "
                f"give epsilon {self.achieved_epsilon:.6g})")


def plan_from_target(cfg: ServerConfig) -> Plan:
    """Calibrate eps0 for ``cfg``'s target (see the module docstring); returns the :class:`Plan`.

    Raises:
        ConfigError: no eps0 meets the target for these rounds and reports (the family's reason), or the target
            is not set.
    """
    from shuffledp.accounting import bounds

    if cfg.target_epsilon <= 0:
        raise ConfigError("run config 'target-epsilon' is 0: nothing to plan (eps0 comes from the run config)")
    try:
        bound = bounds.calibrate(cfg.accounting_family, cfg.target_epsilon, cfg.target_delta, cfg.min_reports,
                                 cfg.num_server_rounds)
    except RefusedError as exc:
        raise ConfigError(f"cannot plan eps0 for target epsilon {cfg.target_epsilon:g}: {exc}") from None
    details = dict(bound.details or {})
    return Plan(target_epsilon=cfg.target_epsilon, delta=cfg.target_delta, family=bound.family, kind=bound.kind,
                eps0=float(bound.value), n_per_round=cfg.min_reports, rounds=cfg.num_server_rounds,
                achieved_epsilon=float(details.get("achieved_epsilon", float("nan"))),
                first_failing_eps0=details.get("first_failing_eps0"))


def apply_plan(cfg: ServerConfig, out_dir: Path, say: Callable[[str], None]) -> tuple[ServerConfig, Plan | None]:
    """Plan eps0 when ``cfg`` has a target: say it, write ``out_dir/plan.json`` and return the config to run.

    Returns:
        ``(cfg, None)`` without a target; else ``(cfg with eps0 = the plan's, the plan)``.

    Raises:
        ConfigError: as :func:`plan_from_target`.
    """
    if cfg.target_epsilon <= 0:
        return cfg, None
    from shuffledp.shuffler.journal import write_file_durably

    plan = plan_from_target(cfg)
    say(f"[shuffledp] {plan.describe()}")
    write_file_durably(out_dir / PLAN_FILE, json.dumps(plan.as_dict(), indent=2, sort_keys=True).encode())
    return replace(cfg, eps0=plan.eps0), plan
