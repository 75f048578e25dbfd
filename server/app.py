"""The Flower ServerApp of shuffledp (``[tool.flwr.app.components] serverapp = "shuffledp.server.app:app"``).

``@app.main()`` is a user of :class:`shuffledp.server.strategy.ShuffleStrategy`, as any Flower app can be: the
strategy runs the shuffled rounds (see :mod:`shuffledp.server.rounds` for one round); this app adds the project's
own model (``model``) and central evaluation on the held-out test split (``dataset``).

Keys: the server and the simulated ClientApps must agree on one key directory. In a simulation whose run config
leaves ``keys-dir`` empty (plain ``flwr run .``), the ServerApp counts the nodes, creates the run's keys in
``<output-dir>/<run-name or run-<run id>>/keys`` and the ClientApps find theirs there
(:mod:`shuffledp.clients.run_paths`); if there are fewer nodes than ``min-reports``, it lowers that threshold to
the node count and says so. ``shuffledp run`` creates the keys itself and passes absolute paths. Relative paths
resolve against the working directory of the SuperLink that runs the simulation: for Flower's managed local
SuperLink, the directory of the first ``flwr run`` that started it. Without Flower's per-run ``uv sync``
(which needs the network) set ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``.

(In simulation every client key lives in that one directory: a simulation-only trust shortcut. In a deployment
each device holds only its own key, named by its node config, and an empty ``keys-dir`` is refused.)
"""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from threadpoolctl import threadpool_limits

from shuffledp.clients import flower_sim
from shuffledp.server.config import parse_run_config
from shuffledp.server.strategy import ShuffleStrategy

__all__ = ["app"]

# numpy's OpenBLAS with more than one thread hangs for good (exec_blas spinning for workers that a fork took away)
# when one thread forks while another is inside a matrix product: seen in `flwr-simulation`, whose ServerApp
# thread computed the PCA while Ray started its processes (16 min at 100% CPU, then the test's timeout). Every
# product here is small, and faster on one thread; so the process that loads this app uses one BLAS thread.
# (`shuffledp run` also sets OPENBLAS_NUM_THREADS=1 for everything it starts.)
threadpool_limits(limits=1, user_api="blas")
# In a simulation this process also runs Flower's engine: give its in-memory LinkState a per-node index (a round of N
# clients is O(N) instead of O(N^2) there; see shuffledp.clients.flower_sim, which the ClientApp installs too). No
# effect on a deployment's SuperLink.
flower_sim.install()

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run (or resume) the configured job on this Grid; outputs go to ``<output-dir>/<run-name>/``."""
    from shuffledp.server.evaluation import CentralEvaluator

    logging.getLogger("shuffledp").setLevel(logging.INFO)
    config = parse_run_config(context.run_config)  # the project's own app: an unknown key is a typo, refused
    central = CentralEvaluator(config)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, accuracy = central.evaluate(arrays.to_numpy_ndarrays())
        return MetricRecord({"loss": float(loss), "accuracy": float(accuracy)})

    strategy = ShuffleStrategy(config, run_id=int(context.run_id),
                               report_sections={"data": central.dataset.describe_splits()})
    strategy.start(grid=grid, initial_arrays=ArrayRecord(central.initial_arrays()), evaluate_fn=evaluate)
