"""ShuffleStrategy: the round engine as a Flower Message-API strategy, on a fake Grid with the real shuffler."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp.strategy import Result, Strategy

from shuffledp.clients import messages as M
from shuffledp.clients.run_paths import simulation_keys_dir
from shuffledp.server.config import ConfigError, parse_run_config
from shuffledp.server.job import resolve_paths, run_job
from shuffledp.server.strategy import ShuffleStrategy


def _named(arrays: list[np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array.from_numpy_ndarray(a) for name, a in zip(("linear.weight", "linear.bias"), arrays)})


def test_start_runs_the_shuffled_rounds_and_returns_a_flower_result(tmp_path: Path, keys: Any, kit: Any) -> None:
    cfg = kit.make_config(tmp_path, keys, **{"eps0": 2.0, "num-server-rounds": 5})
    seen_configs: list[dict[str, Any]] = []
    seen_names: list[list[str]] = []
    honest = kit.honest_factory(keys)

    def client(msg: Message, pid: int) -> Message:
        seen_configs.append(dict(msg.content[M.CONFIG_KEY]))
        seen_names.append(list(msg.content[M.ARRAYS_KEY].keys()))
        return honest(msg, pid)

    grid = kit.FakeGrid.build([client] * kit.N)
    calls: list[tuple[int, list[str]]] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        calls.append((server_round, list(arrays.keys())))
        loss, accuracy = kit.digits_evaluator(arrays.to_numpy_ndarrays())
        return MetricRecord({"loss": loss, "accuracy": accuracy, "calls": len(calls)})

    strategy = ShuffleStrategy(cfg, node_wait=0.0, progress=lambda line: None, plot=False,
                               report_sections={"data": {"test": "the app's own held-out images"}})
    assert isinstance(strategy, Strategy)
    initial = _named(kit.model_arrays())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=2, evaluate_fn=evaluate_fn,
                            train_config=ConfigRecord({"my-setting": 3}))

    assert isinstance(result, Result)
    # the names of the initial arrays go to the clients and come back in the final model
    assert seen_names and all(names == ["linear.weight", "linear.bias"] for names in seen_names)
    assert list(result.arrays.keys()) == ["linear.weight", "linear.bias"]
    final = result.arrays.to_numpy_ndarrays()
    assert any(not np.array_equal(a, b) for a, b in zip(final, initial.to_numpy_ndarrays()))  # the model moved
    # the app's own train setting reaches the clients next to the protocol's
    assert all(c["my-setting"] == 3 and c[M.CFG_EPS0] == 2.0 for c in seen_configs)
    # num_rounds overrides the run config's 5; evaluate_fn is called once per applied round, with its round
    assert [c[0] for c in calls] == [1, 2]
    report = json.loads((tmp_path / "outputs" / "t" / "report.json").read_text())
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert report["data"] == {"test": "the app's own held-out images"}  # the app's own report section
    assert sorted(result.evaluate_metrics_serverapp) == [1, 2]
    for row in report["rounds"]:
        metrics = result.evaluate_metrics_serverapp[row["round"]]
        assert metrics["epsilon"] == row["epsilon"] and metrics["accuracy"] == row["accuracy"]
        assert metrics["calls"] == row["round"]  # the app's own metrics are kept
    assert result.train_metrics_clientapp == {} and result.evaluate_metrics_clientapp == {}
    assert strategy.job is not None and strategy.job.epsilon == report["accounting"]["epsilon"]


def test_without_evaluate_fn_the_rounds_report_no_accuracy(tmp_path: Path, keys: Any, kit: Any) -> None:
    cfg = kit.make_config(tmp_path, keys, **{"num-server-rounds": 1})
    grid = kit.FakeGrid.build([kit.honest_factory(keys)] * kit.N)
    lines: list[str] = []
    result = ShuffleStrategy(cfg, node_wait=0.0, progress=lines.append, plot=False).start(
        grid=grid, initial_arrays=ArrayRecord(kit.model_arrays()))
    report = json.loads((tmp_path / "outputs" / "t" / "report.json").read_text())
    assert report["rounds"][0]["accuracy"] is None and report["rounds"][0]["loss"] is None
    assert "accuracy n/a" in next(line for line in lines if line.startswith("[shuffledp] round 1:"))
    assert list(result.evaluate_metrics_serverapp[1].keys()) == ["epsilon"]


def test_bad_arguments_are_refused_before_anything_is_sent(tmp_path: Path, keys: Any, kit: Any) -> None:
    cfg = kit.make_config(tmp_path, keys)
    grid = kit.FakeGrid.build([kit.honest_factory(keys)] * kit.N)
    strategy = ShuffleStrategy(cfg, node_wait=0.0, progress=lambda line: None, plot=False)
    arrays = ArrayRecord(kit.model_arrays())
    with pytest.raises(ConfigError, match="'eps0' is part of the protocol's train config"):
        strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"eps0": 1.0}))
    with pytest.raises(ConfigError, match="num_rounds must be an int >= 1"):
        strategy.start(grid=grid, initial_arrays=arrays, num_rounds=0)
    with pytest.raises(ConfigError, match="evaluate_config is not used"):
        strategy.start(grid=grid, initial_arrays=arrays, evaluate_config=ConfigRecord({"x": 1}))
    with pytest.raises(TypeError, match="flwr.app.ArrayRecord"):
        strategy.start(grid=grid, initial_arrays=kit.model_arrays())  # type: ignore[arg-type]  # the wrong type on purpose
    assert grid.sent == []


def test_the_separate_train_hooks_refuse_and_there_is_no_federated_evaluation(tmp_path: Path, keys: Any,
                                                                              kit: Any) -> None:
    strategy = ShuffleStrategy(kit.make_config(tmp_path, keys))
    arrays, config = ArrayRecord(kit.model_arrays()), ConfigRecord()
    with pytest.raises(TypeError, match="runs its rounds in start"):
        strategy.configure_train(1, arrays, config, grid=None)  # type: ignore[arg-type]  # never reaches the grid
    with pytest.raises(TypeError, match="runs its rounds in start"):
        strategy.aggregate_train(1, [])
    assert list(strategy.configure_evaluate(1, arrays, config, grid=None)) == []  # type: ignore[arg-type]  # unused
    assert strategy.aggregate_evaluate(1, []) is None


def test_a_raw_run_config_keeps_the_apps_own_keys(tmp_path: Path) -> None:
    strategy = ShuffleStrategy({"eps0": 2.0, "image-size": 12})
    assert strategy.config.eps0 == 2.0 and strategy.config.extra == {"image-size": 12}
    with pytest.raises(ConfigError, match="'eps0'"):
        ShuffleStrategy({"eps0": -1.0})


def test_a_simulation_without_keys_dir_creates_the_runs_keys_and_lowers_k(tmp_path: Path, kit: Any) -> None:
    """An empty keys-dir in a simulation: the run creates one key per connected node in its own folder, which the
    clients derive from the same run config and run id; k is lowered to the node count, and that is said."""
    from shuffledp.clients.core import make_envelope
    from shuffledp.clients.data import load_partition
    from shuffledp.clients.settings import PinnedSettings
    from shuffledp.shuffler import keys as keyfiles

    n_nodes = 9
    raw = {"num-server-rounds": 1, "min-reports": 1000, "reply-timeout": 5.0, "eps0": 8.0, "clip-l1": 1.0,
           "pca-components": 0, "server-lr": 0.5, "keys-dir": "", "output-dir": str(tmp_path / "outputs"),
           "run-name": "", "budget-epsilon": "inf"}
    cfg = parse_run_config(raw)

    def client(msg: Message, pid: int) -> Message:
        keys_dir, derived = simulation_keys_dir(raw, run_id=77)
        assert derived
        d = keyfiles.KeyDirectory(keys_dir)
        pinned = PinnedSettings(
            eps0=8.0, clip_l1=1.0, client_key=keyfiles.load_private_key(d.client_key(pid), "ed25519"),
            server_public_key=keyfiles.load_public_key(d.server_hpke_pub, "x25519"),
            shuffler_public_key=keyfiles.load_public_key(d.shuffler_hpke_pub, "x25519"),
            partition_id=pid, num_partitions=n_nodes)
        arrays = msg.content[M.ARRAYS_KEY].to_numpy_ndarrays()
        env = make_envelope(arrays, msg.content[M.CONFIG_KEY], pinned, load_partition(pid, n_nodes))
        return kit.envelope_reply(msg, env)

    grid = kit.FakeGrid.build([client] * n_nodes)
    lines: list[str] = []
    with pytest.raises(ConfigError, match="not a simulation"):
        resolve_paths(cfg, run_id=77)
    result = run_job(cfg, grid, run_id=77, node_wait=0.5, simulation=True, progress=lines.append, plot=False,
                     evaluator=kit.digits_evaluator, initial_arrays=kit.model_arrays())
    folder = tmp_path / "outputs" / "run-77"
    assert result.paths.keys_dir == folder / "keys"
    assert len(keyfiles.load_enrolment(folder / "keys" / "enrolment.json")) == n_nodes
    assert any(f"created this simulation's keys for {n_nodes} clients" in line for line in lines)
    assert any(f"min-reports (the shuffler's threshold k) lowered from 1000 to {n_nodes}" in line for line in lines)
    report = json.loads((folder / "report.json").read_text())
    assert report["config"]["min-reports"] == n_nodes and report["rounds"][0]["n_reports"] == n_nodes
    # a second process on the same run reuses the keys (resume), and lowers k the same way
    cfg2 = parse_run_config({**raw, "num-server-rounds": 2})
    again = run_job(cfg2, grid, run_id=77, node_wait=0.5, simulation=True, progress=lines.append, plot=False,
                    evaluator=kit.digits_evaluator, initial_arrays=kit.model_arrays())
    assert [h.round for h in again.history] == [1, 2]


def test_a_report_section_may_not_replace_the_reports_own() -> None:
    from shuffledp.server.report import report_document

    assert report_document(config={}, rounds=[], versions={}, sections={"data": 1})["data"] == 1
    with pytest.raises(ValueError, match="would replace the report's own 'rounds'"):
        report_document(config={}, rounds=[], versions={}, sections={"rounds": []})
