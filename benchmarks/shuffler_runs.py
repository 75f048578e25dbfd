"""What ``bench_shuffler.py`` measures with: key directories, sealed envelope files, the shuffler's config, and one
timed submit + fetch through a real shuffler process (with CPU seconds and peak memory from ``/proc``)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shuffledp.shuffler import keys as keyfiles
from shuffledp.shuffler.client import ShufflerClient
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, seal
from shuffledp.shuffler.process import ShufflerProcess

MB = 1_000_000


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for suffix, mult in (("gib", 1024**3), ("kib", 1024), ("mib", 1024**2), ("kb", 1000), ("mb", 1000**2),
                         ("b", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def vm_hwm(pid: int | str) -> int:
    """Peak resident set size in bytes (VmHWM) of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU time consumed so far by a process (all threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reset_hwm(pid: int | str) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). Returns False if not permitted."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class EnvelopeFile:
    """A sized iterable of fixed-length envelopes stored back to back in a file (read one at a time)."""

    def __init__(self, path: Path, count: int, length: int) -> None:
        self.path, self.count, self.length = path, count, length

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb", buffering=0) as fh:
            for _ in range(self.count):
                chunk = fh.read(self.length)
                if len(chunk) != self.length:
                    raise RuntimeError(f"{self.path} is truncated")
                yield chunk


@dataclass
class Keys:
    """A key directory for the benchmark and the raw signing keys of its clients."""

    d: keyfiles.KeyDirectory
    client_sks: list[bytes]
    server_pk: bytes
    shuffler_pk: bytes
    verify_key: bytes
    ca: bytes
    cert: bytes
    key: bytes


def make_keys(root: Path, n_clients: int, max_envelope: int) -> Keys:
    """A key directory with one shuffler/server key set and ``n_clients`` enrolled clients.

    ``init_key_directory`` writes (and fsyncs) one key file per client; the benchmark only needs the client
    keys in memory, so it enrols one client there and then rewrites the enrolment with ``n_clients`` keys."""
    d = keyfiles.init_key_directory(root, 1, k=1, max_envelope_bytes=max_envelope)
    pairs = [keyfiles.generate_keypair("ed25519") for _ in range(n_clients)]
    keyfiles.save_enrolment(d.enrolment, {keyfiles.client_id(i): pk for i, (_, pk) in enumerate(pairs)}, overwrite=True)
    return Keys(
        d=d,
        client_sks=[sk for sk, _ in pairs],
        server_pk=keyfiles.load_public_key(d.server_hpke_pub, "x25519"),
        shuffler_pk=keyfiles.load_public_key(d.shuffler_hpke_pub, "x25519"),
        verify_key=keyfiles.load_public_key(d.shuffler_signing_pub, "ed25519"),
        ca=d.ca_cert.read_bytes(),
        cert=d.serverapp_cert.read_bytes(),
        key=d.serverapp_tls_key.read_bytes(),
    )


def write_config(keys: Keys, path: Path, journal: Path, k: int, max_envelope: int, max_reports: int,
                 staging_memory_limit: int | None = None, retain_staging_buffer: bool = True,
                 heap_tuning: bool = True, verify_threads: int | None = None) -> Path:
    d = keys.d
    optional = [] if staging_memory_limit is None else [f"staging_memory_limit = {staging_memory_limit}"]
    optional.append(f"retain_staging_buffer = {'true' if retain_staging_buffer else 'false'}")
    optional.append(f"heap_tuning = {'true' if heap_tuning else 'false'}")
    if verify_threads is not None:
        optional.append(f"verify_threads = {verify_threads}")
    path.write_text(
        "\n".join(
            [
                'address = "127.0.0.1:0"',
                "key_epoch = 0",
                f"k = {k}",
                f"max_envelope_bytes = {max_envelope}",
                f"max_batch_reports = {max_reports}",
                *optional,
                f'hpke_key = "{d.shuffler_hpke_key}"',
                f'signing_key = "{d.shuffler_signing_key}"',
                f'enrolment = "{d.enrolment}"',
                f'journal_dir = "{journal}"',
                "[tls]",
                f'ca = "{d.ca_cert}"',
                f'cert = "{d.shuffler_cert}"',
                f'key = "{d.shuffler_tls_key}"',
                'client_common_names = ["serverapp"]',
                "",
            ]
        )
    )
    return path


def seal_round(keys: Keys, path: Path, n: int, payload_size: int, round_id: int, digest: bytes) -> EnvelopeFile:
    payload = bytes(payload_size)  # content does not matter to the shuffler; fixed length does
    with open(path, "wb") as fh:
        for i in range(n):
            fh.write(
                seal(payload, server_public_key=keys.server_pk, shuffler_public_key=keys.shuffler_pk,
                     signing_key=keys.client_sks[i], key_epoch=0, round_id=round_id, model_digest=digest)
            )
    return EnvelopeFile(path, n, payload_size + ENVELOPE_OVERHEAD)


@dataclass
class Run:
    """The timings of one size: envelopes submitted and fetched through the shuffler service."""

    size: int
    n: int
    t_submit: float
    t_fetch: float
    env_bytes: int
    inner_bytes: int
    shuffler_hwm_submit: int
    shuffler_hwm_fetch: int
    client_hwm_submit: int
    client_hwm_fetch: int
    cpu_shuffler_submit: float
    cpu_shuffler_fetch: float
    cpu_client_submit: float
    cpu_client_fetch: float
    #: the shuffler's own figures for this batch's seal (its Stats): the whole commit, and of it the output's
    #: durable write (write and fsync), both inside ``t_submit``
    t_commit: float = 0.0
    t_commit_write: float = 0.0


