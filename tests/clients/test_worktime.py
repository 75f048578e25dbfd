"""``shuffledp deploy time-work``: the device times its worst-case work under its pinned limits."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from shuffledp.clients.worktime import time_worst_case, worst_case_models
from shuffledp.deploy.bundle import create_device_bundle
from shuffledp.deploy.deploy_cli import main
from shuffledp.deploy.keys import create_deploy_keys


@pytest.mark.parametrize(("features", "limit"), [(10, 1_000_000), (64, 5_000), (784, 1_000_000), (3, 40)])
def test_worst_case_models_fill_the_parameter_limit(features: int, limit: int) -> None:
    models = worst_case_models(features, limit)
    for kind, arrays in models.items():
        size = sum(a.size for a in arrays)
        assert size <= limit, kind
        # maximal: one more hidden unit (mlp) or output class (logreg) would exceed the limit
        grow = features + 1 + 10 if kind == "mlp" else features + 1
        assert size + grow > limit, kind
    mlp = models["mlp"]
    assert mlp[0].shape[1] == features and mlp[2].shape == (10, mlp[0].shape[0])
    assert models["logreg"][0].shape[1] == features


def test_worst_case_models_refuse_what_cannot_fit() -> None:
    with pytest.raises(ValueError, match="no logreg or mlp with 64 inputs fits in 50 parameters"):
        worst_case_models(64, 50)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="n_features"):
            worst_case_models(bad, 1000)


def test_time_worst_case_runs_the_pinned_limits_on_the_devices_data(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    keys = create_deploy_keys(tmp_path / "keys", 4)
    bundle = create_device_bundle(keys, 2, tmp_path / "b", eps0=2.0, clip_l1=1.0, reply_floor=3600,
                                     max_local_epochs=2, min_batch_size=50, max_model_parameters=3_000,
                                     data={"pca-components": 0})
    node = tomllib.loads((bundle / "node-config.toml").read_text())
    result = time_worst_case(node, repeat=2)
    assert result["features"] == 64  # digits without PCA: the device's data settings were used
    n = result["samples"]
    assert 300 < n < 460  # a quarter of the 1,797 digits, less the held-out split
    assert set(result["models"]) == {"mlp", "logreg"}
    for m in result["models"].values():
        assert m["steps"] == 2 * math.ceil(n / 50) and m["parameters"] <= 3_000 and len(m["seconds"]) == 2
    assert result["worst_s"] == pytest.approx(result["load_s"] + max(max(m["seconds"]) for m in
                                                                     result["models"].values()))
    assert result["covered"] is True and result["reply_floor_s"] == 3600.0
    # the CLI: the same measurement as JSON; a floor that does not cover it is said on stderr
    low = create_device_bundle(keys, 1, tmp_path / "low", eps0=2.0, clip_l1=1.0, max_local_epochs=1,
                                  min_batch_size=100, max_model_parameters=1_000)
    assert main(["deploy", "time-work", "--node-config", str(low / "node-config.toml"), "--repeat", "1"]) == 0
    out = capsys.readouterr()
    assert '"covered": false' in out.out and "the reply-floor (off) does not cover" in out.err
    (tmp_path / "server.toml").write_text('num-server-rounds = 3\n')
    assert main(["deploy", "time-work", "--node-config", str(tmp_path / "server.toml")]) == 1
    assert "pins no eps0" in capsys.readouterr().err
    assert main(["deploy", "time-work", "--node-config", str(low / "node-config.toml"), "--repeat", "0"]) == 1
    assert "repeat must be an int in [1, 100]" in capsys.readouterr().err
