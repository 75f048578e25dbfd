"""``shuffledp audit privacy``: the empirical privacy audit (:mod:`shuffledp.deploy.audit_privacy`) on a grid of
(eps0, n, T), printed beside the accountant's bounds, optionally drawn and with some trials end to end through a
real shuffler process.

Exit code 0: every audited lower bound is at most the accountant's upper bound (``clones`` at the eps0 the
pipeline claims); 1: some lower bound exceeds it (the pipeline does not deliver what is accounted, as the broken
pipelines show); 2: bad input (reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from shuffledp.deploy.audit_privacy import check_audit_args, format_table, run_audit
from shuffledp.deploy.audit_privacy_pipelines import OTHERS, PIPELINES, AuditInstance, LaplacePipeline, make_pipeline

__all__ = ["main", "parse_list"]


def parse_list(text: str, kind: type, name: str) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]`` of ``kind``; raises ValueError naming the option."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shuffledp audit privacy",
        description="empirical lower bound on epsilon of the shuffled randomizer (canary attack, Clopper-Pearson), "
                    "beside the accountant's bounds",
    )
    p.add_argument("--pipeline", default="laplace", choices=PIPELINES,
                   help="the project's randomizer (laplace) or a deliberately broken one (default: laplace)")
    p.add_argument("--eps0", default="2", help="local epsilon(s), comma-separated (default: 2)")
    p.add_argument("--n", default="1000", help="reports per round, comma-separated (default: 1000)")
    p.add_argument("--rounds", default="1", help="rounds T per trial, canary in each, comma-separated (default: 1)")
    p.add_argument("--trials", type=int, default=2000,
                   help="trials per hypothesis, half held apart to choose the test (default: 2000)")
    p.add_argument("--delta", type=float, default=1e-6, help="delta of every bound (default: 1e-6)")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound (default: 0.95)")
    p.add_argument("--others", default="orthogonal", choices=OTHERS,
                   help="the other clients' input: +C e2 (orthogonal, default), -C e1 (same), or 0 (zero)")
    p.add_argument("--dim", type=int, default=None, help="report dimension (default: 2; 1 with --others same/zero "
                   "is allowed)")
    p.add_argument("--clip", type=float, default=1.0, help="L1 clip radius C (default: 1)")
    p.add_argument("--log2-grid", type=int, default=None,
                   help="laplace's grid exponent (default: the clients' grid; e.g. -1: K = 2 steps per C, an "
                        "instance small enough to compute exactly); not with --end-to-end")
    p.add_argument("--records", type=int, default=10, help="m, for --pipeline broken-per-record (default: 10)")
    p.add_argument("--end-to-end", type=int, default=0, metavar="K",
                   help="also run K rounds (alternating canary inputs) through a real shuffler process per (eps0, n), "
                        "laplace only, and place their scores among the in-process ones")
    p.add_argument("--plot", metavar="PREFIX", help="write PREFIX_vs_eps0.png / PREFIX_vs_n.png")
    p.add_argument("--json", action="store_true", help="print the results as JSON lines instead of a table")
    return p


def _end_to_end(instance: AuditInstance, k: int) -> str:
    """Run ``k`` rounds through the real shuffler; returns a line placing their scores among fresh in-process
    scores of the same hypothesis."""
    from shuffledp.deploy.audit_privacy_e2e import shuffled_multisets

    hyps = ["a" if i % 2 == 0 else "b" for i in range(k)]
    pipe = LaplacePipeline(instance)
    multisets = shuffled_multisets(instance, hyps)
    ref = {h: np.sort(pipe.round_scores(h, 2000)) for h in set(hyps)}
    parts = []
    for h, m in zip(hyps, multisets):
        s = float(pipe.score(m))
        parts.append(f"{h}: {s:+.4f} (in-process percentile {100 * np.searchsorted(ref[h], s) / ref[h].size:.0f})")
    return (f"end to end (eps0={instance.eps0:g}, n={instance.n}): {k} rounds through a real shuffler process, "
            "envelopes sealed by the clients' code; one-round scores " + "; ".join(parts) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``shuffledp audit privacy ...`` (``argv`` may start with ``"audit", "privacy"``). See the module docstring.

    Returns:
        The exit code.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    while args and args[0] in ("audit", "privacy"):
        args = args[1:]
    try:
        ns = _parser().parse_args(args)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    try:
        eps0s = parse_list(ns.eps0, float, "--eps0")
        ns_ = parse_list(ns.n, int, "--n")
        rounds = parse_list(ns.rounds, int, "--rounds")
        if ns.end_to_end < 0:
            raise ValueError(f"--end-to-end must be >= 0, got {ns.end_to_end}")
        if ns.end_to_end and ns.pipeline != "laplace":
            raise ValueError("--end-to-end runs the real laplace pipeline only")
        if ns.end_to_end and ns.log2_grid is not None:
            raise ValueError("--end-to-end runs the clients' default grid (the server decodes only that one); "
                             "drop --log2-grid")
        dim = ns.dim if ns.dim is not None else 2
        instances = [AuditInstance(e, n, clip=ns.clip, dim=dim, others=ns.others, log2_grid=ns.log2_grid)
                     for e in eps0s for n in ns_]
        pipes = [make_pipeline(ns.pipeline, inst, records=ns.records) for inst in instances]
        for t in rounds:  # every remaining argument, before the (long) runs
            check_audit_args(t, ns.trials, ns.delta, ns.confidence, 0.5)
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"shuffledp audit privacy: {exc}\n")
        return 2
    results = []
    for pipe in pipes:
        for t in rounds:
            results.append(run_audit(pipe, rounds=t, trials=ns.trials, delta=ns.delta, confidence=ns.confidence))
    if ns.json:
        sys.stdout.write("".join(json.dumps(r.as_dict()) + "\n" for r in results))
    else:
        sys.stdout.write(format_table(results))
    if ns.end_to_end:
        for inst in instances:
            sys.stdout.write(_end_to_end(inst, ns.end_to_end))
    if ns.plot:
        from shuffledp.deploy.audit_privacy_plot import plot_results

        for path in plot_results(results, ns.plot):
            sys.stderr.write(f"wrote {path}\n")
    exceeded = [r for r in results if r.epsilon_lower > (r.references.get("clones", {}).get("value") or float("inf"))]
    for r in exceeded:
        sys.stderr.write(f"shuffledp audit privacy: {r.pipeline} at eps0={r.eps0:g}, n={r.n}, T={r.rounds}: the lower "
                         f"bound {r.epsilon_lower:.3f} exceeds the accountant's upper bound "
                         f"{r.references['clones']['value']:.3f} at the claimed eps0\n")
    return 1 if exceeded else 0
