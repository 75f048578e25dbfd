"""deploy/proxy.nginx.conf in front of a real SuperLink (the real nginx binary, the real file).

The file is run as written except for what only a container provides: the key paths, the upstream address
(``superlink:8000``), the two listen ports (free ports on 127.0.0.1) and the /tmp prefix of the pid and temporary
files. Behind it: one ``flower-superlink`` with TLS, ``--enable-supernode-auth`` and ``--isolation process``
(the compose set-up). Checked:

* ``flwr supernode register`` succeeds through the control port and fails through the fleet port;
* a SuperNode pointed at the fleet port is activated (node authentication headers pass through the proxy);
* the fleet port refuses the Control and Runtime APIs, /docs, /openapi.json, /health, ``..`` and ``%2e%2e``
  escapes and GET; the control port refuses the Fleet and Runtime APIs; refused requests never reach the
  SuperLink (its access log), while an allowed one does, and a client's X-Forwarded-For is not passed on.

nginx is not installed on every CI machine: the live tests are skipped there, saying so.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shuffledp.deploy.bundle import node_config
from shuffledp.deploy.errors import DeployError
from shuffledp.deploy.flower import (
    flower_env,
    free_port,
    register_supernode,
    start_superlink,
    start_supernode,
    write_flower_config,
    write_toml,
)
from shuffledp.deploy.keys import DeployKeys, create_deploy_keys
from shuffledp.deploy.processes import ProcessGroup, kill_group, log_contains, wait_for

CONF = Path(__file__).resolve().parents[2] / "deploy" / "proxy.nginx.conf"
NGINX = shutil.which("nginx")


def render(text: str, *, keys: DeployKeys, upstream: str, fleet_port: int, control_port: int,
           tmp: Path) -> str:
    """The proxy config with the container-only values replaced; each must occur exactly as often as expected,
    so that a change of the file that this test would no longer cover fails here."""
    substitutions = [
        ("/keys/superlink/superlink.crt", str(keys.superlink_cert.resolve()), 1),
        ("/keys/superlink/superlink.key", str(keys.superlink_key.resolve()), 1),
        ("/keys/superlink/ca.crt", str(keys.superlink_ca_cert.resolve()), 1),
        ("server superlink:8000;", f"server {upstream};", 1),
        ("listen 8000 ssl;", f"listen 127.0.0.1:{fleet_port} ssl;", 1),
        ("listen 9093 ssl;", f"listen 127.0.0.1:{control_port} ssl;", 1),
        ("/tmp/nginx", f"{tmp}/nginx", 6),  # pid and the five temporary paths
    ]
    assert text.count("/keys/") == 3, "a key path this test does not substitute"
    for old, new, count in substitutions:
        assert text.count(old) == count, f"{CONF.name}: expected {count} x {old!r}, found {text.count(old)}"
        text = text.replace(old, new)
    return text


def test_config_static_properties() -> None:
    """What can be read off the file without running it."""
    lines = [line.split("#", 1)[0].strip() for line in CONF.read_text().splitlines()]
    directives = [line for line in lines if line]
    joined = "\n".join(directives)
    assert not any(d.startswith("user ") for d in directives), "a `user` directive breaks non-root runs"
    for needed in ("proxy_ssl_verify on;", "proxy_ssl_name superlink;", "proxy_http_version 1.1;",
                   "proxy_buffering off;", "proxy_request_buffering off;", "pid /tmp/nginx.pid;",
                   "error_log stderr warn;"):
        assert needed in directives, needed
    # a client address is never added (only cleared)
    for header in ("X-Forwarded-For", "X-Real-IP", "Forwarded"):
        assert f'proxy_set_header {header} "";' in directives
    assert "$remote_addr" not in joined and "$proxy_add_x_forwarded_for" not in joined
    assert joined.count("proxy_pass ") == 2 and "/v1/runtime" not in joined
    assert "listen 8000 ssl;" in directives and "listen 9093 ssl;" in directives


@dataclass
class Proxied:
    keys: DeployKeys
    root: Path
    superlink: str
    fleet: int
    control: int
    superlink_log: Path
    group: ProcessGroup


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxied]:
    if NGINX is None:
        pytest.skip("nginx is not installed (apt-get install nginx, or any nginx >= 1.22 with the ssl module, on "
                    "PATH): deploy/proxy.nginx.conf cannot be run here")
    root = tmp_path_factory.mktemp("proxy")
    # as for compose: the SuperLink's certificate names `superlink` (what the proxy verifies) and `proxy`
    keys = create_deploy_keys(root / "keys", 2, k=1, sans=["superlink", "proxy"])
    group = ProcessGroup(grace_seconds=5)
    try:
        superlink_log = root / "superlink.log"
        address = start_superlink(group, keys, root / "superlink", dict(os.environ), superlink_log,
                                     isolation="process")
        fleet, control = free_port(), free_port()
        nginx_dir = root / "nginx"
        nginx_dir.mkdir()
        conf = nginx_dir / "proxy.conf"
        conf.write_text(render(CONF.read_text(), keys=keys, upstream=address, fleet_port=fleet,
                               control_port=control, tmp=nginx_dir))
        # -e: the error log before the config is read (the compiled-in path may not be writable by this user)
        group.start("nginx", [NGINX, "-e", "stderr", "-p", str(nginx_dir), "-c", str(conf), "-g", "daemon off;"],
                    log=root / "nginx.log", env=dict(os.environ))
        wait_for(lambda: _listening(fleet) and _listening(control), 30, "nginx to listen", group)
        yield Proxied(keys, root, address, fleet, control, superlink_log, group)
    finally:
        started = [p.popen for p in group.procs]
        group.stop_all()
        assert all(p.poll() is not None for p in started)


def _logged_since(p: Proxied, offset: int, needle: str) -> str:
    """The SuperLink's log after ``offset``, once it holds ``needle`` (uvicorn writes the access line as the
    response starts; waited for a few seconds at most)."""
    wait_for(lambda: needle in p.superlink_log.read_text()[offset:], 10, f"{needle!r} in the SuperLink log",
                 p.group, interval=0.05)
    return p.superlink_log.read_text()[offset:]


def _client(port: int, ca: Path) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cafile=str(ca))  # verifies the chain and the name 127.0.0.1
    return http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)


def _request(p: Proxied, port: int, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    """Status of one request sent with ``path`` exactly as given (http.client does not normalise it)."""
    conn = _client(port, p.keys.superlink_ca_cert)
    try:
        body = b"" if method == "POST" else None
        conn.request(method, path, body=body, headers={"content-type": "application/protobuf",
                                                       "accept": "application/protobuf", **(headers or {})})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.mark.e2e
def test_register_through_control_port_only(proxied: Proxied, tmp_path: Path) -> None:
    p = proxied
    base_env = dict(os.environ)
    via_fleet = flower_env(tmp_path / "fleet-home", base_env)
    write_flower_config(tmp_path / "fleet-home", f"127.0.0.1:{p.fleet}", p.keys.superlink_ca_cert)
    with pytest.raises(DeployError, match="403 Forbidden"):  # flwr says success false (and exits 0)
        register_supernode(via_fleet, p.keys.supernode_pub(1))
    assert "/v1/control/register-node" not in p.superlink_log.read_text()

    via_control = flower_env(tmp_path / "control-home", base_env)
    write_flower_config(tmp_path / "control-home", f"127.0.0.1:{p.control}", p.keys.superlink_ca_cert)
    node_id = register_supernode(via_control, p.keys.supernode_pub(0))
    assert int(node_id) > 0
    assert p.superlink_log.read_text().count('"POST /v1/control/register-node HTTP/1.1" 200') == 1

    # (b) the registered node, pointed at the fleet port, is activated: its signed requests pass the proxy
    logs = tmp_path / "logs"
    conf = write_toml(tmp_path / "node-0.toml", node_config(p.keys, 0, 2, eps0=1.0, clip_l1=1.0))
    node = start_supernode(p.group, p.keys, 0, f"127.0.0.1:{p.fleet}", conf, tmp_path / "node-0", base_env,
                              logs / "supernode-0.log", max_retries=1)
    wait_for(lambda: log_contains(logs / "supernode-0.log", "SuperNode ID"), 90,
                 "the SuperNode behind the proxy to be activated", p.group)
    assert f"SuperNode ID: {node_id}" in (logs / "supernode-0.log").read_text()
    assert f"Activated node_id={node_id}" in p.superlink_log.read_text()
    assert node.poll() is None
    # stopped here, so that its Fleet calls do not mix with the requests the tests below look for in the log
    kill_group(node, None, 10)
    p.group.forget(node)


_REFUSED_ON_FLEET = [
    ("POST", "/v1/control/list-runs"),
    ("POST", "/v1/control/register-node"),
    ("POST", "/v1/control/start-run"),
    ("POST", "/v1/runtime/acquire-task"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/health"),
    ("POST", "/v1/fleet/../control/list-runs"),
    ("POST", "/v1/fleet/%2e%2e/control/list-runs"),
    ("POST", "/v1/fleet/%2E%2E/%2E%2E/v1/control/list-runs"),
    ("POST", "/v1//control/list-runs"),
    ("POST", "/v1/fleet/pull-messages/../../control/list-runs"),
    ("POST", "/v1/fleet/push-object/extra"),
    ("POST", "/v1/fleet/"),
    ("GET", "/v1/fleet/pull-messages"),
    ("HEAD", "/v1/fleet/get-run"),
    ("PUT", "/v1/fleet/push-object"),
]

_REFUSED_ON_CONTROL = [
    ("POST", "/v1/fleet/pull-messages"),
    ("POST", "/v1/fleet/activate-node"),
    ("POST", "/v1/runtime/acquire-task"),
    ("POST", "/v1/runtime/push-logs"),
    ("POST", "/v1/control/../runtime/acquire-task"),
    ("POST", "/v1/control/%2e%2e/fleet/pull-messages"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/health"),
    ("GET", "/v1/control/list-runs"),
]


def _all_refused(p: "Proxied", port: int, requests: list[tuple[str, str]]) -> str:
    """Send each request to ``port``, assert every answer is the proxy's 403, and return the SuperLink's log as it
    was before them (what they add to it is checked by the caller)."""
    before = p.superlink_log.read_text()
    statuses = {(m, path): _request(p, port, m, path) for m, path in requests}
    assert statuses == {key: 403 for key in statuses}
    return before


@pytest.mark.e2e
def test_fleet_port_refuses_everything_but_the_fleet_api(proxied: Proxied) -> None:
    p = proxied
    before = _all_refused(p, p.fleet, _REFUSED_ON_FLEET)
    # a Fleet route does reach the SuperLink (refused there: no node-auth headers)
    assert _request(p, p.fleet, "POST", "/v1/fleet/get-run") not in (403, 404, 502)
    # requests are answered in order, so the refused ones would be logged before this one
    new = _logged_since(p, len(before), "/v1/fleet/get-run")
    for needle in ("/v1/control", "/v1/runtime", "/docs", "/openapi.json", "/health", "/..", "%2e"):
        assert needle not in new.lower(), f"{needle} reached the SuperLink through the fleet port:\n{new}"


@pytest.mark.e2e
def test_control_port_refuses_everything_but_the_control_api(proxied: Proxied) -> None:
    p = proxied
    before = _all_refused(p, p.control, _REFUSED_ON_CONTROL)
    # the Control API itself is reached, and a client-supplied address header is not passed on (uvicorn would
    # log 203.0.113.9 as the client: it trusts X-Forwarded-For from 127.0.0.1, where the proxy is)
    assert _request(p, p.control, "POST", "/v1/control/list-runs",
                    headers={"X-Forwarded-For": "203.0.113.9", "X-Real-IP": "203.0.113.9",
                             "Forwarded": "for=203.0.113.9"}) == 200
    new = _logged_since(p, len(before), '"POST /v1/control/list-runs HTTP/1.1" 200')
    assert "203.0.113.9" not in new
    for needle in ("/v1/fleet", "/v1/runtime", "/docs", "/openapi.json", "/health", "/..", "%2e"):
        assert needle not in new.lower(), f"{needle} reached the SuperLink through the control port:\n{new}"


@pytest.mark.e2e
def test_direct_superlink_port_serves_everything(proxied: Proxied) -> None:
    """The reason for the proxy: the SuperLink itself answers the Control API and /docs on its one port."""
    p = proxied
    port = int(p.superlink.rsplit(":", 1)[1])
    assert _request(p, port, "GET", "/docs") == 200
    assert _request(p, port, "POST", "/v1/control/list-runs") == 200
    # and it believes X-Forwarded-For from 127.0.0.1: the proxy test above would see a header passed on
    before = p.superlink_log.read_text()
    assert _request(p, port, "POST", "/v1/control/list-runs", headers={"X-Forwarded-For": "198.51.100.7"}) == 200
    assert "198.51.100.7" in _logged_since(p, len(before), "/v1/control/list-runs")
