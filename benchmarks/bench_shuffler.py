"""Benchmark: sealed reports through a real shuffler process, submit + fetch over mTLS on loopback.

For each report size (default 100 KiB and 1 MiB payloads) and each repetition this script

1. seals ``--reports`` envelopes (one per enrolled client) for a fresh round, into a file (not timed);
2. submits them to a real ``shuffledp.shuffler.process.ShufflerProcess`` (one per size, serving all repetitions of that
   size; mTLS, 127.0.0.1, port 0, journal in a temporary directory under ``--workdir``);
3. times ``ShufflerClient.submit`` (client-streaming, envelopes read from the file one at a time) and
   ``ShufflerClient.fetch`` (server-streaming; the client checks lengths, count and the attested output
   digest, as the ServerApp does) separately;
4. reads the peak resident memory (``VmHWM``) of the shuffler process and of this client process from
   ``/proc/<pid>/status``; the peak is reset (``echo 5 > /proc/<pid>/clear_refs``) before each phase, so each
   figure is the peak of that phase.

MB/s uses MB = 10^6 bytes of envelope (submit) or inner ciphertext (fetch); "together" is the envelope bytes
over submit + fetch time. The goal is >= 300 MB/s together on a 2-core machine.

Before the runs it writes ``--disk-probe-mib`` (default 1 GiB) to the journal's filesystem and fdatasyncs it:
the shuffler journals and fsyncs every batch before acknowledging it, so that rate bounds submit for a batch of
that size. ``--core-breakdown`` pushes one batch per size through the in-process core (no gRPC) and splits
add() (open, verify, stage) from finish() (output digest, fsync, sign, journal).

Next to each shuffler run, plain gRPC over the same mTLS credentials streams the same envelopes to a do-nothing
servicer in a child process and as many inner-sized items back from it (the transport on this machine, unless
``--no-baseline``): after the shuffler run in odd runs, before it in even ones, so that both see the same load of a
shared machine and a trend in that load favours neither. The summary gives transport time over shuffler time
(submit + fetch): the ratio of the medians, and the median and minimum of the pairs; and the CPU seconds of both
(the plain server and this client) per phase.

``--warmup`` (default 1) untimed submit + fetch rounds per size come first, for the shuffler and the plain server
alike: a fresh shuffler faults in its staging buffer at its first memory-path batch (about 2.5 ms per MB on this
VM; the buffer is then kept for the next batches), which is a start-up cost, not the throughput.

``--big-batch N[,N...]`` (default 1,000,000; 0 skips it) then pushes one batch of N small envelopes
(``--big-envelope-bytes``, default 256) of N freshly enrolled clients through a real shuffler process and reports
its submit and fetch time and the peak RSS of the shuffler and of this client; sealing them (``--seal-workers``
processes) is not timed. ``--quick``: 300 reports per size, 3 runs, no disk probe, a 20,000-report big batch.
``--strace`` attaches ``strace -c -f`` to the shuffler during one extra submit+fetch (syscall time, e.g. fsync);
``--perf`` records it with ``perf record -g`` and prints where its CPU time goes (by library and symbol).

Usage::

    python benchmarks/bench_shuffler.py --quick              # a few minutes
    python benchmarks/bench_shuffler.py --reports 1000 --sizes 100KiB,1MiB --repeat 3 --disk-probe-mib 0
    python benchmarks/bench_shuffler.py --reports 200 --sizes 1MiB --repeat 1 --big-batch 0 --core-breakdown --perf
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shuffledp.shuffler import keys as keyfiles
from shuffledp.shuffler import wire
from shuffledp.shuffler.client import FETCH_METHOD, ShufflerClient
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, ENVELOPE_VERSION, INNER_OVERHEAD, model_digest, seal
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
        att = client.submit(round_id=round_id, key_epoch=0, model_digest=digest, envelopes=envs)
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
    finally:
        client.close()
    return Run(
        size=envs.length - ENVELOPE_OVERHEAD, n=envs.count, t_submit=t1 - t0, t_fetch=t3 - t2,
        env_bytes=envs.count * envs.length, inner_bytes=got, shuffler_hwm_submit=hwm_s_sub,
        shuffler_hwm_fetch=hwm_s_fetch, client_hwm_submit=hwm_c_sub, client_hwm_fetch=hwm_c_fetch,
        cpu_shuffler_submit=s1 - s0, cpu_shuffler_fetch=s3 - s2, cpu_client_submit=c1 - c0, cpu_client_fetch=c3 - c2,
    )


_BASELINE_SERVER = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    from shuffledp.shuffler import shuffler_pb2 as pb, shuffler_pb2_grpc as pb_grpc
    from shuffledp.shuffler import wire
    ca, cert, key, limit, port_file, heap = sys.argv[1:7]
    if heap == "tuned":  # as the shuffler service does (config heap_tuning)
        from shuffledp.shuffler.heap import tune_heap
        tune_heap(int(limit))
    class Sink(pb_grpc.ShufflerServicer):
        def Submit(self, it, ctx):
            n = 0
            for req in it:
                n += len(req.envelope)
            return pb.SubmitResponse(statement=str(n).encode())
        def Fetch(self, req, ctx):
            # a source: batch_id = count (8 bytes) || item length (8 bytes); the items are packed as the
            # shuffler packs them (wire.packed), from one bytes object (no file read, no verification)
            count, length = int.from_bytes(req.batch_id[:8], "big"), int.from_bytes(req.batch_id[8:], "big")
            item = bytes(length)
            for group in wire.packed((item for _ in range(count)), wire.PACKED_MESSAGE_BYTES):
                yield pb.FetchResponse(inner=group)
    s = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", int(limit)),
                                                            ("grpc.max_send_message_length",
                                                             max(int(limit), 2 * wire.PACKED_MESSAGE_BYTES))])
    pb_grpc.add_ShufflerServicer_to_server(Sink(), s)
    creds = grpc.ssl_server_credentials([(open(key, "rb").read(), open(cert, "rb").read())],
                                        root_certificates=open(ca, "rb").read(), require_client_auth=True)
    port = s.add_secure_port("127.0.0.1:0", creds)
    s.start()
    open(port_file, "w").write(str(port))
    s.wait_for_termination()
    """
)


