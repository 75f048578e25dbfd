"""Everything that starts or talks to a Flower process: one environment, one TOML writer, one ``--run-config``
rule, one SuperLink launcher, the SuperNode and executor launchers, and the ``flwr`` CLI call.

Environment
    :func:`flower_env` is the environment of every Flower process ``shuffledp run`` and ``shuffledp deploy``
    start: the caller's environment without any inherited ``FLWR_*`` variable (so a user's ``FLWR_HOME`` or
    setting never leaks into a run), plus :data:`FLOWER_ENV` (no telemetry, no update check, no runtime
    dependency installation, one OpenBLAS thread) and a per-run ``FLWR_HOME``.

``--run-config``
    :data:`RUN_CONFIG_RULE`, read by :func:`parse_run_config_args` for both ``shuffledp run`` and ``shuffledp
    deploy local``: each ``--run-config`` value holds one or more space-separated ``key=value`` pairs, values in
    TOML syntax or bare strings, and the flag may repeat (a later key wins).

SuperLink
    :func:`start_superlink` starts ``flower-superlink`` (TLS with node authentication for ``deploy local``,
    insecure in simulation mode for ``shuffledp run``) and waits until its HTTP API listens.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tomli_w

from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.processes import ProcessGroup, log_contains, wait_for
from shuffledp.deploy.validation import check_isolation

__all__ = [
    "CONNECTION_NAME",
    "FLOWER_ENV",
    "RUN_CONFIG_RULE",
    "flower_env",
    "toml_value",
    "toml_text",
    "write_toml",
    "write_flower_config",
    "parse_run_config_args",
    "run_config_arg",
    "flower_bin",
    "flwr",
    "json_from_output",
    "register_supernode",
    "free_port",
    "start_superlink",
    "start_serverapp_executor",
    "start_supernode",
    "start_supernodes",
]

#: Name of the SuperLink connection written to a run's own ``FLWR_HOME/config.toml``.
CONNECTION_NAME = "shuffledp-local"
#: Set in every Flower process: no telemetry, no update check, no ``uv sync`` of the app's dependencies, and one
#: OpenBLAS thread (see server/app.py: a fork during a multi-threaded matrix product hangs OpenBLAS for good).
FLOWER_ENV: Mapping[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
#: How ``--run-config`` is read (``shuffledp run`` and ``shuffledp deploy local``).
RUN_CONFIG_RULE = ("each --run-config value holds one or more space-separated key=value pairs, values in TOML "
                   "syntax (2, 0.5, true, 'text') or bare strings, or is the path of a .toml file of such keys; the "
                   "flag may repeat, and each key is given once")
#: What uvicorn logs once the SuperLink's HTTP API listens.
_SUPERLINK_READY = "Uvicorn running on"
#: What uvicorn logs when the SuperNode's Runtime HTTP API port was taken (errno 98 on Linux).
_PORT_TAKEN = "address already in use"


class FlowerKeys(Protocol):
    """The TLS files the Flower launchers read (:class:`shuffledp.deploy.keys.DeployKeys` has them)."""

    @property
    def superlink_ca_cert(self) -> Path:
        """The CA the SuperLink's certificate chains to."""

    @property
    def superlink_cert(self) -> Path:
        """The SuperLink's TLS certificate."""

    @property
    def superlink_key(self) -> Path:
        """The SuperLink's TLS key."""

    @property
    def superexec_secret(self) -> Path:
        """The secret a separate ServerApp executor presents."""

    def supernode_key(self, i: int) -> Path:
        """Device ``i``'s SuperNode authentication key."""


def flower_env(flwr_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one Flower process (see the module docstring).

    Args:
        flwr_home: its ``FLWR_HOME`` (a run's own; never the user's).
        base: the environment to start from (default ``os.environ``); its ``FLWR_*`` variables are dropped.

    Returns:
        ``base`` without ``FLWR_*``, with :data:`FLOWER_ENV` and ``FLWR_HOME``.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("FLWR_")}
    env.update(FLOWER_ENV)
    env["FLWR_HOME"] = str(flwr_home)
    return env


