"""A small certificate authority for the gateway's edge listener: one CA, the gateway's server
certificate, one certificate per device and a revocation list. `ctxfuse certs` drives it;
`shared.tls` reads what it writes.

The layout of a TLS directory, and how its files are read and checked, is shared/ca_files.py's.
A device gets ca.pem and its own devices/NAME.{pem,key}; the gateway gets ca.pem, server.{pem,key}
and crl.pem. Keys are EC P-256, unencrypted PKCS#8 PEM, created with mode 0600 so that they are never
readable by others, not even for an instant.

Crash safety: each file is replaced atomically and durably (write aside, fsync, rename, fsync the
directory), so a gateway reloading crl.pem never reads half a file and a finished command survives
power loss. index.json is the source of truth and is written first; crl.pem is rebuilt from it. A crash
between the two leaves a CRL older than the index (never one that forgets a revocation the index
holds), and the next revoke or issue publishes a CRL from the index again (`_sync_crl`).

Faults: each command writes its files together (`ca_files.write_files`): all are written aside before
the first is published, so a full or read-only disk refuses the command with nothing changed, and the
same command works once there is room. A damaged file is refused where it is read, never replaced
(`certs init` over a directory holding any CA file refuses too); `ctxfuse certs crl` rebuilds a
damaged crl.pem from the index.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.ca_files import (
    CANotFoundError,
    CertsError,
    DamagedCAFile,
    DeviceRecord,
    Index,
    InvalidNameError,
    RevokedSerial,
    TLSDir,
    check_device_name,
    check_index_covers,
    key_file,
    load_ca,
    public_file,
    read_crl,
    read_index,
    write_files,
)
from shared.durable_file import NewFile
from shared.tenant_name import TENANT_RULE, is_tenant_name

# names other modules import from here (the layout and its errors live in shared.ca_files)
__all__ = [
    "CA_DAYS",
    "DEVICE_DAYS",
    "DEVICE_URI_PREFIX",
    "LOOPBACK_HOSTS",
    "SERVER_DAYS",
    "TENANT_URI_PREFIX",
    "AlreadyExistsError",
    "CANotFoundError",
    "CertsError",
    "DamagedCAFile",
    "DeviceRecord",
    "Index",
    "InvalidNameError",
    "Issued",
    "RevokedSerial",
    "TLSDir",
    "UnknownDeviceError",
    "check_device_name",
    "check_tenant_name",
    "init_ca",
    "issue_device",
    "issue_server",
    "list_devices",
    "rebuild_crl",
    "revoke_device",
]

CA_DAYS = 3650
SERVER_DAYS = 730
DEVICE_DAYS = 365
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEVICE_URI_PREFIX = "urn:ctxfuse:device:"
# the tenant a device belongs to (its files, batches, chunks and prefix cache are the tenant's);
# a device without one is a tenant of its own
TENANT_URI_PREFIX = "urn:ctxfuse:tenant:"

_DNS_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# allowed clock skew between the issuing machine and the peers
_BACKDATE = dt.timedelta(minutes=5)


class UnknownDeviceError(CertsError):
    pass


class AlreadyExistsError(CertsError):
    pass


@dataclass(frozen=True, slots=True)
class Issued:
    cert: Path
    key: Path
    serial: int
    not_after: dt.datetime


def check_tenant_name(tenant: str) -> str:
    if not is_tenant_name(tenant):
        raise InvalidNameError(f"tenant {tenant!r} must be {TENANT_RULE}")
    return tenant


def init_ca(root: Path, *, days: int = CA_DAYS) -> Issued:
    """Create the CA and an empty CRL in `root`; refuses to replace an existing CA, whole or not (a
    damaged one is restored from a backup, never replaced by a new CA and an empty index)."""
    d = TLSDir(Path(root))
    held = [p.name for p in (d.ca_cert, d.ca_key, d.index) if p.exists()]
    if held:
        raise AlreadyExistsError(f"{d.root} already holds a CA ({', '.join(held)}); not replacing it")
    key = ec.generate_private_key(ec.SECP256R1())
    # a per-CA suffix keeps two deployments' CAs apart by name, so no chain or CRL lookup mixes them
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"ctxfuse edge CA {secrets.token_hex(4)}")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        _validity(x509.CertificateBuilder(), days)
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ski, critical=False)
    )
    cert = builder.sign(key, hashes.SHA256())
    pem = cert.public_bytes(serialization.Encoding.PEM)
    _publish_crl(d, cert, key, Index(), before=[key_file(d.ca_key, key), public_file(d.ca_cert, pem)])
    return Issued(d.ca_cert, d.ca_key, cert.serial_number, cert.not_valid_after_utc)


def issue_server(root: Path, hosts: Sequence[str] = LOOPBACK_HOSTS, *, days: int = SERVER_DAYS) -> Issued:
    """The gateway's certificate for `hosts` (DNS names and IP addresses); replaces an earlier one."""
    if not hosts:
        raise InvalidNameError("a server certificate needs at least one host name or address")
    d = TLSDir(Path(root))
    ca_cert, ca_key = load_ca(d)
    sans = [_general_name(h) for h in dict.fromkeys(hosts)]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ctxfuse gateway")])
    key, cert = _issue_leaf(ca_cert, ca_key, subject, sans, ExtendedKeyUsageOID.SERVER_AUTH, days)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    write_files(d, [key_file(d.server_key, key), public_file(d.server_cert, pem)])
    return Issued(d.server_cert, d.server_key, cert.serial_number, cert.not_valid_after_utc)


