"""What a client pins and refuses before it touches its data: the pinned settings (mechanism, eps0, clip-l1 or
clip-l2, keys, reply floor, work limits) read from the node's own configs, the data settings every device pins,
and the check of a request against them.

Used by the ClientApp's mod (:mod:`shuffledp.clients.mod`), the report path (:mod:`shuffledp.clients.core`), the
deployment's device bundles and the server's simulation config. The server is the adversary here: nothing in a
request can change what is pinned.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shuffledp.clients.data import DATASETS
from shuffledp.clients.mechanism import (
    DEFAULT_MECHANISM,
    L2_MECHANISMS,
    MECHANISMS,
    RESEARCH_ONLY,
    LaplaceMechanism,
    Mechanism,
    make_mechanism,
)
from shuffledp.clients.messages import TrainConfig
from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer

__all__ = [
    "PinnedSettings",
    "PinnedMismatchError",
    "ClientSetupError",
    "MAX_REPLY_FLOOR",
    "DEFAULT_MAX_LOCAL_EPOCHS",
    "DEFAULT_MIN_BATCH_SIZE",
    "DEFAULT_MAX_MODEL_PARAMETERS",
    "check_pinned",
    "pinned_from_configs",
    "DATA_SETTINGS_DEFAULTS",
    "data_settings_from_configs",
    "parse_data_settings",
]

_log = logging.getLogger("shuffledp.client")

class PinnedMismatchError(ValueError):
    """The server asked for a mechanism / eps0 / clip different from the client's pinned values, for more local
    work than the client's pinned work limits allow, or (in a deployment) for another dataset or PCA than the
    device's."""


class ClientSetupError(ValueError):
    """The client's own configuration is missing or invalid (pinned values, key files)."""


#: The largest ``reply-floor`` a client accepts (seconds).
MAX_REPLY_FLOOR = 3600.0
#: Work limits a client pins unless it pins others: requests for more local epochs, or smaller minibatches, are
#: refused. They bound the local work by the client's own settings, so that a ``reply-floor`` can be chosen to
#: cover it (see :class:`PinnedSettings`); the server's defaults (1 epoch, batches of 32) are within them.
DEFAULT_MAX_LOCAL_EPOCHS = 10
DEFAULT_MIN_BATCH_SIZE = 1
#: The model's size scales the work per sample, and the server chooses the model: a model with more parameters
#: is refused. The default admits the bundled models on MNIST without PCA (an mlp of 64 hidden units has 50,890).
DEFAULT_MAX_MODEL_PARAMETERS = 1_000_000
#: The parser's own bounds on a request (shuffledp.clients.messages.TrainConfig), which the pinned limits must lie in.
_LOCAL_EPOCHS_CAP = 10_000
_BATCH_SIZE_CAP = 2**31 - 1
_MODEL_PARAMETERS_CAP = 2**28  # shuffledp.clients.report.MAX_DIM: no larger report can be encoded


