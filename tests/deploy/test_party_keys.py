"""Per-party keys (``deploy keys --party``): each party's directory holds its own secrets only, and the parties'
directories, joined by public hand-overs alone, run a real mTLS shuffle that the server can verify and open."""

from __future__ import annotations

import base64
import os
import shutil
import stat
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from shuffledp.deploy import party_keys as dk
from shuffledp.deploy.deploy_cli import main as deploy_main
from shuffledp.deploy.errors import DeployError
from shuffledp.deploy.keys import DeployKeys, create_deploy_keys
from shuffledp.shuffler import envelope, tls
from shuffledp.shuffler import keys as shuffler_keys
from shuffledp.shuffler.client import ShufflerClient
from shuffledp.shuffler.process import ShufflerProcess, ShufflerStartError

NODES = 3


def _hand_over(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)


def _parties(root: Path, nodes: int = NODES) -> tuple[Path, Path, list[Path]]:
    """The three kinds of party make their keys apart, then exchange public files only (deploy/README.md)."""
    server = dk.create_server_keys(root / "server", sans=["shuffler.internal"]).root
    shuffler = dk.create_shuffler_keys(root / "shuffler", k=2, sans=["shuffler.internal"]).root
    devices = [dk.create_device_keys(root / f"device-{i}", i) for i in range(nodes)]
    enrolment = shuffler / "enrolment.json"
    for i, device in enumerate(devices):  # the enrolment authority enrols each device's public key
        shuffler_keys.enrol_client(enrolment, shuffler_keys.client_id(i), device / "client.pub")
    # the shuffler operator answers the server's signing request and publishes its CA and signing key
    dk.sign_serverapp_request(shuffler, server / "tls" / "serverapp.csr", root / "serverapp.crt")
    _hand_over(root / "serverapp.crt", server / "tls" / "serverapp.crt")
    _hand_over(shuffler / "tls" / "ca.crt", server / "tls" / "ca.crt")
    _hand_over(shuffler / "public" / "shuffler_signing.pub", server / "public" / "shuffler_signing.pub")
    return server, shuffler, devices


def test_each_party_holds_its_own_secrets_only_and_they_run_a_shuffle(tmp_path: Path) -> None:
    server, shuffler, devices = _parties(tmp_path)
    assert dk.check_party_directory(server) == []
    assert dk.check_party_directory(shuffler) == []
    # no private key of one party exists in another's directory: compare every key file's bytes
    secrets_of = {p: {f.read_bytes() for f in p.rglob("*")
                      if f.is_file() and stat.S_IMODE(f.stat().st_mode) == 0o600}
                  for p in (server, shuffler, *devices)}
    for a, held in secrets_of.items():
        assert held, a
        for b, other in secrets_of.items():
            assert a == b or not held & other, (a, b)

    s, v = DeployKeys(server), shuffler_keys.KeyDirectory(shuffler)
    proc = ShufflerProcess(v.config, root_certificate=s.shuffler_ca_cert.read_bytes(),
                           client_certificate=s.serverapp_cert.read_bytes(),
                           client_key=s.serverapp_key.read_bytes(), log_path=tmp_path / "shuffler.log")
    proc.start()
    try:
        digest = envelope.model_digest([b"model"])
        payloads = [bytes([i]) * 64 for i in range(NODES)]
        sealed = [envelope.seal(payloads[i],
                                server_public_key=shuffler_keys.load_public_key(s.server_public_key, "x25519"),
                                shuffler_public_key=shuffler_keys.load_public_key(v.shuffler_hpke_pub, "x25519"),
                                signing_key=shuffler_keys.load_private_key(d / "client.key", "ed25519"),
                                key_epoch=0, round_id=7, model_digest=digest) for i, d in enumerate(devices)]
        verify_key = shuffler_keys.load_public_key(server / "public" / "shuffler_signing.pub", "ed25519")
        with ShufflerClient(proc.address, root_certificate=s.shuffler_ca_cert.read_bytes(),
                            client_certificate=s.serverapp_cert.read_bytes(),
                            client_key=s.serverapp_key.read_bytes(), shuffler_verify_key=verify_key,
                            max_message_bytes=1 << 20) as client:
            attestation = client.submit(round_id=7, key_epoch=0, model_digest=digest, envelopes=sealed)
            inner = client.fetch_all(attestation)
        assert attestation.n_accepted == NODES
        server_key = shuffler_keys.load_private_key(server / "server" / "hpke.key", "x25519")
        opened = [envelope.open_inner(c, server_private_key=server_key, key_epoch=0, round_id=7) for c in inner]
        assert sorted(opened) == sorted(payloads)
    finally:
        proc.stop()