def one_run(keys: Keys, proc: ShufflerProcess, envs: EnvelopeFile, round_id: int, digest: bytes, max_msg: int) -> Run:
    client = ShufflerClient(proc.address, root_certificate=keys.ca, client_certificate=keys.cert, client_key=keys.key,
                            shuffler_verify_key=keys.verify_key, max_message_bytes=max_msg, timeout=3600)
    me = os.getpid()
    try:
        # connect (TLS handshake) before the clock starts, as the plain gRPC baseline does once: a ServerApp keeps
        # its shuffler client for the whole run; the Stats call that each submit makes is timed
        client.stats()
        reset_hwm(proc.pid), reset_hwm(me)
        c0, s0 = cpu_seconds(me), cpu_seconds(proc.pid)
        t0 = time.perf_counter()
        # envelope_length announced, as the ServerApp announces it (server/collect.py): the shuffler then decrypts
        # each envelope straight into its slot (memory path)
        att = client.submit(round_id=round_id, key_epoch=0, model_digest=digest, envelopes=envs,
                            envelope_length=envs.length)
        t1 = time.perf_counter()
        c1, s1 = cpu_seconds(me), cpu_seconds(proc.pid)
        hwm_s_sub, hwm_c_sub = vm_hwm(proc.pid), vm_hwm(me)
        if att.n_accepted != envs.count:
            raise RuntimeError(f"only {att.n_accepted} of {envs.count} reports accepted: {dict(att.dropped)}")
        reset_hwm(proc.pid), reset_hwm(me)
        got = 0
        c2, s2 = cpu_seconds(me), cpu_seconds(proc.pid)
        t2 = time.perf_counter()
        for inner in client.fetch(att):  # verified against the attestation at the end of the stream
            got += len(inner)
        t3 = time.perf_counter()
        c3, s3 = cpu_seconds(me), cpu_seconds(proc.pid)
        hwm_s_fetch, hwm_c_fetch = vm_hwm(proc.pid), vm_hwm(me)
        seal_time = client.stats()  # after the clock: this batch was the last one sealed
    finally:
        client.close()
    return Run(
        size=envs.length - ENVELOPE_OVERHEAD, n=envs.count, t_submit=t1 - t0, t_fetch=t3 - t2,
        env_bytes=envs.count * envs.length, inner_bytes=got, shuffler_hwm_submit=hwm_s_sub,
        shuffler_hwm_fetch=hwm_s_fetch, client_hwm_submit=hwm_c_sub, client_hwm_fetch=hwm_c_fetch,
        cpu_shuffler_submit=s1 - s0, cpu_shuffler_fetch=s3 - s2, cpu_client_submit=c1 - c0, cpu_client_fetch=c3 - c2,
        t_commit=float(seal_time["last_seal_seconds"]), t_commit_write=float(seal_time["last_seal_write_seconds"]),
    )


def _seal_part(args: tuple[bytes, bytes, int, int, int, int, bytes, str]) -> int:
    """Worker of :func:`seal_many`: ``count`` fresh client key pairs and one envelope each, appended to two files
    (public keys, envelopes). Returns ``count``."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    server_pk, shuffler_pk, count, payload_size, round_id, _, digest, prefix = args
    payload = bytes(payload_size)
    with open(prefix + ".env", "wb") as envs, open(prefix + ".pub", "wb") as pubs:
        for _ in range(count):
            sk = ed25519.Ed25519PrivateKey.generate()
            pubs.write(sk.public_key().public_bytes_raw())
            envs.write(seal(payload, server_public_key=server_pk, shuffler_public_key=shuffler_pk,
                            signing_key=sk.private_bytes_raw(), key_epoch=0, round_id=round_id, model_digest=digest))
    return count


def seal_many(keys: Keys, workdir: Path, n: int, payload_size: int, round_id: int, digest: bytes,
              workers: int) -> EnvelopeFile:
    """``n`` envelopes of ``n`` fresh clients, sealed by ``workers`` processes into one file, the clients enrolled
    (the key directory's enrolment is rewritten). Returns the envelopes as an :class:`EnvelopeFile`."""
    import concurrent.futures
    import multiprocessing

    shares = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    prefixes = [str(workdir / f"big-part-{i}") for i in range(workers)]
    jobs = [(keys.server_pk, keys.shuffler_pk, c, payload_size, round_id, i, digest, prefixes[i])
            for i, c in enumerate(shares)]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        if sum(pool.map(_seal_part, jobs)) != n:
            raise RuntimeError("a sealing worker fell short")
    out = workdir / "big.bin"
    enrolled: dict[str, bytes] = {}
    with open(out, "wb") as fh:
        for prefix in prefixes:
            with open(prefix + ".env", "rb") as part:
                shutil.copyfileobj(part, fh, 16 << 20)
            pubs = Path(prefix + ".pub").read_bytes()
            for j in range(0, len(pubs), 32):
                enrolled[keyfiles.client_id(len(enrolled))] = pubs[j : j + 32]
            os.unlink(prefix + ".env")
            os.unlink(prefix + ".pub")
    keyfiles.save_enrolment(keys.d.enrolment, enrolled, overwrite=True)
    return EnvelopeFile(out, n, payload_size + ENVELOPE_OVERHEAD)


def fmt_bytes(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"
