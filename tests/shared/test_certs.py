"""The certificate authority behind the edge listener: what it writes, with which permissions and
extensions, what it refuses, and the `ctxfuse certs` round trip."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ctxfuse.cli import main
from shared import certs


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _crl(root: Path) -> x509.CertificateRevocationList:
    return x509.load_pem_x509_crl(certs.TLSDir(root).crl.read_bytes())


def test_init_writes_a_ca_an_empty_signed_crl_and_a_0600_key(tmp_path: Path) -> None:
    issued = certs.init_ca(tmp_path)
    d = certs.TLSDir(tmp_path)
    assert (issued.cert, issued.key) == (d.ca_cert, d.ca_key)
    assert _mode(d.ca_key) == 0o600
    ca = _cert(d.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    crl = _crl(tmp_path)
    assert len(crl) == 0 and crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert crl.next_update_utc is not None and crl.next_update_utc >= ca.not_valid_after_utc


def test_init_refuses_to_replace_an_existing_ca(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    before = certs.TLSDir(tmp_path).ca_key.read_bytes()
    with pytest.raises(certs.AlreadyExistsError):
        certs.init_ca(tmp_path)
    assert certs.TLSDir(tmp_path).ca_key.read_bytes() == before


def test_server_certificate_names_its_hosts_as_dns_and_ip_sans_for_server_auth(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    issued = certs.issue_server(tmp_path, ["gateway.example", "10.1.2.3", "localhost", "127.0.0.1", "::1"])
    assert _mode(issued.key) == 0o600
    cert = _cert(issued.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gateway.example", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"),
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    cert.verify_directly_issued_by(_cert(certs.TLSDir(tmp_path).ca_cert))


@pytest.mark.parametrize("host", ["bad host", "-x.example", "a..b", "x" * 64 + ".example", ""])
def test_server_hosts_must_be_dns_names_or_ip_addresses(tmp_path: Path, host: str) -> None:
    certs.init_ca(tmp_path)
    with pytest.raises(certs.InvalidNameError):
        certs.issue_server(tmp_path, [host])


def test_device_certificate_carries_its_name_as_cn_and_uri_for_client_auth(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    issued = certs.issue_device(tmp_path, "lab-pi.3")
    d = certs.TLSDir(tmp_path)
    assert (issued.cert, issued.key) == (d.root / "devices/lab-pi.3.pem", d.root / "devices/lab-pi.3.key")
    assert _mode(issued.key) == 0o600
    cert = _cert(issued.cert)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "lab-pi.3"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:ctxfuse:device:lab-pi.3"]
    assert san.get_values_for_type(x509.DNSName) == []
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.serial_number == issued.serial
    cert.verify_directly_issued_by(_cert(d.ca_cert))
    assert [r.name for r in certs.list_devices(tmp_path)] == ["lab-pi.3"]


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "-x", "", "x" * 65, "dev 1", "dév"])
def test_device_names_must_be_safe_file_names(tmp_path: Path, name: str) -> None:
    certs.init_ca(tmp_path)
    with pytest.raises(certs.InvalidNameError):
        certs.issue_device(tmp_path, name)
    assert not (tmp_path / "devices").exists() or not any((tmp_path / "devices").iterdir())


def test_missing_ca_and_unknown_device_raise_their_own_errors(tmp_path: Path) -> None:
    with pytest.raises(certs.CANotFoundError, match="ctxfuse certs init"):
        certs.issue_device(tmp_path, "d1")
    with pytest.raises(certs.CANotFoundError):
        certs.issue_server(tmp_path, ["localhost"])
    certs.init_ca(tmp_path)
    with pytest.raises(certs.UnknownDeviceError):
        certs.revoke_device(tmp_path, "nobody")


def test_a_name_gets_a_second_certificate_only_after_the_first_is_revoked(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    first = certs.issue_device(tmp_path, "d1")
    with pytest.raises(certs.AlreadyExistsError):
        certs.issue_device(tmp_path, "d1")
    certs.revoke_device(tmp_path, "d1")
    with pytest.raises(certs.AlreadyExistsError):
        certs.revoke_device(tmp_path, "d1")
    second = certs.issue_device(tmp_path, "d1")
    assert second.serial != first.serial
    # the old serial stays revoked; the new one is valid
    crl = _crl(tmp_path)
    assert crl.get_revoked_certificate_by_serial_number(first.serial) is not None
    assert crl.get_revoked_certificate_by_serial_number(second.serial) is None


def test_each_revocation_rewrites_a_ca_signed_crl_with_every_serial_and_a_later_time(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    ca = _cert(certs.TLSDir(tmp_path).ca_cert)
    a, b = certs.issue_device(tmp_path, "a"), certs.issue_device(tmp_path, "b")
    times = [_crl(tmp_path).last_update_utc]
    certs.revoke_device(tmp_path, "a")
    times.append(_crl(tmp_path).last_update_utc)
    certs.revoke_device(tmp_path, "b")
    crl = _crl(tmp_path)
    times.append(crl.last_update_utc)
    assert {r.serial_number for r in crl} == {a.serial, b.serial}
    assert crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 3
    # strictly increasing: the gateway's context keeps old CRLs and OpenSSL uses the latest
    assert times == sorted(set(times))
    revoked = {r.name: r.revoked_at for r in certs.list_devices(tmp_path)}
    assert revoked["a"] is not None and revoked["b"] is not None


def test_cli_round_trip_prints_paths_and_never_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path / "tls")
    assert main(["certs", "init", root]) == 0
    assert main(["certs", "server", root, "--host", "gw.example", "--host", "127.0.0.1"]) == 0
    assert main(["certs", "issue", root, "edge-1", "--days", "30"]) == 0
    assert main(["certs", "revoke", root, "edge-1"]) == 0
    assert main(["certs", "list", root]) == 0
    out = capsys.readouterr().out
    d = certs.TLSDir(Path(root))
    for path in (d.ca_cert, d.ca_key, d.crl, d.server_cert, d.server_key, d.device_cert("edge-1")):
        assert str(path) in out
    assert "PRIVATE KEY" not in out and "BEGIN" not in out
    assert "edge-1" in out.splitlines()[-1] and "revoked" in out.splitlines()[-1]
    for key in (d.ca_key, d.server_key, d.device_key("edge-1")):
        assert _mode(key) == 0o600


def test_cli_refuses_a_second_init_with_exit_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "init", str(tmp_path)]) == 0
    assert main(["certs", "init", str(tmp_path)]) == 2
    assert "already holds a CA" in capsys.readouterr().err


def test_cli_lists_every_option_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["certs", "server", "--help"])
    out = capsys.readouterr().out
    assert "--host" in out and "--days" in out and "repeatable" in out
