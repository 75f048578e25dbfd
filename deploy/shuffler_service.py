"""The shuffler service of ``shuffledp deploy local``: started with its own key files (mTLS), checked for a spent
key epoch before any SuperNode starts, and stopped with its temporary files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shuffledp.deploy.errors import DeployError
from shuffledp.deploy.keys import DeployKeys
from shuffledp.deploy.watchdog import DeployWatchdog, Kind

__all__ = ["start_shuffler", "refuse_a_spent_key_epoch", "stop_shuffler"]


def start_shuffler(keys: DeployKeys, log: Path, *, watchdog: DeployWatchdog | None = None) -> Any:
    """Start the shuffler service from ``DIR/shuffler.toml`` (mTLS) and wait until it answers health checks
    over mTLS with the ServerApp's client certificate.

    Its process is named to ``watchdog`` as soon as it exists; if it fails to start, or this is interrupted
    meanwhile, it is stopped here.

    Returns:
        The running :class:`shuffledp.shuffler.process.ShufflerProcess` (stop it with :func:`stop_shuffler`).

    Raises:
        DeployError: it did not start.
    """
    from shuffledp.shuffler.process import ShufflerProcess, ShufflerStartError

    log.parent.mkdir(parents=True, exist_ok=True)
    proc = ShufflerProcess(keys.shuffler_config, root_certificate=keys.shuffler_ca_cert.read_bytes(),
                           client_certificate=keys.serverapp_cert.read_bytes(),
                           client_key=keys.serverapp_key.read_bytes(), log_path=log, startup_timeout=90.0,
                           on_spawn=None if watchdog is None else lambda pid: watchdog.watch(pid, Kind.PROCESS))
    try:
        proc.start()
    except BaseException as exc:
        stop_shuffler(proc, watchdog)  # the caller never gets it
        if isinstance(exc, ShufflerStartError):
            raise DeployError(f"the shuffler service did not start: {exc}") from exc
        raise
    return proc


def refuse_a_spent_key_epoch(proc: Any, key_epoch: int) -> None:
    """Refuse, before any SuperNode starts, a key epoch whose batches the shuffler has already released.

    The ServerApp would refuse it too (a fresh accountant cannot start at 0 for reports already released), but
    only after the whole deployment has started, and only in its own log.

    Raises:
        DeployError: the shuffler released batches of ``key_epoch``, or did not answer.
    """
    import grpc

    try:
        epoch, released = proc.spent_epoch_batches()
    except grpc.RpcError as exc:
        raise DeployError(f"the shuffler did not answer its Stats call ({exc.code().name}: {exc.details()}); "
                          f"see its log") from None
    if epoch == key_epoch and released > 0:
        raise DeployError(
            f"the shuffler has already released {released} batch(es) of key epoch {key_epoch} (its journal is in "
            "these keys' directory), so a new run with them would start its accountant at 0 for reports that were "
            "already released. Rotate the keys to a new key epoch (deploy/README.md, key rotation) or use new keys")


def stop_shuffler(proc: Any, watchdog: DeployWatchdog | None = None) -> None:
    """Stop a :class:`shuffledp.shuffler.process.ShufflerProcess` (SIGTERM, SIGKILL if it does not stop in time),
    remove its temporary files, and tell ``watchdog`` it is stopped."""
    popen = proc.proc
    proc.__exit__(None, None, None)
    if watchdog is not None and popen is not None and popen.poll() is not None:
        watchdog.forget(popen.pid, Kind.PROCESS)
