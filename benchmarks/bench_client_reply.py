"""CPU milliseconds per ``train.shuffled`` reply of the project's ClientApp, outside Ray (issue 30, item 1).

The ClientApp (:data:`shuffledp.clients.app.app`: the mod around the train handler) is called in this process on
requests built as the ServerApp builds them (``server/rounds.py``: one ArrayRecord of the model and one
ConfigRecord per round, shared by every message of the round), each message and context passed through pickle
first as Flower's Ray engine passes them to an actor (fresh objects per reply; not timed), with a key directory
of ``--replies`` clients, the run config of the 10,000-client benchmark (``benchmarks/bench_flower_scale.py``:
``mnist5k-aug``, PCA 20, ``logreg`` d = 210, ``laplace``) and ``num-partitions = --clients`` (each client holds
100,000 / N rows). Every reply goes to another node id, as an actor serves every simulated client in turn.

Two rounds: round 1 (caches cold: key files, the model's checks) and round 2 (another model, as the server's
model changes every round; each node's context carries its round-1 state): the CPU time (``time.process_time``)
of each reply, median and mean, with the load average. ``--profile N`` runs a third round under cProfile (not in
the figures above) and prints its top N entries.

Run: ``python benchmarks/bench_client_reply.py [--replies 2000] [--clients 10000] [--keys-dir D] [--profile 25]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pickle
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_flower_scale import RUN_CONFIG  # noqa: E402 - the path above makes the sibling benchmark importable


def _run_config(keys_dir: Path, n: int) -> dict[str, Any]:
    from shuffledp.deploy.flower import parse_run_config_args
    from shuffledp.server.config import DEFAULTS

    return {**DEFAULTS, **parse_run_config_args([RUN_CONFIG]), "keys-dir": str(keys_dir), "min-reports": min(1000, n)}


def _requests(raw: dict[str, Any], round_id: int, arrays: list[Any], nodes: range) -> list[Any]:
    """The round's messages, built as ``server/rounds.py`` builds them (pickled, as Ray carries them)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

    from shuffledp.clients import messages as M
    from shuffledp.server.config import parse_run_config

    cfg = parse_run_config(raw)
    train = M.TrainConfig(round=round_id, key_epoch=cfg.key_epoch, eps0=cfg.eps0, clip_l1=cfg.clip_l1,
                          mechanism=cfg.mechanism, report=cfg.report, local_epochs=cfg.local_epochs,
                          local_lr=cfg.local_lr, batch_size=cfg.batch_size)
    config_record = ConfigRecord(train.to_dict())
    arrays_record = ArrayRecord({str(i): Array.from_numpy_ndarray(np.ascontiguousarray(a))
                                 for i, a in enumerate(arrays)})
    out = []
    for node in nodes:
        content = RecordDict({M.ARRAYS_KEY: arrays_record, M.CONFIG_KEY: config_record})
        msg = Message(content, dst_node_id=node + 1, message_type=M.MESSAGE_TYPE, group_id=str(round_id))
        msg.metadata.__dict__["_message_id"] = f"r{round_id}-n{node}"
        out.append(pickle.dumps(msg))
    return out


def _round(app: Any, requests: list[bytes], contexts: list[Any], profile: cProfile.Profile | None) -> list[float]:
    """Per-reply CPU ms; each node's context is replaced by the one the app left (its state for the next round)."""
    times = []
    for i, blob in enumerate(requests):
        msg, ctx = pickle.loads(blob), pickle.loads(pickle.dumps(contexts[i]))
        if profile is not None:
            profile.enable()
        t = time.process_time()
        reply = app(msg, ctx)
        times.append((time.process_time() - t) * 1e3)
        if profile is not None:
            profile.disable()
        if reply.has_error():
            raise RuntimeError(f"the ClientApp refused node {i}: {reply.error.reason}")
        contexts[i] = ctx
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", type=int, default=2000, help="node ids per round (one reply each)")
    p.add_argument("--clients", type=int, default=10000, help="num-partitions (the simulated population)")
    p.add_argument("--keys-dir", type=Path, default=None,
                   help="a key directory with at least --replies clients (default: a fresh one, removed after)")
    p.add_argument("--profile", type=int, default=0, help="run round 3 under cProfile and print its top N entries")
    args = p.parse_args(argv)
    if not 1 <= args.replies <= args.clients:
        p.error("need 1 <= --replies <= --clients")

    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    from shuffledp.clients.app import app
    from shuffledp.clients.models import initial_arrays
    from shuffledp.shuffler.keys import init_key_directory

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    tmp = None
    keys_dir = args.keys_dir
    if keys_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-client-reply-")
        keys_dir = Path(tmp.name) / "keys"
        t = time.time()
        init_key_directory(keys_dir, args.replies)
        print(f"keys for {args.replies} clients in {time.time() - t:.1f} s", flush=True)
    raw = _run_config(keys_dir, args.clients)
    nodes = range(args.replies)
    contexts = [Context(run_id=1, node_id=i + 1, node_config={"partition-id": i, "num-partitions": args.clients},
                        state=RecordDict(), run_config=dict(raw)) for i in nodes]
    model = initial_arrays("logreg", 20, 10)
    # the process's first reply (imports, dataset, PCA, partitions) is not counted: a warm actor is the subject
    first = _requests(raw, 1, model, range(args.replies, args.replies + 1))
    _round(app, first, [Context(run_id=1, node_id=0, node_config={"partition-id": 0, "num-partitions": args.clients},
                                state=RecordDict(), run_config=dict(raw))], None)
    print(f"ClientApp CPU per reply, {args.replies} node ids of {args.clients} (mnist5k-aug, PCA 20, logreg d=210, "
          "laplace; pickled requests, no Ray)")
    for rnd in (1, 2):
        arrays = [a + 0.01 * (rnd - 1) for a in model]  # round 2: another model
        reqs = _requests(raw, rnd, arrays, nodes)
        load = os.getloadavg()
        times = _round(app, reqs, contexts, None)
        print(f"  round {rnd}: median {statistics.median(times):.3f} ms, mean {statistics.fmean(times):.3f} ms, "
              f"p90 {sorted(times)[int(0.9 * len(times))]:.3f} ms  (load {load[0]:.2f} {load[1]:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after)", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        _round(app, _requests(raw, 3, [a + 0.02 for a in model], nodes), contexts, prof)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.profile)
        print(s.getvalue())
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