# --------------------------------------------------------------------------------------------------------------
# TOML


def _scalar(value: object) -> bool:
    return isinstance(value, (bool, int, float, str))


def toml_value(value: object) -> str:
    """One value in TOML syntax, as ``flwr run --run-config "key=value"`` reads it.

    Returns:
        The TOML literal (``true``, ``3``, ``2.5``, ``"text"``).

    Raises:
        DeployUsageError: ``value`` is not a boolean, integer, float or string.
    """
    if not _scalar(value):
        raise DeployUsageError(f"a run-config value must be a boolean, integer, float or string, got "
                               f"{type(value).__name__} {value!r}")
    return tomli_w.dumps({"v": value})[len("v = "):].rstrip("\n")


def toml_text(values: Mapping[str, Any], comment: str | None = None) -> str:
    """A TOML document of ``values`` (tables nest), after a ``# comment`` line if given.

    Returns:
        The document.

    Raises:
        DeployError: a value TOML cannot hold.
    """
    try:
        text = tomli_w.dumps(dict(values))
    except TypeError as exc:
        raise DeployError(f"cannot write {dict(values)!r} as TOML: {exc}") from None
    return (f"# {comment}\n" if comment else "") + text


def write_toml(path: Path, values: Mapping[str, object], mode: int = 0o644) -> Path:
    """Write a flat TOML table (Flower's ``--node-config``/``--run-config`` files accept one).

    Returns:
        ``path``.

    Raises:
        DeployError: a value that is not a boolean, integer, float or string.
    """
    for key, value in values.items():
        if not _scalar(value):
            raise DeployError(f"cannot write {key} = {type(value).__name__} {value!r} to a Flower config")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_text(values))
    os.chmod(path, mode)
    return path


def write_flower_config(flwr_home: Path, address: str, root_certificates: Path | None,
                        name: str = CONNECTION_NAME) -> Path:
    """Write ``FLWR_HOME/config.toml`` with one SuperLink connection, the default (``flwr run``/``supernode``).

    Args:
        flwr_home: the run's ``FLWR_HOME``.
        address: the SuperLink's ``host:port``.
        root_certificates: the CA the SuperLink's TLS certificate chains to; None: an insecure connection.
        name: the connection's name.

    Returns:
        The config file's path.
    """
    connection: dict[str, object] = {"address": address}
    if root_certificates is None:
        connection["insecure"] = True
    else:
        connection["root-certificates"] = str(root_certificates.resolve())
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(toml_text({"superlink": {"default": name, name: connection}}))
    return path


# --------------------------------------------------------------------------------------------------------------
# --run-config


def parse_run_config_args(items: Sequence[str]) -> dict[str, object]:
    """The run-config overrides of the ``--run-config`` values ``items`` (:data:`RUN_CONFIG_RULE`).

    ``"eps0=2 min-reports=10"`` in one flag and ``eps0=2`` and ``min-reports=10`` in two give the same dict.
    The pairs are split shell-style: quotes group words and are removed (``run-name='my run'``); then a value
    that is not valid TOML is taken as a string, as Flower does for node config. A value without ``=`` that names
    a ``.toml`` file is read as a table of such keys (what ``flwr run --run-config FILE`` takes).

    Returns:
        ``{key: value}``.

    Raises:
        DeployUsageError: a pair without ``=`` or key, unbalanced quotes, a TOML array or table as value, a key
            given twice (in pairs or files), or a file that cannot be read or is not a flat TOML table.
    """
    out: dict[str, object] = {}

    def put(key: str, value: object, raw: str) -> None:
        if not _scalar(value):
            raise DeployUsageError(f"--run-config {key}: the value {raw!r} is a TOML {type(value).__name__}; a "
                                   f"run-config value is a boolean, integer, float or string ({RUN_CONFIG_RULE})")
        if key in out:
            raise DeployUsageError(f"--run-config gives {key} twice ({out[key]!r} and {value!r}); give it once")
        out[key] = value

    for item in items:
        if "=" not in item and item.strip().endswith(".toml"):
            for key, value in _run_config_file(Path(item.strip())).items():
                put(key, value, repr(value))
            continue
        try:
            tokens = shlex.split(item)
        except ValueError as exc:
            raise DeployUsageError(f"--run-config {item!r}: {exc}; {RUN_CONFIG_RULE}") from None
        if not tokens:
            raise DeployUsageError(f"--run-config {item!r} holds no key=value pair; {RUN_CONFIG_RULE}")
        for token in tokens:
            key, sep, raw = token.partition("=")
            key = key.strip()
            if not sep or not key:
                raise DeployUsageError(f"--run-config expects key=value pairs, got {token!r}: {RUN_CONFIG_RULE}")
            try:
                value = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw
            put(key, value, raw)
    return out


