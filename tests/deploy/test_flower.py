"""shuffledp.deploy.flower: the TOML writer, the --run-config rule, ports and the Flower environment."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from shuffledp.deploy import flower
from shuffledp.deploy.bundle import node_config
from shuffledp.deploy.errors import DeployUsageError
from shuffledp.deploy.flower import (
    CONNECTION_NAME,
    flower_env,
    parse_run_config_args,
    run_config_arg,
    toml_value,
    write_flower_config,
    write_toml,
)
from shuffledp.deploy.keys import create_deploy_keys


def test_node_config_file_round_trips_through_toml(tmp_path: Path) -> None:
    keys = create_deploy_keys(tmp_path / "keys with space", 2)
    conf = node_config(keys, 1, 2, eps0=2.5, clip_l1=0.5)
    path = write_toml(tmp_path / "n.toml", conf)
    loaded = tomllib.loads(path.read_text())
    assert loaded == conf
    assert Path(loaded["client-key"]).is_file() and " " in loaded["client-key"]
    assert set(conf) == {"partition-id", "num-partitions", "eps0", "mechanism", "clip-l1", "reply-floor",
                         "max-local-epochs", "min-batch-size", "max-model-parameters", "client-key",
                         "server-public-key", "shuffler-public-key", "dataset", "data-dir", "pca-components",
                         "partition", "dirichlet-alpha", "seed"}
    flwr_conf = tomllib.loads(write_flower_config(tmp_path / "home", "127.0.0.1:9", keys.superlink_ca_cert)
                              .read_text())
    conn = flwr_conf["superlink"][CONNECTION_NAME]
    assert flwr_conf["superlink"]["default"] == CONNECTION_NAME
    assert conn == {"address": "127.0.0.1:9", "root-certificates": str(keys.superlink_ca_cert.resolve())}


def test_run_config_args_read_toml_values_and_bare_strings() -> None:
    got = parse_run_config_args(["eps0=2 min-reports=10", "run-name=abc", "report='delta'", "budget-epsilon=inf"])
    assert got == {"eps0": 2, "min-reports": 10, "run-name": "abc", "report": "delta", "budget-epsilon": float("inf")}
    with pytest.raises(DeployUsageError, match="key=value"):
        parse_run_config_args(["eps0"])


def test_toml_values_round_trip_through_flwr_syntax() -> None:
    import tomllib

    for value in (True, 3, 2.5, 1e-06, "it's \"quoted\"", "/abs/path with space"):
        assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [flower.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p <= 65535 for p in ports)


def test_one_run_config_rule_for_run_and_deploy_local() -> None:
    """`shuffledp run` took 'k=v k=v' in one flag, `deploy local` one pair per flag: both forms, and a mix of them
    with the flag repeated, give the same overrides; values are TOML or bare strings."""
    want = {"eps0": 2, "local-epochs": 3, "run-name": "my run", "dataset": "digits", "lr": 0.05, "plot": False}
    one_flag = ["eps0=2 local-epochs=3 run-name='my run' dataset=digits lr=0.05 plot=false"]
    one_pair_per_flag = ["eps0=2", "local-epochs=3", "run-name='my run'", "dataset=digits", "lr=0.05", "plot=false"]
    mixed = ["eps0=2 local-epochs=3", "run-name='my run'", "dataset=digits lr=0.05", "plot=false"]
    for items in (one_flag, one_pair_per_flag, mixed):
        assert parse_run_config_args(items) == want
    with pytest.raises(DeployUsageError, match=r"gives eps0 twice \(1 and 2\); give it once"):
        parse_run_config_args(["eps0=1", "eps0=2"])  # no silent choice between two values
    assert parse_run_config_args([]) == {}
    # what `shuffledp run` passes on to `flwr run --run-config` reads back the same
    assert parse_run_config_args([run_config_arg(want)]) == want


@pytest.mark.parametrize("item, wrong", [
    ("eps0", "'eps0'"),
    ("eps0=2 =3", "'=3'"),
    ("run-name='open", "No closing quotation"),
    ("", "holds no key=value pair"),
    ("sizes=[1,2]", "TOML list"),
])
def test_a_bad_run_config_pair_names_what_is_wrong_and_what_is_allowed(item: str, wrong: str) -> None:
    with pytest.raises(DeployUsageError) as info:
        parse_run_config_args(["local-epochs=1", item])
    message = str(info.value)
    assert wrong in message
    assert "key=value" in message and ("TOML" in message or "boolean, integer, float or string" in message)


def test_every_flower_process_gets_the_same_environment(tmp_path: Path) -> None:
    env = flower_env(tmp_path / "home", {"PATH": "/bin", "FLWR_HOME": "/elsewhere", "FLWR_LOG_LEVEL": "DEBUG"})
    assert env == {"PATH": "/bin", "FLWR_HOME": str(tmp_path / "home"), "FLWR_TELEMETRY_ENABLED": "0",
                   "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                   "OPENBLAS_NUM_THREADS": "1"}


def test_the_flower_connection_is_tls_or_insecure(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    insecure = tomllib.loads(write_flower_config(tmp_path / "a", "127.0.0.1:9", None).read_text())
    assert insecure["superlink"][CONNECTION_NAME] == {"address": "127.0.0.1:9", "insecure": True}
    tls = tomllib.loads(write_flower_config(tmp_path / "b", "127.0.0.1:9", ca).read_text())
    assert tls["superlink"][CONNECTION_NAME] == {"address": "127.0.0.1:9", "root-certificates": str(ca.resolve())}


def test_a_run_config_file_is_read_like_pairs(tmp_path: Path) -> None:
    """``--run-config FILE.toml`` (what ``flwr run`` takes): a flat table of the same keys, mixed with pairs."""
    conf = tmp_path / "myrun.toml"
    conf.write_text('eps0 = 2.0\nlocal-epochs = 3\nrun-name = "my run"\n')
    assert parse_run_config_args([str(conf), "dataset=digits"]) == {"eps0": 2.0, "local-epochs": 3,
                                                                     "run-name": "my run", "dataset": "digits"}
    with pytest.raises(DeployUsageError, match="gives eps0 twice"):
        parse_run_config_args([str(conf), "eps0=4"])
    with pytest.raises(DeployUsageError, match="cannot read the file"):
        parse_run_config_args([str(tmp_path / "missing.toml")])
    (tmp_path / "bad.toml").write_text("eps0 = \n")
    with pytest.raises(DeployUsageError, match="is not valid TOML"):
        parse_run_config_args([str(tmp_path / "bad.toml")])
    (tmp_path / "nested.toml").write_text("[section]\neps0 = 1\n")
    with pytest.raises(DeployUsageError, match="is a TOML dict"):
        parse_run_config_args([str(tmp_path / "nested.toml")])
