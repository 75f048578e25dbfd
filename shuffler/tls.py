"""X.509 certificates for mutual TLS (the ServerApp <-> shuffler channel, and the Flower SuperLink).

A small private CA (Ed25519 is not accepted by every TLS stack gRPC is built with, so keys are ECDSA P-256)
issues leaf certificates with a common name and subject alternative names (DNS names and IP addresses), marked
for server authentication, client authentication, or both (RFC 5280 extended key usage).

Everything is returned and accepted as PEM bytes, which is what ``grpc.ssl_*_credentials`` take.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shuffledp.shuffler.validation import require_int

__all__ = ["create_ca", "issue_certificate", "create_csr", "issue_certificate_for_csr", "certificate_common_name"]

_DEFAULT_DAYS = 825


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _check_days(days: int) -> None:
    require_int("validity days", days, 1, 3650)


def _check_name(common_name: str) -> None:
    if not isinstance(common_name, str) or not common_name or len(common_name) > 64:
        raise ValueError(f"common_name must be a non-empty string of at most 64 characters, got {common_name!r}")


def create_ca(common_name: str = "shuffledp CA", *, days: int = _DEFAULT_DAYS) -> tuple[bytes, bytes]:
    """Create a self-signed CA. Returns ``(ca_cert_pem, ca_key_pem)``."""
    _check_name(common_name)
    _check_days(days)
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _parse_san(entry: str) -> x509.GeneralName:
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"each SAN must be a non-empty string (a DNS name or an IP address), got {entry!r}")
    try:
        return x509.IPAddress(ipaddress.ip_address(entry))
    except ValueError:
        pass
    if any(c.isspace() for c in entry) or "/" in entry:
        raise ValueError(f"SAN {entry!r} is neither an IP address nor a DNS name")
    return x509.DNSName(entry)


def issue_certificate(
    ca_cert: bytes,
    ca_key: bytes,
    common_name: str,
    *,
    sans: Sequence[str] = (),
    is_server: bool,
    is_client: bool,
    days: int = _DEFAULT_DAYS,
) -> tuple[bytes, bytes]:
    """Issue a leaf certificate signed by the CA. Returns ``(cert_pem, key_pem)``.

    ``sans`` are DNS names or IP addresses (``"localhost"``, ``"127.0.0.1"``, ``"::1"``); a server certificate
    needs at least one (TLS clients check the SAN, not the CN). ``is_server``/``is_client`` set the extended
    key usages serverAuth/clientAuth; at least one must be true.
    """
    key = _new_key()
    cert = _sign_leaf(ca_cert, ca_key, key.public_key(), common_name, sans=sans, is_server=is_server,
                      is_client=is_client, days=days)
    return cert, _key_pem(key)


def create_csr(common_name: str) -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and a certificate signing request (PKCS#10) for it. Returns ``(csr_pem, key_pem)``.

    The party that will use the certificate runs this, keeps the key and hands over only the request; the CA's
    operator answers with :func:`issue_certificate_for_csr`, so no private key crosses between parties.
    """
    _check_name(common_name)
    key = _new_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue_certificate_for_csr(
    ca_cert: bytes,
    ca_key: bytes,
    csr_pem: bytes,
    common_name: str,
    *,
    sans: Sequence[str] = (),
    is_server: bool,
    is_client: bool,
    days: int = _DEFAULT_DAYS,
) -> bytes:
    """Issue a leaf certificate for the public key of a signing request (made by :func:`create_csr`).

    Only the request's public key is used: the name, SANs and key usages are the CA operator's arguments, never
    what the request asks for. The request must carry a valid self-signature (proof that its sender holds the
    key) and an ECDSA P-256 or P-384 key (what every TLS stack gRPC is built with accepts). Returns the
    certificate PEM. Raises ValueError for a request that is not PEM, not self-signed or has another key type.
    """
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the signing request is not a PEM PKCS#10 request: {exc}") from exc
    if not csr.is_signature_valid:
        raise ValueError("the signing request's signature does not verify: it was not made with its own key")
    public = csr.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name not in ("secp256r1", "secp384r1"):
        raise ValueError(f"the signing request's key must be ECDSA P-256 or P-384, got {type(public).__name__}"
                         + (f" on {public.curve.name}" if isinstance(public, ec.EllipticCurvePublicKey) else ""))
    return _sign_leaf(ca_cert, ca_key, public, common_name, sans=sans, is_server=is_server, is_client=is_client,
                      days=days)


def _sign_leaf(
    ca_cert: bytes,
    ca_key: bytes,
    public: ec.EllipticCurvePublicKey,
    common_name: str,
    *,
    sans: Sequence[str],
    is_server: bool,
    is_client: bool,
    days: int,
) -> bytes:
    """The leaf certificate (PEM) of ``public`` signed by the CA (checks shared by both issuing functions)."""
    _check_name(common_name)
    _check_days(days)
    if not (is_server or is_client):
        raise ValueError("a certificate must be for a server, a client, or both (is_server / is_client)")
    if isinstance(sans, str):
        raise TypeError("sans must be a sequence of strings, not a single string")
    names = [_parse_san(s) for s in sans]
    if is_server and not names:
        raise ValueError("a server certificate needs at least one SAN (DNS name or IP address)")
    try:
        issuer = x509.load_pem_x509_certificate(ca_cert)
        signer = serialization.load_pem_private_key(ca_key, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"ca_cert/ca_key must be PEM (as written by create_ca): {exc}") from exc
    if not isinstance(signer, ec.EllipticCurvePrivateKey):
        raise ValueError("ca_key must be an EC private key (as written by create_ca)")
    if signer.public_key().public_numbers() != issuer.public_key().public_numbers():  # type: ignore[union-attr] - EC (checked)
        raise ValueError("ca_key does not match ca_cert")
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if is_server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if is_client else []
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(issuer.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), issuer.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def certificate_common_name(cert_pem: bytes) -> str:
    """The subject CN of a PEM certificate."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        raise ValueError("certificate has no common name")
    return str(attrs[0].value)
