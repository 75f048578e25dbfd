"""A device bundle pins the mechanism like eps0; the research-only privunit2 is refused for a device."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from shuffledp.clients.settings import pinned_from_configs
from shuffledp.deploy.bundle import create_device_bundle, device_node_config
from shuffledp.deploy.errors import DeployUsageError
from shuffledp.deploy.keys import create_deploy_keys

PATHS = {"client-key": "/d/client.key", "server-public-key": "/d/s.pub", "shuffler-public-key": "/d/sh.pub"}


def test_the_node_config_pins_the_mechanism_and_its_clip(tmp_path: Path) -> None:
    assert device_node_config(0, 2, eps0=1.0, clip_l1=1.0, key_paths=PATHS)["mechanism"] == "laplace"
    conf = device_node_config(0, 2, eps0=1.0, clip_l1=1.0, key_paths=PATHS, mechanism="duchi", clip_l2=0.5)
    assert (conf["mechanism"], conf["clip-l2"]) == ("duchi", 0.5)
    with pytest.raises(DeployUsageError, match="research-only"):
        device_node_config(0, 2, eps0=1.0, clip_l1=1.0, key_paths=PATHS, mechanism="privunit2", clip_l2=0.5)
    with pytest.raises(DeployUsageError, match="needs --clip-l2"):
        device_node_config(0, 2, eps0=1.0, clip_l1=1.0, key_paths=PATHS, mechanism="duchi")
    with pytest.raises(DeployUsageError, match="--clip-l2 belongs to the L2 mechanisms"):
        device_node_config(0, 2, eps0=1.0, clip_l1=1.0, key_paths=PATHS, clip_l2=0.5)
    with pytest.raises(DeployUsageError, match="--mechanism must be one of"):
        device_node_config(0, 2, eps0=1.0, clip_l1=1.0, key_paths=PATHS, mechanism="gauss")
    keys = create_deploy_keys(tmp_path / "keys", 2)
    bundle = create_device_bundle(keys, 1, tmp_path / "b", eps0=2.0, clip_l1=1.0, mechanism="duchi", clip_l2=0.5)
    pinned = pinned_from_configs(tomllib.loads((bundle / "node-config.toml").read_text()), {})
    assert (pinned.mechanism, pinned.eps0, pinned.clip_l2) == ("duchi", 2.0, 0.5)  # what the device's ClientApp reads
