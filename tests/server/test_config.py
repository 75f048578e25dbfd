"""Run-config parsing: defaults agree with pyproject.toml, every bad value is refused with a clear message."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from shuffledp.server.config import DEFAULTS, ConfigError, parse_run_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_match_pyproject_section() -> None:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    section = doc["tool"]["flwr"]["app"]["config"]
    assert section == DEFAULTS


def test_defaults_parse() -> None:
    cfg = parse_run_config({})
    assert cfg.num_server_rounds == DEFAULTS["num-server-rounds"]
    assert cfg.auto_shuffler
    assert cfg.server_optimizer == "sgd"
    # accounting-family = "auto" with the default laplace mechanism; clones is shown next to it
    assert DEFAULTS["accounting-family"] == "auto" and cfg.accounting_family == "blanket-laplace"
    assert cfg.comparison_families == ("rr-lower", "no-shuffle", "clones")


def test_overrides_and_inf_budget() -> None:
    cfg = parse_run_config({"eps0": 2, "budget-epsilon": "inf", "comparison-families": "rr-lower, no-shuffle",
                            "shuffler-address": "shuffler.example.org:7000", "server-optimizer": "adam"})
    assert cfg.eps0 == 2.0 and isinstance(cfg.eps0, float)
    assert math.isinf(cfg.budget_epsilon)
    assert cfg.comparison_families == ("rr-lower", "no-shuffle")
    assert not cfg.auto_shuffler
    assert cfg.as_dict()["budget-epsilon"] == "inf"


def test_default_family_is_removed_from_comparisons() -> None:
    cfg = parse_run_config({"comparison-families": "blanket-laplace,rr-lower"})  # auto -> blanket-laplace (laplace)
    assert cfg.comparison_families == ("rr-lower",)


@pytest.mark.parametrize(("mechanism", "family"), [
    ("laplace", "blanket-laplace"), ("duchi", "blanket-duchi"), ("privunit2", "blanket-privunit2"),
])
def test_auto_resolves_by_mechanism_and_the_resolved_name_is_recorded(mechanism: str, family: str) -> None:
    cfg = parse_run_config({"mechanism": mechanism, "clip-l2": 1.0})
    assert cfg.accounting_family == family
    assert cfg.as_dict()["accounting-family"] == family  # report.json's config
    assert cfg.comparison_families == ("rr-lower", "no-shuffle", "clones")
    explicit = parse_run_config({"mechanism": mechanism, "clip-l2": 1.0, "accounting-family": "auto"})
    assert explicit.accounting_family == family


def test_auto_covers_every_mechanism_with_a_rigorous_upper_family() -> None:
    from shuffledp.accounting.accountant import GUARANTEE_FAMILIES
    from shuffledp.accounting.families import AUTO_FAMILIES, FAMILY_MECHANISMS, resolve_family
    from shuffledp.clients.mechanism import MECHANISMS

    assert set(AUTO_FAMILIES) == set(MECHANISMS)
    for mechanism, family in AUTO_FAMILIES.items():
        assert family in GUARANTEE_FAMILIES and family != "clones"  # never the family the SODA'23 errata restrict
        assert FAMILY_MECHANISMS.get(family, mechanism) == mechanism
    assert resolve_family("clones", "duchi") == "clones"
    with pytest.raises(ValueError, match="no default for mechanism 'gaussian'.*laplace -> blanket-laplace"):
        resolve_family("auto", "gaussian")


def test_an_explicit_clones_stays_allowed_and_leaves_the_comparisons() -> None:
    cfg = parse_run_config({"accounting-family": "clones"})
    assert cfg.accounting_family == "clones" and cfg.comparison_families == ("rr-lower", "no-shuffle")


def test_blanket_duchi_needs_the_duchi_mechanism() -> None:
    cfg = parse_run_config({"accounting-family": "blanket-duchi", "mechanism": "duchi", "clip-l2": 1.0})
    assert cfg.accounting_family == "blanket-duchi"
    for raw in ({"accounting-family": "blanket-duchi"},
                {"comparison-families": "blanket-duchi", "mechanism": "privunit2", "clip-l2": 1.0}):
        with pytest.raises(ConfigError, match="holds only for reports of the 'duchi' mechanism.*use 'auto'"):
            parse_run_config(raw)


def test_blanket_laplace_needs_the_laplace_mechanism() -> None:
    cfg = parse_run_config({"accounting-family": "blanket-laplace", "mechanism": "laplace"})
    assert cfg.accounting_family == "blanket-laplace"
    for raw in ({"accounting-family": "blanket-laplace", "mechanism": "duchi", "clip-l2": 1.0},
                {"comparison-families": "blanket-laplace", "mechanism": "privunit2", "clip-l2": 1.0}):
        with pytest.raises(ConfigError, match="holds only for reports of the 'laplace' mechanism"):
            parse_run_config(raw)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("eps0", 0.0, "'eps0' must be in (0.0, inf]"),
        ("eps0", -1.0, "'eps0'"),
        ("eps0", "4", "must be a number"),
        ("eps0", float("nan"), "finite"),
        ("fraction", 1.5, "'fraction' must be in (0.0, 1.0]"),
        ("fraction", 0.0, "'fraction'"),
        ("min-reports", 0, "'min-reports' must be an integer >= 1"),
        ("min-reports", 2.5, "must be an integer"),
        ("num-server-rounds", True, "must be an integer"),
        ("report", "weights", "'report' must be one of gradient, delta"),
        ("server-optimizer", "rmsprop", "sgd, momentum, adam"),
        ("model", "cnn", "logreg, mlp"),
        ("dataset", "cifar", "digits, mnist"),
        ("target-delta", 1.0, "'target-delta'"),
        ("server-momentum", 1.0, "'server-momentum'"),
        ("accounting-family", "magic", "'accounting-family' enforces the budget, so it must be 'auto' (picked by"),
        ("accounting-family", "rr-lower", "or an upper-bound family, one of ["),
        ("comparison-families", "clones,nope", "unknown accounting families ['nope']"),
        ("comparison-families", "rr-lower,girgis-lower", "unknown accounting families ['girgis-lower']"),
        ("key-epoch", 2**32, "'key-epoch' must be an integer in [0, 4294967295]"),
        ("shuffler-address", "localhost", "'auto' or host:port"),
        ("shuffler-address", "host:70000", "'auto' or host:port"),
        ("run-name", "../escape", "'run-name'"),
        ("output-dir", "  ", "'output-dir'"),
        ("heap-tuning", "yes", "'heap-tuning' must be true or false"),
        ("heap-tuning", 1, "'heap-tuning' must be true or false"),
        ("reply-floor", -0.5, "'reply-floor' must be in [0.0, 3600.0]"),
        ("reply-floor", 3601.0, "'reply-floor' must be in [0.0, 3600.0]"),
        ("reply-floor", 900.0, "'reply-floor' (900 s) must be below 'reply-timeout' (900 s)"),
        ("max-local-epochs", 0, "'max-local-epochs' must be an integer in [1, 10000]"),
        ("min-batch-size", 0, "'min-batch-size' must be an integer in [1, 2147483647]"),
        ("mechanism", "gaussian", "'mechanism' must be one of laplace, duchi, privunit2"),
        ("mechanism", 1, "'mechanism' must be a string"),
        ("clip-l2", 0.0, "'clip-l2' must be in (0.0, inf]"),
        ("clip-l2", "1", "'clip-l2' must be a number"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_run_config({key: value})
    assert fragment in str(info.value)


def test_work_beyond_the_simulated_clients_limits_is_refused_at_startup() -> None:
    with pytest.raises(ConfigError, match="max-local-epochs=10, min-batch-size=1: every client would refuse"):
        parse_run_config({"report": "delta", "local-epochs": 11})
    with pytest.raises(ConfigError, match="batch-size=8, .* min-batch-size=16"):
        parse_run_config({"report": "delta", "min-batch-size": 16, "batch-size": 8})
    assert parse_run_config({"report": "delta", "local-epochs": 20, "max-local-epochs": 20}).local_epochs == 20
    assert parse_run_config({"local-epochs": 11}).local_epochs == 11  # a gradient report does no local epochs


def test_unknown_key_is_refused_unless_allowed() -> None:
    with pytest.raises(ConfigError, match="unknown run config keys \\['epsilon0'\\]"):
        parse_run_config({"epsilon0": 1.0})
    cfg = parse_run_config({"epsilon0": 1.0}, allow_unknown=True)
    assert cfg.extra == {"epsilon0": 1.0}


def test_mnist_needs_a_path() -> None:
    with pytest.raises(ConfigError, match="data-dir"):
        parse_run_config({"dataset": "mnist"})
    assert parse_run_config({"dataset": "mnist", "data-dir": "data/mnist"}).dataset == "mnist"


@pytest.mark.parametrize("over", [{"clip-l1": 2**45}, {"eps0": 100.0}, {"mechanism": "duchi", "eps0": 65.0}])
def test_privacy_values_without_a_client_mechanism_are_refused_at_startup(over: dict) -> None:
    with pytest.raises(ConfigError, match="no usable client mechanism"):
        parse_run_config(over)


def test_the_mechanism_and_its_clip_are_run_config_keys() -> None:
    cfg = parse_run_config({})
    assert (cfg.mechanism, cfg.clip_l2) == ("laplace", 1.0)
    cfg = parse_run_config({"mechanism": "privunit2", "clip-l2": 0.5})
    assert (cfg.mechanism, cfg.clip_l2) == ("privunit2", 0.5)
    assert cfg.as_dict()["mechanism"] == "privunit2" and cfg.as_dict()["clip-l2"] == 0.5  # in report.json
    from shuffledp.server.rounds import RESUME_KEYS

    assert {"mechanism", "clip-l2"} <= set(RESUME_KEYS)


def test_the_server_accepts_exactly_the_datasets_the_clients_can_load() -> None:
    from shuffledp.clients.data import DATASETS as CLIENT_DATASETS
    from shuffledp.server.config import DATASETS

    assert DATASETS == CLIENT_DATASETS
    cfg = parse_run_config({"dataset": "mnist5k-aug"})
    assert cfg.dataset == "mnist5k-aug"