class Baseline:
    """Plain gRPC over the same mTLS credentials in a child process: a do-nothing sink for client-streaming and a
    do-nothing source for server-streaming (the transport ceiling). Started once per size, so that its runs can
    alternate with the shuffler's in one invocation; a context manager."""

    def __init__(self, keys: Keys, max_msg: int, workdir: Path, *, heap_tuning: bool) -> None:
        import grpc

        from shuffledp.shuffler import shuffler_pb2_grpc as pb_grpc

        #: CPU seconds per run: (server submit, server fetch, client submit, client fetch)
        self.cpu: list[tuple[float, float, float, float]] = []
        port_file = workdir / "baseline.port"
        port_file.unlink(missing_ok=True)
        d = keys.d
        self.proc = subprocess.Popen([sys.executable, "-c", _BASELINE_SERVER, str(d.ca_cert), str(d.shuffler_cert),
                                      str(d.shuffler_tls_key), str(max_msg + 1024), str(port_file),
                                      "tuned" if heap_tuning else "default"])
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("baseline server did not start")
                time.sleep(0.05)
            port = int(port_file.read_text())
            creds = grpc.ssl_channel_credentials(root_certificates=keys.ca, private_key=keys.key,
                                                 certificate_chain=keys.cert)
            self.channel = grpc.secure_channel(
                f"127.0.0.1:{port}", creds,
                options=[("grpc.max_send_message_length", max_msg + 1024),
                         ("grpc.max_receive_message_length", max(max_msg + 1024, 2 * wire.PACKED_MESSAGE_BYTES))])
            self.stub = pb_grpc.ShufflerStub(self.channel)
            grpc.channel_ready_future(self.channel).result(timeout=10)
        except BaseException:
            self.close()
            raise

    def run(self, envs: EnvelopeFile) -> tuple[float, float]:
        """Seconds to client-stream the envelopes to the sink (one per message, as protobuf messages), and seconds
        to server-stream as many inner-sized items back from the source, packed as Fetch packs them and decoded
        as ``ShufflerClient.fetch`` decodes them: the transport's own cost in each direction. The CPU seconds of
        the sink/source process and of this client in each phase are appended to :attr:`cpu`
        (``(server submit, server fetch, client submit, client fetch)``)."""
        from shuffledp.shuffler import shuffler_pb2 as pb

        inner_length = envs.length - ENVELOPE_OVERHEAD + INNER_OVERHEAD
        me = os.getpid()
        s0, c0 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        t0 = time.perf_counter()
        resp = self.stub.Submit(pb.SubmitRequest(envelope=bytes(e)) for e in envs)
        t1 = time.perf_counter()
        s1, c1 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        raw_fetch = self.channel.unary_stream(FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString,
                                              response_deserializer=None)
        got = 0
        t2 = time.perf_counter()
        for raw in raw_fetch(pb.FetchRequest(batch_id=envs.count.to_bytes(8, "big") + inner_length.to_bytes(8, "big"))):
            for item in wire.decode_repeated_bytes_field(raw, 1) or []:
                got += len(item)
        t3 = time.perf_counter()
        s3, c3 = cpu_seconds(self.proc.pid), cpu_seconds(me)
        self.cpu.append((s1 - s0, s3 - s1, c1 - c0, c3 - c1))
        if int(resp.statement) != envs.count * envs.length:
            raise RuntimeError("baseline sink received the wrong number of bytes")
        if got != envs.count * inner_length:
            raise RuntimeError(f"baseline source sent {got} bytes, expected {envs.count * inner_length}")
        return t1 - t0, t3 - t2

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)

    def __enter__(self) -> "Baseline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _attached(argv: list[str], *, wait: float) -> Iterator[None]:
    """A profiler attached to the shuffler (``argv`` names its pid) for the duration of the block; it gets a
    second to attach first and SIGINT (write its output) at the end."""
    tracer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    try:
        yield
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(wait)


