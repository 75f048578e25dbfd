"""The one-directory key layout of a deployment (``shuffledp deploy keys --out DIR --nodes N``).

Everything a deployment needs, in one directory: the shuffler package's key directory (HPKE and signing keys,
the server's HPKE key, one Ed25519 signing key per client, the enrolment file and the mTLS certificates between
the ServerApp and the shuffler, written by :func:`shuffledp.shuffler.keys.init_key_directory`), plus the Flower
side: a CA for the SuperLink, the SuperLink's TLS certificate (SANs ``localhost``, ``127.0.0.1`` and every
``--san``), and one SuperNode authentication key pair per device (ECDSA P-384 in OpenSSH format, which is what
``flwr supernode register`` and ``flower-supernode --auth-supernode-private-key`` read). That directory holds
every party's secrets: for tests. ``--party server|shuffler|device`` instead makes one party's keys on its own
host (:mod:`shuffledp.deploy.party_keys`).

Layout added next to the shuffler key directory (see docs/interfaces.md)::

    DIR/superlink/ca.crt                CA the devices trust for the SuperLink (public)
    DIR/superlink/ca.key                SuperLink operator only (0600)
    DIR/superlink/superlink.crt/.key    the SuperLink's TLS certificate and key (key 0600)
    DIR/superlink/superexec.secret      shared secret of the SuperLink and its ServerApp executor (0600; compose)
    DIR/supernodes/node-<i>.key         device i's SuperNode authentication key (OpenSSH ECDSA P-384, 0600)
    DIR/supernodes/node-<i>.pub         its public key, registered with ``flwr supernode register``
    DIR/compose/shuffler.toml           the shuffler's config inside its container (deploy/compose.yml)
    DIR/compose/run-config.toml         the ServerApp's run config for the compose deployment (no secrets)
    DIR/deploy.json                     what was generated (nodes, SANs, key epoch, k); no secrets

The SuperLink has its own CA, separate from the shuffler's mTLS CA (``DIR/tls/``): the devices trust only the
SuperLink CA, and whoever holds the SuperLink CA key cannot mint a client certificate the shuffler accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.flower import toml_text
from shuffledp.deploy.validation import MAX_NODES, check_int

__all__ = [
    "DEFAULT_KEY_EPOCH",
    "MANIFEST_FORMAT",
    "DeployKeys",
    "create_deploy_keys",
    "write_new_file",
    "write_manifest",
    "staged_directory",
    "supernode_keypair",
    "superlink_names",
    "write_superlink_tls",
    "compose_shuffler_config",
    "compose_run_config",
    "CONTAINER_KEYS",
    "CONTAINER_SHUFFLER_PORT",
]

#: The key epoch of new keys unless ``--key-epoch`` says otherwise.
DEFAULT_KEY_EPOCH = 0
#: The ``format`` of every ``deploy.json``.
MANIFEST_FORMAT = "shuffledp-deploy/v1"
#: Where deploy/compose.yml mounts the key files inside the containers.
CONTAINER_KEYS = "/keys"
#: The shuffler's port on the compose network ``shuffle``.
CONTAINER_SHUFFLER_PORT = 7070


@dataclass(frozen=True)
class DeployKeys:
    """Paths of a deployment key directory (the shuffler's layout plus the Flower files listed above)."""

    root: Path

    @property
    def superlink_ca_cert(self) -> Path:
        """The SuperLink CA's certificate (public; every device trusts it)."""
        return self.root / "superlink" / "ca.crt"

    @property
    def superlink_ca_key(self) -> Path:
        """The SuperLink CA's key (the SuperLink operator's only)."""
        return self.root / "superlink" / "ca.key"

    @property
    def superlink_cert(self) -> Path:
        """The SuperLink's TLS certificate."""
        return self.root / "superlink" / "superlink.crt"

    @property
    def superlink_key(self) -> Path:
        """The SuperLink's TLS key."""
        return self.root / "superlink" / "superlink.key"

    def supernode_key(self, i: int) -> Path:
        """Device ``i``'s SuperNode authentication key (private)."""
        return self.root / "supernodes" / f"node-{i}.key"

    def supernode_pub(self, i: int) -> Path:
        """Device ``i``'s SuperNode public key (registered with ``flwr supernode register``)."""
        return self.root / "supernodes" / f"node-{i}.pub"

    @property
    def superexec_secret(self) -> Path:
        """The secret the SuperLink and a separate ServerApp executor share (``--isolation process``)."""
        return self.root / "superlink" / "superexec.secret"

    @property
    def compose_shuffler_config(self) -> Path:
        """The shuffler's config inside its container (deploy/compose.yml)."""
        return self.root / "compose" / "shuffler.toml"

    @property
    def compose_run_config(self) -> Path:
        """The ServerApp's run config of the compose deployment."""
        return self.root / "compose" / "run-config.toml"

    @property
    def manifest(self) -> Path:
        """``deploy.json``: what was generated, for whom; no secrets."""
        return self.root / "deploy.json"

    # the shuffler package's files (docs/interfaces.md, "Key directory")
    @property
    def shuffler_config(self) -> Path:
        """The shuffler service's config."""
        return self.root / "shuffler.toml"

    @property
    def shuffler_ca_cert(self) -> Path:
        """The shuffler's mTLS CA certificate."""
        return self.root / "tls" / "ca.crt"

    @property
    def serverapp_cert(self) -> Path:
        """The ServerApp's mTLS client certificate (for the shuffler)."""
        return self.root / "tls" / "serverapp.crt"

    @property
    def serverapp_key(self) -> Path:
        """The ServerApp's mTLS client key."""
        return self.root / "tls" / "serverapp.key"

    @property
    def server_public_key(self) -> Path:
        """The server's HPKE public key (the inner layer of every report is sealed to it)."""
        return self.root / "public" / "server_hpke.pub"

    @property
    def shuffler_public_key(self) -> Path:
        """The shuffler's HPKE public key (the outer layer)."""
        return self.root / "public" / "shuffler_hpke.pub"

    def client_key(self, i: int) -> Path:
        """Client ``i``'s envelope signing key."""
        return self.root / "clients" / f"client-{i}.key"

    def load_layout(self) -> dict[str, Any]:
        """The manifest of a one-directory layout (party ``all``).

        Returns:
            The manifest, whose ``nodes`` and ``key-epoch`` are non-negative integers.

        Raises:
            DeployUsageError: the directory is one party's (``deploy keys --party``).
            DeployError: the manifest is missing, invalid, or lacks ``nodes`` or ``key-epoch``.
        """
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
        """The ``deploy.json`` written by :func:`write_manifest`.

        Returns:
            The manifest as a dict.

        Raises:
            DeployError: it is absent, not JSON, or not a shuffledp deployment manifest.
        """
        try:
            doc = json.loads(self.manifest.read_text())
        except FileNotFoundError as exc:
            raise DeployError(f"{self.root} is not a deployment key directory: {self.manifest} is missing "
                              "(create one with `shuffledp deploy keys --out DIR --nodes N`)") from exc
        except json.JSONDecodeError as exc:
            raise DeployError(f"{self.manifest} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise DeployError(f"{self.manifest} is not a shuffledp deployment manifest")
        return doc


def write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode``, durably and never overwriting (shuffledp.shuffler.journal.write_file_durably).

    Raises:
        DeployError: ``path`` already exists (a key or certificate is never overwritten).
    """
    from shuffledp.shuffler.journal import write_file_durably

    try:
        write_file_durably(path, data, mode=mode, overwrite=False)
    except FileExistsError as exc:
        raise DeployError(f"{path} already exists; a key or certificate is never overwritten") from exc


def write_manifest(root: Path, party: str, **fields: Any) -> None:
    """Write ``root/deploy.json``: the format, ``party`` (``all`` for the one-directory layout), ``fields`` (no
    secrets) and the time it was created."""
    doc = {"format": MANIFEST_FORMAT, "party": party, **fields,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_new_file(root / "deploy.json", (json.dumps(doc, indent=1) + "\n").encode(), 0o644)


@contextlib.contextmanager
def staged_directory(out: str | os.PathLike[str]) -> Iterator[Path]:
    """A new key directory made whole or not at all.

    The files are written into a hidden sibling (mode 0700), renamed to ``out`` only once all are written, and
    removed on any failure, so that a bad parameter found late, or a kill, never leaves ``out`` half-written (a
    killed run may leave ``.NAME.partial-*`` beside it). ``out`` must not exist or be an empty directory (keys are
    never overwritten). Missing parent directories are created 0755 whatever the umask.

    Yields:
        The staging path to write into.

    Raises:
        DeployUsageError: ``out`` exists and is not an empty directory.
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
    """A fresh SuperNode authentication key pair.

    Flower reads the private key with ``cryptography``'s ``load_ssh_private_key`` and requires an elliptic curve
    key (``flower-supernode --auth-supernode-private-key``); ``flwr supernode register`` reads the public key
    with ``load_ssh_public_key`` and accepts NIST curves only. P-384 matches Flower's documentation
    (``ssh-keygen -t ecdsa -b 384``). The private scalar comes from OpenSSL's CSPRNG.

    Returns:
        ``(private key in OpenSSH PEM, public key in OpenSSH format with a newline)``.
    """
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + b"\n"


def superlink_names(sans: Sequence[str]) -> list[str]:
    """The SANs of the SuperLink's (and the shuffler's) server certificate.

    Returns:
        ``localhost``, ``127.0.0.1`` and ``sans`` (DNS names or IP addresses the other hosts use), without repeats.

    Raises:
        DeployUsageError: ``sans`` is one string rather than a sequence of names.
    """
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
    key_epoch: int = DEFAULT_KEY_EPOCH,
    k: int | None = None,
) -> DeployKeys:
    """Write every key and certificate of a deployment with ``nodes`` devices into ``out`` (which must be empty).

    Args:
        out: the new directory; it is made whole or not at all (:func:`staged_directory`).
        nodes: the number of devices.
        sans: extra DNS names or IP addresses the devices use to reach the SuperLink (``localhost`` and
            ``127.0.0.1`` are always included); also added to the shuffler's server certificate, so the
            ServerApp can reach the shuffler by the same names.
        key_epoch: the key epoch the shuffler expects.
        k: the shuffler's release threshold (default: the shuffler package's).

    Returns:
        The paths of the new directory.

    Raises:
        DeployUsageError: a bad parameter, or a directory that already holds files.
    """
    nodes = check_int("--nodes", nodes, 1, MAX_NODES)
    key_epoch = check_int("--key-epoch", key_epoch, 0, 2**32 - 1)
    if k is not None:
        k = check_int("--k", k, 1, nodes)
    names = superlink_names(sans)
    with staged_directory(out) as staging:
        _write_deploy_keys(staging, nodes, names, key_epoch, k)
    return DeployKeys(Path(out))


def write_superlink_tls(paths: DeployKeys, names: list[str]) -> None:
    """Write the SuperLink operator's files under ``superlink/`` (mode 0700): its own CA, its TLS certificate for
    the SANs ``names`` and key, and the SuperExec shared secret (process isolation, compose; from the OS CSPRNG).

    Raises:
        DeployUsageError: a SAN the certificate cannot carry.
    """
    from shuffledp.shuffler import tls

    try:
        ca_cert, ca_key = tls.create_ca("shuffledp SuperLink CA")
        cert, key = tls.issue_certificate(ca_cert, ca_key, "superlink", sans=names, is_server=True,
                                          is_client=False)
    except ValueError as exc:
        raise DeployUsageError(f"cannot issue the SuperLink certificate for SANs {names}: {exc}") from exc
    (paths.root / "superlink").mkdir(mode=0o700)
    os.chmod(paths.root / "superlink", 0o700)
    write_new_file(paths.superlink_ca_cert, ca_cert, 0o644)
    write_new_file(paths.superlink_ca_key, ca_key, 0o600)
    write_new_file(paths.superlink_cert, cert, 0o644)
    write_new_file(paths.superlink_key, key, 0o600)
    write_new_file(paths.superexec_secret, secrets.token_hex(32).encode(), 0o600)


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
        write_new_file(paths.supernode_key(i), private, 0o600)
        write_new_file(paths.supernode_pub(i), public, 0o644)
    shuffler_conf = load_shuffler_config(paths.shuffler_config)
    (root / "compose").mkdir()
    os.chmod(root / "compose", 0o755)
    write_new_file(paths.compose_shuffler_config, compose_shuffler_config(
        shuffler_conf.key_epoch, shuffler_conf.k, shuffler_conf.max_envelope_bytes), 0o644)
    write_new_file(paths.compose_run_config, compose_run_config(shuffler_conf.key_epoch, min(shuffler_conf.k, nodes)),
                   0o644)
    write_manifest(root, "all", nodes=nodes, **{"superlink-sans": names, "key-epoch": key_epoch,
                                                "k": shuffler_conf.k})


def compose_shuffler_config(key_epoch: int, k: int, max_envelope_bytes: int) -> bytes:
    """The shuffler's config inside its container (paths as mounted by deploy/compose.yml).

    It listens on all interfaces of its container (the compose network ``shuffle`` is internal and joins only the
    ServerApp executor) and accepts only the client certificate whose CN is ``serverapp``.

    Returns:
        The TOML file's bytes.
    """
    k_ = CONTAINER_KEYS
    values = {
        "address": f"0.0.0.0:{CONTAINER_SHUFFLER_PORT}", "key_epoch": key_epoch, "k": k,
        "max_envelope_bytes": max_envelope_bytes, "hpke_key": f"{k_}/shuffler/hpke.key",
        "signing_key": f"{k_}/shuffler/signing.key", "enrolment": f"{k_}/enrolment.json", "journal_dir": "/journal",
        "tls": {"ca": f"{k_}/tls/ca.crt", "cert": f"{k_}/tls/shuffler.crt", "key": f"{k_}/tls/shuffler.key",
                "client_common_names": ["serverapp"]},
    }
    return toml_text(values, "shuffledp shuffler inside its container (deploy/compose.yml); written by "
                             "`shuffledp deploy keys`").encode()


def compose_run_config(key_epoch: int, min_reports: int) -> bytes:
    """The ServerApp's run-config overrides for the compose deployment (``flwr run . <conn> --run-config F``).

    Only paths and public settings: the run config is sent to every SuperNode, so nothing secret goes here.

    Returns:
        The TOML file's bytes.
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
    return toml_text(values, "ServerApp run config for deploy/compose.yml; written by `shuffledp deploy keys`").encode()
