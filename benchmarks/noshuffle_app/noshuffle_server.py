"""NO-SHUFFLE BASELINE ServerApp — NOT PRIVATE AGAINST THE SERVER. Benchmark use only.

Used by ``benchmarks/bench_round_overhead.py``. Per round it does what the product's RoundEngine
(``server/rounds.py``) does minus everything that exists for the shuffle model: wait for / list the connected
nodes (same ``min-reports`` wait and first-round settle), send the same model + round config to all of them,
collect the replies with the same timeout, read the PLAIN encoded noisy reports (it sees which node sent
which: local DP only, no amplification, nothing hidden from the server), decode and average them
(``shuffledp.clients.report.decode_report`` + ``shuffledp.server.optim.ReportAccumulator``), one step of the same server
optimizer and the same central evaluation. No shuffler, no HPKE, no attestation, no accountant/ledger, no checkpoint.

Per-round ``seconds`` use the same boundaries as ``RoundOutcome.seconds`` of the product, so that the sum
over phases is the same "round wall time" in both: ``select`` (node wait + sampling; the product's ``budget``),
``collect`` (send and receive, extract bytes), ``aggregate`` (decode + accumulate; the product's
``open_apply`` minus fetch/open), ``evaluate`` (optimizer step + central evaluation, as in the product).
They are written to ``<output-dir>/<run-name>/baseline_rounds.json`` after every round.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from shuffledp.clients import messages as M
from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer
from shuffledp.clients.report import decode_report
from shuffledp.server.config import parse_run_config
from shuffledp.server.evaluation import CentralEvaluator
from shuffledp.server.optim import ReportAccumulator, ServerOptimizer, num_parameters
from shuffledp.server.rounds import sample_nodes, wait_for_nodes

__all__ = ["app", "ROUNDS_FILE"]

ROUNDS_FILE = "baseline_rounds.json"
PAIRED_FILE = "paired_rounds.json"
MESSAGE_TYPE = "train.plain"
REPORT_KEY = "report"
NODE_WAIT = 120.0  # as shuffledp.server.job.run_job's default node_wait

log = logging.getLogger("shuffledp.noshuffle")
app = ServerApp()


class PlainRounds:
    """NOT PRIVATE AGAINST THE SERVER: one round = send the model, collect plain noisy reports, average, step,
    evaluate; its own model and optimizer. ``run_round`` returns the round's row (``seconds`` per phase)."""

    def __init__(self, grid: Grid, cfg: Any) -> None:
        self.grid, self.cfg = grid, cfg
        self.central = CentralEvaluator(cfg)
        self.arrays = [np.asarray(a) for a in self.central.initial_arrays()]
        self.dim = num_parameters([tuple(a.shape) for a in self.arrays])
        self.log2_grid = DiscreteLaplaceRandomizer(cfg.eps0, cfg.clip_l1).log2_grid
        self.optimizer = ServerOptimizer(cfg.server_optimizer, cfg.server_lr, momentum=cfg.server_momentum)

    def run_round(self, rnd: int, *, settle: float) -> dict[str, Any]:
        cfg, grid = self.cfg, self.grid
        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        nodes = wait_for_nodes(grid, cfg.min_reports, node_wait=NODE_WAIT, settle=settle)  # the product's policy
        sampled = sample_nodes(nodes, cfg.fraction)
        t1 = time.perf_counter()
        seconds["select"] = t1 - t0
        train_cfg = M.TrainConfig(round=rnd, key_epoch=cfg.key_epoch, eps0=cfg.eps0, clip_l1=cfg.clip_l1,
                                  report=cfg.report, local_epochs=cfg.local_epochs, local_lr=cfg.local_lr,
                                  batch_size=cfg.batch_size).to_config_record()
        record = ArrayRecord(self.arrays)
        messages = [
            Message(RecordDict({M.ARRAYS_KEY: record, M.CONFIG_KEY: train_cfg}), dst_node_id=int(n),
                    message_type=MESSAGE_TYPE, group_id=str(rnd))
            for n in sampled
        ]
        replies = grid.send_and_receive(messages, timeout=cfg.reply_timeout)
        reports: list[bytes] = []
        errors = 0
        for reply in replies:
            try:
                if reply.has_error():
                    errors += 1
                    continue
                reports.append(M.envelope_from_record(reply.content[REPORT_KEY]))
            except Exception:  # noqa: BLE001 - a malformed reply is dropped, as in the product
                errors += 1
        del replies, messages
        t2 = time.perf_counter()
        seconds["collect"] = t2 - t1
        acc = ReportAccumulator(self.dim)
        bad = 0
        for payload in reports:
            try:
                acc.add(decode_report(payload, expected_dim=self.dim, expected_log2_grid=self.log2_grid))
            except Exception:  # noqa: BLE001 - a report that does not decode is counted, as in the product
                bad += 1
        t3 = time.perf_counter()
        seconds["aggregate"] = t3 - t2
        if acc.count:
            mean = acc.mean()
            self.arrays = self.optimizer.step(self.arrays, mean if cfg.report == "gradient" else -mean)
        loss, accuracy = (float(v) for v in self.central.evaluate(self.arrays))
        seconds["evaluate"] = time.perf_counter() - t3
        print(f"[noshuffle baseline] round {rnd}: {acc.count} plain reports, accuracy {accuracy:.4f}, "
              f"round {sum(seconds.values()):.2f} s", flush=True)
        return {"round": rnd, "n_sampled": len(sampled), "n_reports": acc.count, "n_errors": errors,
                "n_bad": bad, "accuracy": accuracy, "loss": loss, "seconds": seconds}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """NOT PRIVATE AGAINST THE SERVER: plain noisy reports averaged; per-round timings to baseline_rounds.json.

    With ``paired-benchmark = true`` in the run config, the product's job (``shuffledp.server.job.run_job``: shuffler,
    accountant, ledger) runs instead, and after each of its rounds one plain round runs in the same launch on
    the same nodes (timings to ``paired_rounds.json``): alternating rounds remove the launch-to-launch noise of
    the simulation engine from the comparison.
    """
    cfg = parse_run_config(context.run_config, allow_unknown=True)
    out_dir = cfg.resolved_path(cfg.output_dir) / (cfg.run_name or f"run-{context.run_id}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if context.run_config.get("paired-benchmark"):
        from shuffledp.server.job import run_job

        plain = PlainRounds(grid, cfg)
        doc: dict[str, Any] = {"system": "paired: product rounds, each followed by a plain round (NOT PRIVATE)",
                               "plain_rounds": rows, "finished": False}

        def after_product_round(line: str) -> None:
            print(line, flush=True)
            if line.startswith("[shuffledp] round "):
                rows.append(plain.run_round(len(rows) + 1, settle=0.0))
                (out_dir / PAIRED_FILE).write_text(json.dumps(doc, indent=1) + "\n")

        run_job(cfg, grid, run_id=int(context.run_id), progress=after_product_round, plot=False)
        doc["finished"] = True
        (out_dir / PAIRED_FILE).write_text(json.dumps(doc, indent=1) + "\n")
        return
    plain = PlainRounds(grid, cfg)
    doc = {"system": "no-shuffle baseline (NOT PRIVATE AGAINST THE SERVER)", "rounds": rows, "finished": False}
    for rnd in range(1, cfg.num_server_rounds + 1):
        rows.append(plain.run_round(rnd, settle=3.0 if rnd == 1 else 0.0))
        (out_dir / ROUNDS_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    doc["finished"] = True
    (out_dir / ROUNDS_FILE).write_text(json.dumps(doc, indent=1) + "\n")