def strace_run(keys: Keys, proc: ShufflerProcess, envs: EnvelopeFile, round_id: int, digest: bytes, max_msg: int,
               out: Path) -> str:
    if shutil.which("strace") is None:
        return "strace not installed"
    with _attached(["strace", "-c", "-f", "-o", str(out), "-p", str(proc.pid)], wait=30):
        one_run(keys, proc, envs, round_id, digest, max_msg)
    return out.read_text() if out.exists() else "(no strace output)"


def perf_run(keys: Keys, proc: ShufflerProcess, envs: EnvelopeFile, round_id: int, digest: bytes, max_msg: int,
             out: Path) -> str:
    """``perf record`` the shuffler during one submit+fetch; returns the top DSOs and symbols by self time."""
    if shutil.which("perf") is None:
        return "perf not installed"
    data = out.with_suffix(".data")
    with _attached(["perf", "record", "-F", "499", "-g", "-o", str(data), "-p", str(proc.pid)], wait=60):
        one_run(keys, proc, envs, round_id, digest, max_msg)
    parts = []
    for sort in ("dso", "dso,symbol"):
        r = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", sort, "--stdio",
                            "-g", "none"],
                           capture_output=True, text=True, timeout=120)
        lines = [ln.rstrip() for ln in r.stdout.splitlines() if "%" in ln and not ln.lstrip().startswith("#")]
        parts.append(f"perf self time by {sort}:\n" + "\n".join(lines[:15]))
    return "\n".join(parts)


