"""Benchmark: sealed reports through a real shuffler process, submit + fetch over mTLS on loopback.

For each report size (default 100 KiB and 1 MiB payloads) and each repetition this script

1. seals ``--reports`` envelopes (one per enrolled client) for a fresh round, into a file (not timed);
2. submits them to a real ``shuffledp.shuffler.process.ShufflerProcess`` (one per size, serving all repetitions of that
   size; mTLS, 127.0.0.1, port 0, journal in a temporary directory under ``--workdir``);
3. times ``ShufflerClient.submit`` (client-streaming, envelopes read from the file one at a time, the envelope
   length announced in the header as the ServerApp announces it) and
   ``ShufflerClient.fetch`` (server-streaming; the client checks lengths, count and the attested output
   digest, as the ServerApp does) separately;
4. reads the peak resident memory (``VmHWM``) of the shuffler process and of this client process from
   ``/proc/<pid>/status``; the peak is reset (``echo 5 > /proc/<pid>/clear_refs``) before each phase, so each
   figure is the peak of that phase.

MB/s uses MB = 10^6 bytes of envelope (submit) or inner ciphertext (fetch); "together" is the envelope bytes
over submit + fetch time. The goal is >= 300 MB/s together on a 2-core machine.

Before the runs it writes ``--disk-probe-mib`` (default 1 GiB) to the journal's filesystem and fdatasyncs it:
the shuffler journals and fsyncs every batch before acknowledging it, so that rate bounds submit for a batch of
that size. ``--core-breakdown`` pushes a batch per size through the in-process core (no gRPC; after an untimed
one that faults its staging buffer in) and splits add_many (open, verify, stage; CPU per report) from finish()
(output digest, fsync, sign, journal).

Next to each shuffler run, plain gRPC over the same mTLS credentials and message limits streams the same envelopes
to a do-nothing servicer in a child process and as many inner-sized items back from it (the transport on this
machine, unless ``--no-baseline``). Both directions carry the shuffler's own messages (envelopes packed as
``ShufflerClient`` packs them, items as Fetch packs them) as raw bytes, so the sink and the source do nothing per
message that gRPC does not: a baseline that built protobuf objects per message, or sent one envelope per message,
would be slower than the transport and flatter the ratio. The plain pair runs after the shuffler run in odd
runs and before it in even ones, so that both see the same load of a shared machine and a trend in that load
favours neither. The summary gives transport time over shuffler time
(submit + fetch): the ratio of the medians, and the median and minimum of the pairs; and the CPU seconds of both
(the plain server and this client) per phase. Each run also prints the shuffler's own figures for its seal (its
``Stats``: the commit, and of it the output's durable write), and the summary gives the ratio per pair with that
write taken out of the shuffler's time: what exactly-once costs against the transport on this disk (the shuffler
has no mode without the write).

``--warmup`` (default 1) untimed submit + fetch rounds per size come first, for the shuffler and the plain server
alike: a fresh shuffler faults in its staging buffer at its first memory-path batch (about 2.5 ms per MB on this
VM; the buffer is then kept for the next batches), which is a start-up cost, not the throughput.

``--big-batch N[,N...]`` (default 1,000,000; 0 skips it) then pushes one batch of N small envelopes
(``--big-envelope-bytes``, default 256) of N freshly enrolled clients through a real shuffler process and reports
its submit and fetch time and the peak RSS of the shuffler and of this client; sealing them (``--seal-workers``
processes) is not timed. ``--quick``: 300 reports per size, 3 runs, no disk probe, a 20,000-report big batch.
``--strace`` attaches ``strace -c -f`` to the shuffler during one extra submit+fetch (syscall time, e.g. fsync);
``--perf`` records it with ``perf record -g`` and prints where its CPU time goes (by library and symbol).

``--pin CLIENT/SERVER`` (CPU lists, e.g. ``0/1``) runs this client on the CPUs before the slash and the shuffler and
the plain server on those after it, as if each side had its own machine of that many cores. Unpinned, both
servers share every core with the client, so the ratio also depends on how the scheduler places the threads of
each pair (plain gRPC's submit varies about twofold between runs here); pinned, each server has its cores to
itself and the ratio compares what each costs on them.

Usage::

    python benchmarks/bench_shuffler.py --quick              # a few minutes
    python benchmarks/bench_shuffler.py --reports 1000 --sizes 100KiB,1MiB --repeat 3 --disk-probe-mib 0
    python benchmarks/bench_shuffler.py --reports 200 --sizes 1MiB --repeat 1 --big-batch 0 --core-breakdown --perf
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from shuffler_probes import check_seconds, core_breakdown, disk_write_probe, perf_run, strace_run
from shuffler_runs import (
    MB,
    Keys,
    Run,
    fmt_bytes,
    make_keys,
    one_run,
    parse_size,
    seal_many,
    seal_round,
    vm_hwm,
    write_config,
)
from shuffler_transport import Baseline

from shuffledp.shuffler.config import default_verify_threads
from shuffledp.shuffler.envelope import ENVELOPE_OVERHEAD, INNER_OVERHEAD, model_digest
from shuffledp.shuffler.process import ShufflerProcess


def at_most(pair: tuple[float, float], cpu: tuple[float, float, float, float], write: float, checks_cpu: float,
            total_cpus: int, server_cpus: int) -> float:
    """The highest transport-to-shuffler ratio a shuffler could reach next to one plain gRPC pair, given that it
    moves the same bytes and also needs ``checks_cpu`` CPU seconds for its checks and ``write`` seconds for the
    durable write of the whole output, once the last report is in, before it answers. ``pair`` is the plain
    (submit, fetch) seconds, ``cpu`` its (server submit, server fetch, client submit, client fetch) CPU seconds.
    Its submit takes at least the plain submit's time, the plain submit's CPU plus the checks' over
    ``total_cpus``, and the server's share over ``server_cpus``; then the write; its fetch at least the plain
    fetch. Returns plain time over that least time."""
    tb, tf = pair
    submit = max(tb, (cpu[0] + cpu[2] + checks_cpu) / total_cpus, (cpu[0] + checks_cpu) / server_cpus)
    return (tb + tf) / (submit + write + tf)


def parse_pin(text: str) -> tuple[set[int], set[int]]:
    """``--pin CLIENT/SERVER``: two comma-separated lists of CPU numbers, each non-empty and within this process's
    allowed CPUs. Returns ``(client CPUs, server CPUs)``; raises ValueError saying what was wrong."""
    allowed = os.sched_getaffinity(0)
    parts = text.split("/")
    if len(parts) != 2:
        raise ValueError(f"--pin takes CLIENT/SERVER CPU lists such as 0/1, got {text!r}")
    sets = []
    for side, part in zip(("client", "server"), parts):
        try:
            cpus = {int(c) for c in part.split(",") if c.strip()}
        except ValueError:
            raise ValueError(f"--pin: the {side} CPUs must be comma-separated integers, got {part!r}") from None
        if not cpus or not cpus <= allowed:
            raise ValueError(f"--pin: the {side} CPUs must be a non-empty subset of this process's CPUs "
                             f"{sorted(allowed)}, got {part!r}")
        sets.append(cpus)
    return sets[0], sets[1]


def pin_threads(cpus: set[int]) -> None:
    """Put every thread of this process on ``cpus``. Affinity belongs to each thread (a new thread, or a process it
    forks, inherits its creator's), so gRPC's background threads, started when this process opens its first
    channel, would otherwise keep whatever CPUs their creator had then."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


@contextlib.contextmanager
def spawning_on(cpus: set[int] | None) -> Iterator[None]:
    """Within the block the calling thread runs on ``cpus`` (None: unchanged), so that the processes it starts
    there inherit them; afterwards every thread of this process, including any started within the block, returns
    to the CPUs the calling thread had."""
    if cpus is None:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        pin_threads(own)


@contextlib.contextmanager
def started_on(proc: ShufflerProcess, cpus: set[int] | None) -> Iterator[ShufflerProcess]:
    """``proc`` started on ``cpus`` (None: unpinned) for the duration of the block, then stopped and its
    temporary directory removed."""
    with spawning_on(cpus):
        proc.__enter__()
    try:
        yield proc
    finally:
        proc.__exit__(None, None, None)


def big_batch(keys: Keys, work: Path, n: int, envelope_bytes: int, ns: argparse.Namespace,
              server_cpus: set[int] | None = None) -> str:
    """One batch of ``n`` small envelopes (``envelope_bytes`` each) through a real shuffler process (started on
    ``server_cpus``, None: unpinned): seconds to
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
    proc = ShufflerProcess(cfg, root_certificate=keys.ca, client_certificate=keys.cert, client_key=keys.key,
                           startup_timeout=600.0)
    with started_on(proc, server_cpus):
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
                    help="also push a batch per size through the in-process core (no gRPC), after an untimed "
                         "one: add_many (CPU per report) vs finish()")
    ap.add_argument("--perf", action="store_true", help="perf record the shuffler during one extra run per size")
    ap.add_argument("--no-heap-tuning", action="store_true",
                    help="heap_tuning = false for the shuffler, and no shuffledp.shuffler.heap.tune_heap in this "
                         "client process (which stands in for the ServerApp, where the run config's heap-tuning "
                         "applies) or in the baseline's server: glibc's default thresholds, under which the heap's "
                         "top is trimmed after a megabyte message and faulted back in for the next")
    ap.add_argument("--verify-threads", type=int, default=None,
                    help="the shuffler's verify_threads (0: open and check reports inline on the submit thread); "
                         "default: the shuffler's own default (the CPUs less two, 0 to 2)")
    ap.add_argument("--pin", default=None, metavar="CLIENT/SERVER",
                    help="CPU lists, e.g. 0/1: this client on the first, the shuffler and the plain server on the "
                         "second (default: unpinned, every process on every CPU)")
    ns = ap.parse_args(argv)
    try:
        client_cpus, server_cpus = parse_pin(ns.pin) if ns.pin is not None else (None, None)
    except ValueError as exc:
        ap.error(str(exc))
    # the CPUs the runs may use in all, and those the shuffler (or the plain server) may use
    total_cpus = len(os.sched_getaffinity(0) if client_cpus is None else client_cpus | server_cpus)
    server_cpu_count = total_cpus if server_cpus is None else len(server_cpus)
    if client_cpus is not None:  # for the rest of this process's life
        pin_threads(client_cpus)
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
          f"verify_threads {ns.verify_threads if ns.verify_threads is not None else default_verify_threads()}"
          f"{' (default)' if ns.verify_threads is None else ''}; "
          + ("unpinned" if client_cpus is None else
             f"pinned: this client on CPUs {sorted(client_cpus)}, the servers on {sorted(server_cpus)}"),
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
    #: per size, the least CPU seconds per report of the checks' primitives (shuffler_probes.check_seconds)
    checks: dict[int, float] = {}
    round_id = 0
    try:
        for size in sizes:
            if not ns.no_baseline:
                costs = check_seconds(size + INNER_OVERHEAD)
                checks[size] = sum(costs.values())
                print(f"# size {size}: least CPU per report of the checks' primitives, each alone in a loop: "
                      + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in costs.items())
                      + f"; {checks[size] * 1e6:.1f} us in all", flush=True)
            journal = work / f"journal-{size}"
            cfg = write_config(keys, work / f"shuffler-{size}.toml", journal, k=min(10, ns.reports),
                               max_envelope=max_env, max_reports=max(ns.reports, 1),
                               staging_memory_limit=staging_limit, retain_staging_buffer=not ns.no_retain,
                               heap_tuning=not ns.no_heap_tuning, verify_threads=ns.verify_threads)
            proc = ShufflerProcess(cfg, root_certificate=keys.ca, client_certificate=keys.cert, client_key=keys.key)
            with spawning_on(server_cpus):
                proc.start()
                base = None if ns.no_baseline else Baseline(keys, max_env, work, heap_tuning=not ns.no_heap_tuning)
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
                    line = (f"# size {size} run {rep + 1}: seal {t_seal:.2f}s (untimed), submit {run.t_submit:.2f}s "
                            f"(its commit {run.t_commit:.2f}s, of which the output's durable write "
                            f"{run.t_commit_write:.2f}s), fetch {run.t_fetch:.2f}s")
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
                    rounds = []
                    for name in ("warm", "timed"):
                        round_id += 1
                        rounds.append((round_id, seal_round(keys, work / f"envelopes-{name}.bin", ns.reports, size,
                                                            round_id, digest)))
                    core_cfg = write_config(keys, work / f"core-{size}.toml", work / f"core-journal-{size}",
                                            k=min(10, ns.reports), max_envelope=max_env, max_reports=ns.reports,
                                            verify_threads=ns.verify_threads)
                    extra.append(core_breakdown(keys, core_cfg, rounds, digest))
                    for _, envs in rounds:
                        envs.path.unlink()
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
                extra.append(big_batch(keys, work, n_big, ns.big_envelope_bytes, ns, server_cpus))
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
              "(shuffler + client, submit + fetch) | shuffler submit less the sink's, per report |")
        print("|---|---|---|---|---|---|---|")
        for size in sizes:
            rs = [r for r in rows if r.size == size]
            cpus = transport_cpu.get(size, [])
            if not cpus:
                continue
            med = statistics.median
            extra_cpu = med([r.cpu_shuffler_submit + r.cpu_shuffler_fetch + r.cpu_client_submit + r.cpu_client_fetch
                             - sum(c) for r, c in zip(rs, cpus)])
            # what opening, checking, staging and sealing cost the server per report, beyond receiving it
            per_report = med([r.cpu_shuffler_submit - c[0] for r, c in zip(rs, cpus)]) / rs[0].n
            print(f"| {size // 1024} KiB | " + " | ".join(f"{med([c[i] for c in cpus]):.2f}" for i in range(4))
                  + f" | {extra_cpu:+.2f} | {per_report * 1e6:+,.0f} us |")
    if transport:
        print()
        print("Against plain gRPC over the same mTLS, run right after each shuffler run on the same envelopes "
              "(client-stream to a sink, then server-stream from a source; medians; ratio = transport time over "
              "shuffler time, submit + fetch):")
        print("| payload | shuffler submit + fetch s | plain gRPC submit / fetch s | plain gRPC together MB/s | "
              "shuffler together MB/s | ratio of medians | ratio per pair, median [min, max] | durable write s | "
              "ratio per pair less the write | ratio at most |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for size in sizes:
            rs = [r for r in rows if r.size == size]
            pairs = transport.get(size, [])
            if not pairs:
                continue
            med = statistics.median
            ts = med([r.t_submit + r.t_fetch for r in rs])
            tt = med([b + f for b, f in pairs])
            per = [(b + f) / (r.t_submit + r.t_fetch) for r, (b, f) in zip(rs, pairs)]
            # what the seal's durable write costs: the same ratio with it taken out of the shuffler's time (the
            # shuffler has no mode without it; exactly-once needs the output on disk before Submit answers)
            less = [(b + f) / (r.t_submit + r.t_fetch - r.t_commit_write) for r, (b, f) in zip(rs, pairs)]
            bound = [at_most(pair, cpu, r.t_commit_write, r.n * checks[size], total_cpus, server_cpu_count)
                     for r, pair, cpu in zip(rs, pairs, transport_cpu[size])]
            mb = rs[0].env_bytes / MB
            tb, tf = med([b for b, _ in pairs]), med([f for _, f in pairs])
            print(f"| {size // 1024} KiB | {ts:.2f} | {tb:.2f} / {tf:.2f} | {mb / tt:,.0f} | {mb / ts:,.0f} | "
                  f"**{tt / ts:.0%}** | {med(per):.0%} [{min(per):.0%}, "
                  f"{max(per):.0%}] | {med([r.t_commit_write for r in rs]):.3f} | {med(less):.0%} | "
                  f"{med(bound):.0%} [{min(bound):.0%}, {max(bound):.0%}] |")
        print("ratio at most, per pair (median [min, max]): the transport's time over the least a shuffler could "
              "take next to it on these CPUs if it keeps every check and writes the output whole before it answers: "
              "the plain submit's CPU (sink and client) plus the checks' primitives spread perfectly over the CPUs "
              "(and the sink's plus the checks' over the server's CPUs), then this shuffler's durable write, then "
              "the plain fetch")
    for line in extra:
        print()
        print(line)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
