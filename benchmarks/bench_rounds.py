"""Round wall time with the shuffler vs. a labelled no-shuffle baseline, at 100 and 1,000 clients.

What is measured (no Ray, so that actor scheduling noise does not dominate):

* client side, per round: each client computes its report at the round's model (average gradient on its
  digits partition, L1 clip, exact discrete Laplace noise, encoding: ``shuffledp.clients.core.make_payload``) and, in
  the shuffled system only, seals it (``shuffledp.shuffler.envelope.seal``: two HPKE layers and an Ed25519 signature).
  The clients run one after another in this process; the figure is the sum over clients (a serial upper bound; real
  clients run in parallel).
* server side, per round, from pre-made client replies: the shuffled path is ``shuffledp.server.rounds.RoundEngine.
  run_round`` (build the messages, collect replies from a fake Grid, keep the envelope bytes, submit them over
  mTLS to a REAL shuffler process, verify its attestation, charge the accountant and append the ledger row,
  stream the permuted batch back, open each inner layer, decode, accumulate, one optimizer step); the baseline
  ("no-shuffle, NOT private against the server": the server sees who sent which noisy report) builds the same
  messages, collects plain noisy reports, decodes, averages and steps. Central evaluation is left out of both.

Run: ``python benchmarks/bench_rounds.py [--clients 100 1000] [--rounds 3]``. Prints one table; the overhead
column is (shuffled - baseline) / baseline for the server-side path and for the whole round (client + server).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from shuffledp.accounting.ledger import Ledger
from shuffledp.clients import messages as M
from shuffledp.clients.core import make_payload
from shuffledp.clients.data import load_partition
from shuffledp.clients.models import initial_arrays
from shuffledp.clients.report import decode_report
from shuffledp.clients.settings import PinnedSettings
from shuffledp.server.config import parse_run_config
from shuffledp.server.optim import ReportAccumulator, ServerOptimizer
from shuffledp.server.rounds import RoundEngine, envelope_of
from shuffledp.server.state import InMemoryCheckpointStore
from shuffledp.shuffler import keys as keyfiles
from shuffledp.shuffler.client import ShufflerClient
from shuffledp.shuffler.envelope import open_inner, seal
from shuffledp.shuffler.process import ShufflerProcess

EPS0 = 4.0
CLIP = 1.0


class ReplayGrid:
    """A Grid whose node i answers with ``replies[round][i]`` (pre-made bytes) in the envelope schema."""

    def __init__(self, n: int) -> None:
        self.nodes = list(range(1000, 1000 + n))
        self.payloads: dict[int, list[bytes]] = {}
        self.key = M.ENVELOPE_KEY

    def get_node_ids(self) -> list[int]:
        return self.nodes

    def push_messages(self, messages: Any) -> list[str]:
        """Like Flower's grids: each message gets an id; its reply is ready at once."""
        self.pending: dict[str, Message] = {}
        ids = []
        for i, msg in enumerate(messages):
            mid = f"m{i}"
            msg.metadata.__dict__["_message_id"] = mid
            rnd = int(msg.metadata.group_id)
            payload = self.payloads[rnd][self.nodes.index(msg.metadata.dst_node_id)]
            ct = np.frombuffer(payload, dtype=np.uint8).copy()
            self.pending[mid] = Message(RecordDict({self.key: ArrayRecord({"ct": Array(ct)})}), reply_to=msg)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        return [self.pending.pop(m) for m in list(message_ids) if m in self.pending]


def baseline_round(grid: ReplayGrid, arrays: list[np.ndarray], opt: ServerOptimizer, rnd: int) -> list[np.ndarray]:
    """NO-SHUFFLE BASELINE (not private against the server): same messages, plain noisy reports averaged."""
    cfg = M.TrainConfig(round=rnd, key_epoch=0, eps0=EPS0, clip_l1=CLIP).to_config_record()
    record = ArrayRecord(arrays)
    msgs = [
        Message(RecordDict({M.ARRAYS_KEY: record, M.CONFIG_KEY: cfg}), dst_node_id=n, message_type=M.MESSAGE_TYPE,
                group_id=str(rnd))
        for n in grid.get_node_ids()
    ]
    replies = grid.pull_messages(grid.push_messages(msgs))
    payloads = [e for e, _ in (envelope_of(r, max_bytes=1 << 26) for r in replies) if e is not None]
    dim = sum(a.size for a in arrays)
    acc = ReportAccumulator(dim)
    for p in payloads:
        acc.add(decode_report(p, expected_dim=dim))
    return opt.step(arrays, acc.mean())