def core_breakdown(keys: Keys, cfg: Path, envs: EnvelopeFile, round_id: int, digest: bytes) -> str:
    """The same batch through the transport-free core in this process: time of add() (open, verify, stage)
    versus finish() (output digest over the whole batch, fsync, rename, sign, journal append)."""
    from shuffledp.shuffler.config import load_config
    from shuffledp.shuffler.core import Header
    from shuffledp.shuffler.service import core_from_config

    core = core_from_config(load_config(cfg))
    try:
        b = core.begin(Header(protocol_version=ENVELOPE_VERSION, key_epoch=0, round_id=round_id, model_digest=digest,
                              expected_count=envs.count))
        read = 0.0
        t_add = 0.0
        c0 = time.process_time()
        it = iter(envs)
        for _ in range(envs.count):
            t = time.perf_counter()
            e = next(it)
            t2 = time.perf_counter()
            b.add(e)
            t_add += time.perf_counter() - t2
            read += t2 - t
        c1 = time.process_time()
        t = time.perf_counter()
        sealed = b.finish()
        t_fin = time.perf_counter() - t
        c2 = time.process_time()
    finally:
        core.close()
    total = envs.count * envs.length / MB
    return (f"core only (no gRPC), {envs.count} x {envs.length} B: add() {t_add:.2f}s wall / {c1 - c0:.2f} CPU-s "
            f"({total / t_add:,.0f} MB/s), finish() {t_fin:.2f}s wall / {c2 - c1:.2f} CPU-s; "
            f"batch {sealed.batch_id.hex()[:8]} sealed")


