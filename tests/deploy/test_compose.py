"""deploy/compose.yml and the Dockerfiles, checked without a Docker engine.

What can be checked here: the YAML parses; every build context, Dockerfile and COPY source exists (and is not
excluded by the Dockerfile's .dockerignore); every host path a service mounts exists once ``deploy keys`` and
``deploy bundle`` have run; every flag in every service command is a flag of the real CLI (its ``--help``); the
shuffler is isolated (internal network shared only with the ServerApp executor, no published port, its key
files mounted nowhere else); the SuperLink publishes no port and is reached only through the proxy, whose
mounts and ports match deploy/proxy.nginx.conf (run for real by test_proxy.py); the compose run config is
accepted by the server's run-config parser.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shuffledp.deploy.bundle import create_device_bundle
from shuffledp.deploy.keys import DeployKeys, create_deploy_keys

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "compose.yml"
PROXY_CONF = DEPLOY / "proxy.nginx.conf"
#: The one service that runs an upstream image instead of one built from deploy/.
PROXY_IMAGE = "nginx:1.27-alpine"
_VAR = re.compile(r"\$\{(?P<name>[A-Z_][A-Z0-9_]*)(?::?[?-][^}]*)?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def env_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("compose")
    keys = create_deploy_keys(root / "keys", 2, sans=["superlink", "proxy", "shuffler"])
    for i in (0, 1):
        create_device_bundle(keys, i, root / "devices" / f"node-{i}", eps0=4.0, clip_l1=1.0, prefix="/device")
    return {"SHUFFLEDP_KEYS": str(keys.root), "SHUFFLEDP_DEVICES": str(root / "devices")}


def _expand(text: str, env: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in env:
            raise KeyError(f"compose file uses ${{{name}}}, which the test does not provide")
        return env[name]

    return _VAR.sub(repl, text)


def test_services_and_isolation(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"superlink", "proxy", "serverapp", "shuffler", "supernode-0", "supernode-1"} <= set(services)
    networks = compose["networks"]
    assert networks["shuffle"]["internal"] is True and networks["control"]["internal"] is True
    on_shuffle = sorted(name for name, s in services.items() if "shuffle" in s.get("networks", []))
    assert on_shuffle == ["serverapp", "shuffler"]
    assert services["shuffler"]["networks"] == ["shuffle"]
    published = sorted(name for name, s in services.items() if s.get("ports"))
    assert published == ["proxy"]
    assert all("ports" not in s or name == "proxy" for name, s in services.items())


def _on(services: dict[str, Any], network: str) -> list[str]:
    return sorted(name for name, s in services.items() if network in s.get("networks", []))


def test_superlink_is_reached_only_through_the_proxy(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "ports" not in services["superlink"] and "expose" not in services["superlink"]
    proxy = services["proxy"]
    assert proxy["image"] == PROXY_IMAGE and "build" not in proxy
    # the fleet port for the devices; every other published port bound to the host's loopback only
    ports = [str(p) for p in proxy["ports"]]
    assert ports == ["8000:8000", "127.0.0.1:9093:9093"]
    for spec in ports:
        assert spec.split(":")[-1] == "8000" or spec.startswith("127.0.0.1:"), spec
    # networks: fleet (published) = proxy + demo devices; edge (internal) = proxy + SuperLink;
    # control (internal) = SuperLink + executor; the SuperLink is on no network with a published port
    networks = compose["networks"]
    assert networks["edge"]["internal"] is True and not (networks["fleet"] or {}).get("internal")
    assert _on(services, "fleet") == ["proxy", "supernode-0", "supernode-1"]
    assert _on(services, "edge") == ["proxy", "superlink"]
    assert _on(services, "control") == ["serverapp", "superlink"]
    assert sorted(proxy["networks"]) == ["edge", "fleet"]
    assert sorted(services["superlink"]["networks"]) == ["control", "edge"]
    assert all(networks[n].get("internal") is True for n in services["superlink"]["networks"])
    # devices go through the proxy; the executor talks to the Runtime API directly (never through the proxy)
    for name in ("supernode-0", "supernode-1"):
        command = [str(c) for c in services[name]["command"]]
        assert command[command.index("--superlink") + 1] == "proxy:8000", name
        assert "proxy" in services[name]["depends_on"]
    executor = [str(c) for c in services["serverapp"]["command"]]
    assert executor[executor.index("--runtime-api-address") + 1] == "superlink:8000"
    assert "superlink" in proxy["depends_on"]
    # runs as a non-root uid (the SuperLink's, which owns superlink.key), read-only with a /tmp of its own
    assert str(proxy["user"]) == "10001:10001" and "--uid 10001 " in (DEPLOY / "Dockerfile.superlink").read_text()
    assert proxy["read_only"] is True and proxy["tmpfs"] == ["/tmp"]


def test_proxy_mounts_and_config_agree(compose: dict[str, Any], env_dirs: dict[str, str]) -> None:
    """The proxy mounts its config, the SuperLink's certificate, key and CA certificate, read-only and nothing
    else; the paths, upstream and ports in deploy/proxy.nginx.conf are the ones compose provides."""
    keys = Path(env_dirs["SHUFFLEDP_KEYS"])
    proxy = compose["services"]["proxy"]
    mounts = dict((dst, src) for src, dst in _mounts(proxy, env_dirs))
    assert all(str(v).endswith(":ro") for v in proxy["volumes"])
    assert (DEPLOY / mounts.pop("/etc/nginx/nginx.conf")).resolve() == PROXY_CONF
    assert mounts == {
        "/keys/superlink/ca.crt": str(keys / "superlink" / "ca.crt"),
        "/keys/superlink/superlink.crt": str(keys / "superlink" / "superlink.crt"),
        "/keys/superlink/superlink.key": str(keys / "superlink" / "superlink.key"),
    }
    # no private key but the SuperLink's TLS key, no CA key, no secret: every private file of the key directory
    private = {f for f in keys.rglob("*") if f.is_file() and (f.suffix in (".key", ".secret") or b"PRIVATE KEY"
                                                               in f.read_bytes())}
    assert keys / "superlink" / "ca.key" in private and keys / "tls" / "ca.key" in private
    mounted_private = {Path(src) for src in mounts.values()} & private
    assert mounted_private == {keys / "superlink" / "superlink.key"}
    holders = sorted(name for name, service in compose["services"].items()
                     if any(Path(src) == keys / "superlink" / "superlink.key" for src, _ in _mounts(service, env_dirs)))
    assert holders == ["proxy", "superlink"]
    # the config refers to exactly these files, the SuperLink service's port, and the published ports
    conf = PROXY_CONF.read_text()
    assert set(re.findall(r"/keys/\S+?(?=;)", conf)) == set(mounts)
    superlink = [str(c) for c in compose["services"]["superlink"]["command"]]
    assert re.findall(r"^\s*server (\S+);", conf, re.M) == [f"superlink:{superlink[superlink.index('--port') + 1]}"]
    assert re.findall(r"^\s*listen (\d+) ssl;", conf, re.M) == ["8000", "9093"]
    assert re.search(r"^\s*proxy_ssl_name superlink;", conf, re.M)


def _mounts(service: dict[str, Any], env: dict[str, str]) -> list[tuple[str, str]]:
    """(host source, container target) of each volume, with ${VAR} expanded (named volumes kept by name)."""
    out = []
    for volume in service.get("volumes", []):
        src, dst = _expand(volume, env).split(":")[:2]
        out.append((src, dst))
    return out


def test_private_keys_are_mounted_only_into_their_party(compose: dict[str, Any], env_dirs: dict[str, str]) -> None:
    keys = Path(env_dirs["SHUFFLEDP_KEYS"])
    owners = {
        keys / "shuffler": "shuffler",  # the shuffler's HPKE and signing keys
        keys / "tls" / "shuffler.key": "shuffler",
        keys / "enrolment.json": "shuffler",
        keys / "server": "serverapp",  # the server's HPKE key
        keys / "tls" / "serverapp.key": "serverapp",
    }
    never = {keys / "superlink" / "ca.key", keys / "tls" / "ca.key"}  # CA keys stay offline
    found = set()
    for name, service in compose["services"].items():
        for src, _ in _mounts(service, env_dirs):
            host = Path(src)
            for secret, owner in owners.items():
                if host == secret or secret in host.parents or host in secret.parents:
                    assert name == owner, f"{name} mounts {host}, which only {owner} may hold"
                    found.add(secret)
            for secret in never:
                assert not (host == secret or secret in host.parents), f"{name} mounts the CA key {secret}"
            assert host not in (keys, keys / "clients", keys / "supernodes", keys / "tls"), (
                f"{name} mounts the whole directory {host}")
    assert found == set(owners)


def test_build_contexts_dockerfiles_and_copy_sources(compose: dict[str, Any]) -> None:
    built = 0
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is None:
            if name == "proxy":  # the one upstream image, pinned to a minor version
                assert service["image"] == PROXY_IMAGE
                continue
            # must reuse an image another service builds
            with_build = [s for s in compose["services"].values() if s.get("build")]
            assert any(s.get("image") == service["image"] for s in with_build), name
            continue
        context = (DEPLOY / build["context"]).resolve()
        assert context.is_dir(), f"{name}: build context {context} does not exist"
        dockerfile = context / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        assert ignore.is_file(), f"{name}: {ignore} missing (the context is the repository root)"
        kept = {line[1:].rstrip("/") for line in ignore.read_text().splitlines() if line.startswith("!")}
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                sources = [p for p in line.split()[1:-1] if not p.startswith("--")]
                for src in sources:
                    assert (context / src).exists(), f"{name}: COPY source {src} missing"
                    assert src.rstrip("/") in kept, f"{name}: COPY source {src} excluded by {ignore.name}"
        assert re.search(r"^USER \S+", dockerfile.read_text(), re.M), f"{name}: image runs as root"
        built += 1
    assert built == 4


def test_mounted_host_paths_exist(compose: dict[str, Any], env_dirs: dict[str, str]) -> None:
    checked = 0
    for name, service in compose["services"].items():
        for src, _ in _mounts(service, env_dirs):
            if src.startswith("./"):  # relative to the compose file's folder
                assert (DEPLOY / src).is_file(), f"{name}: {src} does not exist next to compose.yml"
                checked += 1
                continue
            if not src.startswith("/"):
                assert src in compose.get("volumes", {}), f"{name}: named volume {src} not declared"
                continue
            assert Path(src).exists(), f"{name}: mounted path {src} does not exist after deploy keys/bundle"
            checked += 1
    assert checked >= 19


@functools.lru_cache(maxsize=None)
def _help(*cmd: str) -> str:
    exe = shutil.which(cmd[0]) or str(Path(sys.executable).parent / cmd[0])
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", COLUMNS="200")
    res = subprocess.run([exe, *cmd[1:], "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, f"{' '.join(cmd)} --help failed: {res.stderr[-500:]}"
    return res.stdout


def _help_for(command: list[str]) -> str:
    if command[0] == "shuffledp":
        return _help("shuffledp", "shuffler", "serve")
    return _help(command[0])


def test_commands_use_real_flags(compose: dict[str, Any]) -> None:
    seen = 0
    for name, service in compose["services"].items():
        command = service["command"]
        assert isinstance(command, list) and command, f"{name}: command must be an exec-form list"
        if name == "proxy":  # nginx has no --help; its config is run for real by test_proxy.py
            assert command == ["nginx", "-g", "daemon off;"]
            continue
        text = _help_for([str(c) for c in command])
        flags = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", text))
        for i, arg in enumerate(map(str, command)):
            if arg.startswith("--"):
                assert arg in flags, f"{name}: {command[0]} has no flag {arg}"
                seen += 1
                choices = re.search(re.escape(arg) + r" \{([a-z,]+)\}", text)
                if choices:
                    assert str(command[i + 1]) in choices.group(1).split(","), f"{name}: bad value for {arg}"
    assert seen >= 20
    sl = [str(c) for c in compose["services"]["superlink"]["command"]]
    assert "--enable-supernode-auth" in sl and "--insecure" not in sl and "--ssl-certfile" in sl


def test_compose_configs_are_accepted(env_dirs: dict[str, str]) -> None:
    import tomllib

    from shuffledp.server.config import parse_run_config
    from shuffledp.shuffler.config import load_config

    keys = DeployKeys(Path(env_dirs["SHUFFLEDP_KEYS"]))
    conf = load_config(keys.compose_shuffler_config)
    assert conf.address == "0.0.0.0:7070" and conf.tls is not None and conf.tls.client_common_names == ("serverapp",)
    overrides = tomllib.loads(keys.compose_run_config.read_text())
    parsed = parse_run_config(overrides)
    assert parsed.shuffler_address == "shuffler:7070" and parsed.keys_dir == "/keys"
    node = tomllib.loads((Path(env_dirs["SHUFFLEDP_DEVICES"]) / "node-1" / "node-config.toml").read_text())
    assert node["partition-id"] == 1 and node["num-partitions"] == 2 and node["client-key"] == "/device/client.key"
    # the TLS certificates carry the compose service names the other containers use
    from cryptography import x509

    for cert_path in (keys.superlink_cert, keys.root / "tls" / "shuffler.crt"):
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
        assert {"superlink", "proxy", "shuffler", "localhost"} <= set(names), cert_path


_BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed in this image")
        return None
sys.meta_path.insert(0, Block())
"""


