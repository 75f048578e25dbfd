"""The shuffled round engine as a Flower Message-API strategy, for any ServerApp.

:class:`ShuffleStrategy` is a ``flwr.serverapp.strategy.Strategy``: a ServerApp builds it from its
``Context`` and calls :meth:`ShuffleStrategy.start` with its own model and, optionally, its own central
evaluation, as it would call ``FedAvg.start``::

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = ShuffleStrategy.from_context(context)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                evaluate_fn=my_central_evaluation)

What it does per round is :class:`shuffledp.server.rounds.RoundEngine`'s: it sends ``train.shuffled`` to the
sampled nodes (whose ClientApps carry :func:`shuffledp.clients.mod.shuffle_mod`), relays the sealed envelopes to
the shuffler as they arrive, charges the accountant and the ledger with the shuffler's signed count before it
fetches, decodes the shuffled reports into a running mean, takes one server-optimizer step, checkpoints, resumes
after a crash and stops before a round that would exceed ``budget-epsilon``.

Why ``start`` is overridden rather than the ``configure_train``/``aggregate_train`` pair that Flower's default
``start`` loop calls: that loop waits for every reply of a round (``Grid.send_and_receive``) and then hands the
replies, with their metadata, to ``aggregate_train``. The shuffled protocol must stream each envelope to the
shuffler as it arrives, drop the reply and its metadata at once, bind the round to the model sent before
anything is collected, charge the accountant before anything is released, and keep a crash-consistent ledger;
none of these can be split across two callbacks of another loop. So the two train hooks refuse to run alone
(with this reason) and ``start`` runs the whole protocol. There is no federated evaluation: a client's metric on
its own data would leave it next to its node id, outside the shuffle; ``configure_evaluate`` sends nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from shuffledp.server.config import ConfigError, ServerConfig, parse_run_config
from shuffledp.server.job import JobResult, run_job

__all__ = ["ShuffleStrategy", "EvaluateFn"]

#: Flower's central evaluation callback: ``evaluate_fn(server_round, arrays) -> MetricRecord | None``.
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]

_SEPARATE_HOOKS = (
    "ShuffleStrategy runs its rounds in start(): the shuffled protocol streams each envelope to the shuffler as "
    "it arrives and charges the accountant before anything is released, which a separate configure_train / "
    "aggregate_train pair cannot do. Call strategy.start(grid=..., initial_arrays=...)"
)


def _arrays_of(record: ArrayRecord) -> tuple[list[str], list[np.ndarray]]:
    """The record's names and numpy arrays, in its stored order (the order the reports are flattened in)."""
    if not isinstance(record, ArrayRecord):
        raise TypeError(f"initial_arrays must be a flwr.app.ArrayRecord, got {type(record).__name__}")
    if len(record) == 0:
        raise ValueError("initial_arrays is empty: the strategy needs the model to send")
    names = list(record.keys())
    return names, [np.array(a, copy=True) for a in record.to_numpy_ndarrays()]


def _record_of(names: Sequence[str], arrays: Sequence[np.ndarray]) -> ArrayRecord:
    return ArrayRecord({n: Array.from_numpy_ndarray(np.ascontiguousarray(a)) for n, a in zip(names, arrays)})