def test_the_shuffler_refuses_to_start_below_k_enrolled(tmp_path: Path) -> None:
    server = dk.create_server_keys(tmp_path / "server").root
    shuffler = dk.create_shuffler_keys(tmp_path / "shuffler", k=2).root
    device = dk.create_device_keys(tmp_path / "device-0", 0)
    shuffler_keys.enrol_client(shuffler / "enrolment.json", "client-0", device / "client.pub")
    dk.sign_serverapp_request(shuffler, server / "tls" / "serverapp.csr", server / "tls" / "serverapp.crt")
    s = DeployKeys(server)
    proc = ShufflerProcess(shuffler / "shuffler.toml", root_certificate=(shuffler / "tls" / "ca.crt").read_bytes(),
                           client_certificate=s.serverapp_cert.read_bytes(), client_key=s.serverapp_key.read_bytes(),
                           log_path=tmp_path / "shuffler.log", startup_timeout=60.0)
    with pytest.raises(ShufflerStartError, match="k = 2 exceeds the 1 enrolled"):
        proc.start()


def test_check_names_foreign_secrets_missing_hand_overs_and_loose_modes(tmp_path: Path) -> None:
    server = dk.create_server_keys(tmp_path / "server").root
    shuffler = dk.create_shuffler_keys(tmp_path / "shuffler", k=1).root
    problems = dk.check_party_directory(server)
    assert any("missing tls/serverapp.crt" in p and "sign-serverapp" in p for p in problems)
    assert any("missing public/shuffler_signing.pub" in p for p in problems)
    assert any("missing enrolment.json" in p and "keys enrol" in p for p in dk.check_party_directory(shuffler))
    # a server that also holds the shuffler's HPKE key could open reports before they are shuffled
    _hand_over(shuffler / "shuffler" / "hpke.key", server / "shuffler" / "hpke.key")
    assert any("shuffler/hpke.key is a secret of the shuffler" in p for p in dk.check_party_directory(server))
    os.chmod(server / "server" / "hpke.key", 0o644)
    assert any("server/hpke.key is readable by others" in p for p in dk.check_party_directory(server))
    os.chmod(server / "public", 0o777)
    assert any("public is writable by others" in p for p in dk.check_party_directory(server))
    # a certificate issued for another key, or by another CA, is named
    other = dk.create_server_keys(tmp_path / "other").root
    dk.sign_serverapp_request(shuffler, other / "tls" / "serverapp.csr", server / "tls" / "serverapp.crt")
    _hand_over(shuffler / "tls" / "ca.crt", server / "tls" / "ca.crt")
    assert any("is not the certificate of tls/serverapp.key" in p for p in dk.check_party_directory(server))
    another = dk.create_shuffler_keys(tmp_path / "another", k=1).root
    (server / "tls" / "serverapp.crt").unlink()
    dk.sign_serverapp_request(another, server / "tls" / "serverapp.csr", server / "tls" / "serverapp.crt")
    assert "tls/serverapp.crt was not issued by tls/ca.crt" in dk.check_party_directory(server)
    one_dir = create_deploy_keys(tmp_path / "all", 2)
    assert "holds every party's secrets" in dk.check_party_directory(one_dir.root)[0]


def test_party_directories_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        roots = [dk.create_server_keys(tmp_path / "server").root, dk.create_shuffler_keys(tmp_path / "sh", k=1).root,
                 dk.create_device_keys(tmp_path / "device", 4)]
    finally:
        os.umask(old)
    for root in roots:
        assert stat.S_IMODE(root.stat().st_mode) == 0o700, root
        for p in root.rglob("*"):
            mode = stat.S_IMODE(p.stat().st_mode)
            assert not mode & 0o022, (p, oct(mode))
            if p.suffix in (".key", ".secret"):
                assert mode == 0o600, (p, oct(mode))


