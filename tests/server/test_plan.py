"""A run planned from a target epsilon: eps0 calibrated before the first round, pinned by the simulated clients,
recorded in report.json; the run ends within the target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message

from shuffledp.accounting import bounds
from shuffledp.clients import messages as M
from shuffledp.server.config import ConfigError
from shuffledp.server.job import run_job
from shuffledp.server.plan import plan_from_target


def test_the_plan_is_the_largest_eps0_within_the_target(tmp_path: Path, keys: Any, kit: Any) -> None:
    cfg = kit.make_config(tmp_path, keys, **{"target-epsilon": 3.0, "num-server-rounds": 4, "min-reports": 10})
    plan = plan_from_target(cfg)
    # accounting-family = "auto" with the laplace mechanism: the plan calibrates with the resolved blanket-laplace
    assert (plan.family, plan.kind, plan.n_per_round, plan.rounds) == ("blanket-laplace", "upper", 10, 4)
    at_plan = bounds.epsilon("blanket-laplace", plan.eps0, 10, cfg.target_delta, 4).value
    assert at_plan <= 3.0 and at_plan == pytest.approx(plan.achieved_epsilon, rel=1e-12)
    assert bounds.epsilon("blanket-laplace", plan.first_failing_eps0, 10, cfg.target_delta, 4).value > 3.0
    with pytest.raises(ConfigError, match="is above 'budget-epsilon'"):
        kit.make_config(tmp_path, keys, **{"target-epsilon": 3.0, "budget-epsilon": 2.0})
    with pytest.raises(ConfigError, match="cannot plan eps0"):
        plan_from_target(kit.make_config(tmp_path, keys, **{"target-epsilon": 1e-9}))


@pytest.mark.parametrize(("mechanism", "family"), [("duchi", "blanket-duchi"), ("privunit2", "blanket-privunit2")])
def test_the_plan_uses_the_mechanisms_resolved_family(tmp_path: Path, keys: Any, kit: Any, mechanism: str,
                                                      family: str) -> None:
    cfg = kit.make_config(tmp_path, keys, **{"target-epsilon": 3.0, "num-server-rounds": 4, "min-reports": 10,
                                             "mechanism": mechanism, "clip-l2": 1.0, "eps0": 2.0})
    plan = plan_from_target(cfg)
    assert (plan.family, plan.kind) == (family, "upper")
    assert plan.eps0 == bounds.calibrate(family, 3.0, cfg.target_delta, 10, 4).value
    assert "(" + family + ", upper bound" in plan.describe()


def test_a_planned_run_pins_the_planned_eps0_on_the_clients_and_ends_within_the_target(
        tmp_path: Path, keys: Any, kit: Any) -> None:
    from shuffledp.clients.core import make_envelope
    from shuffledp.clients.data import load_partition
    from shuffledp.clients.settings import pinned_from_configs

    raw = {"target-epsilon": 2.5, "num-server-rounds": 3, "eps0": 8.0}  # eps0 is not the run's: the plan is
    cfg = kit.make_config(tmp_path, keys, **raw)
    run_config = cfg.as_dict()
    pinned_seen: list[float] = []

    def client(msg: Message, pid: int) -> Message:
        # a simulated client: its pinned settings come from the run config, and its eps0 from the run's plan
        pinned = pinned_from_configs({"partition-id": pid, "num-partitions": kit.N}, run_config, 1)
        pinned_seen.append(pinned.eps0)
        arrays = msg.content[M.ARRAYS_KEY].to_numpy_ndarrays()
        data = load_partition(pid, kit.N)
        return kit.envelope_reply(msg, make_envelope(arrays, msg.content[M.CONFIG_KEY], pinned, data))

    grid = kit.FakeGrid.build([client] * kit.N)
    lines: list[str] = []
    result = run_job(cfg, grid, run_id=1, node_wait=0.0, progress=lines.append, plot=False,
                     evaluator=kit.digits_evaluator, initial_arrays=kit.model_arrays())
    report = json.loads((result.paths.out_dir / "report.json").read_text())
    plan = report["plan"]
    assert plan["target_epsilon"] == 2.5 and plan["kind"] == "upper" and plan["n_per_round"] == kit.K
    assert any("planned from target epsilon 2.5" in line for line in lines)
    assert set(pinned_seen) == {plan["eps0"]} and plan["eps0"] != 8.0
    assert [r["eps0"] for r in report["rounds"]] == [plan["eps0"]] * 3
    assert report["config"]["eps0"] == plan["eps0"]
    assert report["accounting"]["epsilon"] <= 2.5  # every round had >= k reports: the plan holds
    assert json.loads((result.paths.out_dir / "plan.json").read_text()) == plan
