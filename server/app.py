"""The Flower ServerApp of shuffledp (``[tool.flwr.app.components] serverapp = "shuffledp.server.app:app"``).

``@app.main()`` drives the rounds itself with the Grid (no ``Strategy.start``: FedAvg would need per-client
metrics and plaintext arrays). Everything it does is in :func:`shuffledp.server.job.run_job`; see
:mod:`shuffledp.server.rounds` for one round.

Keys: the simulated ClientApps read ``keys-dir`` from the same run config, so the server and the clients must
agree on one key directory. ``shuffledp run`` creates fresh keys for each run in ``outputs/<run>/keys`` and
passes absolute paths for ``keys-dir`` and ``output-dir``, because the simulated apps run in the working
directory of the SuperLink process, not in the project. Plain ``flwr run .`` works the same way once a key
directory exists (absolute paths; and without Flower's per-run ``uv sync``, which needs the network)::

    export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0
    shuffledp keys init --out "$PWD/keys" --clients 1437 --k 1000
    flwr run . --run-config "keys-dir='$PWD/keys' output-dir='$PWD/outputs'" \
        --federation-config "num-supernodes=1437 client-resources-num-cpus=1" --stream

Without ``keys-dir`` the ServerApp stops at once with a message saying this. (Flower's managed local SuperLink
keeps running after ``flwr run``; ``shuffledp run`` starts and stops a private one instead.)

(In simulation every client key lives in that one directory: a simulation-only trust shortcut. In a deployment
each device holds only its own key, named by its node config.)
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from threadpoolctl import threadpool_limits

from shuffledp.server.config import parse_run_config
from shuffledp.server.job import run_job

__all__ = ["app"]

# numpy's OpenBLAS with more than one thread hangs for good (exec_blas spinning for workers that a fork took away)
# when one thread forks while another is inside a matrix product: seen in `flwr-simulation`, whose ServerApp
# thread computed the PCA while Ray started its processes (16 min at 100% CPU, then the test's timeout). Every
# product here is small, and faster on one thread; so the process that loads this app uses one BLAS thread.
# (`shuffledp run` also sets OPENBLAS_NUM_THREADS=1 for everything it starts.)
threadpool_limits(limits=1, user_api="blas")

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run (or resume) the configured job on this Grid; outputs go to ``<output-dir>/<run-name>/``."""
    logging.getLogger("shuffledp").setLevel(logging.INFO)
    config = parse_run_config(context.run_config)
    run_job(config, grid, run_id=int(context.run_id))