def test_sign_serverapp_uses_only_the_requests_key(tmp_path: Path) -> None:
    shuffler = dk.create_shuffler_keys(tmp_path / "shuffler", k=1).root
    ca_cert = (shuffler / "tls" / "ca.crt").read_bytes()
    # a request asking to be a server certificate for another name still yields a client-only "serverapp" leaf
    csr, _key = tls.create_csr("shuffler")
    (tmp_path / "req.csr").write_bytes(csr)
    cert = dk.sign_serverapp_request(shuffler, tmp_path / "req.csr", tmp_path / "app.crt").read_bytes()
    assert tls.certificate_common_name(cert) == "serverapp"
    leaf = x509.load_pem_x509_certificate(cert)
    assert list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_cert))
    # a tampered request (its signature no longer verifies) and garbage are refused with the reason
    der = x509.load_pem_x509_csr(csr).public_bytes(serialization.Encoding.DER)
    tampered = der.replace(b"shuffler", b"shufflex")  # the subject changed after signing
    body = base64.encodebytes(tampered).replace(b"\n", b"")
    pem = b"-----BEGIN CERTIFICATE REQUEST-----\n" + b"\n".join(
        body[i:i + 64] for i in range(0, len(body), 64)) + b"\n-----END CERTIFICATE REQUEST-----\n"
    (tmp_path / "bad.csr").write_bytes(pem)
    with pytest.raises(DeployError, match="signature does not verify"):
        dk.sign_serverapp_request(shuffler, tmp_path / "bad.csr", tmp_path / "bad.crt")
    (tmp_path / "junk.csr").write_bytes(b"junk")
    with pytest.raises(DeployError, match="not a PEM PKCS#10 request"):
        dk.sign_serverapp_request(shuffler, tmp_path / "junk.csr", tmp_path / "bad.crt")
    assert not (tmp_path / "bad.crt").exists()
    with pytest.raises(DeployError, match="already exists"):
        dk.sign_serverapp_request(shuffler, tmp_path / "req.csr", tmp_path / "app.crt")
    with pytest.raises(DeployError, match="--keys must be the shuffler operator's directory"):
        dk.sign_serverapp_request(tmp_path / "req.csr", tmp_path / "req.csr", tmp_path / "x.crt")


def test_party_keys_refuse_a_used_directory_and_bad_parameters(tmp_path: Path) -> None:
    dk.create_device_keys(tmp_path / "d", 0)
    with pytest.raises(DeployError, match="not an empty directory"):
        dk.create_device_keys(tmp_path / "d", 0)
    with pytest.raises(DeployError, match="--k must be an integer"):
        dk.create_shuffler_keys(tmp_path / "s", k=0)
    with pytest.raises(DeployError, match="--node must be an integer"):
        dk.create_device_keys(tmp_path / "d2", -1)
    assert not (tmp_path / "s").exists() and not (tmp_path / "d2").exists()


