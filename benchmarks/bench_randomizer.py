"""Benchmark the client randomizer: clip + grid + integer projection + exact discrete Laplace noise + encode.

Usage: python benchmarks/bench_randomizer.py [--repeats 7] [--dims 10000 100000 1000000] [--eps0 1.0]

Prints one row per dimension: median and best wall time of the full ``DiscreteLaplaceRandomizer.encode`` and of
its parts (quantize = clip + round + project; noise = exact sampler incl. CSPRNG; encode = int32 packing), and
the throughput of the noise in samples/s. Goal: full randomizer <= 100 ms at d = 1e6. The one-off table build
(cached per noise parameter) is reported separately.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from shuffledp.clients.noise import ChaCha20Rng, DiscreteLaplaceSampler
from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer
from shuffledp.clients.report import encode_report


def _time(fn, repeats: int) -> tuple[float, float, float]:
    """(median wall, best wall, median CPU time of this process) in seconds.

    CPU time is reported too because the benchmark machine may be shared: it excludes time spent waiting
    for the CPU while other processes run."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), min(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dims", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--eps0", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    args = ap.parse_args()

    t = time.perf_counter()
    r = DiscreteLaplaceRandomizer(args.eps0, args.clip)
    build = time.perf_counter() - t
    rng = ChaCha20Rng()
    rng.random_bytes(64 << 20)  # warm-up: allocate the buffers
    t = time.perf_counter()
    rng.random_bytes(64 << 20)
    chacha = 64 / (time.perf_counter() - t)
    print(f"randomizer: {r!r}")
    print(f"noise: exact discrete Laplace, scale {r.sampler.scale:.4g} grid units, "
          f"{r.sampler.n_digits} truncated base-256 digits + geometric top digit")
    print(f"one-off table build: {build * 1e3:.0f} ms; ChaCha20 keystream: {chacha:.0f} MiB/s; "
          f"cpus: {os.cpu_count()}, load avg: {os.getloadavg()[0]:.2f}")
    print()
    hdr = (f"{'d':>9} | {'full med':>9} {'full min':>9} {'full cpu':>9} | {'quantize':>9} {'noise':>9} "
           f"{'encode':>9} | {'Msamples/s':>10}")
    print(hdr)
    print("-" * len(hdr))
    gen = np.random.default_rng(0)  # benchmark input only
    for d in args.dims:
        x = gen.standard_normal(d)
        full_med, full_min, full_cpu = _time(lambda: r.encode(x), args.repeats)
        q_med, _, _ = _time(lambda: r.quantize(x), args.repeats)
        sampler: DiscreteLaplaceSampler = r.sampler
        n_med, n_min, _ = _time(lambda: sampler.sample(d, r.rng), args.repeats)
        y = r.privatize(x)
        e_med, _, _ = _time(lambda: encode_report(y, log2_grid=r.log2_grid, eps_used=r.eps_used), args.repeats)
        print(f"{d:>9} | {full_med * 1e3:>7.1f}ms {full_min * 1e3:>7.1f}ms {full_cpu * 1e3:>7.1f}ms | "
              f"{q_med * 1e3:>7.1f}ms {n_med * 1e3:>7.1f}ms {e_med * 1e3:>7.1f}ms | {d / n_min / 1e6:>10.1f}")
    print()
    print("'full' = clip + grid + projection + exact noise + encode (one report): median and best wall time,")
    print("median process CPU time; quantize/noise/encode are median wall times of the parts")


if __name__ == "__main__":
    main()
