"""A device's bundle (``shuffledp deploy bundle``): the files one device needs, and nothing else, with the node config
it pins.

The node config (:func:`device_node_config`) pins the mechanism, eps0, its clip (clip-l1 or clip-l2), the reply floor,
the work limits (the device refuses requests for more local epochs or smaller minibatches) and the data settings; the
key paths point into the bundle where it will live on the device. A bundle holds the device's own secrets (its SuperNode
key and its client signing key, 0600) and public files only (the SuperLink CA and the pinned server and shuffler HPKE
public keys). :func:`node_config` is the same node config for a SuperNode of ``deploy local``, reading the one-directory
layout in place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shuffledp.clients.mechanism import L2_MECHANISMS, MECHANISMS, RESEARCH_ONLY
from shuffledp.clients.settings import (
    DATA_SETTINGS_DEFAULTS,
    DEFAULT_MAX_LOCAL_EPOCHS,
    DEFAULT_MAX_MODEL_PARAMETERS,
    DEFAULT_MIN_BATCH_SIZE,
    ClientSetupError,
    parse_data_settings,
)
from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.flower import write_toml
from shuffledp.deploy.keys import DeployKeys, write_new_file
from shuffledp.deploy.validation import (
    MAX_NODES,
    check_int,
    check_positive,
    check_reply_floor,
    check_work_limits,
)

__all__ = ["BUNDLE_PUBLIC_FILES", "KEY_PATH_NAMES", "device_data_settings", "device_node_config",
           "bundle_key_paths", "create_device_bundle", "node_config"]

#: The node config's key paths (paths on the device; nothing secret is inlined).
KEY_PATH_NAMES = ("client-key", "server-public-key", "shuffler-public-key")
#: A bundle's public files: (name in the bundle, DeployKeys attribute it is copied from).
BUNDLE_PUBLIC_FILES = (("superlink-ca.crt", "superlink_ca_cert"), ("server_hpke.pub", "server_public_key"),
                       ("shuffler_hpke.pub", "shuffler_public_key"))


def device_data_settings(values: Mapping[str, object] | None) -> dict[str, object]:
    """The data settings a device pins in its node config.

    The device reads its data as its node config says, never as the server's run config says; the run's
    ``dataset`` and ``pca-components`` must be the same (else the device refuses).

    Args:
        values: overrides of shuffledp.clients.settings.DATA_SETTINGS_DEFAULTS (``dataset``, ``data-dir``,
            ``pca-components``, ``partition``, ``dirichlet-alpha``, ``seed``); other keys are ignored.

    Returns:
        The defaults overridden by the data keys of ``values``, checked as the ClientApp checks them
        (shuffledp.clients.settings.parse_data_settings).

    Raises:
        DeployUsageError: a setting the ClientApp would refuse.
    """
    chosen = {key: (values or {}).get(key, default) for key, default in DATA_SETTINGS_DEFAULTS.items()}
    try:
        parse_data_settings(chosen, "the device's data settings")
    except ClientSetupError as exc:
        raise DeployUsageError(str(exc)) from None
    return chosen


def device_node_config(node: int, nodes: int, *, eps0: float, clip_l1: float, key_paths: Mapping[str, str],
                       reply_floor: float = 0.0, max_local_epochs: int = DEFAULT_MAX_LOCAL_EPOCHS,
                       min_batch_size: int = DEFAULT_MIN_BATCH_SIZE,
                       max_model_parameters: int = DEFAULT_MAX_MODEL_PARAMETERS,
                       data: Mapping[str, object] | None = None, mechanism: str = "laplace",
                       clip_l2: float | None = None) -> dict[str, object]:
    """The node config device ``node`` of ``nodes`` runs with (the keys the ClientApp reads, docs/interfaces.md).

    Args:
        node, nodes: its partition id and the number of partitions.
        eps0, clip_l1: the local epsilon and L1 clip it pins.
        mechanism, clip_l2: the local randomizer it pins (``laplace``, default, or ``duchi``; ``privunit2`` is
            research-only and refused) and, for ``duchi``, its L2 clip.
        key_paths: ``client-key``, ``server-public-key``, ``shuffler-public-key``: paths on the device.
        reply_floor, max_local_epochs, min_batch_size, max_model_parameters: the timing and work limits it pins.
        data: its data settings (:func:`device_data_settings`).

    Returns:
        The node config, every value checked.

    Raises:
        DeployUsageError: a value out of its range; DeployError: ``key_paths`` names other keys.
    """
    nodes = check_int("the number of nodes", nodes, 1, MAX_NODES)
    node = check_int("--node", node, 0, nodes - 1)
    eps0, clip_l1 = check_positive("--eps0", eps0), check_positive("--clip-l1", clip_l1)
    if mechanism not in MECHANISMS:
        raise DeployUsageError(f"--mechanism must be one of {', '.join(MECHANISMS)}; got {mechanism!r}")
    if mechanism in RESEARCH_ONLY:
        raise DeployUsageError(f"--mechanism {mechanism} is research-only (its eps0-LDP argument under floating point "
                               "is not certified in code, see docs/mechanisms.md); a device pins one of "
                               f"{', '.join(m for m in MECHANISMS if m not in RESEARCH_ONLY)}")
    pinned_mechanism: dict[str, object] = {"mechanism": mechanism}
    if mechanism in L2_MECHANISMS:
        if clip_l2 is None:
            raise DeployUsageError(f"--mechanism {mechanism} needs --clip-l2 (the L2 clip radius the device pins)")
        pinned_mechanism["clip-l2"] = check_positive("--clip-l2", clip_l2)
    elif clip_l2 is not None:
        raise DeployUsageError(f"--clip-l2 belongs to the L2 mechanisms ({', '.join(L2_MECHANISMS)}); "
                               f"--mechanism {mechanism} uses --clip-l1")
    reply_floor = check_reply_floor(reply_floor)
    max_local_epochs, min_batch_size, max_model_parameters = check_work_limits(
        max_local_epochs, min_batch_size, max_model_parameters)
    if sorted(key_paths) != sorted(KEY_PATH_NAMES):
        raise DeployError(f"key_paths must name exactly {KEY_PATH_NAMES}, got {sorted(key_paths)}")
    return {
        "partition-id": node,
        "num-partitions": nodes,
        "eps0": eps0,
        "clip-l1": clip_l1,
        **pinned_mechanism,
        "reply-floor": reply_floor,
        "max-local-epochs": max_local_epochs,
        "min-batch-size": min_batch_size,
        "max-model-parameters": max_model_parameters,
        **device_data_settings(data),
        **{name: str(key_paths[name]) for name in KEY_PATH_NAMES},
    }


def bundle_key_paths(bundle: Path, prefix: str | None) -> dict[str, str]:
    """The key paths of a node config for the bundle in ``bundle``.

    Returns:
        :data:`KEY_PATH_NAMES` mapped to files under ``prefix``, where the bundle will live on the device
        (default: ``bundle`` itself).
    """
    base = prefix.rstrip("/") if prefix else str(bundle.resolve())
    return {"client-key": f"{base}/client.key", "server-public-key": f"{base}/server_hpke.pub",
            "shuffler-public-key": f"{base}/shuffler_hpke.pub"}


def create_device_bundle(keys: DeployKeys, node: int, out: str | os.PathLike[str], *, eps0: float, clip_l1: float,
                         prefix: str | None = None, **limits_and_data: Any) -> Path:
    """Copy what device ``node`` needs into ``out`` (a new directory) and write its ``node-config.toml``.

    Args:
        keys: a one-directory layout.
        node: the device's index.
        out: the new directory.
        eps0, clip_l1: what the device pins.
        prefix: where the bundle will live on the device (default: ``out`` itself), e.g. ``/device`` for the
            client container.
        limits_and_data: :func:`device_node_config`'s ``reply_floor``, work limits, ``data`` (``data-dir`` is
            a path on the device), ``mechanism`` and ``clip_l2``.

    Returns:
        The bundle's directory.

    Raises:
        DeployUsageError: a bad parameter or an ``out`` that exists; DeployError: a file missing from ``keys``.
    """
    nodes = keys.load_layout()["nodes"]
    dest = Path(out)
    config = device_node_config(node, nodes, eps0=eps0, clip_l1=clip_l1, key_paths=bundle_key_paths(dest, prefix),
                                **limits_and_data)
    if dest.exists():
        raise DeployUsageError(f"{dest} already exists; a bundle is written to a new directory")
    copies = [(getattr(keys, attr), name, 0o644) for name, attr in BUNDLE_PUBLIC_FILES] + [
        (keys.supernode_key(node), "supernode.key", 0o600),
        (keys.supernode_pub(node), "supernode.pub", 0o644),
        (keys.client_key(node), "client.key", 0o600),
    ]
    contents = []
    for src, name, mode in copies:
        try:
            contents.append((name, src.read_bytes(), mode))
        except FileNotFoundError as exc:
            raise DeployError(f"{src} is missing from the key directory {keys.root}") from exc
    dest.mkdir(parents=True, mode=0o700)
    os.chmod(dest, 0o700)
    for name, data, mode in contents:
        write_new_file(dest / name, data, mode)
    write_toml(dest / "node-config.toml", config)
    return dest


def node_config(keys: DeployKeys, partition_id: int, num_partitions: int, *, eps0: float,
                clip_l1: float, reply_floor: float = 0.0,
                data: Mapping[str, object] | None = None, mechanism: str = "laplace",
                clip_l2: float | None = None) -> dict[str, object]:
    """The node config one SuperNode of ``deploy local`` runs with.

    Returns:
        :func:`device_node_config` with the default work limits and the key paths of the one-directory layout
        ``keys``.
    """
    return device_node_config(partition_id, num_partitions, eps0=eps0, clip_l1=clip_l1, reply_floor=reply_floor,
                              data=data, mechanism=mechanism, clip_l2=clip_l2, key_paths={
                                  "client-key": str(keys.client_key(partition_id).resolve()),
                                  "server-public-key": str(keys.server_public_key.resolve()),
                                  "shuffler-public-key": str(keys.shuffler_public_key.resolve())})
