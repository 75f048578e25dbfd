"""Key files, enrolment and the key directory layout of docs/interfaces.md."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from shuffledp.shuffler import keys
from shuffledp.shuffler.cli import main as cli_main
from shuffledp.shuffler.config import load_config

LAYOUT = [
    "public/shuffler_hpke.pub",
    "public/shuffler_signing.pub",
    "public/server_hpke.pub",
    "shuffler/hpke.key",
    "shuffler/signing.key",
    "server/hpke.key",
    "clients/client-0.key",
    "clients/client-2.key",
    "enrolment.json",
    "tls/ca.crt",
    "tls/shuffler.crt",
    "tls/shuffler.key",
    "tls/serverapp.crt",
    "tls/serverapp.key",
    "shuffler.toml",
]


def test_cli_keys_init_writes_the_whole_layout(tmp_path: Path) -> None:
    out = tmp_path / "k"
    assert cli_main(["keys", "init", "--out", str(out), "--clients", "3", "--key-epoch", "4", "--k", "2"]) == 0
    for rel in LAYOUT:
        assert (out / rel).is_file(), rel
    assert not (out / "clients/client-3.key").exists()
    for rel in LAYOUT:
        mode = stat.S_IMODE((out / rel).stat().st_mode)
        if rel.endswith(".key"):
            assert mode == 0o600, (rel, oct(mode))
        else:
            assert mode & 0o077 != 0o077 and not mode & 0o002
    d = keys.KeyDirectory(out)
    # the pairs match
    assert keys.public_from_private(keys.load_private_key(d.shuffler_hpke_key), "x25519") == keys.load_public_key(
        d.shuffler_hpke_pub
    )
    assert keys.public_from_private(keys.load_private_key(d.server_hpke_key), "x25519") == keys.load_public_key(
        d.server_hpke_pub
    )
    assert keys.public_from_private(
        keys.load_private_key(d.shuffler_signing_key), "ed25519"
    ) == keys.load_public_key(d.shuffler_signing_pub)
    enrolled = keys.load_enrolment(d.enrolment)
    assert sorted(enrolled) == ["client-0", "client-1", "client-2"]
    for i in range(3):
        assert enrolled[f"client-{i}"] == keys.public_from_private(keys.load_private_key(d.client_key(i)), "ed25519")
    cfg = load_config(d.config)
    assert (cfg.key_epoch, cfg.k, cfg.address, cfg.insecure) == (4, 2, "127.0.0.1:0", False)
    assert cfg.hpke_key == d.shuffler_hpke_key.resolve() and cfg.tls is not None
    assert cfg.tls.client_common_names == ("serverapp",)
    assert str(tmp_path) not in d.config.read_text()  # relative paths only
    # refuses to overwrite an existing key directory
    assert cli_main(["keys", "init", "--out", str(out), "--clients", "3"]) == 2


def test_kind_and_mode_checks(tmp_path: Path) -> None:
    sk, pk = keys.generate_keypair("ed25519")
    keys.save_private_key(tmp_path / "a.key", sk, "ed25519")
    keys.save_public_key(tmp_path / "a.pub", pk, "ed25519")
    assert keys.load_private_key(tmp_path / "a.key", "ed25519") == sk
    assert keys.load_public_key(tmp_path / "a.pub") == pk
    with pytest.raises(ValueError, match="holds a ed25519 key; expected x25519"):
        keys.load_private_key(tmp_path / "a.key", "x25519")
    with pytest.raises(ValueError, match="expected x25519"):
        keys.load_public_key(tmp_path / "a.pub", "x25519")
    os.chmod(tmp_path / "a.key", 0o644)
    with pytest.raises(PermissionError, match="must be 0600"):
        keys.load_private_key(tmp_path / "a.key")
    with pytest.raises(FileExistsError):
        keys.save_private_key(tmp_path / "a.key", sk, "ed25519")
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(ValueError, match="not a PEM public key"):
        keys.load_public_key(tmp_path / "junk.pub")
    with pytest.raises(ValueError, match="kind must be one of"):
        keys.generate_keypair("rsa")  # type: ignore[arg-type] - the wrong type on purpose


def test_enrolment_validation(tmp_path: Path) -> None:
    _, a = keys.generate_keypair("ed25519")
    _, b = keys.generate_keypair("ed25519")
    keys.save_enrolment(tmp_path / "e.json", {"client-0": a, "client-1": b})
    assert keys.load_enrolment(tmp_path / "e.json") == {"client-0": a, "client-1": b}
    with pytest.raises(ValueError, match="share a public key"):
        keys.save_enrolment(tmp_path / "f.json", {"client-0": a, "client-1": a})
    doc = json.loads((tmp_path / "e.json").read_text())
    doc["clients"]["client-2"] = a.hex()
    (tmp_path / "g.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="share a public key"):
        keys.load_enrolment(tmp_path / "g.json")
    (tmp_path / "h.json").write_text(json.dumps({"clients": {}}))
    with pytest.raises(ValueError, match="not an enrolment file"):
        keys.load_enrolment(tmp_path / "h.json")
    doc["clients"] = {"client-0": "zz"}
    (tmp_path / "i.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="not hex"):
        keys.load_enrolment(tmp_path / "i.json")
    # keys libsodium refuses (shuffledp.shuffler.envelope checks signatures with it): the identity point, a point of
    # order 8 and a point of mixed order (a + the order-8 point, outside the prime-order subgroup). OpenSSL parses all
    # three, and its cofactorless check even accepts a forged signature under the identity key.
    ident = (1).to_bytes(32, "little")
    order8 = bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a")
    mixed = _point_add(a, order8)
    for name, bad in (("identity", ident), ("order 8", order8), ("mixed order", mixed)):
        with pytest.raises(ValueError, match="invalid Ed25519 public key .*never sign a report"):
            keys.save_enrolment(tmp_path / "j.json", {"client-0": a, "client-1": bad})
        doc["clients"] = {"client-0": a.hex(), "client-1": bad.hex()}
        (tmp_path / "k.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match="invalid Ed25519 public key"):
            keys.load_enrolment(tmp_path / "k.json")
        assert not (tmp_path / "j.json").exists(), name  # nothing written


def _point_add(a: bytes, b: bytes) -> bytes:
    """Edwards25519 point addition on encoded points (RFC 8032, section 5.1.3 decoding, 5.1.4 addition)."""
    p = 2**255 - 19
    d = -121665 * pow(121666, -1, p) % p

    def decode(s: bytes) -> tuple[int, int]:
        y = int.from_bytes(s, "little") & ((1 << 255) - 1)
        sign = s[31] >> 7
        x2 = (y * y - 1) * pow(d * y * y + 1, -1, p) % p
        x = pow(x2, (p + 3) // 8, p)
        if (x * x - x2) % p:
            x = x * pow(2, (p - 1) // 4, p) % p
        if x & 1 != sign:
            x = p - x
        return x, y

    (x1, y1), (x2, y2) = decode(a), decode(b)
    t = d * x1 * x2 * y1 * y2 % p
    x3 = (x1 * y2 + x2 * y1) * pow(1 + t, -1, p) % p
    y3 = (y1 * y2 + x1 * x2) * pow(1 - t, -1, p) % p
    return (y3 | ((x3 & 1) << 255)).to_bytes(32, "little")


def test_init_parameter_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_clients"):
        keys.init_key_directory(tmp_path / "a", 0)
    with pytest.raises(ValueError, match="key_epoch"):
        keys.init_key_directory(tmp_path / "b", 2, key_epoch=-1)
    with pytest.raises(ValueError, match="k must be"):
        keys.init_key_directory(tmp_path / "c", 2, k=0)
    with pytest.raises(ValueError, match="n_clients = 2"):
        keys.init_key_directory(tmp_path / "d", 2, k=3)
    assert keys.client_id(7) == "client-7"
    with pytest.raises(ValueError):
        keys.client_id(-1)


def test_cli_client_and_enrol_keep_client_private_keys_on_the_device(tmp_path: Path) -> None:
    """A device makes its own key pair; the operator enrols only the public key it was given."""
    device, operator = tmp_path / "device", tmp_path / "operator"
    assert cli_main(["keys", "client", "--out", str(device), "--client-id", "phone-1"]) == 0
    assert stat.S_IMODE((device / "phone-1.key").stat().st_mode) == 0o600
    enrolment = operator / "enrolment.json"
    operator.mkdir()
    args = ["keys", "enrol", "--enrolment", str(enrolment), "--client-id", "phone-1",
            "--public-key", str(device / "phone-1.pub")]
    assert cli_main(args) == 0
    pk = keys.public_from_private(keys.load_private_key(device / "phone-1.key"), "ed25519")
    assert keys.load_enrolment(enrolment) == {"phone-1": pk}
    assert sorted(p.name for p in operator.iterdir()) == ["enrolment.json"]  # no private key near the operator
    assert cli_main(args) == 2  # already enrolled
    assert cli_main(["keys", "client", "--out", str(device), "--client-id", "phone-1"]) == 2  # no overwrite
    with pytest.raises(ValueError, match="share a public key"):
        keys.enrol_client(enrolment, "phone-2", device / "phone-1.pub")
    with pytest.raises(ValueError, match="client id must match"):
        keys.create_client_key(device, "../evil")
    assert cli_main(["keys", "client", "--out", str(device), "--client-id", "phone-2"]) == 0
    keys.enrol_client(enrolment, "phone-2", device / "phone-2.pub")
    assert sorted(keys.load_enrolment(enrolment)) == ["phone-1", "phone-2"]


def test_a_key_path_under_a_regular_file_is_not_reported_as_an_existing_key(tmp_path: Path) -> None:
    from shuffledp.shuffler.keys import save_public_key

    (tmp_path / "notadir").write_text("")
    with pytest.raises(OSError) as exc:
        save_public_key(tmp_path / "notadir" / "k.pub", bytes(32), "ed25519")
    assert "refusing to overwrite a key file" not in str(exc.value)