def issue_device(root: Path, name: str, *, tenant: str | None = None, days: int = DEVICE_DAYS) -> Issued:
    """A client certificate and key for device `name`, of `tenant` if given (a SAN URI beside the
    device's own; the gateway serves the device as that tenant). A name may be issued again only once
    its previous certificate is revoked, so one name never has two valid certificates."""
    d = TLSDir(Path(root))
    if tenant is not None:
        check_tenant_name(tenant)
    cert_path, key_path = d.device_cert(name), d.device_key(name)
    ca_cert, ca_key = load_ca(d)
    index = read_index(d)
    _sync_crl(d, ca_cert, ca_key, index)
    earlier = index.devices.get(name)
    if earlier is not None and earlier.revoked_at is None:
        raise AlreadyExistsError(f"device {name!r} already has a valid certificate; revoke it first")
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(DEVICE_URI_PREFIX + name)]
    if tenant is not None:
        sans.append(x509.UniformResourceIdentifier(TENANT_URI_PREFIX + tenant))
    key, cert = _issue_leaf(ca_cert, ca_key, subject, sans, ExtendedKeyUsageOID.CLIENT_AUTH, days)
    # recorded before the files are published: a certificate that is out there can always be revoked
    # by name
    serial = format(cert.serial_number, "x")
    index.devices[name] = DeviceRecord(name, serial, cert.not_valid_after_utc, tenant=tenant)
    pem = cert.public_bytes(serialization.Encoding.PEM)
    write_files(d, [_index_file(d, index), key_file(key_path, key), public_file(cert_path, pem)])
    return Issued(cert_path, key_path, cert.serial_number, cert.not_valid_after_utc)


def revoke_device(root: Path, name: str) -> DeviceRecord:
    """Add device `name`'s current certificate to the CRL and rewrite crl.pem."""
    d = TLSDir(Path(root))
    check_device_name(name)
    ca_cert, ca_key = load_ca(d)
    index = read_index(d)
    _sync_crl(d, ca_cert, ca_key, index)  # a revoke cut short before its CRL is published now
    record = index.devices.get(name)
    if record is None:
        raise UnknownDeviceError(f"no device {name!r} in {d.index}")
    if record.revoked_at is not None:
        raise AlreadyExistsError(f"device {name!r} was already revoked at {record.revoked_at.isoformat()}")
    record.revoked_at = dt.datetime.now(dt.UTC)
    index.revoked.append(RevokedSerial(record.serial, name, record.revoked_at))
    _publish_crl(d, ca_cert, ca_key, index)
    return record


def list_devices(root: Path) -> list[DeviceRecord]:
    d = TLSDir(Path(root))
    if not d.ca_cert.exists():
        raise CANotFoundError(f"no CA in {d.root}: run `ctxfuse certs init {d.root}` first")
    return sorted(read_index(d).devices.values(), key=lambda r: r.name)