class ShuffleStrategy(Strategy):
    """Federated rounds in the shuffle model of differential privacy, as a Flower strategy.

    Args:
        config: the run configuration: a validated :class:`ServerConfig`, or a raw run config mapping (keys of
            ``[tool.flwr.app.config]``; missing keys take :data:`shuffledp.server.config.DEFAULTS`; keys this
            project does not know are kept for the app, not refused, since an app has settings of its own).
        run_id: Flower's run id; names the output folder ``<output-dir>/run-<run_id>`` when ``run-name`` is empty.
        node_wait: seconds to wait for at least ``min-reports`` nodes before each round.
        base: directory relative paths in the config resolve against (default: the working directory).
        progress: where the per-round progress lines go (default: stdout).
        plot: also write ``accuracy_epsilon.png`` next to ``report.json``.
        report_sections: more top-level sections of report.json, e.g. ``{"data": ...}`` saying what each split of
            your dataset did (which one the test metrics come from, which one anything was fitted on).
    """

    def __init__(
        self,
        config: ServerConfig | Mapping[str, Any],
        *,
        run_id: int = 0,
        node_wait: float = 120.0,
        base: Path | None = None,
        progress: Callable[[str], None] | None = None,
        plot: bool = True,
        report_sections: Mapping[str, Any] | None = None,
    ) -> None:
        self.report_sections = dict(report_sections or {})
        self.config = config if isinstance(config, ServerConfig) else parse_run_config(config, allow_unknown=True)
        self.run_id = int(run_id)
        self.node_wait = float(node_wait)
        self.base = base
        self.progress = progress
        self.plot = plot
        #: what the last :meth:`start` produced (paths, history, report.json's document), or None
        self.job: JobResult | None = None

    @classmethod
    def from_context(cls, context: Context, **kwargs: Any) -> ShuffleStrategy:
        """The strategy for this ServerApp run: its run config and run id (``kwargs`` as for the constructor)."""
        return cls(context.run_config, run_id=int(context.run_id), **kwargs)

    # -- Flower's strategy interface ---------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Not used on its own; raises TypeError (see the module docstring: :meth:`start` runs the rounds)."""
        raise TypeError(_SEPARATE_HOOKS)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Not used on its own; raises TypeError (see the module docstring: :meth:`start` runs the rounds)."""
        raise TypeError(_SEPARATE_HOOKS)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No federated evaluation (a client's metric would leave its node outside the shuffle): returns []."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """No federated evaluation: returns None."""
        return None

    def summary(self) -> None:
        """Log the run's privacy settings to Flower's log, as Flower's strategies do when they start."""
        c = self.config
        clip = f"clip-l1={c.clip_l1:g}" if c.mechanism == "laplace" else f"clip-l2={c.clip_l2:g}"
        flwr_log(INFO, f"ShuffleStrategy: {c.mechanism} mechanism, eps0={c.eps0:g} per report, {clip}, "
                       f"report={c.report}, min-reports k={c.min_reports}, budget epsilon={c.budget_epsilon:g} at "
                       f"delta={c.target_delta:g} ({c.accounting_family}, upper bound), {c.num_server_rounds} "
                       f"rounds, server optimizer {c.server_optimizer} lr {c.server_lr:g}")

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Run (or resume) the shuffled rounds on ``grid`` and return the final model and the server's metrics.

        Args:
            grid: the ServerApp's Grid.
            initial_arrays: the model of round 1 (ignored when the run resumes from its checkpoint). Its names,
                order, shapes and dtypes are what the clients receive and must reply with.
            num_rounds: rounds to run (round ids 1..num_rounds); None: the run config's ``num-server-rounds``.
            timeout: seconds to wait for the replies of a round; None: the run config's ``reply-timeout``.
            train_config: more entries for the clients' train config (e.g. your handler's own settings); a key of
                the protocol's own train config (eps0, clip-l1, local-lr, ...) is refused: those come from the
                run config, where the clients' pinned values are checked against them.
            evaluate_config: unused (there is no federated evaluation); must be None or empty.
            evaluate_fn: central evaluation ``evaluate_fn(server_round, arrays) -> MetricRecord | None`` after each
                applied round; its ``"loss"`` and ``"accuracy"`` entries, when present, are what report.json and
                the progress lines show. None: no evaluation (the progress lines say accuracy n/a).

        Returns:
            ``flwr.serverapp.strategy.Result``: ``arrays`` is the final model (the names of ``initial_arrays``);
            ``evaluate_metrics_serverapp`` maps each applied round to ``evaluate_fn``'s metrics plus the
            cumulative ``epsilon`` (the default family's upper bound at ``target-delta``). No client metrics.

        Raises:
            ConfigError: a bad argument or run config (nothing has been sent).
            shuffledp.server.rounds.ResumeError: the run's checkpoint and ledger do not agree.
        """
        cfg = self.config
        if num_rounds is not None:
            if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
                raise ConfigError(f"num_rounds must be an int >= 1 (or None for the run config's), got {num_rounds!r}")
            cfg = replace(cfg, num_server_rounds=num_rounds)
        if timeout is not None:
            if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= cfg.reply_floor:
                raise ConfigError(f"timeout must be a finite number of seconds above reply-floor "
                                  f"({cfg.reply_floor:g}), got {timeout!r}")
            cfg = replace(cfg, reply_timeout=float(timeout))
        if evaluate_config:
            raise ConfigError("evaluate_config is not used: the strategy has no federated evaluation (a client's "
                              "metric would leave its node outside the shuffle); evaluate centrally with evaluate_fn")
        names, arrays = _arrays_of(initial_arrays)
        metrics: dict[int, MetricRecord] = {}
        state = {"round": 0}

        def on_round_started(round_id: int) -> None:
            state["round"] = round_id

        def evaluator(current: Sequence[np.ndarray]) -> tuple[float | None, float | None]:
            if evaluate_fn is None:
                return None, None
            result = evaluate_fn(state["round"], _record_of(names, current))
            if result is None:
                return None, None
            metrics[state["round"]] = result
            loss, accuracy = result.get("loss"), result.get("accuracy")
            return (None if loss is None else float(loss)), (None if accuracy is None else float(accuracy))

        self.summary()
        job = run_job(cfg, grid, run_id=self.run_id, evaluator=evaluator, initial_arrays=arrays,
                      array_names=names, train_config=dict(train_config or {}), node_wait=self.node_wait,
                      base=self.base, progress=self.progress, plot=self.plot, on_round_started=on_round_started,
                      report_sections=self.report_sections)
        self.job = job
        served: dict[int, MetricRecord] = {}
        for outcome in job.history:
            if outcome.status != "applied" or outcome.epsilon is None:
                continue
            record = MetricRecord(dict(metrics.get(outcome.round, MetricRecord())))
            record["epsilon"] = float(outcome.epsilon)
            served[outcome.round] = record
        return Result(arrays=_record_of(names, job.arrays), evaluate_metrics_serverapp=served)
