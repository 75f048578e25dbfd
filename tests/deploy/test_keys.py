"""shuffledp.deploy.keys: the one-directory key layout."""

from __future__ import annotations

from shuffledp.deploy.keys import supernode_keypair


def test_supernode_keypair_is_what_flower_reads() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    private, public = supernode_keypair()
    sk = load_ssh_private_key(private, None)
    pk = load_ssh_public_key(public)
    assert isinstance(sk, ec.EllipticCurvePrivateKey) and isinstance(pk, ec.EllipticCurvePublicKey)
    assert sk.curve.name == "secp384r1"
    assert sk.public_key().public_numbers() == pk.public_numbers()
    assert supernode_keypair()[0] != private  # fresh randomness each time
