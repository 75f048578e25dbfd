"""Typed configuration of a shuffledp run, parsed once from Flower's ``context.run_config``.

Every key lives in ``[tool.flwr.app.config]`` of ``pyproject.toml`` (kebab-case, as Flower expects) and can be
overridden with ``flwr run . --run-config 'k=v'`` or ``shuffledp run --run-config 'k=v'``. The ClientApps see the
same run config (Flower sends it to every node), so nothing secret may be put here: keys are referred to by
directory (``keys-dir``), never inlined.

:func:`parse_run_config` validates every value at this boundary and raises :class:`ConfigError` naming the key,
the value received and what is allowed. Unknown keys are an error too (a typo would otherwise silently run with
a default).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shuffledp.clients.mechanism import L2_MECHANISMS, MECHANISMS
from shuffledp.clients.settings import DATA_SETTINGS_DEFAULTS

__all__ = [
    "ConfigError",
    "ServerConfig",
    "parse_run_config",
    "DEFAULTS",
    "REPORT_MODES",
    "OPTIMIZERS",
    "MODELS",
    "DATASETS",
    "PARTITIONS",
    "MECHANISMS",
]

REPORT_MODES = ("gradient", "delta")
OPTIMIZERS = ("sgd", "momentum", "adam")
MODELS = ("logreg", "mlp")
#: The datasets a run may name: the clients' loaders (``shuffledp.clients.data.DATASETS``; a test checks they agree).
DATASETS = ("digits", "mnist5k", "mnist5k-aug", "mnist")
PARTITIONS = ("iid", "dirichlet")

#: The defaults, identical to ``[tool.flwr.app.config]`` in pyproject.toml (a test checks they agree).
DEFAULTS: dict[str, bool | int | float | str] = {
    "num-server-rounds": 20,
    "fraction": 1.0,
    "min-reports": 1000,
    "reply-timeout": 900.0,
    "reply-floor": 0.0,
    "eps0": 3.4434,
    "mechanism": "laplace",
    "clip-l1": 0.5,
    "clip-l2": 1.0,
    "report": "gradient",
    "local-epochs": 1,
    "local-lr": 0.1,
    "batch-size": 32,
    "max-local-epochs": 10,
    "min-batch-size": 1,
    "max-model-parameters": 1_000_000,
    "server-optimizer": "sgd",
    "server-lr": 20.0,
    "server-momentum": 0.9,
    "model": "logreg",
    "hidden-units": 64,
    **DATA_SETTINGS_DEFAULTS,  # dataset, data-dir, pca-components, partition, dirichlet-alpha, seed
    "target-delta": 1e-6,
    "target-epsilon": 0.0,
    "budget-epsilon": 10.0,
    "accounting-family": "auto",
    "comparison-families": "rr-lower,no-shuffle,clones",
    "shuffler-address": "auto",
    "shuffler-root-cert": "",
    "shuffler-client-cert": "",
    "shuffler-client-key": "",
    "keys-dir": "",
    "key-epoch": 0,
    "output-dir": "outputs",
    "run-name": "",
    "max-message-bytes": 64 * 1024 * 1024,
    "heap-tuning": True,
}

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})$")


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or outside its allowed range."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The validated settings of one run (see ``DEFAULTS`` for the run-config key of each field).

    Privacy-relevant fields: ``mechanism``, ``eps0`` and the mechanism's clip (``clip_l1`` for ``laplace``,
    ``clip_l2`` for ``duchi`` / ``privunit2``) are sent to the clients, which refuse values different from their
    own pinned ones; ``min_reports`` (k) is the smallest number of envelopes for which a round is sent to
    the shuffler at all; ``budget_epsilon`` at ``target_delta`` is enforced with ``accounting_family`` before each
    round (``math.inf`` disables the stop but still accounts). ``accounting_family`` is always a family name: the
    run config's ``"auto"`` is resolved by ``mechanism`` when the config is parsed
    (:func:`shuffledp.accounting.families.resolve_family`), and the resolved name is what the plan, report.json
    and the ledger use.
    """

    num_server_rounds: int
    fraction: float
    min_reports: int
    reply_timeout: float
    #: simulation only: the clients' pinned reply floor (seconds; deployed clients pin it in their node config)
    reply_floor: float
    eps0: float
    clip_l1: float
    report: str
    local_epochs: int
    local_lr: float
    batch_size: int
    #: simulation only: the clients' pinned work limits (shuffledp.clients.settings.PinnedSettings; deployed clients
    #: pin theirs)
    max_local_epochs: int
    min_batch_size: int
    max_model_parameters: int
    server_optimizer: str
    server_lr: float
    server_momentum: float
    model: str
    hidden_units: int
    dataset: str
    data_dir: str
    pca_components: int
    partition: str
    dirichlet_alpha: float
    seed: int
    target_delta: float
    target_epsilon: float  # 0: eps0 is given; > 0: eps0 is planned from it before the first round (server/plan.py)
    budget_epsilon: float
    accounting_family: str
    comparison_families: tuple[str, ...]
    shuffler_address: str
    shuffler_root_cert: str
    shuffler_client_cert: str
    shuffler_client_key: str
    keys_dir: str
    key_epoch: int
    output_dir: str
    run_name: str
    max_message_bytes: int
    heap_tuning: bool = True
    #: the local randomizer (shuffledp.clients.mechanism.MECHANISMS) and the L2 clip of duchi / privunit2
    mechanism: str = "laplace"
    clip_l2: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def auto_shuffler(self) -> bool:
        """True when the ServerApp starts (and stops) its own local shuffler process."""
        return self.shuffler_address == "auto"

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe view in run-config spelling (kebab-case keys), as written to report.json."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if key == "extra":
                continue
            if key == "comparison_families":
                value = ",".join(value)
            if isinstance(value, float) and math.isinf(value):
                value = "inf"
            out[key.replace("_", "-")] = value
        return out

    def resolved_path(self, value: str, *, base: Path | None = None) -> Path:
        """Resolve a path-valued setting against ``base`` (default: the current directory)."""
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = (base or Path.cwd()) / path
        return path


