"""``shuffledp deploy``: keys for a Flower deployment and a real multi-process TLS deployment on one machine.

Six sub-commands:

``shuffledp deploy keys --out DIR --nodes N [--san NAME ...]``
    Everything a deployment needs, in one directory: the shuffler package's key directory (HPKE and signing keys,
    the server's HPKE key, one Ed25519 signing key per client, the enrolment file and the mTLS certificates
    between the ServerApp and the shuffler, written by :func:`shuffledp.shuffler.keys.init_key_directory`), plus the Flower
    side: a CA for the SuperLink, the SuperLink's TLS certificate (SANs ``localhost``, ``127.0.0.1`` and every
    ``--san``), and one SuperNode authentication key pair per device (ECDSA P-384 in OpenSSH format, which is what
    ``flwr supernode register`` and ``flower-supernode --auth-supernode-private-key`` read in Flower 1.41).
    That directory holds every party's secrets: for tests. ``--party server|shuffler|device`` instead makes one
    party's keys on its own host (:mod:`shuffledp.deploy.party_keys`).

``shuffledp deploy sign-serverapp --keys DIR --csr FILE --out FILE``
    The shuffler operator issues the ServerApp's mTLS client certificate from the server's signing request.

``shuffledp deploy check --keys DIR``
    Whether a party's directory holds what it needs and no other party's secret; its public files' fingerprints.

``shuffledp deploy local --nodes 3 --rounds 2 [--workdir DIR]``
    Starts ``flower-superlink`` (TLS, ``--enable-supernode-auth``, a file database, runtime dependency
    installation disabled), the shuffler service (mTLS), registers each SuperNode's public key, starts the
    SuperNodes (each with its own node config: partition, pinned eps0 and clip-l1, key paths), submits the app with
    ``flwr run . <connection>``, follows the run until it finishes, prints the per-round report and the timing
    breakdown, and stops every process it started, also on Ctrl-C, SIGTERM or failure; a watchdog process
    (deploy/watchdog.py) stops them should ``deploy local`` itself be killed.

Layout added by ``deploy keys`` next to the shuffler key directory (see docs/interfaces.md)::

    DIR/superlink/ca.crt                CA the devices trust for the SuperLink (public)
    DIR/superlink/ca.key                SuperLink operator only (0600)
    DIR/superlink/superlink.crt/.key    the SuperLink's TLS certificate and key (key 0600)
    DIR/superlink/superexec.secret      shared secret of the SuperLink and its ServerApp executor (0600; compose)
    DIR/supernodes/node-<i>.key         device i's SuperNode authentication key (OpenSSH ECDSA P-384, 0600)
    DIR/supernodes/node-<i>.pub         its public key, registered with ``flwr supernode register``
    DIR/compose/shuffler.toml           the shuffler's config inside its container (deploy/compose.yml)
    DIR/compose/run-config.toml         the ServerApp's run config for the compose deployment (no secrets)
    DIR/deploy.json                     what was generated (nodes, SANs, key epoch, k); no secrets

``shuffledp deploy bundle --keys DIR --node I --out D --eps0 X --clip-l1 C``
    Copies the files one device needs (and nothing else) into ``D`` and writes its ``node-config.toml``; with
    ``--device D`` (and the three public files) it completes a device's own directory in place.

``shuffledp deploy time-work --node-config FILE``
    On the device: times its worst-case local work under its pinned limits (see ``--help``).

The SuperLink has its own CA, separate from the shuffler's mTLS CA (``DIR/tls/``): the devices trust only the
SuperLink CA, and whoever holds the SuperLink CA key cannot mint a client certificate the shuffler accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shuffledp.clients.core import (
    DATA_SETTINGS_DEFAULTS,
    DEFAULT_MAX_LOCAL_EPOCHS,
    DEFAULT_MAX_MODEL_PARAMETERS,
    DEFAULT_MIN_BATCH_SIZE,
    ClientSetupError,
    parse_data_settings,
)
from shuffledp.deploy.watchdog import DeployWatchdog, Kind, WatchdogError, open_pidfd, send_signal
from shuffledp.server.report import epsilon_label

__all__ = [
    "main",
    "DeployError",
    "DeployKeys",
    "create_deploy_keys",
    "supernode_keypair",
    "node_config",
    "write_flower_config",
    "ProcessGroup",
    "LocalDeployment",
    "run_local",
    "format_report",
    "create_device_bundle",
    "compose_shuffler_config",
    "compose_run_config",
    "start_superlink",
    "start_supernode",
    "start_supernodes",
    "start_shuffler",
    "start_serverapp_executor",
    "register_supernode",
    "round_timings",
    "FileTailer",
    "CONNECTION_NAME",
]

#: Name of the SuperLink connection written to the deployment's own ``FLWR_HOME/config.toml``.
CONNECTION_NAME = "shuffledp-local"
#: Environment every Flower process of the deployment runs with (no telemetry, no update check, no ``uv sync``).
FLOWER_ENV: Mapping[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
_MAX_NODES = 10_000
_DEFAULT_KEY_EPOCH = 0


class DeployError(RuntimeError):
    """The deployment could not be prepared, started or completed; the message says which step and why."""


class DeployUsageError(DeployError):
    """A parameter of the command is wrong (the message says which and what is allowed); nothing was started or
    written. ``shuffledp deploy`` exits 2 for it, as for an argument the parser refused, and 1 for a failure."""


# --------------------------------------------------------------------------------------------------------------
# keys


@dataclass(frozen=True)
class DeployKeys:
    """Paths of a deployment key directory (the shuffler's layout plus the Flower files listed above)."""

    root: Path

    @property
    def superlink_ca_cert(self) -> Path:
        return self.root / "superlink" / "ca.crt"

    @property
    def superlink_ca_key(self) -> Path:
        return self.root / "superlink" / "ca.key"

    @property
    def superlink_cert(self) -> Path:
        return self.root / "superlink" / "superlink.crt"

    @property
    def superlink_key(self) -> Path:
        return self.root / "superlink" / "superlink.key"

    def supernode_key(self, i: int) -> Path:
        return self.root / "supernodes" / f"node-{i}.key"

    def supernode_pub(self, i: int) -> Path:
        return self.root / "supernodes" / f"node-{i}.pub"

    @property
    def superexec_secret(self) -> Path:
        return self.root / "superlink" / "superexec.secret"

    @property
    def compose_shuffler_config(self) -> Path:
        return self.root / "compose" / "shuffler.toml"

    @property
    def compose_run_config(self) -> Path:
        return self.root / "compose" / "run-config.toml"

    @property
    def manifest(self) -> Path:
        return self.root / "deploy.json"

    # the shuffler package's files (docs/interfaces.md, "Key directory")
    @property
    def shuffler_config(self) -> Path:
        return self.root / "shuffler.toml"

    @property
    def shuffler_ca_cert(self) -> Path:
        return self.root / "tls" / "ca.crt"

    @property
    def serverapp_cert(self) -> Path:
        return self.root / "tls" / "serverapp.crt"

    @property
    def serverapp_key(self) -> Path:
        return self.root / "tls" / "serverapp.key"

    @property
    def server_public_key(self) -> Path:
        return self.root / "public" / "server_hpke.pub"

    @property
    def shuffler_public_key(self) -> Path:
        return self.root / "public" / "shuffler_hpke.pub"

    def client_key(self, i: int) -> Path:
        return self.root / "clients" / f"client-{i}.key"

    def load_layout(self) -> dict[str, Any]:
        """The manifest of a one-directory layout (party ``all``), whose ``nodes`` and ``key-epoch`` are checked;
        DeployError for a party's directory (``deploy keys --party``) or a manifest without them."""
        doc = self.load_manifest()
        if doc.get("party", "all") != "all":
            raise DeployUsageError(f"{self.root} holds the keys of the {doc.get('party')!r} party only; this needs a "
                              "one-directory layout (`deploy keys --out DIR --nodes N`; a device completes its "
                              "own directory with `deploy bundle --device`)")
        for key in ("nodes", "key-epoch"):
            if isinstance(doc.get(key), bool) or not isinstance(doc.get(key), int) or doc[key] < 0:
                raise DeployError(f"{self.manifest} has no valid {key!r} (a non-negative integer)")
        return doc

    def load_manifest(self) -> dict[str, Any]:
        """The ``deploy.json`` written by :func:`create_deploy_keys` (raises DeployError if absent or invalid)."""
        try:
            doc = json.loads(self.manifest.read_text())
        except FileNotFoundError as exc:
            raise DeployError(f"{self.root} is not a deployment key directory: {self.manifest} is missing "
                              "(create one with `shuffledp deploy keys --out DIR --nodes N`)") from exc
        except json.JSONDecodeError as exc:
            raise DeployError(f"{self.manifest} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != "shuffledp-deploy/v1":
            raise DeployError(f"{self.manifest} is not a shuffledp deployment manifest")
        return doc


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` (never overwriting; :func:`shuffledp.shuffler.journal.write_file_durably`)."""
    from shuffledp.shuffler.journal import write_file_durably

    try:
        write_file_durably(path, data, mode=mode, overwrite=False)
    except FileExistsError as exc:
        raise DeployError(f"{path} already exists; a key or certificate is never overwritten") from exc


@contextlib.contextmanager
def staged_directory(out: str | os.PathLike[str]) -> Iterator[Path]:
    """A new key directory made whole or not at all: the files are written into a hidden sibling (mode 0700),
    renamed to ``out`` only once all are written, and removed on any failure, so that a bad parameter found
    late, or a kill, never leaves ``out`` half-written (a killed run may leave ``.NAME.partial-*`` beside it).

    ``out`` must not exist or be an empty directory (keys are never overwritten). Missing parent directories are
    created 0755 whatever the umask. Yields the staging path to write into.
    """
    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise DeployUsageError(f"{root} exists and is not an empty directory; keys are never overwritten "
                          "(choose a new directory; see deploy/README.md, 'Rotating keys')")
    missing = [parent for parent in root.absolute().parents if not parent.exists()]
    for parent in reversed(missing):
        parent.mkdir(exist_ok=True)
        os.chmod(parent, 0o755)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.partial-", dir=root.absolute().parent))  # 0700
    try:
        yield staging
        if root.exists():
            root.rmdir()  # empty (checked above); a file put there meanwhile makes this fail, and nothing is lost
        os.rename(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def supernode_keypair() -> tuple[bytes, bytes]:
    """A fresh SuperNode authentication key pair ``(private_openssh, public_openssh)``.

    Flower 1.41 reads the private key with ``cryptography``'s ``load_ssh_private_key`` and requires an elliptic
    curve key (``flower-supernode --auth-supernode-private-key``); ``flwr supernode register`` reads the public key
    with ``load_ssh_public_key`` and accepts NIST curves only. P-384 matches Flower's documentation
    (``ssh-keygen -t ecdsa -b 384``). The private scalar comes from OpenSSL's CSPRNG.
    """
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + b"\n"


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DeployUsageError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def superlink_names(sans: Sequence[str]) -> list[str]:
    """The SANs of the SuperLink's (and the shuffler's) server certificate: ``localhost``, ``127.0.0.1`` and
    ``sans`` (DNS names or IP addresses the other hosts use), without repeats."""
    if isinstance(sans, str):
        raise DeployUsageError("sans must be a sequence of names, not one string")
    names = ["localhost", "127.0.0.1"]
    for name in sans:
        if name not in names:
            names.append(name)
    return names


def create_deploy_keys(
    out: str | os.PathLike[str],
    nodes: int,
    *,
    sans: Sequence[str] = (),
    key_epoch: int = _DEFAULT_KEY_EPOCH,
    k: int | None = None,
) -> DeployKeys:
    """Write every key and certificate of a deployment with ``nodes`` devices into ``out`` (which must be empty).

    ``sans`` are extra DNS names or IP addresses the devices use to reach the SuperLink (``localhost`` and
    ``127.0.0.1`` are always included); they are also added to the shuffler's server certificate, so the
    ServerApp can reach the shuffler by the same names. ``k`` is the shuffler's release threshold (default: the
    shuffler package's). Raises DeployError for bad parameters or a directory that already holds files; the
    directory is made whole or not at all (:func:`staged_directory`).
    """
    nodes = _check_int("--nodes", nodes, 1, _MAX_NODES)
    key_epoch = _check_int("--key-epoch", key_epoch, 0, 2**32 - 1)
    if k is not None:
        k = _check_int("--k", k, 1, nodes)
    names = superlink_names(sans)
    with staged_directory(out) as staging:
        _write_deploy_keys(staging, nodes, names, key_epoch, k)
    return DeployKeys(Path(out))


def write_superlink_tls(paths: DeployKeys, names: list[str]) -> None:
    """The SuperLink operator's files under ``superlink/`` (mode 0700): its own CA, its TLS certificate for the SANs
    ``names`` and key, and the SuperExec shared secret (process isolation, compose; from the OS CSPRNG)."""
    from shuffledp.shuffler import tls

    try:
        ca_cert, ca_key = tls.create_ca("shuffledp SuperLink CA")
        cert, key = tls.issue_certificate(ca_cert, ca_key, "superlink", sans=names, is_server=True,
                                          is_client=False)
    except ValueError as exc:
        raise DeployUsageError(f"cannot issue the SuperLink certificate for SANs {names}: {exc}") from exc
    (paths.root / "superlink").mkdir(mode=0o700)
    os.chmod(paths.root / "superlink", 0o700)
    _write_file(paths.superlink_ca_cert, ca_cert, 0o644)
    _write_file(paths.superlink_ca_key, ca_key, 0o600)
    _write_file(paths.superlink_cert, cert, 0o644)
    _write_file(paths.superlink_key, key, 0o600)
    _write_file(paths.superexec_secret, secrets.token_hex(32).encode(), 0o600)


def _write_deploy_keys(root: Path, nodes: int, names: list[str], key_epoch: int, k: int | None) -> None:
    """The files of :func:`create_deploy_keys`, written into ``root`` (its staging directory)."""
    from shuffledp.shuffler import keys as shuffler_keys
    from shuffledp.shuffler.config import load_config as load_shuffler_config

    paths = DeployKeys(root)
    write_superlink_tls(paths, names)
    kwargs: dict[str, Any] = {"key_epoch": key_epoch, "shuffler_sans": tuple(names)}
    if k is not None:
        kwargs["k"] = k
    shuffler_keys.init_key_directory(root, nodes, **kwargs)
    (root / "supernodes").mkdir(mode=0o700)
    for i in range(nodes):
        private, public = supernode_keypair()
        _write_file(paths.supernode_key(i), private, 0o600)
        _write_file(paths.supernode_pub(i), public, 0o644)
    shuffler_conf = load_shuffler_config(paths.shuffler_config)
    (root / "compose").mkdir()
    os.chmod(root / "compose", 0o755)
    _write_file(paths.compose_shuffler_config, compose_shuffler_config(shuffler_conf.key_epoch, shuffler_conf.k,
                                                                       shuffler_conf.max_envelope_bytes), 0o644)
    _write_file(paths.compose_run_config, compose_run_config(shuffler_conf.key_epoch, min(shuffler_conf.k, nodes)),
                0o644)
    manifest = {
        "format": "shuffledp-deploy/v1",
        "party": "all",
        "nodes": nodes,
        "superlink-sans": names,
        "key-epoch": key_epoch,
        "k": shuffler_conf.k,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_file(paths.manifest, (json.dumps(manifest, indent=1) + "\n").encode(), 0o644)


#: Where deploy/compose.yml mounts the key files inside the containers.
CONTAINER_KEYS = "/keys"
#: The shuffler's port on the compose network ``shuffle``.
CONTAINER_SHUFFLER_PORT = 7070


def compose_shuffler_config(key_epoch: int, k: int, max_envelope_bytes: int) -> bytes:
    """The shuffler's config inside its container (paths as mounted by deploy/compose.yml).

    It listens on all interfaces of its container (the compose network ``shuffle`` is internal and joins only the
    ServerApp executor) and accepts only the client certificate whose CN is ``serverapp``.
    """
    k_ = CONTAINER_KEYS
    return (
        "# shuffledp shuffler inside its container (deploy/compose.yml); written by `shuffledp deploy keys`\n"
        f'address = "0.0.0.0:{CONTAINER_SHUFFLER_PORT}"\n'
        f"key_epoch = {key_epoch}\n"
        f"k = {k}\n"
        f"max_envelope_bytes = {max_envelope_bytes}\n"
        f'hpke_key = "{k_}/shuffler/hpke.key"\n'
        f'signing_key = "{k_}/shuffler/signing.key"\n'
        f'enrolment = "{k_}/enrolment.json"\n'
        'journal_dir = "/journal"\n\n'
        "[tls]\n"
        f'ca = "{k_}/tls/ca.crt"\n'
        f'cert = "{k_}/tls/shuffler.crt"\n'
        f'key = "{k_}/tls/shuffler.key"\n'
        'client_common_names = ["serverapp"]\n'
    ).encode()


def compose_run_config(key_epoch: int, min_reports: int) -> bytes:
    """The ServerApp's run-config overrides for the compose deployment (``flwr run . <conn> --run-config F``).

    Only paths and public settings: the run config is sent to every SuperNode, so nothing secret goes here.
    """
    k_ = CONTAINER_KEYS
    values: dict[str, object] = {
        "shuffler-address": f"shuffler:{CONTAINER_SHUFFLER_PORT}",
        "shuffler-root-cert": f"{k_}/tls/ca.crt",
        "shuffler-client-cert": f"{k_}/tls/serverapp.crt",
        "shuffler-client-key": f"{k_}/tls/serverapp.key",
        "keys-dir": k_,
        "key-epoch": key_epoch,
        "min-reports": min_reports,
        "output-dir": "/outputs",
    }
    return ("# ServerApp run config for deploy/compose.yml; written by `shuffledp deploy keys`\n"
            + "".join(f"{_toml_key(key)} = {_toml_value(v)}\n" for key, v in values.items())).encode()


def _check_reply_floor(value: object) -> float:
    """``--reply-floor``: seconds in [0, 3600] (shuffledp.clients.core.MAX_REPLY_FLOOR; see clients/app.py)."""
    from shuffledp.clients.core import MAX_REPLY_FLOOR

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_REPLY_FLOOR:
        raise DeployUsageError(f"--reply-floor must be a number of seconds in [0, {MAX_REPLY_FLOOR:g}], got {value!r}")
    return float(value)


def _check_work_limits(max_local_epochs: object, min_batch_size: object,
                       max_model_parameters: object) -> tuple[int, int, int]:
    """``--max-local-epochs`` in [1, 10000], ``--min-batch-size`` >= 1 and ``--max-model-parameters`` in
    [1, 2**28] (shuffledp.clients.core.PinnedSettings)."""
    return (_check_int("--max-local-epochs", max_local_epochs, 1, 10_000),
            _check_int("--min-batch-size", min_batch_size, 1, 2**31 - 1),
            _check_int("--max-model-parameters", max_model_parameters, 1, 2**28))


def device_data_settings(values: Mapping[str, object] | None) -> dict[str, object]:
    """The data settings a device pins in its node config (shuffledp.clients.core.DATA_SETTINGS_DEFAULTS: ``dataset``,
    ``data-dir``, ``pca-components``, ``partition``, ``dirichlet-alpha``, ``partition-seed``): the defaults,
    overridden by the data keys of ``values`` (other keys ignored), checked as the ClientApp checks them
    (shuffledp.clients.core.parse_data_settings). The device reads its data as its node config says, never as the server's
    run config says; the run's ``dataset`` and ``pca-components`` must be the same (else the device refuses)."""
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
                       data: Mapping[str, object] | None = None) -> dict[str, object]:
    """The node config device ``node`` of ``nodes`` runs with (the keys the ClientApp reads, docs/interfaces.md),
    every value checked: eps0, clip-l1, the reply floor and the work limits it pins, its data settings
    (:func:`device_data_settings`) and ``key_paths`` (``client-key``, ``server-public-key``,
    ``shuffler-public-key``: paths on the device; nothing secret is inlined). Raises DeployError."""
    nodes = _check_int("the number of nodes", nodes, 1, _MAX_NODES)
    node = _check_int("--node", node, 0, nodes - 1)
    for name, value in (("--eps0", eps0), ("--clip-l1", clip_l1)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise DeployUsageError(f"{name} must be a finite number > 0, got {value!r}")
    reply_floor = _check_reply_floor(reply_floor)
    max_local_epochs, min_batch_size, max_model_parameters = _check_work_limits(
        max_local_epochs, min_batch_size, max_model_parameters)
    if sorted(key_paths) != sorted(_KEY_PATH_NAMES):
        raise DeployError(f"key_paths must name exactly {_KEY_PATH_NAMES}, got {sorted(key_paths)}")
    return {
        "partition-id": node,
        "num-partitions": nodes,
        "eps0": float(eps0),
        "clip-l1": float(clip_l1),
        "reply-floor": reply_floor,
        "max-local-epochs": max_local_epochs,
        "min-batch-size": min_batch_size,
        "max-model-parameters": max_model_parameters,
        **device_data_settings(data),
        **{name: str(key_paths[name]) for name in _KEY_PATH_NAMES},
    }


_KEY_PATH_NAMES = ("client-key", "server-public-key", "shuffler-public-key")
#: A bundle's public files: (name in the bundle, DeployKeys attribute it is copied from).
BUNDLE_PUBLIC_FILES = (("superlink-ca.crt", "superlink_ca_cert"), ("server_hpke.pub", "server_public_key"),
                       ("shuffler_hpke.pub", "shuffler_public_key"))


def bundle_key_paths(bundle: Path, prefix: str | None) -> dict[str, str]:
    """The key paths of a node config for the bundle in ``bundle``, which will live at ``prefix`` on the device
    (default: ``bundle`` itself)."""
    base = prefix.rstrip("/") if prefix else str(bundle.resolve())
    return {"client-key": f"{base}/client.key", "server-public-key": f"{base}/server_hpke.pub",
            "shuffler-public-key": f"{base}/shuffler_hpke.pub"}


def create_device_bundle(keys: DeployKeys, node: int, out: str | os.PathLike[str], *, eps0: float, clip_l1: float,
                         prefix: str | None = None, **limits_and_data: Any) -> Path:
    """Copy what device ``node`` needs into ``out`` (a new directory) and write its ``node-config.toml``.

    The node config (:func:`device_node_config`; ``limits_and_data`` are its ``reply_floor``, work limits and
    ``data``) pins eps0, clip-l1, the reply floor, the work limits (the device refuses requests for more local
    epochs or smaller minibatches; with a reply floor, pick one above the work at these limits) and the data
    settings (``data-dir`` is a path on the device).

    The bundle holds the device's own secrets (its SuperNode key and its client signing key, 0600) and public
    files only (the SuperLink CA and the pinned server and shuffler HPKE public keys). ``prefix`` is where the
    bundle will live on the device (default: ``out`` itself), e.g. ``/device`` for the client container.
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
        _write_file(dest / name, data, mode)
    write_toml(dest / "node-config.toml", config)
    return dest


# --------------------------------------------------------------------------------------------------------------
# Flower configuration


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DeployError(f"cannot write the non-finite number {value!r} to a Flower config")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string literal is a valid TOML basic string
    raise DeployError(f"cannot write {type(value).__name__} {value!r} to a Flower config")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def write_toml(path: Path, values: Mapping[str, object], mode: int = 0o644) -> Path:
    """Write a flat TOML table (Flower's ``--node-config``/``--run-config`` files accept one)."""
    text = "".join(f"{_toml_key(k)} = {_toml_value(v)}\n" for k, v in values.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


def write_flower_config(flwr_home: Path, address: str, root_certificates: Path,
                        name: str = CONNECTION_NAME) -> Path:
    """Write ``FLWR_HOME/config.toml`` with one TLS SuperLink connection (used by ``flwr run``/``supernode``)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(
        "[superlink]\n"
        f"default = {_toml_value(name)}\n\n"
        f"[superlink.{_toml_key(name)}]\n"
        f"address = {_toml_value(address)}\n"
        f"root-certificates = {_toml_value(str(root_certificates.resolve()))}\n"
    )
    return path


def node_config(keys: DeployKeys, partition_id: int, num_partitions: int, *, eps0: float,
                clip_l1: float, reply_floor: float = 0.0,
                data: Mapping[str, object] | None = None) -> dict[str, object]:
    """The node config one SuperNode of ``deploy local`` runs with (:func:`device_node_config`, default work
    limits), with the key paths of the one-directory layout ``keys``."""
    return device_node_config(partition_id, num_partitions, eps0=eps0, clip_l1=clip_l1, reply_floor=reply_floor,
                              data=data, key_paths={
                                  "client-key": str(keys.client_key(partition_id).resolve()),
                                  "server-public-key": str(keys.server_public_key.resolve()),
                                  "shuffler-public-key": str(keys.shuffler_public_key.resolve())})


# --------------------------------------------------------------------------------------------------------------
# processes


#: Ports this process has handed out with :func:`free_port` (host, port); never handed out twice.
_HANDED_OUT: set[tuple[str, int]] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago and that this process has not handed out before.

    Flower's processes take their port on the command line, so the port is chosen here and bound seconds later by
    the child. The kernel may offer the same free port to two consecutive ``bind(port 0)`` calls (seen here: two
    SuperNodes started back to back got the same port and the second died with EADDRINUSE), so the ports handed
    out are remembered. A port taken by an unrelated process in between is still possible;
    :func:`start_supernodes` restarts a SuperNode that lost its port that way.
    """
    with _HANDED_OUT_LOCK:
        for _ in range(256):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if (host, port) not in _HANDED_OUT:
                _HANDED_OUT.add((host, port))
                return port
    raise DeployError(f"the kernel offered only ports already handed out on {host} (256 tries)")


@dataclass
class _Proc:
    """A process started as the leader of a session of its own, with the sessions it started itself (adopted:
    leader pid -> pidfd, see :meth:`ProcessGroup.adopt_sessions`)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    sessions: dict[int, int | None] = field(default_factory=dict)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group and to each adopted session's group whose leader still lives."""
        _signal_group(self.popen, sig)
        for pid, fd in self.sessions.items():
            send_signal(Kind.LED_GROUP, pid, fd, sig)

    def kill(self, watchdog: DeployWatchdog | None, wait: float) -> None:
        """SIGKILL the adopted sessions and the process group (:func:`_kill_group`); forget the sessions."""
        for pid, fd in self.sessions.items():
            send_signal(Kind.LED_GROUP, pid, fd, signal.SIGKILL)
            if watchdog is not None:
                watchdog.forget(pid, Kind.LED_GROUP)
            if fd is not None:
                os.close(fd)
        self.sessions.clear()
        _kill_group(self.popen, watchdog, wait)


@dataclass
class ProcessGroup:
    """Processes started in their own process groups, stopped together (reverse order, TERM then KILL).

    With a ``watchdog``, each process group (and each adopted session, :meth:`adopt_sessions`) is named to it
    when started and forgotten once killed, so that the watchdog stops those still running should this process
    die without stopping them (SIGKILL included).
    """

    procs: list[_Proc] = field(default_factory=list)
    grace_seconds: float = 10.0
    watchdog: DeployWatchdog | None = None

    def start(self, name: str, argv: Sequence[str], *, log: Path, env: Mapping[str, str],
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` as the leader of a new session and process group, output appended to ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            popen = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(env), cwd=cwd, start_new_session=True)
        self.procs.append(_Proc(name, popen, log))
        if self.watchdog is not None:
            self.watchdog.watch(popen.pid, Kind.GROUP)
        return popen

    def adopt_sessions(self, popen: subprocess.Popen[bytes]) -> list[int]:
        """Stop, with ``popen``'s group, the sessions its process has started itself; returns their leaders' pids.

        ``flower-superlink`` starts its ServerApp executor (``flower-superexec``, the parent of every
        ``flwr-serverapp``) in a session of its own, out of reach of a signal to the SuperLink's group. Each such
        child is held through a pidfd and named to the watchdog; its group is signalled only while it lives, so a
        number reused once it has gone is never hit.
        """
        entry = next(p for p in self.procs if p.popen is popen)
        for pid in _session_children(popen.pid):
            if pid in entry.sessions:
                continue
            try:
                fd = open_pidfd(pid)
            except ProcessLookupError:
                continue
            if pid not in _session_children(popen.pid):  # gone, and its number reused, before the pidfd
                if fd is not None:
                    os.close(fd)
                continue
            entry.sessions[pid] = fd
            if self.watchdog is not None:
                self.watchdog.watch(pid, Kind.LED_GROUP)
        return sorted(entry.sessions)

    def forget(self, popen: subprocess.Popen[bytes]) -> None:
        """Drop an exited process from the group (it is being replaced); a running one is refused. Whatever it
        left in its process group is killed, so the watchdog can forget the group's number."""
        if popen.poll() is None:
            raise DeployError(f"refusing to forget process {popen.pid}: it is still running")
        for p in self.procs:
            if p.popen is popen:
                p.kill(self.watchdog, wait=0)
        self.procs = [p for p in self.procs if p.popen is not popen]

    def check_alive(self) -> None:
        """Raise DeployError naming the first process that has exited (with the tail of its log)."""
        for p in self.procs:
            code = p.popen.poll()
            if code is not None:
                raise DeployError(f"{p.name} exited with code {code}; last lines of {p.log}:\n{tail(p.log)}")

    def stop_all(self) -> None:
        """SIGTERM every group, wait up to ``grace_seconds``, then SIGKILL every group and forget them all."""
        for p in reversed(self.procs):
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for p in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in reversed(self.procs):
            # the group may still hold children (a SuperNode's superexec and flwr-clientapp) after the leader died
            p.kill(self.watchdog, wait=5)
        self.procs.clear()


def _signal_group(popen: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def _kill_group(popen: subprocess.Popen[Any], watchdog: DeployWatchdog | None, wait: float) -> None:
    """SIGKILL the whole process group led by ``popen``, wait up to ``wait`` s for the leader, and once the leader
    has been reaped tell ``watchdog`` to forget the group (its members are dead or dying of SIGKILL)."""
    _signal_group(popen, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=wait)
    if watchdog is not None and popen.poll() is not None:
        watchdog.forget(popen.pid, Kind.GROUP)


def _session_children(pid: int) -> list[int]:
    """The children of ``pid`` that lead a session of their own (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # "pid (comm) state ppid pgrp session ..."; comm may hold spaces and parentheses
            _state, ppid, _pgrp, session = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(ppid) == pid and int(session) == int(entry.name):
            found.append(int(entry.name))
    return found


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class _Interrupted(BaseException):
    """Raised from the SIGTERM/SIGHUP handler so that every ``finally`` runs and the processes are stopped."""


class _Signals:
    """SIGTERM, SIGHUP and SIGINT while ``deploy local`` runs (see :func:`_stop_on_signals`).

    The first one starts the stopping: SIGINT raises KeyboardInterrupt, the others :class:`_Interrupted`, so every
    ``finally`` runs. Once stopping has begun (that first signal, or :meth:`stopping` at the start of a cleanup
    that began otherwise), a signal is only recorded: a second or third SIGTERM cannot cut the cleanup short and
    leave processes running.
    """

    def __init__(self) -> None:
        self.received: list[str] = []
        self.raised = False
        self._stopping = False

    def handler(self, signum: int, _frame: object) -> None:
        self.received.append(signal.Signals(signum).name)
        if self._stopping:
            return
        self._stopping = self.raised = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Interrupted(f"received signal {self.received[-1]}")

    def stopping(self) -> None:
        """The cleanup starts: from now on signals are recorded, not raised."""
        self._stopping = True


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[_Signals]:
    """Handle SIGTERM, SIGHUP and SIGINT with :class:`_Signals` inside the block (main thread only). A signal
    that arrived during a cleanup that it did not start makes the block end with :class:`_Interrupted` once the
    cleanup is done (unless another exception is already on its way), so the exit status says interrupted."""
    signals = _Signals()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            previous[sig] = signal.signal(sig, signals.handler)
    try:
        yield signals
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)
    if signals.received and not signals.raised:
        raise _Interrupted(f"received signal {signals.received[0]} while stopping")


def _wait_for(predicate: Any, timeout: float, what: str, group: ProcessGroup, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        group.check_alive()
        if time.monotonic() > deadline:
            raise DeployError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _log_contains(path: Path, needle: str) -> bool:
    try:
        return needle in path.read_text(errors="replace")
    except FileNotFoundError:
        return False



def flower_env(flwr_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one Flower process: its own FLWR_HOME, telemetry/update check/``uv sync`` off."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("FLWR_")}
    env.update(FLOWER_ENV)
    env["FLWR_HOME"] = str(flwr_home)
    return env


def start_superlink(group: ProcessGroup, keys: DeployKeys, state_dir: Path, base_env: Mapping[str, str],
                    log: Path, *, host: str = "127.0.0.1", port: int | None = None,
                    ready_timeout: float = 120.0, isolation: str = "subprocess") -> str:
    """Start ``flower-superlink`` with TLS, ``--enable-supernode-auth`` and a file database; return host:port.

    ``isolation="subprocess"``: the SuperLink starts its own ServerApp executor, whose working directory is
    ``state_dir``. ``"process"``: it waits for a separate executor (:func:`start_serverapp_executor`, the
    ``serverapp`` container of deploy/compose.yml) that must present ``superlink/superexec.secret``.
    Waits until it listens, then adopts the session in which it started its executor
    (:meth:`ProcessGroup.adopt_sessions`).
    """
    if isolation not in ("subprocess", "process"):
        raise DeployError(f"isolation must be 'subprocess' or 'process', got {isolation!r}")
    port = free_port(host) if port is None else port
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        _flower_bin("flower-superlink"), "--host", host, "--port", str(port),
        "--ssl-ca-certfile", str(keys.superlink_ca_cert), "--ssl-certfile", str(keys.superlink_cert),
        "--ssl-keyfile", str(keys.superlink_key), "--enable-supernode-auth",
        "--database", str(state_dir / "state.db"), "--disable-runtime-dependency-installation",
    ]
    if isolation == "process":
        argv += ["--isolation", "process", "--superexec-auth-secret-file", str(keys.superexec_secret)]
    popen = group.start("flower-superlink", argv, log=log, env=flower_env(state_dir / "flwr-home", base_env),
                        cwd=state_dir)
    _wait_for(lambda: _log_contains(log, "Uvicorn running on"), ready_timeout, "the SuperLink to listen", group)
    group.adopt_sessions(popen)  # its ServerApp executor (subprocess isolation), started before it listens
    return f"{host}:{port}"


def start_serverapp_executor(group: ProcessGroup, keys: DeployKeys, superlink: str, state_dir: Path,
                             base_env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``flower-superexec`` against the SuperLink's Runtime API (TLS, shared secret), as the ``serverapp``
    container of deploy/compose.yml does; it runs each submitted ServerApp in ``state_dir``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return group.start("flower-superexec (ServerApp)", [
        _flower_bin("flower-superexec"), "--runtime-api-address", superlink,
        "--root-certificates", str(keys.superlink_ca_cert),
        "--superexec-auth-secret-file", str(keys.superexec_secret),
    ], log=log, env=flower_env(state_dir / "flwr-home", base_env), cwd=state_dir)


def start_supernode(group: ProcessGroup, keys: DeployKeys, index: int, superlink: str, node_config_file: Path,
                    state_dir: Path, base_env: Mapping[str, str], log: Path, *,
                    host: str = "127.0.0.1", max_retries: int | None = None) -> subprocess.Popen[bytes]:
    """Start one ``flower-supernode`` authenticating with ``supernodes/node-<index>.key`` over TLS."""
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        _flower_bin("flower-supernode"), "--superlink", superlink,
        "--root-certificates", str(keys.superlink_ca_cert),
        "--auth-supernode-private-key", str(keys.supernode_key(index)),
        "--node-config", str(node_config_file), "--host", host, "--port", str(free_port(host)),
    ]
    if max_retries is not None:
        argv += ["--max-retries", str(max_retries)]
    return group.start(f"flower-supernode {index}", argv, log=log,
                       env=flower_env(state_dir / "flwr-home", base_env), cwd=state_dir)


def start_shuffler(keys: DeployKeys, log: Path, *, watchdog: DeployWatchdog | None = None) -> Any:
    """Start the shuffler service from ``DIR/shuffler.toml`` (mTLS) and wait until it answers health checks
    over mTLS with the ServerApp's client certificate. Returns the running :class:`shuffledp.shuffler.process.ShufflerProcess`
    (stop it with :func:`_stop_shuffler`). Its process is named to ``watchdog`` as soon as it exists; if it fails
    to start, or this is interrupted meanwhile, it is stopped here.
    """
    from shuffledp.shuffler.process import ShufflerProcess, ShufflerStartError

    log.parent.mkdir(parents=True, exist_ok=True)
    proc = ShufflerProcess(keys.shuffler_config, root_certificate=keys.shuffler_ca_cert.read_bytes(),
                           client_certificate=keys.serverapp_cert.read_bytes(),
                           client_key=keys.serverapp_key.read_bytes(), log_path=log, startup_timeout=90.0,
                           on_spawn=None if watchdog is None else lambda pid: watchdog.watch(pid, Kind.PROCESS))
    try:
        proc.start()
    except BaseException as exc:
        _stop_shuffler(proc, watchdog)  # the caller never gets it
        if isinstance(exc, ShufflerStartError):
            raise DeployError(f"the shuffler service did not start: {exc}") from exc
        raise
    return proc


def _refuse_a_spent_key_epoch(proc: Any, key_epoch: int) -> None:
    """Refuse, before any SuperNode starts, a key epoch whose batches the shuffler has already released. The
    ServerApp would refuse it too (a fresh accountant cannot start at 0 for reports already released), but only
    after the whole deployment has started, and only in its own log."""
    import grpc

    try:
        epoch, released = proc.spent_epoch_batches()
    except grpc.RpcError as exc:
        raise DeployError(f"the shuffler did not answer its Stats call ({exc.code().name}: {exc.details()}); "
                          f"see its log") from None
    if epoch == key_epoch and released > 0:
        raise DeployError(
            f"the shuffler has already released {released} batch(es) of key epoch {key_epoch} (its journal is in "
            "these keys' directory), so a new run with them would start its accountant at 0 for reports that were "
            "already released. Rotate the keys to a new key epoch (deploy/README.md, key rotation) or use new keys")


def _stop_shuffler(proc: Any, watchdog: DeployWatchdog | None = None) -> None:
    """Stop a :class:`shuffledp.shuffler.process.ShufflerProcess` (SIGTERM, SIGKILL if it does not stop in time), remove its
    temporary files, and tell ``watchdog`` it is stopped."""
    popen = proc.proc
    proc.__exit__(None, None, None)
    if watchdog is not None and popen is not None and popen.poll() is not None:
        watchdog.forget(popen.pid, Kind.PROCESS)


#: What uvicorn logs when the SuperNode's Runtime HTTP API port was taken (errno 98 on Linux).
_PORT_TAKEN = "address already in use"


def start_supernodes(group: ProcessGroup, keys: DeployKeys, superlink: str, node_config_files: Sequence[Path],
                     state_root: Path, base_env: Mapping[str, str], logs: Path, *, host: str = "127.0.0.1",
                     timeout: float = 120.0, port_attempts: int = 3) -> None:
    """Start SuperNode ``i`` with ``node_config_files[i]`` for every i, then wait until each is accepted.

    All are started before any is waited for (each spends seconds importing Flower). A SuperNode whose Runtime
    HTTP API port was taken between :func:`free_port` and its own bind exits with EADDRINUSE; it is restarted on
    a fresh port, at most ``port_attempts`` times in all. Any other exit is an error naming the node and its log.
    """
    if port_attempts < 1:
        raise DeployError(f"port_attempts must be >= 1, got {port_attempts}")
    logs_of = [logs / f"supernode-{i}.log" for i in range(len(node_config_files))]

    def start(i: int) -> subprocess.Popen[bytes]:
        return start_supernode(group, keys, i, superlink, node_config_files[i], state_root / f"node-{i}", base_env,
                               logs_of[i], host=host)

    procs = [start(i) for i in range(len(node_config_files))]
    for i, log in enumerate(logs_of):
        attempts = 1
        deadline = time.monotonic() + timeout
        while not _log_contains(log, "SuperNode ID"):
            code = procs[i].poll()
            if code is not None and attempts < port_attempts and log.read_text(errors="replace").count(
                    _PORT_TAKEN) == attempts:
                group.forget(procs[i])
                attempts += 1
                procs[i] = start(i)
                continue
            group.check_alive()
            if time.monotonic() > deadline:
                raise DeployError(f"timed out after {timeout:.0f} s waiting for SuperNode {i} to be accepted by "
                                  "the SuperLink")
            time.sleep(0.2)


# --------------------------------------------------------------------------------------------------------------
# the local deployment


def _app_dir_default() -> Path:
    """The project directory holding ``pyproject.toml`` with ``[tool.flwr.app]`` (the repository root)."""
    here = Path(__file__).resolve().parent.parent
    if (here / "pyproject.toml").is_file():
        return here
    return Path.cwd()


def _flower_bin(name: str) -> str:
    """Path of a Flower console script, preferring the one next to this interpreter."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise DeployError(f"{name} not found next to {sys.executable} nor on PATH; install flwr (pip install flwr)")
    return found


#: Run-config keys that ``deploy local`` sets (and the SuperNodes pin, or the deployment wires up): a
#: ``--run-config`` override of one would contradict the nodes or the deployment, so it is refused.
_OWNED_RUN_CONFIG: dict[str, str] = {
    "num-server-rounds": "use --rounds",
    "min-reports": "use --min-reports",
    "reply-timeout": "use --reply-timeout",
    "eps0": "use --eps0",
    "clip-l1": "use --clip-l1",
    "fraction": "every node takes part",
    "key-epoch": "the keys' manifest says it",
    **{key: "the deployment wires it up" for key in (
        "shuffler-address", "shuffler-root-cert", "shuffler-client-cert", "shuffler-client-key", "keys-dir",
        "output-dir", "run-name")},
}


@dataclass
class LocalDeployment:
    """Settings of ``shuffledp deploy local`` (validated by :meth:`validate`)."""

    nodes: int = 3
    rounds: int = 2
    workdir: Path | None = None
    keys_dir: Path | None = None
    app_dir: Path | None = None
    eps0: float = 4.0
    clip_l1: float = 1.0
    min_reports: int | None = None
    reply_timeout: float = 300.0
    reply_floor: float = 0.0
    timeout: float = 900.0
    run_config: dict[str, object] = field(default_factory=dict)
    isolation: str = "subprocess"

    def validate(self) -> None:
        _check_int("--nodes", self.nodes, 1, 1000)
        _check_int("--rounds", self.rounds, 1, 10_000)
        for name, value in (("--eps0", self.eps0), ("--clip-l1", self.clip_l1),
                            ("--reply-timeout", self.reply_timeout), ("--timeout", self.timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise DeployUsageError(f"{name} must be a finite number > 0, got {value!r}")
        if _check_reply_floor(self.reply_floor) >= self.reply_timeout:
            raise DeployUsageError(f"--reply-floor ({self.reply_floor:g} s) must be below --reply-timeout "
                              f"({self.reply_timeout:g} s)")
        if self.min_reports is not None:
            _check_int("--min-reports", self.min_reports, 1, self.nodes)
        if self.isolation not in ("subprocess", "process"):
            raise DeployUsageError(f"--isolation must be 'subprocess' or 'process', got {self.isolation!r}")
        app = (self.app_dir or _app_dir_default()).resolve()
        if not (app / "pyproject.toml").is_file():
            raise DeployUsageError(f"--app {app} has no pyproject.toml; point it at the shuffledp project directory")
        for flag, directory, holds in (("--workdir", self.workdir, "key paths, the enrolment file"),
                                       ("--keys", self.keys_dir, "the enrolment file, key configs")):
            where = None if directory is None else Path(directory).resolve()
            if where is not None and (where == app or app in where.parents):
                raise DeployUsageError(
                    f"{flag} {where} is inside the app directory {app}: `flwr run` would pack "
                    f"its TOML/JSON files ({holds}) into the app bundle; choose a directory outside it")
        if self.workdir is not None:
            work = Path(self.workdir).resolve()
            if work.exists() and (not work.is_dir() or any(work.iterdir())):
                # a second run there would overwrite the first's results and logs, and read its old log lines
                raise DeployUsageError(f"--workdir {work} exists and is not an empty directory; choose a new one (each "
                                  "run writes its keys, logs, results and Flower state there)")
        for key in self.run_config:
            if key in _OWNED_RUN_CONFIG:
                raise DeployUsageError(f"--run-config {key} is set by deploy local itself ({_OWNED_RUN_CONFIG[key]}); "
                                  "an override would contradict what the nodes pin or how the deployment is wired")
        self.data_settings()

    def data_settings(self) -> dict[str, object]:
        """The data settings every SuperNode pins (:func:`device_data_settings`): the app's run-config defaults
        (``[tool.flwr.app.config]`` of its pyproject.toml) with ``run_config`` on top, so that the devices read
        what the run's dataset and PCA say."""
        import tomllib

        app = (self.app_dir or _app_dir_default()).resolve()
        try:
            defaults = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
            raise DeployUsageError(
                f"cannot read the run-config defaults of {app / 'pyproject.toml'}: {exc!r}") from None
        return device_data_settings({**defaults, **self.run_config})


@dataclass
class DeployResult:
    """What ``deploy local`` observed: the run's status, the report written by the ServerApp and timings."""

    status: str
    run_id: str
    report: dict[str, Any] | None
    report_path: Path | None
    timings: dict[str, Any]
    workdir: Path


def _flwr(env: Mapping[str, str], args: Sequence[str], *, cwd: Path | None = None,
          timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_flower_bin("flwr"), *args], env=dict(env), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _json_from_output(text: str) -> dict[str, Any]:
    """The JSON object in ``flwr ... --format json`` output (Flower may print a banner line before it)."""
    start = text.find("{")
    if start < 0:
        raise DeployError(f"expected JSON from flwr, got: {text.strip()[:500]}")
    try:
        doc = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise DeployError(f"could not parse flwr's JSON output ({exc}): {text.strip()[:500]}") from exc
    if not isinstance(doc, dict):
        raise DeployError(f"expected a JSON object from flwr, got {doc!r}")
    return doc


def register_supernode(cli_env: Mapping[str, str], public_key: Path) -> str:
    """``flwr supernode register`` one public key; returns the node id the SuperLink assigned."""
    res = _flwr(cli_env, ["supernode", "register", str(public_key), CONNECTION_NAME, "--format", "json"])
    if res.returncode != 0:
        raise DeployError(f"flwr supernode register {public_key} failed (exit {res.returncode}): "
                          f"{(res.stdout + res.stderr).strip()[-800:]}")
    doc = _json_from_output(res.stdout)
    if not doc.get("success") or "node-id" not in doc:
        raise DeployError(f"flwr supernode register {public_key} did not return a node id: {doc}")
    return str(doc["node-id"])


class _LogFollower(threading.Thread):
    """Streams ``flwr log RUN --stream`` into a file, stamping each line with its arrival time."""

    def __init__(self, popen: subprocess.Popen[str], out: IO[str], t0: float, echo: IO[str] | None = None) -> None:
        super().__init__(daemon=True)
        self.popen = popen
        self.out = out
        self.t0 = t0
        self.echo = echo  # progress lines ("[shuffledp] ...") are relayed here as they arrive
        self.lines: list[tuple[float, str]] = []

    def run(self) -> None:
        stream = self.popen.stdout
        if stream is None:
            return
        for line in stream:
            t = time.monotonic() - self.t0
            self.lines.append((t, line.rstrip("\n")))
            self.out.write(f"{t:9.3f} {line}")
            self.out.flush()
            if self.echo is not None and "[shuffledp]" in line:
                self.echo.write(line if line.endswith("\n") else line + "\n")
                self.echo.flush()


class FileTailer(threading.Thread):
    """Follows log files as they grow and records ``(seconds since t0, file key, line)`` for each new line.

    Flower's own log lines carry no timestamps; stamping them on arrival (every ``interval`` seconds) is what
    lets :func:`round_timings` split a round into polling, client compute and server-side work.
    """

    def __init__(self, files: Mapping[str, Path], t0: float, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.files = dict(files)
        self.t0 = t0
        self.interval = interval
        self.events: list[tuple[float, str, str]] = []
        self._offsets = {key: 0 for key in self.files}
        self._partial = {key: "" for key in self.files}
        self._stop_event = threading.Event()

    def poll(self) -> None:
        now = time.monotonic() - self.t0
        for key, path in self.files.items():
            try:
                with open(path, "rb") as fh:
                    fh.seek(self._offsets[key])
                    data = fh.read()
            except FileNotFoundError:
                continue
            if not data:
                continue
            self._offsets[key] += len(data)
            text = self._partial[key] + data.decode(errors="replace")
            *complete, self._partial[key] = text.split("\n")
            self.events.extend((now, key, _strip_ansi(line)) for line in complete)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.poll()
        self.poll()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip_ansi(line: str) -> str:
    return _ANSI.sub("", line)


_ROUND_TAG = re.compile(r"\[RUN \d+, ROUND (\S+)\]")
_PROGRESS = re.compile(r"\[shuffledp\] round (\d+): (?:(skipped|stopped|lost) - )?")


def round_timings(events: Sequence[tuple[float, str, str]], run_start: float,
                  round_ends: Mapping[int, float]) -> list[dict[str, float]]:
    """Split each round's wall time from the stamped log lines of the SuperNodes and the ServerApp's own clock.

    Args:
        events: ``(seconds since the deployment's start, log key, line)``, stamped on arrival.
        run_start: the run's submission, on the same clock.
        round_ends: the end of each round on the same clock, from the ServerApp's own clock
            (``RoundOutcome.finished_at``). The ServerApp's progress lines are not used as round boundaries: they
            reach the followed logs late (buffered, or relayed by Flower), often several rounds in one read.

    Returns:
        One row per round that has an end in ``round_ends`` or a progress line, in round order. For round r (the
        ServerApp sends every message of a round at once, ``group_id = str(r)``):

    * ``wall``: from the end of round r-1 (the run's submission for r = 1, which therefore also holds the
      ServerApp's start-up: data, model, waiting for the nodes) to the end of round r; absent, like every figure
      measured from a round's end, for a round that has no end in ``round_ends`` (a budget stop is not saved);
    * ``to-first-node``: until the first SuperNode logs ``Receiving`` (the ServerApp pushing the messages plus the
      SuperNode's pull interval, about 3 s in Flower 1.41);
    * ``client``: the slowest node's ``Receiving`` to ``Sent successfully``, split into ``client-download``
      (the message), ``client-pickup`` (until the SuperNode's executor starts a ``flwr-clientapp`` process for it:
      the executor polls), ``clientapp`` (that new process: interpreter, Flower, PyTorch and data start-up, local
      training, noise, sealing) and ``client-upload``;
    * ``node-spread``: first to last node receiving (SuperNodes poll independently);
    * ``server-side``: the last reply sent to the progress line: the ServerApp's own polling for replies, the
      shuffler round trip, opening and applying the reports, central evaluation.

    A round that updated no model (its progress line says ``skipped``, ``stopped`` or ``lost``) has ``status``.

    The SuperNodes' times are arrival times of log lines sampled every few tens of ms, so each figure is good to
    about 0.1 s.
    """
    recv: dict[int, dict[str, float]] = {}
    sent: dict[int, dict[str, float]] = {}
    # intermediate marks of a node's message handling: downloaded, executor picked it up, reply ready
    marks: dict[str, dict[int, dict[str, float]]] = {"Received successfully": {}, "Start `flwr-clientapp`": {},
                                                     "Sending:": {}}
    status: dict[int, str] = {}
    listed: set[int] = set(round_ends)
    current: dict[str, int | None] = {}
    for t, key, line in sorted(events, key=lambda e: e[0]):
        m = _PROGRESS.search(line)
        if m:
            listed.add(int(m.group(1)))
            if m.group(2):
                status.setdefault(int(m.group(1)), m.group(2))
            continue
        if not key.startswith("supernode"):
            continue
        m = _ROUND_TAG.search(line)
        if m:
            current[key] = int(m.group(1)) if m.group(1).isdigit() else None
            continue
        rnd = current.get(key)
        if rnd is None:
            continue
        if "Receiving:" in line:
            recv.setdefault(rnd, {}).setdefault(key, t)
        elif "Sent successfully" in line:
            sent.setdefault(rnd, {})[key] = t
        else:
            for needle, table in marks.items():
                if needle in line:
                    table.setdefault(rnd, {}).setdefault(key, t)
    out: list[dict[str, float]] = []
    previous_end = run_start
    for rnd in sorted(listed):
        end = round_ends.get(rnd)
        row: dict[str, Any] = {"round": rnd}
        if end is not None:
            row["wall"] = end - previous_end
        if rnd in status:
            row["status"] = status[rnd]  # no model update this round: nothing to open, apply or evaluate
        r_recv, r_sent = recv.get(rnd, {}), sent.get(rnd, {})
        if r_recv:
            row["to-first-node"] = min(r_recv.values()) - previous_end
            row["node-spread"] = max(r_recv.values()) - min(r_recv.values())
        both = [k for k in r_recv if k in r_sent]
        if both:
            slowest = max(both, key=lambda k: r_sent[k] - r_recv[k])
            row["client"] = r_sent[slowest] - r_recv[slowest]
            if end is not None:
                row["server-side"] = end - max(r_sent.values())
            points = [r_recv[slowest]] + [marks[n].get(rnd, {}).get(slowest) for n in marks] + [r_sent[slowest]]
            if all(p is not None for p in points):
                names = ("client-download", "client-pickup", "clientapp", "client-upload")
                for name, a, b in zip(names, points, points[1:]):
                    row[name] = b - a  # type: ignore[operator]
        out.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        if end is not None:
            previous_end = end
    return out


def server_history(run_dir: Path) -> list[dict[str, Any]]:
    """The ServerApp's per-round history (``RoundOutcome.as_dict()`` rows) kept in the run's checkpoint.

    Returns:
        The rows in round order, or ``[]`` if the run saved no checkpoint.

    Raises:
        Exception: whatever reading the checkpoint raised (a missing or corrupt state file).
    """
    from shuffledp.server.job import RunPaths
    from shuffledp.server.state import SqliteCheckpointStore

    store = SqliteCheckpointStore(RunPaths(out_dir=run_dir, keys_dir=run_dir).state)
    try:
        checkpoint = store.load()
    finally:
        store.close()
    return [] if checkpoint is None else [dict(h) for h in checkpoint.history if "round" in h]


def server_round_ends(history: Sequence[Mapping[str, Any]], wall_t0: float) -> dict[int, float]:
    """Each round's end (``finished_at``, the ServerApp's Unix time) as seconds since ``wall_t0`` (the Unix time
    of the deployment's start), for :func:`round_timings`. Both clocks are this machine's."""
    return {int(h["round"]): float(h["finished_at"]) - wall_t0 for h in history
            if isinstance(h.get("finished_at"), (int, float))}


def merge_server_seconds(rows: list[dict[str, float]], history: Sequence[Mapping[str, Any]]) -> None:
    """Add the ServerApp's own per-phase times (``RoundOutcome.seconds``, kept in the run's checkpoint history)
    to the rows of :func:`round_timings` as ``server-<phase>``: ``collect`` (send and wait for every reply),
    ``shuffle`` (submit the batch, verify the attestation), ``account``, ``open_apply`` (fetch, decrypt, apply),
    ``evaluate``.
    """
    by_round = {int(h["round"]): h.get("seconds") or {} for h in history}
    for row in rows:
        for phase, value in by_round.get(int(row["round"]), {}).items():
            row[f"server-{phase}"] = round(float(value), 3)
        if "server-collect" in row and "client" in row:
            # collect time not spent in the slowest client: pushes, the SuperNodes' and the Grid's polling
            row["messaging"] = round(row["server-collect"] - row["client"], 3)



def run_local(cfg: LocalDeployment, *, out: IO[str] = sys.stdout) -> DeployResult:
    """Run the whole local deployment (see the module docstring) and return what it observed.

    Every process is started in its own process group and stopped in ``finally``: on success, on error, on
    Ctrl-C (KeyboardInterrupt) and on SIGTERM/SIGHUP (converted to an exception while this runs); signals that
    arrive during that cleanup do not interrupt it (:class:`_Signals`). Should this process die without its
    ``finally`` (SIGKILL), the :class:`shuffledp.deploy.watchdog.DeployWatchdog` started first stops them.
    """
    cfg.validate()
    app_dir = (cfg.app_dir or _app_dir_default()).resolve()
    data = cfg.data_settings()  # what every SuperNode pins (the devices read their data as their config says)
    work = Path(cfg.workdir).resolve() if cfg.workdir else Path(tempfile.mkdtemp(prefix="shuffledp-deploy-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    min_reports = cfg.min_reports if cfg.min_reports is not None else cfg.nodes

    if cfg.keys_dir is not None:
        keys = DeployKeys(Path(cfg.keys_dir).resolve())
        manifest = keys.load_layout()
        if int(manifest["nodes"]) < cfg.nodes:
            raise DeployError(f"{keys.root} has keys for {manifest['nodes']} nodes, fewer than --nodes {cfg.nodes}")
        key_epoch = int(manifest["key-epoch"])
        from shuffledp.shuffler.config import load_config as load_shuffler_config

        threshold = load_shuffler_config(keys.shuffler_config).k
        if threshold > cfg.nodes:
            raise DeployError(f"the shuffler in {keys.shuffler_config} releases a batch only with k={threshold} "
                              f"distinct clients, more than --nodes {cfg.nodes}; every round would be skipped")
    else:
        keys = create_deploy_keys(work / "keys", cfg.nodes, k=min_reports)
        key_epoch = _DEFAULT_KEY_EPOCH

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    cli_env = flower_env(work / "cli-home", base_env)
    host = "127.0.0.1"
    shuffler: Any = None
    follower: _LogFollower | None = None
    tailer: FileTailer | None = None
    t_submit = 0.0
    log_proc: subprocess.Popen[str] | None = None
    run_id = ""
    status = "not-started"
    timings: dict[str, Any] = {}
    run_info: dict[str, Any] = {}
    output_dir = work / "outputs"
    run_name = "deploy-" + time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{secrets.token_hex(3)}"
    t_start = time.monotonic()
    wall_t0 = time.time()  # the same instant on the Unix clock, which the ServerApp stamps its rounds' ends with
    with _stop_on_signals() as signals, DeployWatchdog() as watchdog:
        group = ProcessGroup(watchdog=watchdog)
        try:
            # 1. SuperLink: TLS, node authentication, a file database (`:memory:` fails under load in 1.4x)
            address = start_superlink(group, keys, work / "superlink", base_env, logs / "superlink.log", host=host,
                                      isolation=cfg.isolation)
            if cfg.isolation == "process":
                start_serverapp_executor(group, keys, address, work / "serverapp", base_env,
                                         logs / "serverapp-executor.log")
            write_flower_config(work / "cli-home", address, keys.superlink_ca_cert)

            # 2. the shuffler service (mTLS; its own key files)
            t = time.monotonic()
            shuffler = start_shuffler(keys, logs / "shuffler.log", watchdog=watchdog)
            shuffler_address = shuffler.address
            timings["shuffler-start-s"] = time.monotonic() - t
            _refuse_a_spent_key_epoch(shuffler, key_epoch)

            # 3. register each SuperNode's public key, then start the SuperNodes
            with ThreadPoolExecutor(max_workers=min(8, cfg.nodes)) as pool:  # each `flwr` call starts Python
                node_ids = list(pool.map(lambda i: register_supernode(cli_env, keys.supernode_pub(i)),
                                         range(cfg.nodes)))
            confs = [write_toml(work / "supernodes" / f"node-{i}" / "node-config.toml",
                                node_config(keys, i, cfg.nodes, eps0=cfg.eps0, clip_l1=cfg.clip_l1,
                                            reply_floor=cfg.reply_floor, data=data))
                     for i in range(cfg.nodes)]
            start_supernodes(group, keys, address, confs, work / "supernodes", base_env, logs, host=host)
            timings["startup-s"] = time.monotonic() - t_start
            timings["node-ids"] = node_ids
            tailer = FileTailer({"superlink": logs / "superlink.log",
                                 **{f"supernode-{i}": logs / f"supernode-{i}.log" for i in range(cfg.nodes)}},
                                t_start)
            tailer.start()

            # 4. submit the app; overrides in a TOML file (paths are quoted properly, nothing secret inside)
            overrides: dict[str, object] = {
                "num-server-rounds": cfg.rounds,
                "fraction": 1.0,
                "min-reports": min_reports,
                "reply-timeout": float(cfg.reply_timeout),
                "eps0": float(cfg.eps0),
                "clip-l1": float(cfg.clip_l1),
                "shuffler-address": shuffler_address,
                "shuffler-root-cert": str(keys.shuffler_ca_cert),
                "shuffler-client-cert": str(keys.serverapp_cert),
                "shuffler-client-key": str(keys.serverapp_key),
                "keys-dir": str(keys.root),
                "key-epoch": key_epoch,
                "output-dir": str(output_dir),
                "run-name": run_name,
            }
            overrides.update(cfg.run_config)
            rc_file = write_toml(work / "run-config.toml", overrides)
            t_submit = time.monotonic()
            res = _flwr(cli_env, ["run", str(app_dir), CONNECTION_NAME, "--run-config", str(rc_file),
                                  "--format", "json"], cwd=app_dir, timeout=300)
            if res.returncode != 0:
                raise DeployError(f"flwr run failed (exit {res.returncode}): {(res.stdout + res.stderr)[-1500:]}")
            doc = _json_from_output(res.stdout)
            if not doc.get("success") or not doc.get("run-id"):
                raise DeployError(f"flwr run did not start a run: {doc}")
            run_id = str(doc["run-id"])
            timings["submit-s"] = time.monotonic() - t_submit
            out.write(f"run {run_id} submitted to {address} ({cfg.nodes} SuperNodes, {cfg.rounds} rounds); "
                      f"logs in {logs}\n")
            out.flush()

            # 5. follow the run: stream its log (timestamped) and poll its status
            run_log = open(logs / "run.log", "w")  # noqa: SIM115 - closed in finally
            log_proc = subprocess.Popen([_flower_bin("flwr"), "log", run_id, CONNECTION_NAME, "--stream"],
                                        env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
            watchdog.watch(log_proc.pid, Kind.GROUP)
            follower = _LogFollower(log_proc, run_log, t_start, echo=out)
            follower.start()
            deadline = time.monotonic() + cfg.timeout
            status = "pending"
            finished_line = f"of run {run_id}"
            next_ls = 0.0
            while not status.startswith("finished"):
                if time.monotonic() > deadline:
                    _flwr(cli_env, ["stop", run_id, CONNECTION_NAME], timeout=60)
                    raise DeployError(f"run {run_id} did not finish within --timeout {cfg.timeout:.0f} s "
                                      f"(status {status}); stopped it. Logs: {logs}")
                group.check_alive()
                time.sleep(0.5)
                # the SuperLink logs "Finished task ... of run <id>"; `flwr ls` (a new Python process each time)
                # is asked then, and every 20 s as a fallback
                done = tailer is not None and any(
                    "Finished task" in line and finished_line in line for _, _, line in tailer.events)
                if done or time.monotonic() >= next_ls:
                    next_ls = time.monotonic() + 20.0
                    res = _flwr(cli_env, ["ls", CONNECTION_NAME, "--run-id", run_id, "--format", "json"],
                                timeout=60)
                    if res.returncode == 0:
                        runs = _json_from_output(res.stdout).get("runs") or []
                        if runs:
                            status = str(runs[0].get("status", status))
                            run_info = runs[0]
            timings["run-s"] = time.monotonic() - t_submit
            timings["flower-run"] = {k: run_info.get(k) for k in ("elapsed", "compute-time", "network-traffic",
                                                                  "running-at", "finished-at")}
            time.sleep(1.0)  # let the log stream deliver the last lines
        except KeyboardInterrupt:
            status = "interrupted"
            out.write("interrupted: stopping every process of the deployment\n")
            raise
        finally:
            signals.stopping()  # later signals do not cut this short; the watchdog stops what it misses
            if log_proc is not None:
                _signal_group(log_proc, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    log_proc.wait(timeout=5)
                _kill_group(log_proc, watchdog, wait=5)
            if follower is not None:
                follower.join(timeout=5)
                follower.out.close()
            if tailer is not None:
                tailer.stop()
            group.stop_all()
            if shuffler is not None:
                _stop_shuffler(shuffler, watchdog)  # SIGTERM, wait, remove its temporary files

    report_file = output_dir / run_name / "report.json"
    report_path = report_file if report_file.is_file() else None
    report = json.loads(report_path.read_text()) if report_path else None
    if tailer is not None:
        events = list(tailer.events)
        if follower is not None:
            events += [(t, "run", line) for t, line in follower.lines]
        history: list[dict[str, Any]] = []
        if report_path is not None:
            try:
                history = server_history(report_path.parent)
            except Exception as exc:  # noqa: BLE001 - timing is informative only; say why it is missing
                timings["server-clock-unavailable"] = str(exc)[:200]
        timings["rounds"] = round_timings(events, t_submit - t_start, server_round_ends(history, wall_t0))
        merge_server_seconds(timings["rounds"], history)
        with open(logs / "timeline.log", "w") as fh:  # every log line of the deployment, stamped on arrival
            for t, key, line in sorted(events, key=lambda e: e[0]):
                fh.write(f"{t:9.3f} {key:<12} {line}\n")
    timings["total-s"] = time.monotonic() - t_start
    result = DeployResult(status, run_id, report, report_path, timings, work)
    (work / "deploy-result.json").write_text(json.dumps({
        "status": status, "run-id": run_id, "report": str(report_path) if report_path else None,
        "timings": timings}, indent=1, default=str) + "\n")
    return result


def format_report(result: DeployResult) -> str:
    """The per-round table printed at the end of ``deploy local``."""
    lines = [f"run {result.run_id}: {result.status}"]
    if result.report is None:
        lines.append("no report.json was written (see the logs in " + str(result.workdir / "logs") + ")")
        return "\n".join(lines)
    lines.append(f"report: {result.report_path}")
    rows = result.report.get("rounds", [])
    if rows:
        lines.append(f"epsilon: cumulative ({epsilon_label(rows[-1].get('family', ''), rows[-1].get('kind', ''))})")
    lines.append(f"{'round':>5} {'reports':>8} {'accuracy':>9} {'loss':>8} {'eps0':>6} {'epsilon':>10} {'delta':>8}")
    for r in rows:
        def num(key: str, fmt: str) -> str:
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
        lines.append(f"{num('round', 'd'):>5} {num('n_reports', 'd'):>8} {num('accuracy', '.4f'):>9} "
                     f"{num('loss', '.4f'):>8} {num('eps0', '.3g'):>6} {num('epsilon', '.4f'):>10} "
                     f"{num('delta', '.1e'):>8}")
    t = result.timings
    lines.append(f"wall: total {t.get('total-s', 0):.1f} s, start-up {t.get('startup-s', 0):.1f} s, "
                 f"run {t.get('run-s', 0):.1f} s (submission to finished)")
    if t.get("rounds"):
        lines.append("where each round's time goes (seconds; round 1 also holds the ServerApp's start-up):")
        for row in t["rounds"]:
            def f(key: str) -> str:
                v = row.get(key)
                return f"{v:.2f}" if isinstance(v, (int, float)) else "?"
            if "status" in row:  # a budget stop, a skipped or a lost round: no phases beyond what is known
                known = ", slowest client " + f("client") if "client" in row else ""
                lines.append(f"  round {row['round']}: {row['status']} (no model update), wall {f('wall')}{known}")
                continue
            lines.append(
                f"  round {row['round']}: wall {f('wall')} | ServerApp collect {f('server-collect')} = slowest "
                f"client {f('client')} (download {f('client-download')}, executor pickup {f('client-pickup')}, "
                f"clientapp process {f('clientapp')}, upload {f('client-upload')}) + Flower messaging/polling "
                f"{f('messaging')} | shuffle {f('server-shuffle')} | open+apply {f('server-open_apply')} | "
                f"evaluate {f('server-evaluate')}")
    lines.append("With only a handful of nodes the shuffle gives little amplification: epsilon stays close to the "
                 "no-shuffle bound. Amplification needs about 1,000 reports per round.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shuffledp deploy", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    k = sub.add_parser("keys", help="create the keys and certificates of a deployment (all, or one party's)")
    k.add_argument("--out", required=True, type=Path, help="new (empty) directory for the keys")
    k.add_argument("--party", choices=("all", "server", "shuffler", "device"), default="all",
                   help="whose keys: all (one directory with every party's secrets: tests only; the default), or "
                        "the server's, the shuffler's or one device's, made on that party's host "
                        "(deploy/README.md, 'Each party makes its own keys')")
    k.add_argument("--nodes", type=int, default=None, help="number of devices (SuperNodes/clients; --party all)")
    k.add_argument("--node", type=int, default=None, help="this device's index, its partition id (--party device)")
    k.add_argument("--san", action="append", default=[], metavar="NAME",
                   help="extra DNS name or IP address of the SuperLink/shuffler (repeatable)")
    k.add_argument("--key-epoch", type=int, default=None,
                   help=f"key epoch the shuffler expects (default {_DEFAULT_KEY_EPOCH}; raise it when rotating keys)")
    k.add_argument("--k", type=int, default=None,
                   help="shuffler release threshold (distinct signers; required with --party shuffler)")

    sg = sub.add_parser("sign-serverapp", help="shuffler operator: issue the ServerApp's mTLS client certificate "
                                               "from the server's tls/serverapp.csr")
    sg.add_argument("--keys", required=True, type=Path, help="the shuffler operator's directory (--party shuffler)")
    sg.add_argument("--csr", required=True, type=Path, help="the server's certificate signing request")
    sg.add_argument("--out", required=True, type=Path, help="where to write the certificate (new file)")

    ck = sub.add_parser("check", help="check a party's key directory: what it needs, no other party's secrets, "
                                      "modes; print its public files' fingerprints")
    ck.add_argument("--keys", required=True, type=Path, help="a directory written by `shuffledp deploy keys`")

    b = sub.add_parser("bundle", help="write a device's bundle: the files it needs and its node config")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--keys", type=Path, help="directory written by `shuffledp deploy keys` (--party all)")
    src.add_argument("--device", type=Path,
                     help="on the device: complete its own directory (`deploy keys --party device`) in place")
    b.add_argument("--node", type=int, default=None, help="device index, its partition id (with --keys)")
    b.add_argument("--out", type=Path, default=None, help="new directory for the bundle (with --keys)")
    b.add_argument("--nodes", type=int, default=None, help="number of devices in the deployment (with --device)")
    b.add_argument("--superlink-ca", type=Path, default=None,
                   help="the server operator's superlink/ca.crt (with --device)")
    b.add_argument("--server-public-key", type=Path, default=None,
                   help="the server operator's public/server_hpke.pub (with --device)")
    b.add_argument("--shuffler-public-key", type=Path, default=None,
                   help="the shuffler operator's public/shuffler_hpke.pub (with --device)")
    b.add_argument("--eps0", required=True, type=float, help="eps0 the device pins (it refuses any other)")
    b.add_argument("--clip-l1", required=True, type=float, help="L1 clip C the device pins")
    b.add_argument("--reply-floor", type=float, default=0.0,
                   help="seconds before which the device sends no reply, so the reply time does not reveal how "
                        "long its local work took (set it above the slowest round's work); 0 = off")
    b.add_argument("--max-local-epochs", type=int, default=DEFAULT_MAX_LOCAL_EPOCHS,
                   help="the most local epochs the device does for one request (more is refused)")
    b.add_argument("--min-batch-size", type=int, default=DEFAULT_MIN_BATCH_SIZE,
                   help="the smallest minibatch the device trains with (smaller is refused)")
    b.add_argument("--max-model-parameters", type=int, default=DEFAULT_MAX_MODEL_PARAMETERS,
                   help="the largest model (total parameters) the device trains (larger is refused)")
    # the device's data settings (shuffledp.clients.core.DATA_SETTINGS_DEFAULTS); the server's run config does not choose them
    b.add_argument("--dataset", default=None, help="digits (bundled, default) | mnist (IDX files under --data-dir)")
    b.add_argument("--data-dir", default=None, help="folder on the device holding the dataset's files (mnist)")
    b.add_argument("--pca-components", type=int, default=None, help="PCA components (default 10; 0 = none)")
    b.add_argument("--partition", default=None, help="iid (default) | dirichlet: this device's share of the data")
    b.add_argument("--dirichlet-alpha", type=float, default=None, help="Dirichlet concentration (default 0.5)")
    b.add_argument("--partition-seed", type=int, default=None, help="seed of the partition (default 0)")
    b.add_argument("--prefix", default=None,
                   help="where the bundle will be on the device (default: --out; /device for the client image)")

    tw = sub.add_parser("time-work", help="on the device: time its worst-case local work under its pinned limits "
                                          "(to choose a reply-floor that covers it)")
    tw.add_argument("--node-config", required=True, type=Path, help="the device's node-config.toml (from `bundle`)")
    tw.add_argument("--repeat", type=int, default=3, help="timed repetitions per model shape (default 3)")

    loc = sub.add_parser("local", help="run a TLS deployment with N SuperNodes on this machine")
    loc.add_argument("--nodes", type=int, default=3)
    loc.add_argument("--rounds", type=int, default=2)
    loc.add_argument("--workdir", type=Path, default=None,
                     help="directory for keys, logs, the database and outputs (default: a new temp directory)")
    loc.add_argument("--keys", type=Path, default=None, help="use keys from `shuffledp deploy keys` instead")
    loc.add_argument("--app", type=Path, default=None, help="the Flower app directory (default: this project)")
    loc.add_argument("--eps0", type=float, default=4.0, help="eps0 pinned on every SuperNode")
    loc.add_argument("--clip-l1", type=float, default=1.0, help="L1 clip C pinned on every SuperNode")
    loc.add_argument("--min-reports", type=int, default=None, help="k: smallest batch shuffled (default: --nodes)")
    loc.add_argument("--reply-timeout", type=float, default=300.0, help="seconds the server waits for replies")
    loc.add_argument("--reply-floor", type=float, default=0.0,
                     help="seconds before which no SuperNode replies (see `bundle --reply-floor`); 0 = off")
    loc.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is stopped")
    loc.add_argument("--run-config", action="append", default=[], metavar="KEY=VALUE",
                     help="extra run-config override (TOML value), repeatable")
    loc.add_argument("--isolation", choices=("subprocess", "process"), default="subprocess",
                     help="process: run the ServerApp in a separate flower-superexec authenticated with the "
                          "SuperExec secret, as the compose deployment does")
    loc.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    return parser


def _parse_overrides(items: Sequence[str]) -> dict[str, object]:
    import tomllib

    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DeployUsageError(f"--run-config expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value  # a bare word is taken as a string, as Flower does for node config
    return out


def _keys(args: argparse.Namespace) -> int:
    """``deploy keys``: every party's keys in one directory (``--party all``), or one party's."""
    from shuffledp.deploy import party_keys as deploy_keys

    allowed = {"all": {"nodes", "key_epoch", "k", "san"}, "server": {"san"},
               "shuffler": {"k", "key_epoch", "san"}, "device": {"node"}}[args.party]
    given = {"nodes": args.nodes is not None, "node": args.node is not None, "k": args.k is not None,
             "key_epoch": args.key_epoch is not None, "san": bool(args.san)}
    extra = sorted(f"--{name.replace('_', '-')}" for name, on in given.items() if on and name not in allowed)
    if extra:
        raise DeployUsageError(f"{', '.join(extra)} does not apply to --party {args.party}")
    needed = {"all": ("nodes",), "shuffler": ("k",), "device": ("node",)}.get(args.party, ())
    missing = [f"--{name}" for name in needed if not given[name]]
    if missing:
        raise DeployUsageError(f"--party {args.party} needs {', '.join(missing)}")
    key_epoch = _DEFAULT_KEY_EPOCH if args.key_epoch is None else args.key_epoch
    if args.party == "all":
        paths = create_deploy_keys(args.out, args.nodes, sans=args.san, key_epoch=key_epoch, k=args.k)
        print(f"wrote deployment keys for {args.nodes} nodes to {paths.root}")
        print(f"  SuperLink CA (give to devices): {paths.superlink_ca_cert}")
        print(f"  register each device: flwr supernode register {paths.root}/supernodes/node-<i>.pub <connection>")
        print("  this directory holds every party's secrets (tests only); private keys are mode 0600; see "
              "deploy/README.md for which party keeps which file")
        return 0
    if args.party == "server":
        root = deploy_keys.create_server_keys(args.out, sans=args.san).root
        hand_over = ["tls/serverapp.csr to the shuffler operator (`deploy sign-serverapp`)",
                     "superlink/ca.crt and public/server_hpke.pub to every device"]
    elif args.party == "shuffler":
        root = deploy_keys.create_shuffler_keys(args.out, k=args.k, key_epoch=key_epoch, sans=args.san).root
        hand_over = ["public/shuffler_hpke.pub to every device",
                     "public/shuffler_signing.pub and tls/ca.crt to the server operator",
                     "then enrol each device's client.pub: `shuffledp keys enrol --enrolment "
                     f"{root}/enrolment.json --client-id client-<i> --public-key client.pub`"]
    else:
        root = deploy_keys.create_device_keys(args.out, args.node)
        hand_over = [f"client.pub to the shuffler operator (enrolled as client-{args.node})",
                     "supernode.pub to the server operator (`flwr supernode register`)",
                     "then complete it with `shuffledp deploy bundle --device` once the public keys have arrived"]
    print(f"wrote the {args.party}'s keys to {root} (private keys 0600, directory 0700); hand over (public):")
    for line in hand_over:
        print(f"  {line}")
    print(f"  `shuffledp deploy check --keys {root}` says what is still missing")
    return 0


def _check(root: Path) -> int:
    """``deploy check``: the problems of a key directory (exit 1 if any) and its public files' fingerprints."""
    from shuffledp.deploy.party_keys import check_party_directory, public_fingerprints

    problems = check_party_directory(root)
    for line in problems:
        print(f"problem: {line}")
    for rel, digest in public_fingerprints(root).items():
        print(f"sha256 {digest}  {rel}")
    print("ok: nothing is wrong with this directory" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def _bundle(args: argparse.Namespace) -> int:
    """``deploy bundle``: from a one-directory layout (``--keys``), or a device's own directory (``--device``)."""
    limits_and_data: dict[str, Any] = {
        "reply_floor": args.reply_floor, "max_local_epochs": args.max_local_epochs,
        "min_batch_size": args.min_batch_size, "max_model_parameters": args.max_model_parameters,
        "data": {key: value for key, value in (
            ("dataset", args.dataset), ("data-dir", args.data_dir), ("pca-components", args.pca_components),
            ("partition", args.partition), ("dirichlet-alpha", args.dirichlet_alpha),
            ("partition-seed", args.partition_seed)) if value is not None}}
    device_flags = {"--nodes": args.nodes, "--superlink-ca": args.superlink_ca,
                    "--server-public-key": args.server_public_key, "--shuffler-public-key": args.shuffler_public_key}
    if args.keys is not None:
        wrong = [flag for flag, value in device_flags.items() if value is not None]
        if wrong or args.node is None or args.out is None:
            raise DeployUsageError("bundle --keys needs --node and --out" + (
                f", and takes no {', '.join(wrong)} (those complete a device's own directory, with --device)"
                if wrong else ""))
        dest = create_device_bundle(DeployKeys(args.keys), args.node, args.out, eps0=args.eps0,
                                    clip_l1=args.clip_l1, prefix=args.prefix, **limits_and_data)
        start = f"wrote the bundle of device {args.node} to {dest}; copy it to the device and start it with"
    else:
        from shuffledp.deploy.party_keys import complete_device_bundle

        missing = [flag for flag, value in device_flags.items() if value is None]
        if missing or args.node is not None or args.out is not None:
            raise DeployUsageError("bundle --device completes the device's directory in place: it needs "
                              f"{', '.join(device_flags)}" + (f" (missing: {', '.join(missing)})" if missing else "")
                              + " and takes no --node or --out (the node is in the directory's deploy.json)")
        dest = complete_device_bundle(args.device, nodes=args.nodes, superlink_ca=args.superlink_ca,
                                      server_public_key=args.server_public_key,
                                      shuffler_public_key=args.shuffler_public_key, eps0=args.eps0,
                                      clip_l1=args.clip_l1, prefix=args.prefix, **limits_and_data)
        start = f"completed the device's bundle {dest}; start it with"
    print(start)
    print("  flower-supernode --superlink <superlink-host>:8000 --root-certificates <dir>/superlink-ca.crt "
          "--auth-supernode-private-key <dir>/supernode.key --node-config <dir>/node-config.toml")
    return 0


def _time_work(node_config_path: Path, repeat: int) -> int:
    """``deploy time-work``: print :func:`shuffledp.clients.worktime.time_worst_case` as JSON; warn on stderr if the pinned
    reply-floor does not cover the measured worst case. Exit 0 once measured (1 for a bad node config)."""
    import tomllib

    from shuffledp.clients.worktime import time_worst_case

    try:
        node = tomllib.loads(node_config_path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise DeployError(f"cannot read the node config {node_config_path}: {exc}") from None
    if "eps0" not in node:
        raise DeployError(f"{node_config_path} pins no eps0: it is not a device's node config (see `deploy bundle`)")
    try:
        result = time_worst_case(node, repeat=repeat)
    except ValueError as exc:  # ClientSetupError (keys, limits, data settings), a bad --repeat, unloadable data
        raise DeployError(str(exc)) from None
    print(json.dumps(result, indent=1))
    worst, floor = result["worst_s"], result["reply_floor_s"]
    if not result["covered"]:
        state = "off" if floor == 0 else f"{floor:g} s"
        print(f"shuffledp deploy: the reply-floor ({state}) does not cover the measured worst case ({worst:.2f} s): "
              f"set it well above that (e.g. {math.ceil(2 * worst)} s) with `bundle --reply-floor`, and below the "
              "server's reply-timeout", file=sys.stderr)
    else:
        print(f"the reply-floor ({floor:g} s) covers the measured worst case ({worst:.2f} s); this is a measurement, "
              "not a bound: keep a margin", file=sys.stderr)
    return 0


def main(argv: Sequence[str]) -> int:
    """``shuffledp deploy ...``; ``argv[0]`` is ``"deploy"``. Returns the exit code."""
    args_list = list(argv)[1:] if argv and argv[0] == "deploy" else list(argv)
    parser = _parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.action == "keys":
            return _keys(args)
        if args.action == "sign-serverapp":
            from shuffledp.deploy.party_keys import sign_serverapp_request

            cert = sign_serverapp_request(args.keys, args.csr, args.out)
            print(f"signed the request with sha256 {hashlib.sha256(args.csr.read_bytes()).hexdigest()} (compare it "
                  "with the server's `deploy check` output over a second channel before trusting it)")
            print(f"wrote the ServerApp's client certificate {cert}; send it to the server operator with "
                  f"{args.keys / 'tls' / 'ca.crt'} (its tls/serverapp.crt and tls/ca.crt)")
            return 0
        if args.action == "check":
            return _check(args.keys)
        if args.action == "bundle":
            return _bundle(args)
        if args.action == "time-work":
            return _time_work(args.node_config, args.repeat)
        cfg = LocalDeployment(nodes=args.nodes, rounds=args.rounds, workdir=args.workdir, keys_dir=args.keys,
                              app_dir=args.app, eps0=args.eps0, clip_l1=args.clip_l1,
                              min_reports=args.min_reports, reply_timeout=args.reply_timeout,
                              reply_floor=args.reply_floor, timeout=args.timeout,
                              run_config=_parse_overrides(args.run_config), isolation=args.isolation)
        result = run_local(cfg, out=sys.stderr if args.json else sys.stdout)  # keep --json output parseable
        if args.json:
            print(json.dumps({"status": result.status, "run-id": result.run_id, "report": result.report,
                              "timings": result.timings, "workdir": str(result.workdir)}, indent=1, default=str))
        else:
            print(format_report(result))
        return 0 if result.status == "finished:completed" and result.report is not None else 1
    except DeployUsageError as exc:
        print(f"shuffledp deploy: {exc}", file=sys.stderr)
        return 2
    except (DeployError, WatchdogError) as exc:
        print(f"shuffledp deploy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shuffledp deploy: interrupted; every process was stopped", file=sys.stderr)
        return 130
    except _Interrupted as exc:
        print(f"shuffledp deploy: {exc}; every process was stopped", file=sys.stderr)
        return 143
