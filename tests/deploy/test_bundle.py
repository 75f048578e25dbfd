"""shuffledp.deploy.bundle: a device's bundle holds its own files only and pins its settings."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from shuffledp.deploy import deploy_cli
from shuffledp.deploy.bundle import create_device_bundle, node_config
from shuffledp.deploy.errors import DeployError
from shuffledp.deploy.keys import create_deploy_keys
from shuffledp.deploy.local import LocalDeployment


def test_bundle_holds_only_the_devices_files(tmp_path: Path) -> None:
    keys = create_deploy_keys(tmp_path / "keys", 3)
    bundle = create_device_bundle(keys, 2, tmp_path / "b", eps0=1.0, clip_l1=2.0)
    names = sorted(p.name for p in bundle.iterdir())
    assert names == ["client.key", "node-config.toml", "server_hpke.pub", "shuffler_hpke.pub", "superlink-ca.crt",
                     "supernode.key", "supernode.pub"]
    assert (bundle / "client.key").read_bytes() == keys.client_key(2).read_bytes()
    assert (bundle / "supernode.key").read_bytes() == keys.supernode_key(2).read_bytes()
    assert (bundle / "client.key").stat().st_mode & 0o777 == 0o600
    conf = tomllib.loads((bundle / "node-config.toml").read_text())
    assert conf["partition-id"] == 2 and conf["eps0"] == 1.0 and conf["clip-l1"] == 2.0
    assert Path(conf["client-key"]) == (bundle / "client.key").resolve()
    with pytest.raises(DeployError, match="already exists"):
        create_device_bundle(keys, 1, bundle, eps0=1.0, clip_l1=1.0)
    with pytest.raises(DeployError, match=r"--node must be an integer in \[0, 2\]"):
        create_device_bundle(keys, 3, tmp_path / "b3", eps0=1.0, clip_l1=1.0)
    assert conf["reply-floor"] == 0.0  # off unless asked for
    timed = create_device_bundle(keys, 1, tmp_path / "b1", eps0=1.0, clip_l1=2.0, reply_floor=45)
    conf = tomllib.loads((timed / "node-config.toml").read_text())
    assert conf["reply-floor"] == 45.0
    from shuffledp.clients.settings import pinned_from_configs

    assert pinned_from_configs(conf, {}).reply_floor == 45.0  # what the device's ClientApp reads
    for bad in (-1.0, 3601.0, float("nan"), True):
        with pytest.raises(DeployError, match=r"--reply-floor must be a number of seconds in \[0, 3600\]"):
            create_device_bundle(keys, 0, tmp_path / f"bad{bad}", eps0=1.0, clip_l1=1.0, reply_floor=bad)
        assert not (tmp_path / f"bad{bad}").exists()  # refused before anything was written
    with pytest.raises(DeployError, match="--reply-floor .* must be below --reply-timeout"):
        LocalDeployment(reply_floor=300.0, reply_timeout=300.0).validate()
    # the work limits the device pins (defaults: 10 epochs, batches of 1), and the CLI flags that set them
    assert (conf["max-local-epochs"], conf["min-batch-size"], conf["max-model-parameters"]) == (10, 1, 1_000_000)
    assert deploy_cli.main(["deploy", "bundle", "--keys", str(keys.root), "--node", "0", "--out", str(tmp_path / "w"),
                    "--eps0", "1", "--clip-l1", "1", "--max-local-epochs", "2", "--min-batch-size", "16",
                    "--max-model-parameters", "5000"]) == 0
    limited = pinned_from_configs(tomllib.loads((tmp_path / "w" / "node-config.toml").read_text()), {})
    assert (limited.max_local_epochs, limited.min_batch_size, limited.max_model_parameters) == (2, 16, 5000)
    for kw, flag in (({"max_local_epochs": 0}, "--max-local-epochs"), ({"min_batch_size": 1.5}, "--min-batch-size"),
                     ({"max_model_parameters": 2**28 + 1}, "--max-model-parameters")):
        with pytest.raises(DeployError, match=flag):
            create_device_bundle(keys, 0, tmp_path / "badlimit", eps0=1.0, clip_l1=1.0, **kw)
        assert not (tmp_path / "badlimit").exists()


def test_devices_pin_their_data_settings(tmp_path: Path, shuffledp_app: Callable[..., Path]) -> None:
    """The device reads the data its node config names (shuffledp.clients.settings.data_settings_from_configs), so the
    bundle
    and `deploy local` write the data settings there: bundle flags, or the run's (app defaults + --run-config)."""
    from shuffledp.clients.settings import data_settings_from_configs

    keys = create_deploy_keys(tmp_path / "keys", 2)
    plain = tomllib.loads((create_device_bundle(keys, 0, tmp_path / "b0", eps0=1.0, clip_l1=1.0)
                           / "node-config.toml").read_text())
    assert {k: plain[k] for k in ("dataset", "data-dir", "pca-components", "partition", "dirichlet-alpha",
                                  "seed")} == {"dataset": "digits", "data-dir": "", "pca-components": 10,
                                                         "partition": "iid", "dirichlet-alpha": 0.5,
                                                         "seed": 0}
    assert deploy_cli.main(["deploy", "bundle", "--keys", str(keys.root), "--node", "1", "--out", str(tmp_path / "b1"),
                    "--eps0", "1", "--clip-l1", "1", "--dataset", "mnist", "--data-dir", "/device/data",
                    "--pca-components", "0", "--partition", "dirichlet", "--dirichlet-alpha", "0.3",
                    "--seed", "7"]) == 0
    conf = tomllib.loads((tmp_path / "b1" / "node-config.toml").read_text())
    # what the device's ClientApp reads, whatever the server's run config says about data-dir or partitions
    assert data_settings_from_configs(conf, {"data-dir": "/srv", "seed": 0, "dataset": "mnist"}) == {
        "dataset": "mnist", "data_dir": "/device/data", "pca_components": None, "scheme": "dirichlet",
        "alpha": 0.3, "seed": 7}
    for flags, data in ((["--pca-components", "-1"], {"pca-components": -1}),
                        (["--partition", "zipf"], {"partition": "zipf"}),
                        (["--dirichlet-alpha", "0"], {"dirichlet-alpha": 0.0}),
                        (["--dataset", "minst"], {"dataset": "minst"})):
        assert deploy_cli.main(["deploy", "bundle", "--keys", str(keys.root), "--node", "0", "--out",
                                str(tmp_path / "bad"), "--eps0", "1", "--clip-l1", "1", *flags]) == 2
        with pytest.raises(DeployError, match=f"data settings\\['{next(iter(data))}'\\] must be"):
            create_device_bundle(keys, 0, tmp_path / "bad", eps0=1.0, clip_l1=1.0, data=data)
        assert not (tmp_path / "bad").exists()  # refused before anything was written
    with pytest.raises(DeployError, match="dataset 'mnist' needs 'data-dir'"):  # else it fails on the device
        create_device_bundle(keys, 0, tmp_path / "bad", eps0=1.0, clip_l1=1.0, data={"dataset": "mnist"})
    # deploy local: the app's run-config defaults with --run-config on top, the same for every node
    app = shuffledp_app(tmp_path / "app", 'dataset = "digits"\npca-components = 20\nseed = 4\n')
    local = LocalDeployment(app_dir=app, run_config={"pca-components": 0, "local-epochs": 2})
    local.validate()
    data = local.data_settings()
    assert (data["pca-components"], data["seed"], data["dataset"]) == (0, 4, "digits")
    assert node_config(keys, 1, 2, eps0=1.0, clip_l1=1.0, data=data)["pca-components"] == 0
    with pytest.raises(DeployError, match="pca-components"):
        LocalDeployment(app_dir=app, run_config={"pca-components": "many"}).validate()
    (app / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(DeployError, match="run-config defaults"):
        local.data_settings()


def test_a_bundle_pins_the_eps0_of_a_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`deploy bundle --calibration` takes the eps0 `shuffledp account calibrate --json` planned, only a certified
    one (an upper-bound family's), and never together with --eps0."""
    import json

    from shuffledp.deploy import cli as shuffledp_cli

    keys = create_deploy_keys(tmp_path / "keys", 2)
    assert shuffledp_cli.main(["account", "calibrate", "--target-epsilon", "4", "--n", "1000", "--rounds", "10",
                            "--delta", "1e-6", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    base = ["deploy", "bundle", "--keys", str(keys.root), "--node", "1", "--clip-l1", "1"]
    assert deploy_cli.main([*base, "--out", str(tmp_path / "d"), "--calibration", str(tmp_path / "plan.json")]) == 0
    conf = tomllib.loads((tmp_path / "d" / "node-config.toml").read_text())
    assert conf["eps0"] == plan["value"] and plan["kind"] == "upper"
    (tmp_path / "approx.json").write_text(json.dumps({**plan, "kind": "approximate", "bound": "ccg"}))
    assert deploy_cli.main([*base, "--out", str(tmp_path / "e"), "--calibration", str(tmp_path / "approx.json")]) == 2
    assert "a device pins only a certified eps0" in capsys.readouterr().err
    assert deploy_cli.main([*base, "--out", str(tmp_path / "f"), "--calibration", str(tmp_path / "plan.json"),
                            "--eps0", "2"]) == 2
    assert "not both" in capsys.readouterr().err
    assert deploy_cli.main([*base[:-2], "--out", str(tmp_path / "g"), "--eps0", "2"]) == 2
    assert "needs --clip-l1" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "efg")
