"""Round wall time of the real Flower simulation: the shuffled product vs. a labelled no-shuffle baseline.

Issue 4's benchmark point: "round wall time at 100 and 1,000 clients with the shuffler vs. a labelled
no-shuffle baseline (plain noisy reports averaged, not private against the server) — overhead goal <= 10% at
1,000".

* shuffled: the product exactly as ``shuffledp run --clients N --rounds R`` runs it (``shuffledp.deploy.runner.main``:
  fresh keys, private SuperLink, ``flwr run`` of this repository, local shuffler process), with
  ``budget-epsilon=inf`` so that a small N is not stopped by the budget (accounting still runs every round).
* baseline: ``benchmarks/noshuffle_app`` (NOT PRIVATE AGAINST THE SERVER), launched with the same helpers
  (``shuffledp.deploy.runner._launch``: same SuperLink, env vars, ``flwr run`` command and federation config
  ``num-supernodes=N client-resources-num-cpus=1``) and the same run config. Its clients do the same work
  (partition, model, clip, exact discrete Laplace, encoding) and reply with the plain encoded report.

Round wall time = the sum of the server's own per-round phase timings (``RoundOutcome.seconds`` from the run's
``state.sqlite`` checkpoint history for the product, ``baseline_rounds.json`` for the baseline): from the start of
node selection to the end of central evaluation, same boundaries in both. Not included in either: the product's
per-round checkpoint / report writes after evaluation. Round 1 is excluded (Ray actor start-up and the first-round
3 s node settle dominate it; its times are printed). The product streams each poll's envelopes to the shuffler while
it collects (``shuffledp.server.rounds``), so the shuffler's verification is inside ``collect`` and ``submit`` is
only the end of the stream (seal, fsync, attestation). Seal runs inside the clients (part of ``collect``); its cost
is estimated by a microbenchmark: N x t_seal / 2 actors.

Configurations are interleaved A B A B ... (``--repeats``) so that background load hits both equally.

``--paired`` (recommended): whole launches of Flower's simulation land on different speed levels (one baseline
launch ran 7.2-7.7 s rounds, the next 9.2-9.9 s), which swamps a 10% effect when whole launches are alternated. With
``--paired`` each launch runs the benchmark app in paired mode: every product round
(``shuffledp.server.job.run_job``: shuffler, accountant, ledger, checkpoint) is followed by one plain round on the
same nodes, and the overhead is computed over these pairs (mean ratio with a bootstrap 90% interval, and the median
of per-pair ratios).
``--plain-seal`` (with ``--paired``) makes the plain clients also seal and discard their report, which isolates
the server side's share.

Run: ``python benchmarks/bench_round_overhead.py [--clients 100 1000] [--rounds 3] [--repeats 2]``, or
``python benchmarks/bench_round_overhead.py --paired --clients 1000 --rounds 6 --repeats 3``.
Run outputs go to ``outputs/bench-round-overhead-<UTC>/`` (``--out``); every SuperLink/Ray process started is
stopped by the runner's helpers after each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shuffledp.deploy import runner as runner
from shuffledp.deploy.flower import run_config_arg

ROOT = Path(__file__).resolve().parent.parent
BASELINE_APP = Path(__file__).resolve().parent / "noshuffle_app"

COMMON = {"budget-epsilon": float("inf")}  # both systems; a small N must not be stopped by the budget


def run_shuffled(n: int, rounds: int, out: Path, name: str, log: Path) -> list[dict[str, Any]]:
    """``shuffledp run --clients n --rounds rounds`` in-process; per-round outcomes from its checkpoint."""
    from shuffledp.server.state import SqliteCheckpointStore

    os.environ["SHUFFLEDP_FLWR_HOME"] = str(out / f".flwr-{name}")
    argv = ["run", "--clients", str(n), "--rounds", str(rounds), "--run-name", name, "--output-dir", str(out)]
    argv += ["--run-config", run_config_arg(COMMON)]
    with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        code = runner.main(argv)
    if code != 0:
        raise RuntimeError(f"shuffledp run failed (exit {code}); see {log} and {out / name}")
    store = SqliteCheckpointStore(out / name / "state.sqlite")
    try:
        ckpt = store.load()
    finally:
        store.close()
    rows = [h for h in ckpt.history if h["status"] == "applied"]
    if len(rows) != rounds or any(h["n_reports"] != n for h in rows):
        raise RuntimeError(f"shuffled run {name}: not every round applied all {n} reports: {ckpt.history}")
    return rows


def run_baseline(n: int, rounds: int, out: Path, name: str, log: Path) -> list[dict[str, Any]]:
    """The no-shuffle baseline app (NOT PRIVATE AGAINST THE SERVER) through the runner's launch helpers."""
    from shuffledp.server.config import DEFAULTS

    out_dir = out / name
    out_dir.mkdir(parents=True, exist_ok=True)
    run_config = {"num-server-rounds": rounds, "min-reports": min(int(DEFAULTS["min-reports"]), n),
                  "output-dir": str(out), "run-name": name, **COMMON}
    spec = {"clients": n, "run_config": run_config, "project": str(BASELINE_APP)}
    with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        code = runner._launch(BASELINE_APP, out_dir, spec, flwr_home=out / f".flwr-{name}")
    doc = json.loads((out_dir / "baseline_rounds.json").read_text())
    if code != 0 or not doc.get("finished"):
        raise RuntimeError(f"baseline run failed (flwr exit {code}); see {log}")
    rows = doc["rounds"]
    if any(r["n_reports"] != n for r in rows):
        raise RuntimeError(f"baseline run {name}: a round lacked reports: {rows}")
    return rows