def bench(n: int, rounds: int, workdir: Path) -> dict[str, Any]:
    keys = keyfiles.init_key_directory(workdir / f"keys-{n}", n, k=max(2, n // 2))
    spk = keyfiles.load_public_key(keys.server_hpke_pub, "x25519")
    shpk = keyfiles.load_public_key(keys.shuffler_hpke_pub, "x25519")
    ssk = keyfiles.load_private_key(keys.server_hpke_key, "x25519")
    pinned = [
        PinnedSettings(eps0=EPS0, clip_l1=CLIP, client_key=keyfiles.load_private_key(keys.client_key(i), "ed25519"),
                       server_public_key=spk, shuffler_public_key=shpk, partition_id=i, num_partitions=n)
        for i in range(n)
    ]
    data = [load_partition(i, n) for i in range(n)]
    tls = (keys.ca_cert.read_bytes(), keys.serverapp_cert.read_bytes(), keys.serverapp_tls_key.read_bytes())
    cfg = parse_run_config({
        "eps0": EPS0, "clip-l1": CLIP, "min-reports": max(2, n // 2), "keys-dir": str(keys.root),
        "output-dir": str(workdir), "run-name": f"bench-{n}", "budget-epsilon": 1e6, "num-server-rounds": rounds + 1,
    })
    out = workdir / f"bench-{n}"
    out.mkdir(parents=True, exist_ok=True)
    model = initial_arrays("logreg", 64, 10)
    shuffled_grid, base_grid = ReplayGrid(n), ReplayGrid(n)
    t_client_base: list[float] = []
    t_client_seal: list[float] = []
    t_server_shuf: list[float] = []
    t_server_base: list[float] = []
    phases: dict[str, list[float]] = {}
    with ShufflerProcess(keys.config, root_certificate=tls[0], client_certificate=tls[1], client_key=tls[2]) as proc, \
            ShufflerClient(proc.address, root_certificate=tls[0], client_certificate=tls[1], client_key=tls[2],
                           shuffler_verify_key=keyfiles.load_public_key(keys.shuffler_signing_pub, "ed25519"),
                           max_message_bytes=1 << 26) as client, \
            Ledger(out / "ledger.sqlite") as ledger:
        engine = RoundEngine(
            cfg, grid=shuffled_grid, shuffler=client,
            open_inner=lambda inner, r: open_inner(inner, server_private_key=ssk, key_epoch=0, round_id=r),
            evaluator=lambda arrays: (0.0, 0.0), initial_arrays=model, ledger=ledger, store=InMemoryCheckpointStore(),
        )
        engine.restore()
        base_arrays = [a.copy() for a in model]
        base_opt = ServerOptimizer("sgd", cfg.server_lr)
        for rnd in range(1, rounds + 2):  # round 1 warms up (imports, sampler tables, connections): not timed
            digest = M.arrays_digest(engine.arrays)
            config = M.TrainConfig(round=rnd, key_epoch=0, eps0=EPS0, clip_l1=CLIP)
            # client side: payloads (both systems), then sealing (shuffled system only)
            t0 = time.perf_counter()
            payloads = [make_payload(engine.arrays, config, pinned[i], data[i]) for i in range(n)]
            t1 = time.perf_counter()
            envelopes = [seal(p, server_public_key=spk, shuffler_public_key=shpk, signing_key=pinned[i].client_key,
                              key_epoch=0, round_id=rnd, model_digest=digest) for i, p in enumerate(payloads)]
            t2 = time.perf_counter()
            t_client_base.append(t1 - t0)
            t_client_seal.append(t2 - t1)
            shuffled_grid.payloads[rnd] = envelopes
            base_grid.payloads[rnd] = [make_payload(base_arrays, config, pinned[i], data[i]) for i in range(n)]
            t3 = time.perf_counter()
            outcome = engine.run_round(rnd)
            t4 = time.perf_counter()
            if outcome.status != "applied" or outcome.n_reports != n:
                raise RuntimeError(f"benchmark round {rnd} at n={n} did not apply all reports: {outcome}")
            base_arrays = baseline_round(base_grid, base_arrays, base_opt, rnd)
            t5 = time.perf_counter()
            if rnd == 1:
                t_client_base.clear()
                t_client_seal.clear()
                continue
            t_server_shuf.append(t4 - t3)
            t_server_base.append(t5 - t4)
            for key, value in outcome.seconds.items():
                phases.setdefault(key, []).append(value)
    med = statistics.median
    return {
        "n": n,
        "client_payload": med(t_client_base),
        "client_seal": med(t_client_seal),
        "server_shuffled": med(t_server_shuf),
        "server_baseline": med(t_server_base),
        "phases": {k: med(v) for k, v in phases.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per size (medians are reported)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny models: a thread pool only adds contention (the simulation's actors use 1 too)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as tmp:
        for n in args.clients:
            print(f"... n={n}: generating keys and running {args.rounds} rounds", flush=True)
            results.append(bench(n, args.rounds, Path(tmp)))
    print()
    print("Round wall time, medians over rounds, seconds (logreg on digits, d=650, eps0=4, C=1; this machine)")
    header = ("n", "client payload (sum)", "client seal (sum)", "server baseline", "server shuffled",
              "server overhead", "round baseline", "round shuffled", "round overhead")
    print(" | ".join(header))
    for r in results:
        base_round = r["client_payload"] + r["server_baseline"]
        shuf_round = r["client_payload"] + r["client_seal"] + r["server_shuffled"]
        print(" | ".join([
            str(r["n"]), f"{r['client_payload']:.3f}", f"{r['client_seal']:.3f}", f"{r['server_baseline']:.3f}",
            f"{r['server_shuffled']:.3f}", f"{(r['server_shuffled'] / r['server_baseline'] - 1) * 100:.0f}%",
            f"{base_round:.3f}", f"{shuf_round:.3f}", f"{(shuf_round / base_round - 1) * 100:.1f}%",
        ]))
        phases = ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
        print(f"    shuffled server path by phase (s): {phases}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
