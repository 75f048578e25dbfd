"""One rule for where a run's folder and its simulation keys are, used by the ServerApp and every ClientApp."""

from __future__ import annotations

from pathlib import Path

import pytest

from shuffledp.clients.run_paths import run_folder, simulation_keys_dir
from shuffledp.clients.settings import ClientSetupError, pinned_from_configs
from shuffledp.shuffler.keys import init_key_directory


def test_the_run_folder_and_the_derived_key_directory(tmp_path: Path) -> None:
    assert run_folder("out", "", 42, base=tmp_path) == tmp_path / "out" / "run-42"
    assert run_folder(str(tmp_path / "abs"), "mine", 42) == tmp_path / "abs" / "mine"
    assert simulation_keys_dir({"output-dir": "out"}, 42, base=tmp_path) == (tmp_path / "out" / "run-42" / "keys",
                                                                             True)
    assert simulation_keys_dir({"keys-dir": "k", "output-dir": "out"}, 42, base=tmp_path) == (tmp_path / "k", False)


def test_a_simulated_client_finds_its_key_in_the_runs_own_directory(tmp_path: Path) -> None:
    run_config = {"eps0": 2.0, "clip-l1": 1.0, "keys-dir": "", "output-dir": str(tmp_path / "out"), "run-name": ""}
    node_config = {"partition-id": 2, "num-partitions": 3}
    with pytest.raises(ClientSetupError, match="does not exist yet"):
        pinned_from_configs(node_config, run_config, 5)
    with pytest.raises(ClientSetupError, match="no run id"):
        pinned_from_configs(node_config, run_config)
    init_key_directory(tmp_path / "out" / "run-5" / "keys", 3, k=2)  # what the ServerApp of run 5 creates
    pinned = pinned_from_configs(node_config, run_config, 5)
    assert pinned.partition_id == 2 and len(pinned.client_key) == 32
    with pytest.raises(ClientSetupError, match="does not exist yet"):
        pinned_from_configs(node_config, run_config, 6)  # another run's folder: not this one's keys
