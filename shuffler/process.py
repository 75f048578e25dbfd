"""``ShufflerProcess``: run the shuffler service as a child process (for the runner, deployments and tests).

Starts ``python -m shuffledp.shuffler.cli shuffler serve --config F --port-file P``, waits until the service has written
its bound port (it does so only after recovery and ``server.start()``), then, when it has credentials (or the
config is insecure), until the gRPC health service answers SERVING. ``stop()`` sends SIGTERM (graceful: the
service drains in-flight RPCs); ``kill()`` sends SIGKILL (crash tests). ``on_spawn`` is called with the child's
pid as soon as it exists, before the wait (``shuffledp deploy local`` hands it to its watchdog there).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import shuffler_pb2_grpc as pb_grpc
from shuffledp.shuffler.config import load_config

__all__ = ["ShufflerProcess", "ShufflerStartError"]


class ShufflerStartError(RuntimeError):
    """The service did not become ready; the message includes the tail of its log."""


class ShufflerProcess:
    """A shuffler service subprocess. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        root_certificate: bytes | None = None,
        client_certificate: bytes | None = None,
        client_key: bytes | None = None,
        startup_timeout: float = 30.0,
        log_path: str | os.PathLike[str] | None = None,
        on_spawn: Callable[[int], None] | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.config = load_config(self.config_path)  # fail early on a bad config
        self._creds = (root_certificate, client_certificate, client_key)
        if any(c is not None for c in self._creds) and any(c is None for c in self._creds):
            raise ValueError("health checks over mTLS need root_certificate, client_certificate and client_key")
        self.startup_timeout = startup_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="shuffler-proc-")
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / "shuffler.log"
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._on_spawn = on_spawn

    @property
    def address(self) -> str:
        """``host:port`` the running shuffler listens on (the config's host, the port it reported)."""
        if self.port is None:
            raise RuntimeError("the shuffler process is not running")
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def pid(self) -> int:
        """The process id of the running shuffler."""
        if self.proc is None:
            raise RuntimeError("the shuffler process is not running")
        return self.proc.pid

    def start(self) -> "ShufflerProcess":
        """Start the shuffler process and wait for the port it reports; returns ``self``.

        When the health check can be reached (insecure, or with all three TLS files), also wait until it reports
        SERVING.

        Raises:
            RuntimeError: it is already running.
            ShufflerStartError: it exited, or did not start in time (the message ends with its log's tail).
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("already running")
        port_file = Path(self._tmp.name) / "port"
        port_file.unlink(missing_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shuffledp.shuffler.cli",
                    "shuffler",
                    "serve",
                    "--config",
                    str(self.config_path),
                    "--port-file",
                    str(port_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        if self._on_spawn is not None:
            self._on_spawn(self.proc.pid)
        deadline = time.monotonic() + self.startup_timeout
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise ShufflerStartError(f"shuffler exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise ShufflerStartError(
                    f"shuffler did not report a port in {self.startup_timeout}s:\n{self.log_tail()}"
                )
            time.sleep(0.02)
        self.port = int(port_file.read_text().strip())
        if self.config.insecure or all(c is not None for c in self._creds):
            self._wait_healthy(deadline)
        return self

    def _channel(self) -> grpc.Channel:
        if self.config.insecure:
            return grpc.insecure_channel(self.address)
        root, cert, key = self._creds
        creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(self.address, creds)

    def health(self, timeout: float = 2.0) -> str:
        """The health status name (``SERVING``, ``NOT_SERVING``, ...) of the shuffler service."""
        with self._channel() as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="shuffledp.shuffler.v1.Shuffler"), timeout=timeout
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def spent_epoch_batches(self, timeout: float = 10.0) -> tuple[int, int]:
        """The service's key epoch and how many batches of it it has already released (its Stats)."""
        with self._channel() as ch:
            resp = pb_grpc.ShufflerStub(ch).Stats(pb.StatsRequest(), timeout=timeout)
        return int(resp.key_epoch), int(resp.epoch_batches_released)

    def _wait_healthy(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ShufflerStartError(f"shuffler exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.health() == "SERVING":
                    return
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.05)
        self.kill()
        raise ShufflerStartError(f"shuffler not healthy in time ({last}):\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the shuffler's log (empty if there is no log yet)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 25.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout``). Returns the exit code. The default leaves room for the
        service's graceful stop: 10 s of gRPC grace, then up to 5 s for open batches (ShufflerCore.close)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.port = None
        return rc

    def kill(self) -> None:
        """SIGKILL (no cleanup in the child): for crash tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.port = None

    def __enter__(self) -> "ShufflerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()
