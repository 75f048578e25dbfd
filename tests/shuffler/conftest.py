"""Shared fixtures for the shuffler tests: a key directory, an envelope factory, an in-process core/server."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shuffledp.shuffler import builder as core_module
from shuffledp.shuffler import keys as keyfiles
from shuffledp.shuffler.client import ShufflerClient
from shuffledp.shuffler.config import load_config
from shuffledp.shuffler.core import CoreConfig, Header, ShufflerCore
from shuffledp.shuffler.envelope import ENVELOPE_VERSION, model_digest, seal
from shuffledp.shuffler.service import build_server, core_from_config

N_CLIENTS = 8
K = 3


@dataclasses.dataclass
class Kit:
    """Keys of one key directory plus helpers to build envelopes and submissions."""

    d: keyfiles.KeyDirectory
    n_clients: int
    k: int
    key_epoch: int = 0

    def __post_init__(self) -> None:
        self.server_pk = keyfiles.load_public_key(self.d.server_hpke_pub, "x25519")
        self.server_sk = keyfiles.load_private_key(self.d.server_hpke_key, "x25519")
        self.shuffler_pk = keyfiles.load_public_key(self.d.shuffler_hpke_pub, "x25519")
        self.shuffler_sk = keyfiles.load_private_key(self.d.shuffler_hpke_key, "x25519")
        self.verify_key = keyfiles.load_public_key(self.d.shuffler_signing_pub, "ed25519")
        self.signing_sk = keyfiles.load_private_key(self.d.shuffler_signing_key, "ed25519")
        self.client_sks = [keyfiles.load_private_key(self.d.client_key(i), "ed25519") for i in range(self.n_clients)]
        self.enrolment = keyfiles.load_enrolment(self.d.enrolment)
        self.digest = model_digest([b"model-v1"])
        self.ca = self.d.ca_cert.read_bytes()
        self.app_cert = self.d.serverapp_cert.read_bytes()
        self.app_key = self.d.serverapp_tls_key.read_bytes()

    def payload(self, i: int, size: int = 64) -> bytes:
        return (f"report-{i}:".encode() + bytes(size))[:size]

    def seal(
        self,
        i: int,
        *,
        round_id: int = 1,
        size: int = 64,
        payload: bytes | None = None,
        key_epoch: int | None = None,
        digest: bytes | None = None,
        signing_key: bytes | None = None,
        version: int = ENVELOPE_VERSION,
    ) -> bytes:
        return seal(
            self.payload(i, size) if payload is None else payload,
            server_public_key=self.server_pk,
            shuffler_public_key=self.shuffler_pk,
            signing_key=self.client_sks[i] if signing_key is None else signing_key,
            key_epoch=self.key_epoch if key_epoch is None else key_epoch,
            round_id=round_id,
            model_digest=self.digest if digest is None else digest,
            version=version,
        )

    def header(self, count: int, *, round_id: int = 1, **over: object) -> Header:
        kw: dict[str, object] = dict(
            protocol_version=ENVELOPE_VERSION, key_epoch=self.key_epoch, round_id=round_id, model_digest=self.digest,
            expected_count=count,
        )
        kw.update(over)
        return Header(**kw)  # type: ignore[arg-type] - any field overridden, bad values too

    def core_config(self, journal_dir: Path, **over: object) -> CoreConfig:
        kw: dict[str, object] = dict(
            key_epoch=self.key_epoch,
            k=self.k,
            hpke_private_key=self.shuffler_sk,
            signing_private_key=self.signing_sk,
            enrolment=self.enrolment,
            journal_dir=journal_dir,
            max_envelope_bytes=1 << 20,
            verify_threads=2,  # the pool's path whatever this machine's CPUs (the default depends on them)
        )
        kw.update(over)
        return CoreConfig(**kw)  # type: ignore[arg-type] - any field overridden, bad values too

    def client(self, address: str, *, tls: bool = True) -> ShufflerClient:
        return ShufflerClient(
            address,
            root_certificate=self.ca if tls else None,
            client_certificate=self.app_cert if tls else None,
            client_key=self.app_key if tls else None,
            shuffler_verify_key=self.verify_key,
            max_message_bytes=1 << 20,
        )


@pytest.fixture(autouse=True)
def pipelined_signature_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every envelope of these tests takes the pipelined path (signature checks on the core's verify pool).

    In production only messages with at least ``PIPELINE_MIN_JOB_BYTES`` (256 KiB) of plaintext are pipelined,
    and the test envelopes are small, so without this the in-process cores and servers here would only ever
    check inline. The inline path is covered by ``verify_threads = 0`` tests in test_core_signature_checks.py and by
    the service tests that run the shuffler as a subprocess.
    """
    monkeypatch.setattr(core_module, "PIPELINE_MIN_JOB_BYTES", 0)


@pytest.fixture(scope="session")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Kit:
    root = tmp_path_factory.mktemp("keys") / "k"
    d = keyfiles.init_key_directory(root, N_CLIENTS, k=K, max_envelope_bytes=1 << 20)
    return Kit(d=d, n_clients=N_CLIENTS, k=K)


@pytest.fixture
def core(kit: Kit, tmp_path: Path) -> Iterator[ShufflerCore]:
    c = ShufflerCore(kit.core_config(tmp_path / "journal"))
    yield c
    c.close()


@pytest.fixture
def disk_core(kit, tmp_path: Path):
    """A core whose every batch takes the disk staging path (staging_memory_limit = 0)."""
    c = ShufflerCore(kit.core_config(tmp_path / "disk-journal", staging_memory_limit=0))
    yield c
    c.close()


def write_config(kit: Kit, path: Path, *, insecure: bool = False, journal: str = "journal", **extra: object) -> Path:
    """A service config in ``path``'s directory pointing at the kit's key files (absolute paths, in tmp)."""
    d = kit.d
    lines = [
        'address = "127.0.0.1:0"',
        f"key_epoch = {kit.key_epoch}",
        f"k = {extra.pop('k', kit.k)}",
        f"max_envelope_bytes = {extra.pop('max_envelope_bytes', 1 << 20)}",
        f'hpke_key = "{d.shuffler_hpke_key}"',
        f'signing_key = "{d.shuffler_signing_key}"',
        f'enrolment = "{d.enrolment}"',
        f'journal_dir = "{journal}"',
    ]
    if insecure:
        lines.append("insecure = true")
    else:
        lines += [
            "[tls]",
            f'ca = "{d.ca_cert}"',
            f'cert = "{d.shuffler_cert}"',
            f'key = "{d.shuffler_tls_key}"',
            'client_common_names = ["serverapp"]',
        ]
    if extra:
        raise TypeError(f"unknown config overrides {extra}")
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclasses.dataclass
class Running:
    server: grpc.Server
    port: int
    core: ShufflerCore
    address: str


@pytest.fixture
def running(kit: Kit, tmp_path: Path) -> Iterator[Running]:
    """An in-process mTLS shuffler server on 127.0.0.1, port 0."""
    cfg = load_config(write_config(kit, tmp_path / "shuffler.toml"))
    c = core_from_config(cfg)
    server, port, _ = build_server(cfg, c, max_workers=4)
    yield Running(server=server, port=port, core=c, address=f"127.0.0.1:{port}")
    server.stop(grace=None).wait()
    c.close()
