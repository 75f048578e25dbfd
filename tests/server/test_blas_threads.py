"""A fork while another thread is inside a multi-threaded OpenBLAS product hangs OpenBLAS for good (exec_blas
spins for worker threads the fork shut down). It hung `flwr-simulation` once: its ServerApp thread computed the
digits PCA while Ray started processes, 16 minutes at 100% CPU until the end-to-end test's timeout killed the
runner. The processes that load the apps therefore use one BLAS thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_FORKS_WHILE_MULTIPLYING = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    import {module}
    from threadpoolctl import threadpool_info
    blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]  # numpy's, and scipy's if loaded
    assert blas and set(blas) == {{1}}, blas
    x, w = np.ones((1437, 64)), np.ones((64, 10))  # the size of the digits PCA transform
    done = [0]
    def multiply():
        while True:
            x @ w
            done[0] += 1
    threading.Thread(target=multiply, daemon=True).start()
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.001)
    before = done[0]
    time.sleep(0.2)
    assert done[0] > before, "the multiplying thread is stuck"
    print("ok", done[0])
""")


@pytest.mark.parametrize("module", ["shuffledp.server.app", "shuffledp.clients.app"])
def test_loading_an_app_limits_blas_so_a_fork_cannot_hang_it(module: str) -> None:
    """Without the limit this hangs within the first 50 forks on this machine (2 cores; reproduced 3 times of 3),
    and the subprocess times out."""
    res = subprocess.run([sys.executable, "-c", _FORKS_WHILE_MULTIPLYING.format(module=module)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-2000:]


def test_the_runner_gives_every_process_of_the_run_one_blas_thread(tmp_path) -> None:
    from shuffledp.deploy.runner import _flower_env

    assert _flower_env(tmp_path)["OPENBLAS_NUM_THREADS"] == "1"