def run_paired(n: int, rounds: int, out: Path, name: str, log: Path, *,
               plain_seal: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One launch of the benchmark app in paired mode: the product's rounds (``shuffledp.server.job.run_job``, with the
    shuffler and the accountant), each followed by one plain round (NOT PRIVATE) on the same nodes. Returns
    (product rounds, plain rounds) as per-round dicts with ``seconds``."""
    from shuffledp.server.config import DEFAULTS
    from shuffledp.server.state import SqliteCheckpointStore
    from shuffledp.shuffler import cli as shuffler_cli

    out_dir = out / name
    out_dir.mkdir(parents=True, exist_ok=True)
    k = min(int(DEFAULTS["min-reports"]), n)
    keys = out_dir / "keys"
    with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        if shuffler_cli.main(["keys", "init", "--out", str(keys), "--clients", str(n), "--k", str(k)]) != 0:
            raise RuntimeError(f"keys init failed; see {log}")
        run_config = {"num-server-rounds": rounds, "min-reports": k, "output-dir": str(out), "run-name": name,
                      "keys-dir": str(keys), "paired-benchmark": True, "paired-plain-seal": plain_seal, **COMMON}
        code = runner._launch(BASELINE_APP, out_dir, {"clients": n, "run_config": run_config,
                                                     "project": str(BASELINE_APP)}, flwr_home=out / f".flwr-{name}")
    doc = json.loads((out_dir / "paired_rounds.json").read_text())
    if code != 0 or not doc.get("finished"):
        raise RuntimeError(f"paired run failed (flwr exit {code}); see {log}")
    store = SqliteCheckpointStore(out_dir / "state.sqlite")
    try:
        product = [h for h in store.load().history if h["status"] == "applied"]
    finally:
        store.close()
    plain = doc["plain_rounds"]
    if len(product) != rounds or len(plain) != rounds or any(r["n_reports"] != n for r in product + plain):
        raise RuntimeError(f"paired run {name}: not every round used all {n} reports")
    return product, plain


def paired_main(args: argparse.Namespace, out: Path) -> int:
    """``--paired``: alternate product and plain rounds inside each launch and compare them pairwise."""
    import numpy as np

    for n in args.clients:
        pairs: list[tuple[float, float]] = []
        for rep in range(args.repeats):
            name = f"paired-n{n}-r{rep}"
            t0 = time.monotonic()
            product, plain = run_paired(n, args.rounds, out, name, out / f"{name}.log", plain_seal=args.plain_seal)
            tp = [sum(r["seconds"].values()) for r in product]
            tb = [sum(r["seconds"].values()) for r in plain]
            pairs.extend(zip(tp[1:], tb[1:]))  # round 1 of each: Ray start-up / first-round settle
            print(f"... {name}: product {', '.join(f'{t:.2f}' for t in tp)} s | "
                  f"plain {', '.join(f'{t:.2f}' for t in tb)} s (whole launch {time.monotonic() - t0:.0f} s)",
                  flush=True)
            (out / f"paired-{n}.json").write_text(json.dumps({"pairs": pairs}, indent=1) + "\n")
        a = np.array(pairs)
        ratio = a[:, 0] / a[:, 1] - 1.0
        rng = np.random.default_rng(12345)  # statistics only
        idx = rng.integers(0, len(a), size=(4000, len(a)))
        boot = a[idx, 0].mean(axis=1) / a[idx, 1].mean(axis=1) - 1.0
        lo, hi = np.quantile(boot, [0.05, 0.95])
        print(f"\nPaired rounds (N={n}; {len(a)} pairs from {args.repeats} launches; each product round followed by "
              f"a plain round, NOT PRIVATE, on the same nodes in the same launch):")
        print(f"  product median {np.median(a[:, 0]):.2f} s, plain median {np.median(a[:, 1]):.2f} s; overhead: "
              f"mean {(a[:, 0].mean() / a[:, 1].mean() - 1) * 100:+.1f}% (bootstrap 90% interval {lo * 100:+.1f}% .. "
              f"{hi * 100:+.1f}%), median of per-pair ratios {np.median(ratio) * 100:+.1f}%")
    print(f"Outputs: {out}")
    return 0


def seal_seconds(repeat: int = 300) -> float:
    """Seconds per ``shuffledp.shuffler.envelope.seal`` of one d=650 report (two HPKE layers + Ed25519), this
    process."""
    import numpy as np

    from shuffledp.clients.core import make_payload
    from shuffledp.clients.data import load_partition
    from shuffledp.clients.messages import TrainConfig, arrays_digest
    from shuffledp.clients.models import initial_arrays
    from shuffledp.clients.settings import PinnedSettings
    from shuffledp.shuffler import keys as kf
    from shuffledp.shuffler.envelope import seal

    with tempfile.TemporaryDirectory() as tmp:
        keys = kf.init_key_directory(Path(tmp) / "k", 2, k=2)
        spk = kf.load_public_key(keys.server_hpke_pub, "x25519")
        shpk = kf.load_public_key(keys.shuffler_hpke_pub, "x25519")
        ck = kf.load_private_key(keys.client_key(0), "ed25519")
    pinned = PinnedSettings(eps0=4.0, clip_l1=1.0, client_key=ck, server_public_key=spk, shuffler_public_key=shpk)
    arrays = initial_arrays("logreg", 10, 10)
    cfg = TrainConfig(round=1, key_epoch=0, eps0=4.0, clip_l1=1.0)
    payload = make_payload(arrays, cfg, pinned, load_partition(0, 100, pca_components=10))
    digest = arrays_digest([np.asarray(a) for a in arrays])
    t0 = time.perf_counter()
    for _ in range(repeat):
        seal(payload, server_public_key=spk, shuffler_public_key=shpk, signing_key=ck, key_epoch=0, round_id=1,
             model_digest=digest)
    return (time.perf_counter() - t0) / repeat


def _bootstrap_ratio(a: list[float], b: list[float], reps: int = 4000) -> tuple[float, float]:
    """5% and 95% quantiles of mean(a*)/mean(b*) - 1 over bootstrap resamples of launch means (statistics only;
    a fixed seed so that the printed interval is reproducible from results.json)."""
    import numpy as np

    rng = np.random.default_rng(12345)
    ra = rng.choice(np.asarray(a), size=(reps, len(a))).mean(axis=1)
    rb = rng.choice(np.asarray(b), size=(reps, len(b))).mean(axis=1)
    q = np.quantile(ra / rb - 1.0, [0.05, 0.95])
    return float(q[0]), float(q[1])


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--rounds", type=int, default=3, help="rounds per run; round 1 (warm-up) is not counted")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration, interleaved A B A B")
    p.add_argument("--out", type=Path, default=None, help="parent of the runs' outputs")
    p.add_argument("--paired", action="store_true",
                   help="alternate product and plain rounds inside each launch (removes launch-level noise)")
    p.add_argument("--plain-seal", action="store_true",
                   help="with --paired: plain clients also seal (and discard) their report, which isolates the "
                        "server-side cost of the shuffled round")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 is warm-up)")
    out = (args.out or ROOT / "outputs" / datetime.now(timezone.utc).strftime("bench-round-overhead-%Y%m%d-%H%M%S"))
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.paired:
        return paired_main(args, out)
    t_seal = seal_seconds()
    results: dict[int, dict[str, Any]] = {}
    for n in args.clients:
        res = results.setdefault(n, {"shuffled": [], "baseline": [], "first": {"shuffled": [], "baseline": []}})
        for rep in range(args.repeats):
            for system, fn in (("shuffled", run_shuffled), ("baseline", run_baseline)):
                name = f"{system}-n{n}-r{rep}"
                t0 = time.monotonic()
                rows = fn(n, args.rounds, out, name, out / f"{name}.log")
                totals = [sum(r["seconds"].values()) for r in rows]
                res["first"][system].append(totals[0])
                res[system].extend(r["seconds"] for r in rows[1:])
                res.setdefault("launch_means", {}).setdefault(system, []).append(statistics.mean(totals[1:]))
                print(f"... {name}: rounds {', '.join(f'{t:.2f}' for t in totals)} s "
                      f"(whole launch {time.monotonic() - t0:.0f} s)", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    print(f"\nRound wall time, seconds: median over rounds 2..{args.rounds} of {args.repeats} runs per system "
          f"(logreg on digits, d=650, eps0=4, C=1; 2 Ray actors, 1 CPU each). Baseline = no-shuffle, NOT PRIVATE "
          f"AGAINST THE SERVER. Round 1 excluded (Ray start-up).")
    print(f"{'N':>5} | {'shuffled':>8} | {'baseline':>8} | {'overhead':>8} | {'collect s/b':>13} | {'submit':>6} | "
          f"{'account':>7} | {'fetch+open+dec':>14} | {'decode(b)':>9} | {'seal est':>8} | {'round 1 s/b':>13}")
    for n, res in results.items():
        shuf = [sum(s.values()) for s in res["shuffled"]]
        base = [sum(s.values()) for s in res["baseline"]]
        ph = {k: _med([s.get(k, 0.0) for s in res["shuffled"]]) for k in ("collect", "shuffle", "account",
                                                                            "open_apply")}
        bph = {k: _med([s.get(k, 0.0) for s in res["baseline"]]) for k in ("collect", "aggregate")}
        ms, mb = _med(shuf), _med(base)
        print(f"{n:>5} | {ms:>8.2f} | {mb:>8.2f} | {(ms / mb - 1) * 100:>7.1f}% | "
              f"{ph['collect']:>6.2f}/{bph['collect']:<6.2f} | {ph['shuffle']:>6.3f} | {ph['account']:>7.3f} | "
              f"{ph['open_apply']:>14.3f} | {bph['aggregate']:>9.3f} | {n * t_seal / 2:>8.3f} | "
              f"{_med(res['first']['shuffled']):>6.1f}/{_med(res['first']['baseline']):<6.1f}")
        print(f"      per-round totals shuffled {[round(x, 2) for x in shuf]}, baseline {[round(x, 2) for x in base]}")
        ls, lb = res["launch_means"]["shuffled"], res["launch_means"]["baseline"]
        lo, hi = _bootstrap_ratio(ls, lb)
        print(f"      launch level ({len(ls)} launches each; whole launches vary more than rounds): mean overhead "
              f"{(statistics.mean(ls) / statistics.mean(lb) - 1) * 100:+.1f}%, bootstrap 90% interval "
              f"{lo * 100:+.1f}% .. {hi * 100:+.1f}%")
    print(f"seal microbenchmark: {t_seal * 1e3:.3f} ms per report; 'seal est' = N x t_seal / 2 actors (inside "
          f"collect). submit = closing the Submit stream (the envelopes were streamed to the shuffler during collect) "
          f"+ attestation check; fetch+open+dec = streamed fetch, HPKE open, "
          f"decode, accumulate. Outputs: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
