"""X.509 issuance for mTLS: names, SANs, key usages, chain."""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from shuffledp.shuffler import tls


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return tls.create_ca("test CA", days=30)


def test_server_certificate_fields_and_chain(ca) -> None:
    cert_pem, key_pem = tls.issue_certificate(
        ca[0], ca[1], "superlink", sans=["localhost", "127.0.0.1", "::1", "node.example"], is_server=True,
        is_client=False,
    )
    cert = x509.load_pem_x509_certificate(cert_pem)
    ca_cert = x509.load_pem_x509_certificate(ca[0])
    assert tls.certificate_common_name(cert_pem) == "superlink"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "node.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca_cert)
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc <= ca_cert.not_valid_after_utc
    assert b"PRIVATE KEY" in key_pem


def test_client_and_dual_certificates(ca) -> None:
    cert_pem, _ = tls.issue_certificate(ca[0], ca[1], "serverapp", is_server=False, is_client=True)
    eku = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert_pem, _ = tls.issue_certificate(ca[0], ca[1], "both", sans=["localhost"], is_server=True, is_client=True)
    eku = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}


def test_issue_validation(ca) -> None:
    with pytest.raises(ValueError, match="needs at least one SAN"):
        tls.issue_certificate(ca[0], ca[1], "s", is_server=True, is_client=False)
    with pytest.raises(ValueError, match="server, a client, or both"):
        tls.issue_certificate(ca[0], ca[1], "s", sans=["localhost"], is_server=False, is_client=False)
    with pytest.raises(TypeError, match="not a single string"):
        tls.issue_certificate(ca[0], ca[1], "s", sans="localhost", is_server=True, is_client=False)
    with pytest.raises(ValueError, match="neither an IP address nor a DNS name"):
        tls.issue_certificate(ca[0], ca[1], "s", sans=["bad name"], is_server=True, is_client=False)
    other = tls.create_ca("other")
    with pytest.raises(ValueError, match="does not match"):
        tls.issue_certificate(ca[0], other[1], "s", sans=["localhost"], is_server=True, is_client=False)
    with pytest.raises(ValueError, match="common_name"):
        tls.create_ca("")
    with pytest.raises(ValueError, match="validity days"):
        tls.create_ca("x", days=0)
    assert isinstance(
        x509.load_pem_x509_certificate(ca[0]).public_key(), ec.EllipticCurvePublicKey
    )