@dataclass(frozen=True)
class PinnedSettings:
    """What the client decides, not the server: privacy parameters, keys, and its partition."""

    eps0: float
    clip_l1: float
    client_key: bytes = field(repr=False)  # Ed25519 private key, raw 32 bytes
    server_public_key: bytes  # X25519, raw 32 bytes
    shuffler_public_key: bytes  # X25519, raw 32 bytes
    partition_id: int = 0
    num_partitions: int = 1
    log2_grid: int | None = None
    #: seconds: the ClientApp sends no reply earlier than this after the request arrived, so that the reply time
    #: does not reveal how long the local work took (it grows with the local dataset); 0 = off
    reply_floor: float = 0.0
    #: work limits: a request for more local epochs, or for smaller minibatches, is refused (on the request
    #: alone, never the data). Without them the server could ask for so much work (10,000 epochs of batch 1)
    #: that no reply-floor covers it, and read the dataset size off the reply time. With them the work is at most
    #: ``max_local_epochs`` passes over the data in batches of at least ``min_batch_size``: measure that on the
    #: device and pin a reply-floor above it.
    max_local_epochs: int = DEFAULT_MAX_LOCAL_EPOCHS
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE
    #: the largest model (total number of parameters) the client trains: the work per sample grows with it
    max_model_parameters: int = DEFAULT_MAX_MODEL_PARAMETERS
    #: the local randomizer (shuffledp.clients.mechanism.MECHANISMS): ``laplace`` clips to L1 ``clip_l1``, the L2
    #: mechanisms ``duchi`` and ``privunit2`` clip to L2 ``clip_l2``
    mechanism: str = DEFAULT_MECHANISM
    clip_l2: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mechanism, str) or self.mechanism not in MECHANISMS:
            raise ClientSetupError(f"pinned mechanism must be one of {', '.join(MECHANISMS)}; got {self.mechanism!r}")
        if self.mechanism in L2_MECHANISMS and self.clip_l2 is None:
            raise ClientSetupError(f"pinned mechanism {self.mechanism!r} needs a pinned clip-l2 (its L2 clip radius)")
        names = ("eps0", "clip_l1") + (("clip_l2",) if self.clip_l2 is not None else ())
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ClientSetupError(f"pinned {name.replace('_', '-')} must be a finite number > 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.mechanism != "laplace":
            if self.log2_grid is not None:
                raise ClientSetupError(f"pinned log2-grid belongs to the laplace mechanism; {self.mechanism!r} has no "
                                       "grid (leave log2-grid out)")
            try:  # an eps0 the mechanism refuses is a setup error, found before any request uses the data
                self.local_mechanism()
            except (TypeError, ValueError) as exc:
                raise ClientSetupError(f"pinned mechanism={self.mechanism!r}, eps0={self.eps0!r}, "
                                       f"clip-l2={self.clip_l2!r}: {exc}") from None
        for name in ("client_key", "server_public_key", "shuffler_public_key"):
            v = getattr(self, name)
            if not isinstance(v, (bytes, bytearray)) or len(v) != 32:
                raise ClientSetupError(f"pinned {name} must be 32 raw key bytes")
        rf = self.reply_floor
        if isinstance(rf, bool) or not isinstance(rf, (int, float)) or not 0 <= rf <= MAX_REPLY_FLOOR:
            raise ClientSetupError(
                f"pinned reply-floor must be a number of seconds in [0, {MAX_REPLY_FLOOR:g}], got {rf!r}"
            )
        object.__setattr__(self, "reply_floor", float(rf))
        for name, cap in (("max_local_epochs", _LOCAL_EPOCHS_CAP), ("min_batch_size", _BATCH_SIZE_CAP),
                          ("max_model_parameters", _MODEL_PARAMETERS_CAP)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= cap:
                raise ClientSetupError(f"pinned {name.replace('_', '-')} must be an int in [1, {cap}], got {v!r}")
        if not (0 <= self.partition_id < self.num_partitions):
            raise ClientSetupError(
                f"partition-id must be in [0, num-partitions={self.num_partitions}), got {self.partition_id}"
            )
        if self.mechanism != "laplace":
            return
        try:  # settings the randomizer refuses (eps0 above its cap, a clip beyond the report format, a bad grid)
            self.randomizer()  # are a setup error, found before any request uses the data
            grid = _randomizer(self.eps0, self.clip_l1, None).log2_grid
        except (TypeError, ValueError) as exc:
            raise ClientSetupError(f"pinned eps0={self.eps0!r}, clip-l1={self.clip_l1!r}: {exc}") from None
        if self.mechanism == "laplace" and self.log2_grid is not None and self.log2_grid != grid:
            # The server decodes every report on the grid that (eps0, clip-l1) give (shuffledp.server.rounds). A report
            # on another grid carries it in its header and its values' scale, so it stands out of the shuffled batch
            # (this client gets no amplification), and the server, which drops it only after charging the round
            # with it, would credit the others with more amplification than they got.
            raise ClientSetupError(
                f"pinned log2-grid={self.log2_grid!r}: the grid must be the one the server decodes with, "
                f"{grid} for eps0={self.eps0!r}, clip-l1={self.clip_l1!r} (leave log2-grid out to use it)"
            )

    def randomizer(self) -> DiscreteLaplaceRandomizer:
        """The client's randomizer for the pinned eps0, clip and grid (one per process and setting, cached)."""
        return _randomizer(self.eps0, self.clip_l1, self.log2_grid)

    def local_mechanism(self) -> Mechanism:
        """The client's pinned mechanism (shuffledp.clients.mechanism.Mechanism), one per process and setting.

        Returns:
            For ``laplace``, the discrete Laplace mechanism around :meth:`randomizer`; for ``duchi`` and
            ``privunit2``, the L2 mechanism for (eps0, clip-l2).
        """
        return _mechanism(self.mechanism, self.eps0, self.clip_l1 if self.mechanism == "laplace" else self.clip_l2,
                          self.log2_grid)


@functools.lru_cache(maxsize=8)
def _mechanism(name: str, eps0: float, clip: float | None, log2_grid: int | None) -> Mechanism:
    # one mechanism (and CSPRNG, keyed from os.urandom) per process and setting
    if name == "laplace":
        return LaplaceMechanism(_randomizer(eps0, clip, log2_grid))  # type: ignore[arg-type] - laplace has a clip
    return make_mechanism(name, eps0=eps0, clip_l2=clip)


@functools.lru_cache(maxsize=8)
def _randomizer(eps0: float, clip: float, log2_grid: int | None) -> DiscreteLaplaceRandomizer:
    # one randomizer (and CSPRNG, keyed from os.urandom) per process and setting; the sampler tables are reused
    return DiscreteLaplaceRandomizer(eps0, clip, log2_grid=log2_grid)


def _num(cfg: Mapping[str, Any], key: str, where: str) -> float:
    if key not in cfg:
        raise ClientSetupError(f"{where} has no {key!r}: the client must pin it (see docs/interfaces.md)")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ClientSetupError(f"{where}[{key!r}] must be a number, got {v!r}")
    return float(v)


def _int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    if key not in cfg:
        raise ClientSetupError(f"{where} has no {key!r}")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ClientSetupError(f"{where}[{key!r}] must be an int, got {v!r}")
    return int(v)


@functools.lru_cache(maxsize=1 << 17)
def _load_key_file(path: str, kind: str, private: bool, identity: tuple[int, int, int, int]) -> bytes:
    """One key file, cached by its identity (inode, size, mtime, mode): a rotated key or loosened permissions
    change the identity, so the file is read (and its permissions checked) again. A simulation process (Ray actor)
    serves every simulated client in turn, so the cache holds them all (131,072 identities, about 200 bytes each;
    with 4,096, a run of 10,000 clients parsed a PEM file for almost every reply)."""
    from shuffledp.shuffler.keys import load_private_key, load_public_key

    del identity  # part of the cache key only
    return load_private_key(path, kind) if private else load_public_key(path, kind)


def _load_keys(client_key: Path, server_pub: Path, shuffler_pub: Path) -> tuple[bytes, bytes, bytes]:
    """The client's signing key and the pinned public keys; each file is read once per identity, not on every
    request (a simulated round re-reads them for every node otherwise)."""
    try:
        loaded = []
        for path, kind, private in ((client_key, "ed25519", True), (server_pub, "x25519", False),
                                    (shuffler_pub, "x25519", False)):
            st = os.stat(path)
            loaded.append(_load_key_file(str(path), kind, private,
                                         (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)))
        return loaded[0], loaded[1], loaded[2]
    except (OSError, ValueError) as exc:
        raise ClientSetupError(f"cannot load the client's keys: {exc}") from exc


@functools.lru_cache(maxsize=1 << 17)
def _simulation_key_paths(keys_dir: str, partition_id: int) -> tuple[Path, Path, Path]:
    """Client ``partition_id``'s key and the pinned public keys in a simulation key directory (paths only)."""
    from shuffledp.shuffler.keys import KeyDirectory

    kd = KeyDirectory(Path(keys_dir))
    return kd.client_key(partition_id), kd.server_hpke_pub, kd.shuffler_hpke_pub


def pinned_from_configs(node_config: Mapping[str, Any], run_config: Mapping[str, Any],
                        run_id: int | None = None) -> PinnedSettings:
    """Pinned settings as docs/interfaces.md says.

    Deployment (``eps0`` in node_config): node_config supplies ``eps0``, ``clip-l1``, ``client-key``,
    ``server-public-key``, ``shuffler-public-key`` (paths), ``partition-id``, ``num-partitions`` and optionally
    ``mechanism`` (default ``laplace``; ``privunit2`` is research-only and refused here), ``clip-l2`` (required by
    the L2 mechanisms, which need no ``clip-l1``), ``log2-grid``, ``reply-floor``, ``max-local-epochs``,
    ``min-batch-size`` and ``max-model-parameters``.
    Simulation: run_config supplies ``eps0``, ``clip-l1``, ``mechanism``, ``clip-l2``, ``keys-dir`` (client i uses
    ``keys-dir/clients/client-<i>.key`` and ``keys-dir/public/*``) and optionally the same five; node_config supplies
    ``partition-id`` and ``num-partitions`` (Flower's simulation engine sets them); with ``target-epsilon`` > 0 the
    pinned eps0 is the one the ServerApp planned for the run (:func:`shuffledp.clients.run_paths.planned_eps0`,
    ``<run folder>/plan.json``), not the run config's. An empty ``keys-dir`` means the
    run's own key directory, which the ServerApp creates in the run folder (``run_id`` names it:
    :func:`shuffledp.clients.run_paths.simulation_keys_dir`). Values are checked by :class:`PinnedSettings`.
    """
    if "eps0" in node_config:
        where = "node_config"
        src = node_config
        names = ("client-key", "server-public-key", "shuffler-public-key")
        missing = [n for n in names if not isinstance(node_config.get(n), str) or not node_config[n]]
        if missing:
            raise ClientSetupError(f"node_config pins 'eps0' (a deployment) but has no {missing} (paths of the "
                                   "device's key files, written by `shuffledp deploy bundle`)")
        keys = _load_keys(*(Path(str(node_config[n])) for n in names))
    else:
        where = "run_config"
        src = run_config
        from shuffledp.clients.run_paths import simulation_keys_dir

        if not str(run_config.get("keys-dir", "") or "").strip() and run_id is None:
            raise ClientSetupError("run_config has no 'keys-dir' (and node_config pins no 'eps0'), and no run id to "
                                   "find the run's own key directory by")
        keys_dir, derived = simulation_keys_dir(run_config, 0 if run_id is None else run_id)
        if derived and not (keys_dir / "enrolment.json").is_file():
            raise ClientSetupError(f"the run's key directory {keys_dir} does not exist yet: run config 'keys-dir' is "
                                   "empty, so the ServerApp creates it before the first round (is the ServerApp "
                                   "of this run one that does? a relative output-dir must resolve to the same folder "
                                   "on both sides)")
        pid = _int(node_config, "partition-id", "node_config")
        keys = _load_keys(*_simulation_key_paths(str(keys_dir), pid))
    grid = src.get("log2-grid")
    if grid is not None and (isinstance(grid, bool) or not isinstance(grid, int)):
        raise ClientSetupError(f"{where}['log2-grid'] must be an int, got {grid!r}")
    mechanism = src.get("mechanism", DEFAULT_MECHANISM)
    if not isinstance(mechanism, str) or mechanism not in MECHANISMS:
        raise ClientSetupError(f"{where}['mechanism'] must be one of {', '.join(MECHANISMS)}; got {mechanism!r}")
    if where == "node_config" and mechanism in RESEARCH_ONLY:
        raise ClientSetupError(
            f"node_config pins mechanism={mechanism!r}, which is research-only (its eps0-LDP argument under floating "
            "point is not certified in code, see docs/mechanisms.md): a deployed client uses "
            f"{', '.join(m for m in MECHANISMS if m not in RESEARCH_ONLY)}"
        )
    l2 = mechanism in L2_MECHANISMS
    eps0 = _num(src, "eps0", where)
    target = src.get("target-epsilon", 0.0) if where == "run_config" else 0.0
    if target:  # a simulation planned from a target epsilon: the eps0 the ServerApp calibrated for this run
        from shuffledp.clients.run_paths import planned_eps0

        try:
            eps0 = planned_eps0(run_config, 0 if run_id is None else run_id)
        except ValueError as exc:
            raise ClientSetupError(str(exc)) from None
    return PinnedSettings(
        eps0=eps0,
        # the L2 mechanisms do not use clip-l1 (nor compare it): 1.0 stands in when it is not pinned
        clip_l1=_num(src, "clip-l1", where) if not l2 or "clip-l1" in src else 1.0,
        clip_l2=_num(src, "clip-l2", where) if l2 or "clip-l2" in src else None,
        mechanism=mechanism,
        client_key=keys[0],
        server_public_key=keys[1],
        shuffler_public_key=keys[2],
        partition_id=_int(node_config, "partition-id", "node_config"),
        num_partitions=_int(node_config, "num-partitions", "node_config"),
        log2_grid=grid,
        reply_floor=src.get("reply-floor", 0.0),
        max_local_epochs=src.get("max-local-epochs", DEFAULT_MAX_LOCAL_EPOCHS),
        min_batch_size=src.get("min-batch-size", DEFAULT_MIN_BATCH_SIZE),
        max_model_parameters=src.get("max-model-parameters", DEFAULT_MAX_MODEL_PARAMETERS),
    )


#: The data settings and their defaults (docs/interfaces.md): which dataset, where its files are, the PCA fitted
#: on it, and how its training split is partitioned among the clients.
DATA_SETTINGS_DEFAULTS: dict[str, Any] = {
    "dataset": "digits",
    "data-dir": "",
    "pca-components": 10,
    "partition": "iid",
    "dirichlet-alpha": 0.5,
    "seed": 0,
}
#: The data settings that fix the model's input (its width and the features' meaning). In a deployment a run
#: config that names other values than the device pins is refused (pinned-mismatch): the server's model and
#: evaluation would not fit this device's data. ``data-dir`` is a path on each machine and may differ.
_MODEL_INPUT_KEYS = ("dataset", "pca-components")
_PARTITION_SCHEMES = ("iid", "dirichlet")


def parse_data_settings(src: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keyword arguments of :func:`shuffledp.clients.data.load_partition` from the data settings in ``src`` (keys of
    :data:`DATA_SETTINGS_DEFAULTS`; defaults for missing keys, other keys ignored), each checked for its type
    and range; ``where`` names ``src`` in the error message. Raises :class:`ClientSetupError`."""
    v = {key: src.get(key, default) for key, default in DATA_SETTINGS_DEFAULTS.items()}
    for key in ("dataset", "data-dir", "partition"):
        if not isinstance(v[key], str):
            raise ClientSetupError(f"{where}[{key!r}] must be a string, got {v[key]!r}")
    if v["dataset"] not in DATASETS:
        raise ClientSetupError(f"{where}['dataset'] must be one of {DATASETS}, got {v['dataset']!r}")
    if v["dataset"] == "mnist" and not v["data-dir"]:
        raise ClientSetupError(f"{where}: dataset 'mnist' needs 'data-dir' (a folder with MNIST/raw/*-ubyte[.gz])")
    if v["partition"] not in _PARTITION_SCHEMES:
        raise ClientSetupError(f"{where}['partition'] must be one of {_PARTITION_SCHEMES}, got {v['partition']!r}")
    for key in ("pca-components", "seed"):
        if isinstance(v[key], bool) or not isinstance(v[key], int) or v[key] < 0:
            raise ClientSetupError(f"{where}[{key!r}] must be an int >= 0, got {v[key]!r}")
    alpha = v["dirichlet-alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
        raise ClientSetupError(f"{where}['dirichlet-alpha'] must be a finite number > 0, got {alpha!r}")
    return {
        "dataset": v["dataset"],
        "data_dir": v["data-dir"] or None,
        "pca_components": v["pca-components"] or None,
        "scheme": v["partition"],
        "alpha": float(alpha),
        "seed": v["seed"],
    }


def data_settings_from_configs(node_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :func:`shuffledp.clients.data.load_partition`: ``dataset`` ("digits" | "mnist"),
    ``data-dir`` (a folder; "" = none), ``pca-components`` (10; 0 = none), ``partition`` ("iid" | "dirichlet"),
    ``dirichlet-alpha`` (0.5), ``seed`` (0), each optional.

    Deployment (``eps0`` in node_config, as for :func:`pinned_from_configs`): from the node config. Which files
    on the device are read, and which of their records, is the device's choice: a server that chose
    ``data-dir`` could point the client at any folder and learn from the reply whether a loadable dataset is
    there, outside the eps0-LDP mechanism. The run config's ``dataset`` and ``pca-components``, if given, must
    equal the device's (else :class:`PinnedMismatchError`: the server's model would not fit this data); its
    other data settings are not read. Simulation: from the run config (every simulated client is the
    operator's). Raises :class:`ClientSetupError` for a value of the wrong type or range. Decided on the
    configs alone, never the data.
    """
    if "eps0" not in node_config:
        return parse_data_settings(run_config, "run_config")
    settings = parse_data_settings(node_config, "node_config")
    for key in _MODEL_INPUT_KEYS:
        pinned = node_config.get(key, DATA_SETTINGS_DEFAULTS[key])
        if key in run_config and run_config[key] != pinned:
            raise PinnedMismatchError(
                f"the run asks for {key}={run_config[key]!r}; this device's data is pinned to {key}={pinned!r}"
            )
    return settings



def check_pinned(cfg: TrainConfig, pinned: PinnedSettings, n_parameters: int | None = None) -> None:
    """Refuse a request that the pinned settings do not allow. Raises :class:`PinnedMismatchError`.

    The mechanism must be the pinned one (a request without ``mechanism`` asks for ``laplace``); eps0 and the
    mechanism's clip (clip-l1 for ``laplace``, clip-l2 for ``duchi`` / ``privunit2``) must equal the pinned values
    exactly (the pinned values are the contract; any difference is refused, not "close enough"). The model
    (``n_parameters``, the total size of the request's arrays) must have at most ``max-model-parameters``; with
    ``report = "delta"``, ``local-epochs`` must be at most the pinned ``max-local-epochs`` and ``batch-size`` at
    least the pinned ``min-batch-size``. The decision reads
    the request and the pinned settings only, never the data, so a refusal says nothing about the data.
    """
    if n_parameters is not None and n_parameters > pinned.max_model_parameters:
        raise PinnedMismatchError(
            f"the model has {n_parameters} parameters; this client's limit is max-model-parameters="
            f"{pinned.max_model_parameters}"
        )
    if cfg.mechanism != pinned.mechanism:
        raise PinnedMismatchError(
            f"request asks mechanism={cfg.mechanism!r}; this client is pinned to mechanism={pinned.mechanism!r} and "
            "refuses to change it"
        )
    if pinned.mechanism in L2_MECHANISMS:
        if cfg.eps0 != pinned.eps0 or cfg.clip_l2 != pinned.clip_l2:
            raise PinnedMismatchError(
                f"request asks eps0={cfg.eps0!r}, clip-l2={cfg.clip_l2!r}; this client is pinned to "
                f"eps0={pinned.eps0!r}, clip-l2={pinned.clip_l2!r} ({pinned.mechanism}) and refuses to change them"
            )
    elif cfg.eps0 != pinned.eps0 or cfg.clip_l1 != pinned.clip_l1:
        raise PinnedMismatchError(
            f"request asks eps0={cfg.eps0!r}, clip-l1={cfg.clip_l1!r}; this client is pinned to "
            f"eps0={pinned.eps0!r}, clip-l1={pinned.clip_l1!r} and refuses to change them"
        )
    if cfg.report == "delta" and (cfg.local_epochs > pinned.max_local_epochs or cfg.batch_size < pinned.min_batch_size):
        raise PinnedMismatchError(
            f"request asks local-epochs={cfg.local_epochs}, batch-size={cfg.batch_size}; this client's work limits "
            f"are max-local-epochs={pinned.max_local_epochs}, min-batch-size={pinned.min_batch_size}"
        )