def disk_write_probe(directory: Path, total: int, block: int = 2**20) -> dict[str, float]:
    """MB/s of making ``total`` fresh bytes durable in a new file in ``directory``, two ways:

    * ``buffered``: ``write`` into the page cache, then ``fdatasync`` (like ``dd conv=fdatasync``), also split
      into its two parts (``page-cache`` and ``fdatasync``): the first part is mostly the cost of faulting in
      fresh pages, which on a VM whose host reclaims idle guest memory can dominate;
    * ``direct``: ``O_DIRECT`` writes from one reused aligned buffer, then ``fdatasync`` (no page cache; what
      the shuffler's memory path does at seal), or absent where the filesystem refuses O_DIRECT.
    """
    import mmap

    out: dict[str, float] = {}
    buf = os.urandom(block)
    path = directory / "disk-probe.bin"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(total // block):
            os.write(fd, buf)
        t1 = time.perf_counter()
        os.fdatasync(fd)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        path.unlink()
    out["buffered"] = total / MB / (t2 - t0)
    out["page-cache"] = total / MB / (t1 - t0)
    out["fdatasync"] = total / MB / (t2 - t1)
    if hasattr(os, "O_DIRECT"):
        aligned = mmap.mmap(-1, block)
        aligned[:] = buf
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o600)
            try:
                t0 = time.perf_counter()
                for i in range(total // block):
                    os.pwrite(fd, aligned, i * block)
                os.fdatasync(fd)
                out["direct"] = total / MB / (time.perf_counter() - t0)
            finally:
                os.close(fd)
                path.unlink()
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # only "O_DIRECT refused" means no figure; anything else is an error
                raise
        finally:
            aligned.close()
    return out


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


def big_batch(keys: Keys, work: Path, n: int, envelope_bytes: int, ns: argparse.Namespace) -> str:
    """One batch of ``n`` small envelopes (``envelope_bytes`` each) through a real shuffler process: seconds to
    seal (untimed otherwise), submit and fetch, and the peak RSS of the shuffler and of this client in each phase.
    Returns the report line."""
    payload = envelope_bytes - ENVELOPE_OVERHEAD
    if payload < 1:
        raise SystemExit(f"--big-envelope-bytes must exceed the {ENVELOPE_OVERHEAD}-byte envelope overhead")
    digest = model_digest([b"bench-big"])
    t = time.perf_counter()
    envs = seal_many(keys, work, n, payload, 1, digest, workers=max(1, min(ns.seal_workers, os.cpu_count() or 1)))
    t_seal = time.perf_counter() - t
    print(f"# big batch: {n:,} envelopes of {envelope_bytes} B sealed in {t_seal:.0f} s (untimed)", flush=True)
    max_env = max(envelope_bytes, 1024)
    cfg = write_config(keys, work / "shuffler-big.toml", work / "journal-big", k=min(10, n), max_envelope=max_env,
                       max_reports=n, heap_tuning=not ns.no_heap_tuning, verify_threads=ns.verify_threads)
    with ShufflerProcess(cfg, root_certificate=keys.ca, client_certificate=keys.cert, client_key=keys.key,
                         startup_timeout=600.0) as proc:
        idle = vm_hwm(proc.pid)
        run = one_run(keys, proc, envs, 1, digest, max_env + 1024)
    envs.path.unlink()
    shutil.rmtree(work / "journal-big", ignore_errors=True)
    return (f"big batch: {n:,} reports of {envelope_bytes} B envelopes ({payload} B payloads) through the real "
            f"service: submit {run.t_submit:.1f} s ({n / run.t_submit:,.0f} reports/s), fetch {run.t_fetch:.1f} s, "
            f"together {run.t_submit + run.t_fetch:.1f} s; peak RSS of the shuffler "
            f"{fmt_bytes(run.shuffler_hwm_submit)} (submit) / {fmt_bytes(run.shuffler_hwm_fetch)} (fetch), idle after "
            f"start {fmt_bytes(idle)}; of this "
            f"client {fmt_bytes(run.client_hwm_submit)} / {fmt_bytes(run.client_hwm_fetch)}; shuffler CPU "
            f"{run.cpu_shuffler_submit:.1f} / {run.cpu_shuffler_fetch:.1f} s")


def fmt_bytes(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", type=int, default=1000)
    ap.add_argument("--sizes", default="100KiB,1MiB", help="comma-separated payload sizes")
    ap.add_argument("--repeat", type=int, default=2, help="runs per size (each a new round, freshly sealed)")
    ap.add_argument("--workdir", default=None, help="where keys, envelopes and the journal go (default: a tempdir)")
    ap.add_argument("--baseline", action="store_true", help="(the default) time plain gRPC after each run")
    ap.add_argument("--no-baseline", action="store_true",
                    help="do not time plain gRPC streaming to a sink and from a source (the transport ceiling) after "
                         "each shuffler run")
    ap.add_argument("--quick", action="store_true",
                    help="a short run: 300 reports per size, 3 runs each, no disk probe, a 20,000-report big batch")
    ap.add_argument("--big-batch", default="1000000",
                    help="reports in one batch of small envelopes through the real service, with time and peak "
                         "memory; several sizes comma-separated, each its own batch (0: skip)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed submit + fetch rounds per size before the timed ones (shuffler and plain gRPC)")
    ap.add_argument("--big-envelope-bytes", type=int, default=256, help="envelope length of the big batch")
    ap.add_argument("--seal-workers", type=int, default=2, help="processes that seal the big batch")
    ap.add_argument("--staging-memory-limit", default=None,
                    help="the shuffler's staging_memory_limit (e.g. 2GiB: batches up to that size are staged in "
                         "memory); default: the shuffler's own default, 1 GiB")
    ap.add_argument("--no-retain", action="store_true",
                    help="retain_staging_buffer = false (unmap the memory path's buffer after every batch)")
    ap.add_argument("--strace", action="store_true", help="strace -c the shuffler during one extra run per size")
    ap.add_argument("--disk-probe-mib", type=int, default=1024,
                    help="MiB for the fdatasync'ed disk write probe (0: skip); small probes can fit in a host cache")
    ap.add_argument("--core-breakdown", action="store_true",
                    help="also push one batch per size through the in-process core (no gRPC): add() vs finish()")
    ap.add_argument("--perf", action="store_true", help="perf record the shuffler during one extra run per size")
    ap.add_argument("--no-heap-tuning", action="store_true",
                    help="heap_tuning = false for the shuffler, and no shuffledp.shuffler.heap.tune_heap in this "
                         "client process (which stands in for the ServerApp, where the run config's heap-tuning "
                         "applies) or in the baseline's server: glibc's default thresholds, under which the heap's "
                         "top is trimmed after a megabyte message and faulted back in for the next")
    ap.add_argument("--verify-threads", type=int, default=None,
                    help="the shuffler's verify_threads (0: check signatures inline on the submit thread); "
                         "default: the shuffler's own default, 1")
    ns = ap.parse_args(argv)
    if ns.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--reports" not in given:
            ns.reports = 300
        if "--repeat" not in given:
            ns.repeat = 3
        if "--disk-probe-mib" not in given:
            ns.disk_probe_mib = 0
        if "--big-batch" not in given:
            ns.big_batch = "20000"
    sizes = [parse_size(s) for s in ns.sizes.split(",")]
    staging_limit = None if ns.staging_memory_limit is None else parse_size(ns.staging_memory_limit)
    if ns.reports < 1 or ns.repeat < 1 or not sizes:
        ap.error("--reports and --repeat must be >= 1")
    tmp = tempfile.TemporaryDirectory(prefix="bench-shuffler-", dir=ns.workdir)
    work = Path(tmp.name)
    print(f"# bench_shuffler: {ns.reports} reports per batch, sizes {ns.sizes}, {ns.repeat} run(s) each; "
          f"{os.cpu_count()} CPUs; workdir {work}; heap tuning {'off' if ns.no_heap_tuning else 'on'}; "
          f"load average {os.getloadavg()[0]:.2f}; staging_memory_limit "
          f"{'default (1 GiB)' if staging_limit is None else staging_limit}, retain_staging_buffer {not ns.no_retain}, "
          f"verify_threads {'default (1)' if ns.verify_threads is None else ns.verify_threads}",
          flush=True)
    max_env = max(sizes) + ENVELOPE_OVERHEAD
    max_msg = max_env + 1024
    if not ns.no_heap_tuning:  # this process plays the ServerApp, which tunes its heap (run config heap-tuning)
        from shuffledp.server.config import DEFAULTS
        from shuffledp.shuffler.heap import tune_heap
        print(f"# client: {tune_heap(DEFAULTS['max-message-bytes']).describe()} (the ServerApp's default)",
              flush=True)
    extra: list[str] = []
    keys = make_keys(work / "keys", ns.reports, max_env)
    if ns.disk_probe_mib > 0:
        probe = disk_write_probe(work, total=ns.disk_probe_mib * 2**20)
        direct = f"{probe['direct']:,.0f} MB/s" if "direct" in probe else "refused by the filesystem"
        extra.append(f"disk: {ns.disk_probe_mib} MiB made durable in the journal's filesystem: buffered write + "
                     f"fdatasync {probe['buffered']:,.0f} MB/s (write into fresh page cache {probe['page-cache']:,.0f} "
                     f"MB/s, then fdatasync {probe['fdatasync']:,.0f} MB/s); O_DIRECT write + fdatasync {direct}")
    digest = model_digest([b"bench-model"])
    rows: list[Run] = []
    transport: dict[int, list[tuple[float, float]]] = {}
    transport_cpu: dict[int, list[tuple[float, float, float, float]]] = {}
    round_id = 0
    try:
        for size in sizes:
            journal = work / f"journal-{size}"
            cfg = write_config(keys, work / f"shuffler-{size}.toml", journal, k=min(10, ns.reports),
                               max_envelope=max_env, max_reports=max(ns.reports, 1),
                               staging_memory_limit=staging_limit, retain_staging_buffer=not ns.no_retain,
                               heap_tuning=not ns.no_heap_tuning, verify_threads=ns.verify_threads)
            proc = ShufflerProcess(cfg, root_certificate=keys.ca, client_certificate=keys.cert, client_key=keys.key)
            proc.start()
            base = None if ns.no_baseline else Baseline(keys, max_msg, work, heap_tuning=not ns.no_heap_tuning)
            try:
                print(f"# shuffler pid {proc.pid} at {proc.address}; idle VmHWM {fmt_bytes(vm_hwm(proc.pid))}",
                      flush=True)
                for _ in range(ns.warmup):
                    round_id += 1
                    envs = seal_round(keys, work / "envelopes.bin", ns.reports, size, round_id, digest)
                    t = time.perf_counter()
                    one_run(keys, proc, envs, round_id, digest, max_msg)
                    warm = f"# size {size} warm-up (untimed): shuffler submit + fetch {time.perf_counter() - t:.2f}s"
                    if base is not None:
                        warm += f", plain gRPC {sum(base.run(envs)):.2f}s"
                        base.cpu.pop()
                    print(warm, flush=True)
                    shutil.rmtree(journal / "batches", ignore_errors=True)
                    (journal / "batches").mkdir(exist_ok=True)
                for rep in range(ns.repeat):
                    round_id += 1
                    t = time.perf_counter()
                    envs = seal_round(keys, work / "envelopes.bin", ns.reports, size, round_id, digest)
                    t_seal = time.perf_counter() - t
                    # next to each other, on the same envelopes, so that the ratio sees the same load; the order
                    # alternates (shuffler first in odd runs, plain gRPC first in even ones) so that a trend in the
                    # machine's load does not favour either
                    plain_first = base is not None and rep % 2 == 1
                    if plain_first:
                        tb, tf = base.run(envs)  # type: ignore[union-attr] - base is not None here
                    run = one_run(keys, proc, envs, round_id, digest, max_msg)
                    rows.append(run)
                    line = (f"# size {size} run {rep + 1}: seal {t_seal:.2f}s (untimed), submit {run.t_submit:.2f}s, "
                            f"fetch {run.t_fetch:.2f}s")
                    if base is not None:
                        if not plain_first:
                            tb, tf = base.run(envs)
                        transport.setdefault(size, []).append((tb, tf))
                        transport_cpu.setdefault(size, []).append(base.cpu[-1])
                        line += (f"; plain gRPC ({'before' if plain_first else 'after'}): submit {tb:.2f}s, "
                                 f"fetch {tf:.2f}s; ratio {(tb + tf) / (run.t_submit + run.t_fetch):.0%}")
                    print(line, flush=True)
                    shutil.rmtree(journal / "batches", ignore_errors=True)  # keep disk use bounded between runs
                    (journal / "batches").mkdir(exist_ok=True)
                if ns.core_breakdown:
                    round_id += 1
                    envs = seal_round(keys, work / "envelopes.bin", ns.reports, size, round_id, digest)
                    core_cfg = write_config(keys, work / f"core-{size}.toml", work / f"core-journal-{size}",
                                            k=min(10, ns.reports), max_envelope=max_env, max_reports=ns.reports)
                    extra.append(core_breakdown(keys, core_cfg, envs, round_id, digest))
                    shutil.rmtree(work / f"core-journal-{size}", ignore_errors=True)
                if ns.perf:
                    round_id += 1
                    envs = seal_round(keys, work / "envelopes.bin", ns.reports, size, round_id, digest)
                    text = perf_run(keys, proc, envs, round_id, digest, max_msg, work / f"perf-{size}.txt")
                    extra.append(f"perf of the shuffler, {size} B payloads, one submit+fetch:\n{text}")
                    shutil.rmtree(journal / "batches", ignore_errors=True)
                    (journal / "batches").mkdir(exist_ok=True)
                if ns.strace:
                    round_id += 1
                    envs = seal_round(keys, work / "envelopes.bin", ns.reports, size, round_id, digest)
                    text = strace_run(keys, proc, envs, round_id, digest, max_msg, work / f"strace-{size}.txt")
                    extra.append(f"strace -c -f of the shuffler, {size} B payloads, one submit+fetch:\n{text}")
                    shutil.rmtree(journal / "batches", ignore_errors=True)
                    (journal / "batches").mkdir(exist_ok=True)
            finally:
                if base is not None:
                    base.close()
                proc.stop()
        for n_big in (int(x) for x in str(ns.big_batch).split(",")):
            if n_big > 0:
                extra.append(big_batch(keys, work, n_big, ns.big_envelope_bytes, ns))
    finally:
        tmp.cleanup()

    print()
    header = ("| payload | reports | submit s | submit rep/s | submit MB/s | fetch s | fetch MB/s | together s | "
              "together MB/s | shuffler peak (submit/fetch) | client peak (submit/fetch) |")
    print(header)
    print("|" + "|".join(["---"] * (header.count("|") - 1)) + "|")
    for size in sizes:
        rs = [r for r in rows if r.size == size]
        for label, pick in (("median", statistics.median), ("best", min)):
            if len(rs) == 1 and label == "best":
                continue
            ts = pick([r.t_submit for r in rs])
            tf = pick([r.t_fetch for r in rs])
            tt = pick([r.t_submit + r.t_fetch for r in rs])
            r0 = rs[0]
            print(
                f"| {size // 1024} KiB ({label}) | {r0.n} | {ts:.2f} | {r0.n / ts:,.0f} | "
                f"{r0.env_bytes / MB / ts:,.0f} | "
                f"{tf:.2f} | {r0.inner_bytes / MB / tf:,.0f} | {tt:.2f} | {r0.env_bytes / MB / tt:,.0f} | "
                f"{fmt_bytes(max(r.shuffler_hwm_submit for r in rs))} / "
                f"{fmt_bytes(max(r.shuffler_hwm_fetch for r in rs))} | "
                f"{fmt_bytes(max(r.client_hwm_submit for r in rs))} / "
                f"{fmt_bytes(max(r.client_hwm_fetch for r in rs))} |"
            )
    print()
    print("CPU seconds per phase (median over runs; less sensitive than wall time to other load on the machine):")
    print("| payload | shuffler submit | shuffler fetch | client submit | client fetch | "
          "shuffler MB per CPU-s (submit) |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        rs = [r for r in rows if r.size == size]
        med = statistics.median
        css = med([r.cpu_shuffler_submit for r in rs])
        print(f"| {size // 1024} KiB | {css:.2f} | {med([r.cpu_shuffler_fetch for r in rs]):.2f} | "
              f"{med([r.cpu_client_submit for r in rs]):.2f} | {med([r.cpu_client_fetch for r in rs]):.2f} | "
              f"{rs[0].env_bytes / MB / css if css else float('inf'):,.0f} |")
    if transport_cpu:
        print()
        print("CPU seconds of plain gRPC over the same mTLS (medians): the sink/source process and this client")
        print("| payload | server submit | server fetch | client submit | client fetch | shuffler extra CPU-s "
              "(shuffler + client, submit + fetch) |")
        print("|---|---|---|---|---|---|")
        for size in sizes:
            rs = [r for r in rows if r.size == size]
            cpus = transport_cpu.get(size, [])
            if not cpus:
                continue
            med = statistics.median
            extra_cpu = med([r.cpu_shuffler_submit + r.cpu_shuffler_fetch + r.cpu_client_submit + r.cpu_client_fetch
                             - sum(c) for r, c in zip(rs, cpus)])
            print(f"| {size // 1024} KiB | " + " | ".join(f"{med([c[i] for c in cpus]):.2f}" for i in range(4))
                  + f" | {extra_cpu:+.2f} |")
    if transport:
        print()
        print("Against plain gRPC over the same mTLS, run right after each shuffler run on the same envelopes "
              "(client-stream to a sink, then server-stream from a source; medians; ratio = transport time over "
              "shuffler time, submit + fetch):")
        print("| payload | shuffler submit + fetch s | plain gRPC submit / fetch s | plain gRPC together MB/s | "
              "shuffler together MB/s | ratio of medians | ratio per pair, median [min, max] |")
        print("|---|---|---|---|---|---|---|")
        for size in sizes:
            rs = [r for r in rows if r.size == size]
            pairs = transport.get(size, [])
            if not pairs:
                continue
            med = statistics.median
            ts = med([r.t_submit + r.t_fetch for r in rs])
            tt = med([b + f for b, f in pairs])
            per = [(b + f) / (r.t_submit + r.t_fetch) for r, (b, f) in zip(rs, pairs)]
            mb = rs[0].env_bytes / MB
            tb, tf = med([b for b, _ in pairs]), med([f for _, f in pairs])
            print(f"| {size // 1024} KiB | {ts:.2f} | {tb:.2f} / {tf:.2f} | {mb / tt:,.0f} | {mb / ts:,.0f} | "
                  f"**{tt / ts:.0%}** | {med(per):.0%} [{min(per):.0%}, "
                  f"{max(per):.0%}] |")
    for line in extra:
        print()
        print(line)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