def _deploy(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = deploy_main(["deploy", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_per_party_flow_through_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, shuffler, device = tmp_path / "server", tmp_path / "shuffler", tmp_path / "device"
    assert _deploy(capsys, "keys", "--party", "server", "--out", server, "--san", "superlink.example.org")[0] == 0
    assert _deploy(capsys, "keys", "--party", "shuffler", "--out", shuffler, "--k", 1)[0] == 0
    code, out = _deploy(capsys, "keys", "--party", "device", "--out", device, "--node", 1)
    assert code == 0 and "client.pub to the shuffler operator (enrolled as client-1)" in out
    # flags of another party, and a missing one, are refused before anything is written
    for argv, message in ((["--party", "device", "--node", "0", "--nodes", "3"],
                           "--nodes does not apply to --party device"),
                          (["--party", "server", "--k", "2"], "--k does not apply to --party server"),
                          (["--party", "shuffler"], "--party shuffler needs --k"),
                          (["--nodes", "2", "--node", "1"], "--node does not apply to --party all")):
        code, out = _deploy(capsys, "keys", "--out", tmp_path / "refused", *argv)
        assert code == 2 and message in out, out  # a usage error
        assert not (tmp_path / "refused").exists()
    code, out = _deploy(capsys, "check", "--keys", server)
    assert code == 1 and "missing tls/serverapp.crt" in out and "problem(s)" in out

    # the hand-overs: public files and one signing request
    assert _deploy(capsys, "sign-serverapp", "--keys", shuffler, "--csr", server / "tls" / "serverapp.csr",
                   "--out", server / "tls" / "serverapp.crt")[0] == 0
    _hand_over(shuffler / "tls" / "ca.crt", server / "tls" / "ca.crt")
    _hand_over(shuffler / "public" / "shuffler_signing.pub", server / "public" / "shuffler_signing.pub")
    shuffler_keys.enrol_client(shuffler / "enrolment.json", "client-1", device / "client.pub")
    public = {"--superlink-ca": server / "superlink" / "ca.crt",
              "--server-public-key": server / "public" / "server_hpke.pub",
              "--shuffler-public-key": shuffler / "public" / "shuffler_hpke.pub"}
    flags = [str(x) for pair in public.items() for x in pair]
    code, out = _deploy(capsys, "bundle", "--device", device, "--nodes", 3, "--eps0", 2, "--clip-l1", 1,
                        "--out", tmp_path / "b")
    assert code == 2 and "takes no --node or --out" in out
    swapped = flags.copy()
    swapped[1] = str(public["--server-public-key"])  # a public key where the SuperLink CA belongs
    code, out = _deploy(capsys, "bundle", "--device", device, "--nodes", 3, "--eps0", 2, "--clip-l1", 1, *swapped)
    assert code == 1 and "cannot be this device's superlink-ca.crt" in out
    assert not (device / "node-config.toml").exists() and not (device / "server_hpke.pub").exists()
    code, out = _deploy(capsys, "bundle", "--device", device, "--nodes", 3, "--eps0", 2, "--clip-l1", 1,
                        "--dataset", "digits", *flags)
    assert code == 0, out
    conf = tomllib.loads((device / "node-config.toml").read_text())
    assert (conf["partition-id"], conf["num-partitions"], conf["eps0"]) == (1, 3, 2.0)
    assert shuffler_keys.load_private_key(conf["client-key"], "ed25519")
    assert shuffler_keys.load_public_key(conf["server-public-key"], "x25519") == shuffler_keys.load_public_key(
        public["--server-public-key"], "x25519")
    code, out = _deploy(capsys, "bundle", "--device", device, "--nodes", 3, "--eps0", 2, "--clip-l1", 1, *flags)
    assert code == 2 and "already complete" in out  # an output that exists: a usage error

    prints = {}
    for party in (server, shuffler, device):
        code, out = _deploy(capsys, "check", "--keys", party)
        assert code == 0 and "ok: nothing is wrong" in out, out
        prints[party.name] = {line.split()[2]: line.split()[1] for line in out.splitlines()
                              if line.startswith("sha256 ")}
    # the fingerprints the two ends print for one hand-over agree, so they can be compared over another channel
    assert prints["device"]["server_hpke.pub"] == prints["server"]["public/server_hpke.pub"]
    assert prints["device"]["shuffler_hpke.pub"] == prints["shuffler"]["public/shuffler_hpke.pub"]
    assert prints["server"]["tls/ca.crt"] == prints["shuffler"]["tls/ca.crt"]


def test_what_travels_is_checked_by_content_not_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A public file with a private key appended, a secret under another name, a server certificate
    in the ServerApp's place, too few enrolled clients, one key pinned twice, an encrypted key."""
    server, shuffler, devices = _parties(tmp_path, nodes=2)
    device = devices[0]
    ca, server_pub = server / "superlink" / "ca.crt", server / "public" / "server_hpke.pub"
    shuffler_pub = shuffler / "public" / "shuffler_hpke.pub"
    leaky = tmp_path / "leaky.pub"
    leaky.write_bytes(server_pub.read_bytes() + (server / "server" / "hpke.key").read_bytes())
    twice = {"nodes": 2, "superlink_ca": ca, "server_public_key": shuffler_pub, "shuffler_public_key": shuffler_pub,
             "eps0": 1.0, "clip_l1": 1.0}
    with pytest.raises(DeployError, match="same key"):
        dk.complete_device_bundle(device, **twice)
    (device / "shuffler_hpke.pub").symlink_to(tmp_path / "nowhere")  # a retry must find no half bundle
    with pytest.raises(DeployError, match="already has shuffler_hpke.pub"):
        dk.complete_device_bundle(device, **{**twice, "server_public_key": server_pub})
    (device / "shuffler_hpke.pub").unlink()
    with pytest.raises(DeployError, match="not a CA certificate"):  # the SuperLink's own leaf is no CA
        dk.complete_device_bundle(device, **{**twice, "server_public_key": server_pub,
                                             "superlink_ca": server / "superlink" / "superlink.crt"})
    with pytest.raises(DeployError, match="no private key"):
        dk.complete_device_bundle(device, **{**twice, "server_public_key": leaky})
    assert sorted(p.name for p in device.iterdir()) == ["client.key", "client.pub", "deploy.json", "supernode.key",
                                                        "supernode.pub"]
    dk.complete_device_bundle(device, **{**twice, "server_public_key": server_pub})
    assert dk.check_party_directory(device) == []
    # only the parsed key is written: byte for byte what the server published
    assert (device / "server_hpke.pub").read_bytes() == server_pub.read_bytes()

    assert dk.check_party_directory(server) == []
    with (server / "tls" / "ca.crt").open("ab") as fh:
        fh.write((shuffler / "tls" / "ca.key").read_bytes())  # the shuffler CA's key, riding along
    shutil.copyfile(shuffler / "shuffler" / "hpke.key", server / "server" / "backup.pem")
    problems = dk.check_party_directory(server)
    assert any(p.startswith("tls/ca.crt holds private key material") for p in problems), problems
    assert any(p.startswith("server/backup.pem holds private key material") for p in problems), problems
    # the shuffler's own server certificate and key in the ServerApp's place: right CA, wrong name and usage
    for name in ("crt", "key"):
        shutil.copyfile(shuffler / "tls" / f"shuffler.{name}", server / "tls" / f"serverapp.{name}")
    problems = dk.check_party_directory(server)
    assert "tls/serverapp.crt names ['shuffler'], not CN 'serverapp'" in problems
    assert "tls/serverapp.crt is not for client authentication" in problems
    # the server's key in the shuffler's TLS key's place; k above the enrolment
    shutil.copyfile(server / "superlink" / "superlink.key", shuffler / "tls" / "shuffler.key")
    config = shuffler / "shuffler.toml"
    config.write_text(config.read_text().replace("k = 2", "k = 3"))
    problems = dk.check_party_directory(shuffler)
    assert "tls/shuffler.crt is not the certificate of tls/shuffler.key" in problems
    assert any("2 client(s), fewer than k = 3" in p for p in problems), problems
    # an encrypted key is a problem, not a traceback
    key = serialization.load_pem_private_key((server / "superlink" / "superlink.key").read_bytes(), None)
    (server / "superlink" / "superlink.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"x")))
    assert any(p.startswith("cannot read superlink/superlink.crt") for p in dk.check_party_directory(server))


def test_a_failed_or_misused_key_command_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _deploy(capsys, "keys", "--party", "shuffler", "--out", tmp_path / "s", "--k", 2,
                        "--san", "bad name!")
    assert code == 2 and "bad name!" in out  # a wrong parameter
    assert list(tmp_path.iterdir()) == []  # no half directory, no staging left behind
    assert _deploy(capsys, "keys", "--party", "shuffler", "--out", tmp_path / "s", "--k", 2)[0] == 0
    device = dk.create_device_keys(tmp_path / "d", 0)
    # a party's directory is not a one-directory layout: clear errors, no traceback
    code, out = _deploy(capsys, "local", "--keys", device, "--workdir", tmp_path / "w", "--nodes", 1)
    assert code == 2 and "holds the keys of the 'device' party only" in out
    with pytest.raises(DeployError, match="holds the keys of the 'shuffler' party only"):
        DeployKeys(tmp_path / "s").load_layout()
