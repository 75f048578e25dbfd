"""Optional probes of ``bench_shuffler.py``: ``strace -c`` and ``perf record`` of the shuffler during one run, the
in-process core's add/finish split, the journal filesystem's write + fdatasync rate, and the least CPU time the
checks need per report."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shuffler_runs import MB, EnvelopeFile, Keys, one_run

from shuffledp.shuffler import wire
from shuffledp.shuffler.envelope import ENVELOPE_VERSION
from shuffledp.shuffler.process import ShufflerProcess


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


def core_breakdown(keys: Keys, cfg: Path, rounds: list[tuple[int, EnvelopeFile]], digest: bytes) -> str:
    """Batches through the transport-free core in this process, one per ``(round_id, envelopes)``: the first
    untimed (it faults the staging buffer in, which the core then keeps), the last timed. Envelopes are read from
    their file first and handed to ``add_many`` in the groups a 1 MiB Submit message holds, as the service hands
    them; the time of add_many (open, verify, stage) is split from that of finish() (output digest, write,
    fsync, rename, sign, journal)."""
    from shuffledp.shuffler.config import load_config
    from shuffledp.shuffler.core import Header
    from shuffledp.shuffler.service import core_from_config

    core = core_from_config(load_config(cfg))
    try:
        for round_id, envs in rounds:
            b = core.begin(Header(protocol_version=ENVELOPE_VERSION, key_epoch=0, round_id=round_id,
                                  model_digest=digest, expected_count=envs.count, envelope_length=envs.length))
            t_add = c_add = 0.0
            for group in wire.packed(iter(envs), wire.PACKED_MESSAGE_BYTES):
                group = [bytes(e) for e in group]
                t, c = time.perf_counter(), time.process_time()
                b.add_many(group)
                t_add += time.perf_counter() - t
                c_add += time.process_time() - c
            t, c = time.perf_counter(), time.process_time()
            sealed = b.finish()
            t_fin, c_fin = time.perf_counter() - t, time.process_time() - c
    finally:
        core.close()
    total = envs.count * envs.length / MB
    return (f"core only (no gRPC), {envs.count} x {envs.length} B, after {len(rounds) - 1} untimed batch(es): "
            f"add_many {t_add:.2f}s wall / {c_add:.2f} CPU-s ({total / t_add:,.0f} MB/s, "
            f"{c_add / envs.count * 1e6:,.0f} us of CPU per report), finish() {t_fin:.2f}s wall / {c_fin:.2f} CPU-s; "
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


def check_seconds(inner_length: int, *, trials: int = 5) -> dict[str, float]:
    """The least CPU seconds per report of the work every check needs, each primitive timed in a loop on its own
    in this process with its data in cache (best of ``trials`` loops), with the fastest implementation installed:

    - ``x25519``: the outer HPKE open's Diffie-Hellman (libsodium or OpenSSL, whichever is faster here);
    - ``ed25519``: the report signature's verification (libsodium or OpenSSL);
    - ``aes-gcm``: decrypting the outer layer's plaintext (head and inner ciphertext), OpenSSL one-shot;
    - ``blake3``: the hash of the inner ciphertext that the signature and the attested output digest cover.

    A lower bound on what a shuffler that keeps every check spends per report beyond receiving it: no staging,
    no bookkeeping, caches warm."""
    import blake3
    import nacl.bindings
    from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from shuffledp.shuffler.envelope import OUTER_HEAD_BYTES

    def best(fn: Any, loops: int) -> float:
        fn()
        runs = []
        for _ in range(trials):
            t = time.thread_time()  # this thread's CPU time: a preemption would otherwise count as cost
            for _ in range(loops):
                fn()
            runs.append((time.thread_time() - t) / loops)
        return min(runs)

    loops = max(20, min(500, (64 * 2**20) // max(inner_length, 1)))
    sk = x25519.X25519PrivateKey.generate()
    peer = x25519.X25519PrivateKey.generate().public_key().public_bytes_raw()
    raw_sk = sk.private_bytes_raw()
    signer = ed25519.Ed25519PrivateKey.generate()
    signer_pk = signer.public_key().public_bytes_raw()
    message = os.urandom(120)  # the signed statement's size: binding, report id, length, hash
    signature = signer.sign(message)
    key, nonce = os.urandom(16), os.urandom(12)
    aead = AESGCM(key)
    sealed = aead.encrypt(nonce, os.urandom(OUTER_HEAD_BYTES + inner_length), None)
    out = bytearray(OUTER_HEAD_BYTES + inner_length)
    inner = memoryview(out)[OUTER_HEAD_BYTES:]
    return {
        "x25519": min(best(lambda: nacl.bindings.crypto_scalarmult(raw_sk, peer), 500),
                      best(lambda: sk.exchange(x25519.X25519PublicKey.from_public_bytes(peer)), 500)),
        "ed25519": min(best(lambda: nacl.bindings.crypto_sign_open(signature + message, signer_pk), 500),
                       best(lambda: ed25519.Ed25519PublicKey.from_public_bytes(signer_pk).verify(signature, message),
                            500)),
        "aes-gcm": best(lambda: aead.decrypt_into(nonce, sealed, None, out), loops),
        "blake3": best(lambda: blake3.blake3(inner).digest(), loops),
    }