def rebuild_crl(root: Path) -> Path:
    """Publish crl.pem again from index.json: the fix for a damaged crl.pem (a readable one must be
    accounted for by the index, as for every command)."""
    d = TLSDir(Path(root))
    ca_cert, ca_key = load_ca(d)
    index = read_index(d)
    try:
        if d.crl.exists():
            check_index_covers(d, index, read_crl(d, ca_cert))
    except DamagedCAFile as fault:
        if fault.path != d.crl:
            raise  # the index is the one damaged: a CRL from it could drop revocations
    _publish_crl(d, ca_cert, ca_key, index)
    return d.crl


def _issue_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    subject: x509.Name,
    sans: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    days: int,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    # AKI/SKI and critical key usage: what OpenSSL's strict mode (Python 3.13's default) requires
    builder = (
        _validity(x509.CertificateBuilder(), days)
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_authority_key_id(ca_key), critical=False)
    )
    return key, builder.sign(ca_key, hashes.SHA256())


def _validity(builder: x509.CertificateBuilder, days: int) -> x509.CertificateBuilder:
    if days < 1:
        raise CertsError(f"validity must be at least one day, got {days}")
    now = dt.datetime.now(dt.UTC)
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_DNS_LABEL_RE.fullmatch(label) for label in labels):
        raise InvalidNameError(f"{host!r} is neither an IP address nor a DNS name")
    return x509.DNSName(".".join(labels).lower())


def _authority_key_id(ca_key: ec.EllipticCurvePrivateKey) -> x509.AuthorityKeyIdentifier:
    return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())


def _publish_crl(
    d: TLSDir,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    index: Index,
    before: Sequence[NewFile] = (),
) -> None:
    """A new CRL of everything `index` revokes: the index (with the CRL's number and time) first, then
    crl.pem built from it, so no crash leaves a CRL the index does not account for."""
    # shared.tls adds each new CRL beside the old ones in the live context, and OpenSSL then uses the
    # CRL with the latest lastUpdate (whole seconds). So each CRL must be strictly later than the last:
    # wait for the next second rather than date it in the future (a future CRL is "not yet valid").
    index.crl_last_update = _next_crl_time(index.crl_last_update)
    index.crl_number += 1
    crl = _crl_pem(d, ca_cert, ca_key, index)
    write_files(d, [*before, _index_file(d, index), public_file(d.crl, crl)])


def _sync_crl(d: TLSDir, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, index: Index) -> None:
    """Publish a CRL again if crl.pem is not the one the index last recorded (a crash between the two,
    or none yet). A damaged crl.pem, or an index that does not account for it, is refused instead:
    rebuilding from such an index could drop revocations."""
    number = check_index_covers(d, index, read_crl(d, ca_cert)) if d.crl.exists() else None
    if number != index.crl_number:
        _publish_crl(d, ca_cert, ca_key, index)


def _crl_pem(d: TLSDir, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, index: Index) -> bytes:
    """crl.pem from the index: its number, time and revoked serials."""
    if index.crl_last_update is None:
        raise CertsError(f"{d.index} records no CRL time; it was not written by `ctxfuse certs`")
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(index.crl_last_update)
        # the CRL never goes stale on its own: the gateway reads it locally, and an expired CRL
        # would refuse every device
        .next_update(ca_cert.not_valid_after_utc)
        .add_extension(x509.CRLNumber(index.crl_number), critical=False)
        .add_extension(_authority_key_id(ca_key), critical=False)
    )
    for r in index.revoked:
        revoked = x509.RevokedCertificateBuilder().serial_number(int(r.serial, 16))
        builder = builder.add_revoked_certificate(revoked.revocation_date(r.revoked_at).build())
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _next_crl_time(previous: dt.datetime | None) -> dt.datetime:
    deadline = time.monotonic() + 2.0
    while True:
        now = dt.datetime.now(dt.UTC).replace(microsecond=0)
        if previous is None or now > previous:
            return now
        if time.monotonic() > deadline:
            raise CertsError(f"the clock is behind the last CRL ({previous.isoformat()}); fix the clock")
        time.sleep(0.05)


def _index_file(d: TLSDir, index: Index) -> NewFile:
    return public_file(d.index, msgspec.json.format(msgspec.json.encode(index)) + b"\n")