def _import_without(blocked: list[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCKER + code, ",".join(blocked)], capture_output=True, text=True,
                          timeout=120, cwd=DEPLOY.parent)


def test_shuffler_image_needs_only_the_dependencies_its_dockerfile_installs() -> None:
    """Dockerfile.shuffler installs cryptography, blake3, pynacl, grpcio, grpcio-health-checking, protobuf and numpy
    only."""
    code = ("import shuffledp.shuffler.cli, shuffledp.shuffler.service, shuffledp.shuffler.core, "
            "shuffledp.shuffler.journal, shuffledp.shuffler.config, shuffledp.shuffler.keys, shuffledp.shuffler.tls, "
            "shuffledp.shuffler.attestation, shuffledp.shuffler.envelope\n"
            "from shuffledp.deploy.cli import main\n"
            "raise SystemExit(main(['shuffler', 'serve', '--help']))\n")
    res = _import_without(["scipy", "torch", "flwr", "sklearn", "matplotlib", "dp_accounting", "ray"], code)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--config" in res.stdout


def test_client_image_dependencies_suffice_for_the_clientapp() -> None:
    """Dockerfile.client installs flwr, numpy, cryptography, scikit-learn and CPU PyTorch (no Ray, no
    matplotlib, no dp-accounting)."""
    code = ("import shuffledp.clients.app, shuffledp.clients.core, shuffledp.clients.data, shuffledp.clients.models\n"
            "print(shuffledp.clients.app.app)\n")
    res = _import_without(["matplotlib", "dp_accounting", "ray"], code)
    assert res.returncode == 0, res.stderr[-2000:]