def _run_config_file(path: Path) -> dict[str, object]:
    """The keys of a run-config file: a flat TOML table (as ``flwr run --run-config FILE`` reads it).

    Raises:
        DeployUsageError: it cannot be read or parsed.
    """
    try:
        return dict(tomllib.loads(path.expanduser().read_text()))
    except OSError as exc:
        raise DeployUsageError(f"--run-config {str(path)!r}: cannot read the file ({exc.strerror or exc}); "
                               f"{RUN_CONFIG_RULE}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DeployUsageError(f"--run-config {str(path)!r} is not valid TOML ({exc})") from None


def run_config_arg(values: Mapping[str, object]) -> str:
    """``values`` as one ``flwr run --run-config`` argument.

    Returns:
        ``key=value`` pairs, space-separated, values in TOML syntax.
    """
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


# --------------------------------------------------------------------------------------------------------------
# the flwr CLI


def flower_bin(name: str) -> str:
    """Path of a Flower console script, preferring the one next to this interpreter.

    Returns:
        The path.

    Raises:
        DeployError: it is neither there nor on PATH.
    """
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise DeployError(f"{name} not found next to {sys.executable} nor on PATH; install flwr (pip install flwr)")
    return found


def flwr(env: Mapping[str, str], args: Sequence[str], *, cwd: Path | None = None,
         timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``flwr ARGS`` with ``env`` and wait.

    Returns:
        The completed process (its output captured as text; a non-zero exit is not raised).
    """
    return subprocess.run([flower_bin("flwr"), *args], env=dict(env), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def json_from_output(text: str) -> dict[str, Any]:
    """The JSON object in ``flwr ... --format json`` output (Flower may print a banner line before it).

    Returns:
        The object.

    Raises:
        DeployError: there is none.
    """
    start = text.find("{")
    if start < 0:
        raise DeployError(f"expected JSON from flwr, got: {text.strip()[:500]}")
    try:
        doc = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise DeployError(f"could not parse flwr's JSON output ({exc}): {text.strip()[:500]}") from exc
    if not isinstance(doc, dict):
        raise DeployError(f"expected a JSON object from flwr, got {doc!r}")
    return doc


def register_supernode(cli_env: Mapping[str, str], public_key: Path) -> str:
    """``flwr supernode register`` one public key.

    Returns:
        The node id the SuperLink assigned.

    Raises:
        DeployError: the SuperLink refused it, or flwr failed.
    """
    res = flwr(cli_env, ["supernode", "register", str(public_key), CONNECTION_NAME, "--format", "json"])
    if res.returncode != 0:
        raise DeployError(f"flwr supernode register {public_key} failed (exit {res.returncode}): "
                          f"{(res.stdout + res.stderr).strip()[-800:]}")
    doc = json_from_output(res.stdout)
    if not doc.get("success") or "node-id" not in doc:
        raise DeployError(f"flwr supernode register {public_key} did not return a node id: {doc}")
    return str(doc["node-id"])


# --------------------------------------------------------------------------------------------------------------
# launchers


#: Ports this process has handed out with :func:`free_port` (host, port); never handed out twice.
_HANDED_OUT: set[tuple[str, int]] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago and that this process has not handed out before.

    Flower's processes take their port on the command line, so the port is chosen here and bound seconds later by
    the child. The kernel may offer the same free port to two consecutive ``bind(port 0)`` calls (two SuperNodes
    started back to back got the same port and the second died with EADDRINUSE), so the ports handed out are
    remembered. A port taken by an unrelated process in between is still possible; :func:`start_supernodes`
    restarts a SuperNode that lost its port that way.

    Returns:
        The port.

    Raises:
        DeployError: the kernel kept offering ports already handed out.
    """
    with _HANDED_OUT_LOCK:
        for _ in range(256):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if (host, port) not in _HANDED_OUT:
                _HANDED_OUT.add((host, port))
                return port
    raise DeployError(f"the kernel offered only ports already handed out on {host} (256 tries)")


def start_superlink(group: ProcessGroup, keys: FlowerKeys | None, state_dir: Path, base_env: Mapping[str, str],
                    log: Path, *, host: str = "127.0.0.1", port: int | None = None, ready_timeout: float = 120.0,
                    isolation: str = "subprocess", simulation: bool = False, flwr_home: Path | None = None,
                    cwd: Path | None = None, adopt: bool = True) -> str:
    """Start ``flower-superlink`` with a file database and wait until its HTTP API listens.

    Args:
        group: the group it is started in (named ``flower-superlink``).
        keys: TLS and node authentication with these files (``deploy local``); None: ``--insecure``.
        state_dir: holds its database ``state.db``.
        base_env: the environment :func:`flower_env` starts from.
        log: its output (appended; only what it writes from now on counts for readiness).
        host, port: where it listens (default: a :func:`free_port`).
        ready_timeout: seconds to wait until it listens.
        isolation: ``subprocess``: it starts its own ServerApp executor; ``process``: it waits for a separate one
            (:func:`start_serverapp_executor`, the ``serverapp`` container of deploy/compose.yml) that must present
            ``superlink/superexec.secret``.
        simulation: run apps in Flower's simulation runtime (``shuffledp run``).
        flwr_home: its ``FLWR_HOME`` (default ``state_dir/flwr-home``).
        cwd: its working directory, where its executor runs the ServerApp (default ``state_dir``).
        adopt: once it listens, stop the session in which it started its executor with its group
            (:meth:`ProcessGroup.adopt_sessions`); ``shuffledp run`` names every descendant itself instead.

    Returns:
        ``host:port``.

    Raises:
        DeployUsageError: a bad ``isolation``, or ``process`` isolation without TLS.
        DeployError: it exited, or did not listen within ``ready_timeout``.
    """
    check_isolation("isolation", isolation)
    if isolation == "process" and keys is None:
        raise DeployUsageError("isolation 'process' needs the SuperExec secret of a key directory")
    port = free_port(host) if port is None else port
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [flower_bin("flower-superlink"), "--host", host, "--port", str(port), "--database",
            str(state_dir / "state.db"), "--disable-runtime-dependency-installation", "--isolation", isolation]
    if keys is None:
        argv.append("--insecure")
    else:
        argv += ["--ssl-ca-certfile", str(keys.superlink_ca_cert), "--ssl-certfile", str(keys.superlink_cert),
                 "--ssl-keyfile", str(keys.superlink_key), "--enable-supernode-auth"]
    if simulation:
        argv.append("--simulation")
    if isolation == "process" and keys is not None:
        argv += ["--superexec-auth-secret-file", str(keys.superexec_secret)]
    offset = log.stat().st_size if log.exists() else 0
    popen = group.start("flower-superlink", argv, log=log,
                        env=flower_env(flwr_home or state_dir / "flwr-home", base_env), cwd=cwd or state_dir)
    wait_for(lambda: log_contains(log, _SUPERLINK_READY, offset), ready_timeout, "the SuperLink to listen", group)
    if adopt:
        group.adopt_sessions(popen)  # its ServerApp executor (subprocess isolation), started before it listens
    return f"{host}:{port}"


def start_serverapp_executor(group: ProcessGroup, keys: FlowerKeys, superlink: str, state_dir: Path,
                             base_env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``flower-superexec`` against the SuperLink's Runtime API (TLS, shared secret), as the ``serverapp``
    container of deploy/compose.yml does; it runs each submitted ServerApp in ``state_dir``.

    Returns:
        The started process.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    return group.start("flower-superexec (ServerApp)", [
        flower_bin("flower-superexec"), "--runtime-api-address", superlink,
        "--root-certificates", str(keys.superlink_ca_cert),
        "--superexec-auth-secret-file", str(keys.superexec_secret),
    ], log=log, env=flower_env(state_dir / "flwr-home", base_env), cwd=state_dir)


def start_supernode(group: ProcessGroup, keys: FlowerKeys, index: int, superlink: str, node_config_file: Path,
                    state_dir: Path, base_env: Mapping[str, str], log: Path, *,
                    host: str = "127.0.0.1", max_retries: int | None = None) -> subprocess.Popen[bytes]:
    """Start one ``flower-supernode`` authenticating with ``supernodes/node-<index>.key`` over TLS.

    Returns:
        The started process.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        flower_bin("flower-supernode"), "--superlink", superlink,
        "--root-certificates", str(keys.superlink_ca_cert),
        "--auth-supernode-private-key", str(keys.supernode_key(index)),
        "--node-config", str(node_config_file), "--host", host, "--port", str(free_port(host)),
    ]
    if max_retries is not None:
        argv += ["--max-retries", str(max_retries)]
    return group.start(f"flower-supernode {index}", argv, log=log,
                       env=flower_env(state_dir / "flwr-home", base_env), cwd=state_dir)


def start_supernodes(group: ProcessGroup, keys: FlowerKeys, superlink: str, node_config_files: Sequence[Path],
                     state_root: Path, base_env: Mapping[str, str], logs: Path, *, host: str = "127.0.0.1",
                     timeout: float = 120.0, port_attempts: int = 3) -> None:
    """Start SuperNode ``i`` with ``node_config_files[i]`` for every i, then wait until each is accepted.

    All are started before any is waited for (each spends seconds importing Flower). A SuperNode whose Runtime
    HTTP API port was taken between :func:`free_port` and its own bind exits with EADDRINUSE; it is restarted on
    a fresh port, at most ``port_attempts`` times in all.

    Raises:
        DeployError: any other exit (naming the node and its log), or a node not accepted within ``timeout``.
    """
    if port_attempts < 1:
        raise DeployError(f"port_attempts must be >= 1, got {port_attempts}")
    logs_of = [logs / f"supernode-{i}.log" for i in range(len(node_config_files))]

    def start(i: int) -> subprocess.Popen[bytes]:
        return start_supernode(group, keys, i, superlink, node_config_files[i], state_root / f"node-{i}", base_env,
                               logs_of[i], host=host)

    procs = [start(i) for i in range(len(node_config_files))]
    for i, log in enumerate(logs_of):
        attempts = 1
        deadline = time.monotonic() + timeout
        while not log_contains(log, "SuperNode ID"):
            code = procs[i].poll()
            if code is not None and attempts < port_attempts and log.read_text(errors="replace").count(
                    _PORT_TAKEN) == attempts:
                group.forget(procs[i])
                attempts += 1
                procs[i] = start(i)
                continue
            group.check_alive()
            if time.monotonic() > deadline:
                raise DeployError(f"timed out after {timeout:.0f} s waiting for SuperNode {i} to be accepted by "
                                  "the SuperLink")
            time.sleep(0.2)
