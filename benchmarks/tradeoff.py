"""Privacy-utility trade-off of the main job: test accuracy and epsilon for eps0 in {1, 2, 4, 8} and no noise.

Each setting runs the main job's arithmetic in-process, without Ray and without the cryptographic layers (which
change neither the numbers nor their distribution: the shuffler only permutes, the sum is order-free):
every round, each of the N clients (one digits partition each) computes its report with
``shuffledp.clients.core.make_payload`` (average gradient at the round's model, L1 clip C, exact discrete Laplace
noise of scale 2C/eps0, fixed-length encoding); the server decodes each with ``shuffledp.clients.report.decode_report``
into the O(model) running sum (``shuffledp.server.optim.ReportAccumulator``) and takes one
``shuffledp.server.optim.ServerOptimizer`` step with the mean; the test accuracy is the central evaluation the ServerApp
does. epsilon is the cumulative upper bound of the default family (``clones``) at delta = 1e-6 for n = N reports per
round (``shuffledp.accounting.accountant.ShuffleAccountant``). "no noise" clips but adds no noise: it is not private at
all.

Run: ``python benchmarks/tradeoff.py [--rounds R] [--clients 1437] [--eps0 1 2 4 8] [--repeats 3]``; prints
one table. It takes a few minutes (N x rounds x settings x repeats client reports, 1-3 ms each here).
"""

from __future__ import annotations

import argparse
import math
import time

from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound
from shuffledp.clients.core import compute_update
from shuffledp.clients.data import load_data, load_partition
from shuffledp.clients.messages import TrainConfig
from shuffledp.clients.models import evaluate, initial_arrays
from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer, clip_l1
from shuffledp.clients.report import decode_report
from shuffledp.server.config import DEFAULTS
from shuffledp.server.optim import ReportAccumulator, ServerOptimizer


def run_setting(
    eps0: float | None, *, rounds: int, clients: int, lr: float, clip: float, delta: float, pca: int | None
) -> dict:
    """One main job at ``eps0`` (None: clipped, no noise). Returns accuracy/loss per round and final epsilon."""
    ds = load_data("digits", pca_components=pca)
    data = [load_partition(i, clients, pca_components=pca) for i in range(clients)]
    arrays = initial_arrays("logreg", ds.n_features, ds.n_classes)
    dim = sum(a.size for a in arrays)
    opt = ServerOptimizer("sgd", lr)
    randomizer = None if eps0 is None else DiscreteLaplaceRandomizer(eps0, clip)
    cfg = TrainConfig(round=1, key_epoch=0, eps0=eps0 or 1.0, clip_l1=clip)
    accuracies = []
    for _ in range(rounds):
        acc = ReportAccumulator(dim)
        for x, y in data:
            update = compute_update(arrays, cfg, x, y)
            if randomizer is None:
                acc.add(clip_l1(update, clip))
            else:
                acc.add(decode_report(randomizer.encode(update), expected_dim=dim))
        arrays = opt.step(arrays, acc.mean())
        accuracies.append(evaluate(arrays, ds.x_test, ds.y_test)[1])
    epsilon = math.inf
    if eps0 is not None:
        acct = ShuffleAccountant(target_delta=delta)
        acct.compose(ShuffleRound(n=clients, eps0=eps0), count=rounds)
        epsilon = acct.epsilon().value
    return {"eps0": eps0, "accuracy": accuracies[-1], "best": max(accuracies), "epsilon": epsilon}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=int(DEFAULTS["num-server-rounds"]))
    parser.add_argument("--clients", type=int, default=1437)
    parser.add_argument("--eps0", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--lr", type=float, default=float(DEFAULTS["server-lr"]))
    parser.add_argument("--clip", type=float, default=float(DEFAULTS["clip-l1"]))
    parser.add_argument("--delta", type=float, default=float(DEFAULTS["target-delta"]))
    parser.add_argument("--repeats", type=int, default=3, help="independent runs per setting (fresh noise)")
    parser.add_argument("--pca", type=int, default=int(DEFAULTS["pca-components"]),
                        help="PCA components fitted on the held-out split (0: raw 64 pixels)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny models: a thread pool only adds contention (the simulation's actors use 1 too)
    rows = []
    for eps0 in [*args.eps0, None]:
        t0 = time.perf_counter()
        runs = [run_setting(eps0, rounds=args.rounds, clients=args.clients, lr=args.lr, clip=args.clip,
                            delta=args.delta, pca=args.pca or None) for _ in range(args.repeats)]
        finals = [r["accuracy"] for r in runs]
        rows.append({"eps0": eps0, "mean": sum(finals) / len(finals), "low": min(finals), "high": max(finals),
                     "epsilon": runs[0]["epsilon"], "seconds": time.perf_counter() - t0})
        label = "no noise" if eps0 is None else f"eps0={eps0:g}"
        print(f"... {label}: accuracy {[round(a, 4) for a in finals]} ({rows[-1]['seconds']:.0f} s)", flush=True)
    print()
    print(f"Main job trade-off: digits, logreg, {args.clients} clients (one sample each), {args.rounds} rounds, "
          f"PCA={args.pca or 'none'}, C={args.clip:g}, SGD lr={args.lr:g}; "
          f"epsilon = clones upper bound at delta={args.delta:g}; {args.repeats} runs per setting")
    print("eps0 | test accuracy after the last round: mean [min, max] | epsilon after all rounds")
    for row in rows:
        label = "none (not private)" if row["eps0"] is None else f"{row['eps0']:g}"
        eps = "inf (no privacy)" if math.isinf(row["epsilon"]) else f"{row['epsilon']:.3f}"
        print(f"{label} | {row['mean']:.3f} [{row['low']:.3f}, {row['high']:.3f}] | {eps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