def _get(raw: Mapping[str, Any], key: str) -> Any:
    return raw[key] if key in raw else DEFAULTS[key]


def _int(raw: Mapping[str, Any], key: str, *, minimum: int, maximum: int | None = None) -> int:
    value = _get(raw, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"run config {key!r} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"run config {key!r} must be an integer {allowed}, got {value}")
    return int(value)


def _float(
    raw: Mapping[str, Any],
    key: str,
    *,
    low: float,
    high: float | None = None,
    low_inclusive: bool = False,
    high_inclusive: bool = True,
    allow_inf: bool = False,
) -> float:
    value = _get(raw, key)
    if isinstance(value, str) and allow_inf and value.strip().lower() in {"inf", "infinity"}:
        value = math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"run config {key!r} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not (allow_inf and number > 0)):
        allowed = "a finite number or inf" if allow_inf else "a finite number"
        raise ConfigError(f"run config {key!r} must be {allowed}, got {number!r}")
    below = number < low if low_inclusive else number <= low
    above = high is not None and (number > high if high_inclusive else number >= high)
    if below or above:
        lo = "[" if low_inclusive else "("
        hi = "]" if high_inclusive else ")"
        top = "inf" if high is None else repr(high)
        raise ConfigError(f"run config {key!r} must be in {lo}{low!r}, {top}{hi}, got {number!r}")
    return number


def _bool(raw: Mapping[str, Any], key: str) -> bool:
    value = _get(raw, key)
    if not isinstance(value, bool):
        raise ConfigError(f"run config {key!r} must be true or false, got {type(value).__name__} {value!r}")
    return value


def _str(raw: Mapping[str, Any], key: str, *, choices: tuple[str, ...] | None = None) -> str:
    value = _get(raw, key)
    if not isinstance(value, str):
        raise ConfigError(f"run config {key!r} must be a string, got {type(value).__name__} {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"run config {key!r} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _families(raw: Mapping[str, Any], key: str, known: tuple[str, ...]) -> tuple[str, ...]:
    text = _str(raw, key)
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"run config {key!r} names unknown accounting families {unknown}; known: {list(known)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"run config {key!r} lists a family twice: {text!r}")
    return names


def _accounting_families() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(known, guarantees)``: every family a run may name (those the accountant composes over rounds;
    ``girgis-lower`` is a Renyi curve only), and those that may enforce a budget (every number they give is an
    upper bound). Imported here, not at module level, to keep ``import shuffledp.server.config`` light."""
    from shuffledp.accounting import FAMILIES
    from shuffledp.accounting.accountant import GUARANTEE_FAMILIES

    return tuple(FAMILIES), tuple(GUARANTEE_FAMILIES)


def _check_mechanism_families(mechanism: str, families: tuple[str, ...]) -> None:
    """A mechanism-aware family (``blanket-laplace``, ``blanket-duchi``, ``blanket-privunit2``) bounds only the
    reports of its own randomizer: refuse it (as the budget family or as a comparison) when the run's clients use
    another ``mechanism``."""
    from shuffledp.accounting.families import FAMILY_MECHANISMS

    for name in families:
        needed = FAMILY_MECHANISMS.get(name)
        if needed is not None and needed != mechanism:
            raise ConfigError(
                f"run config names {name!r}, a bound that holds only for reports of the {needed!r} mechanism, but "
                f"'mechanism' = {mechanism!r}; use 'auto' (the mechanism's own default), a generic family (e.g. "
                f"'clones-focs') or mechanism = {needed!r}")


def _budget_family(raw: Mapping[str, Any], mechanism: str, guarantees: tuple[str, ...]) -> str:
    """The run's budget family: ``accounting-family`` as given, or ``"auto"`` resolved by ``mechanism``
    (laplace -> blanket-laplace, duchi -> blanket-duchi, privunit2 -> blanket-privunit2:
    :data:`shuffledp.accounting.families.AUTO_FAMILIES`, each rigorous for its mechanism without the withdrawn
    general proof of Feldman, McMillan, Talwar, SODA 2023, Lemma 3.5).

    Raises:
        ConfigError: not ``"auto"`` and not an upper-bound family, or ``"auto"`` for a mechanism without a default.
    """
    from shuffledp.accounting.families import AUTO_FAMILY, resolve_family

    family = _str(raw, "accounting-family")
    if family == AUTO_FAMILY:
        try:
            return resolve_family(family, mechanism)
        except ValueError as exc:
            raise ConfigError(f"run config 'accounting-family': {exc}") from None
    if family not in guarantees:
        raise ConfigError(
            f"run config 'accounting-family' enforces the budget, so it must be {AUTO_FAMILY!r} (picked by "
            f"'mechanism') or an upper-bound family, one of {list(guarantees)}; got {family!r} (approximate and "
            "lower-bound families belong in 'comparison-families')"
        )
    return family


def parse_run_config(raw: Mapping[str, Any], *, allow_unknown: bool = False) -> ServerConfig:
    """Validate Flower's run config and return a :class:`ServerConfig`.

    Args:
        raw: ``context.run_config`` (keys as in ``[tool.flwr.app.config]``); missing keys take ``DEFAULTS``.
        allow_unknown: keep keys this module does not know in ``ServerConfig.extra`` instead of failing.

    Raises:
        ConfigError: a value has the wrong type or is out of range, or a key is unknown.
    """
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown and not allow_unknown:
        raise ConfigError(f"unknown run config keys {unknown}; known keys: {sorted(DEFAULTS)}")
    known_families, guarantees = _accounting_families()

    mechanism = _str(raw, "mechanism", choices=MECHANISMS)
    family = _budget_family(raw, mechanism, guarantees)
    comparison = tuple(f for f in _families(raw, "comparison-families", known_families) if f != family)
    _check_mechanism_families(mechanism, (family, *comparison))

    address = _str(raw, "shuffler-address").strip()
    if address != "auto":
        match = _ADDRESS.match(address)
        if match is None or not 1 <= int(match.group("port")) <= 65535:
            raise ConfigError(
                f"run config 'shuffler-address' must be 'auto' or host:port with a port in [1, 65535]; "
                f"got {address!r}"
            )

    run_name = _str(raw, "run-name").strip()
    if run_name and not _RUN_NAME.match(run_name):
        raise ConfigError(
            "run config 'run-name' must start with a letter or digit and contain only letters, digits, '.', '_' "
            f"and '-' (at most 100 characters); got {run_name!r}"
        )

    dataset = _str(raw, "dataset", choices=DATASETS)
    data_dir = _str(raw, "data-dir")
    if dataset == "mnist" and not data_dir.strip():
        raise ConfigError("run config 'data-dir' must name the folder with the MNIST IDX files when dataset='mnist'")

    from shuffledp.clients.settings import MAX_REPLY_FLOOR

    config = ServerConfig(
        num_server_rounds=_int(raw, "num-server-rounds", minimum=1),
        fraction=_float(raw, "fraction", low=0.0, high=1.0),
        min_reports=_int(raw, "min-reports", minimum=1),
        reply_timeout=_float(raw, "reply-timeout", low=0.0),
        reply_floor=_float(raw, "reply-floor", low=0.0, high=MAX_REPLY_FLOOR, low_inclusive=True),
        eps0=_float(raw, "eps0", low=0.0),
        mechanism=mechanism,
        clip_l1=_float(raw, "clip-l1", low=0.0),
        clip_l2=_float(raw, "clip-l2", low=0.0),
        report=_str(raw, "report", choices=REPORT_MODES),
        local_epochs=_int(raw, "local-epochs", minimum=1),
        local_lr=_float(raw, "local-lr", low=0.0),
        batch_size=_int(raw, "batch-size", minimum=1),
        max_local_epochs=_int(raw, "max-local-epochs", minimum=1, maximum=10_000),
        min_batch_size=_int(raw, "min-batch-size", minimum=1, maximum=2**31 - 1),
        max_model_parameters=_int(raw, "max-model-parameters", minimum=1, maximum=2**28),
        server_optimizer=_str(raw, "server-optimizer", choices=OPTIMIZERS),
        server_lr=_float(raw, "server-lr", low=0.0),
        server_momentum=_float(raw, "server-momentum", low=0.0, high=1.0, low_inclusive=True, high_inclusive=False),
        model=_str(raw, "model", choices=MODELS),
        hidden_units=_int(raw, "hidden-units", minimum=1),
        dataset=dataset,
        data_dir=data_dir,
        pca_components=_int(raw, "pca-components", minimum=0),
        partition=_str(raw, "partition", choices=PARTITIONS),
        dirichlet_alpha=_float(raw, "dirichlet-alpha", low=0.0),
        seed=_int(raw, "seed", minimum=0),
        target_delta=_float(raw, "target-delta", low=0.0, high=1.0, high_inclusive=False),
        target_epsilon=_float(raw, "target-epsilon", low=0.0, low_inclusive=True),
        budget_epsilon=_float(raw, "budget-epsilon", low=0.0, allow_inf=True),
        accounting_family=family,
        comparison_families=comparison,
        shuffler_address=address,
        shuffler_root_cert=_str(raw, "shuffler-root-cert"),
        shuffler_client_cert=_str(raw, "shuffler-client-cert"),
        shuffler_client_key=_str(raw, "shuffler-client-key"),
        keys_dir=_str(raw, "keys-dir"),
        key_epoch=_int(raw, "key-epoch", minimum=0, maximum=2**32 - 1),  # a u32 in the envelope's binding
        output_dir=_str(raw, "output-dir"),
        run_name=run_name,
        max_message_bytes=_int(raw, "max-message-bytes", minimum=1024),
        heap_tuning=_bool(raw, "heap-tuning"),
        extra={key: raw[key] for key in unknown},
    )
    if config.reply_floor >= config.reply_timeout:
        raise ConfigError(
            f"run config 'reply-floor' ({config.reply_floor:g} s) must be below 'reply-timeout' "
            f"({config.reply_timeout:g} s): every reply would arrive after the server stopped waiting"
        )
    if config.report == "delta" and (
        config.local_epochs > config.max_local_epochs or config.batch_size < config.min_batch_size
    ):
        raise ConfigError(
            f"run config asks local-epochs={config.local_epochs}, batch-size={config.batch_size}, but the simulated "
            f"clients' work limits are max-local-epochs={config.max_local_epochs}, min-batch-size="
            f"{config.min_batch_size}: every client would refuse (raise the limits or lower the work)"
        )
    if not config.output_dir.strip():
        raise ConfigError("run config 'output-dir' must be a non-empty path")
    if config.target_epsilon > config.budget_epsilon:
        raise ConfigError(
            f"run config 'target-epsilon' ({config.target_epsilon:g}) is above 'budget-epsilon' "
            f"({config.budget_epsilon:g}): the plan would spend more than the budget allows; lower the target or "
            "raise the budget")
    from shuffledp.clients.mechanism import make_mechanism

    clip_key = "clip-l2" if config.mechanism in L2_MECHANISMS else "clip-l1"
    try:  # the clients' mechanism must exist for these values, or every report of the run would fail
        make_mechanism(config.mechanism, eps0=config.eps0, clip_l1=config.clip_l1, clip_l2=config.clip_l2)
    except ValueError as exc:
        raise ConfigError(f"run config 'mechanism' = {config.mechanism!r} with 'eps0' / {clip_key!r} gives no usable "
                          f"client mechanism: {exc}") from None
    return config
