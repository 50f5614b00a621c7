"""A small certificate authority for the gateway's edge listener: one CA, the gateway's server
certificate, one certificate per device and a revocation list. `ctxfuse certs` drives it;
`shared.tls` reads what it writes.

One layout per TLS directory (`TLSDir` owns the paths):

    DIR/ca.pem              CA certificate; the gateway and every device trust it
    DIR/ca.key              CA private key (0600); only `ctxfuse certs` needs it, keep it off the gateway host
    DIR/crl.pem             revocation list signed by the CA; written by `init`, rewritten on each revoke
    DIR/server.pem          the gateway's certificate (serverAuth; DNS names and IP addresses as SANs)
    DIR/server.key          its key (0600)
    DIR/devices/NAME.pem    a device certificate (clientAuth; CN = NAME, SAN URI urn:ctxfuse:device:NAME,
                            and urn:ctxfuse:tenant:TENANT for a device issued with a tenant)
    DIR/devices/NAME.key    its key (0600)
    DIR/index.json          issued devices and every revoked serial, the CRL number and time

A device gets ca.pem and its own devices/NAME.{pem,key}; the gateway gets ca.pem, server.{pem,key}
and crl.pem. Keys are EC P-256, unencrypted PKCS#8 PEM, created with mode 0600 so that they are never
readable by others, not even for an instant.

Crash safety: each file is replaced atomically and durably (write aside, fsync, rename, fsync the
directory), so a gateway reloading crl.pem never reads half a file and a finished command survives
power loss. index.json is the source of truth and is written first; crl.pem is rebuilt from it. A crash
between the two leaves a CRL older than the index (never one that forgets a revocation the index
holds), and the next revoke or issue publishes a CRL from the index again (`_sync_crl`).
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

from shared.durable_file import write_atomic
from shared.errors import CtxfuseError
from shared.tenant_name import TENANT_RULE, is_tenant_name

CA_DAYS = 3650
SERVER_DAYS = 730
DEVICE_DAYS = 365
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEVICE_URI_PREFIX = "urn:ctxfuse:device:"
# the tenant a device belongs to (its files, batches, chunks and prefix cache are the tenant's);
# a device without one is a tenant of its own
TENANT_URI_PREFIX = "urn:ctxfuse:tenant:"

# a device name becomes a file name and a CN (at most 64 characters): no separators, no leading dot
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DNS_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# allowed clock skew between the issuing machine and the peers
_BACKDATE = dt.timedelta(minutes=5)


class CertsError(CtxfuseError):
    """A certificate operation could not be done; the message says what to do instead."""


class CANotFoundError(CertsError):
    pass


class UnknownDeviceError(CertsError):
    pass


class InvalidNameError(CertsError):
    pass


class AlreadyExistsError(CertsError):
    pass


class DeviceRecord(msgspec.Struct):
    name: str
    serial: str  # hex
    not_after: dt.datetime
    revoked_at: dt.datetime | None = None
    tenant: str | None = None  # None: the device is a tenant of its own


class RevokedSerial(msgspec.Struct):
    serial: str  # hex
    name: str
    revoked_at: dt.datetime


class Index(msgspec.Struct):
    """index.json. `revoked` keeps every revoked serial (the CRL is rebuilt from it), also after a
    name is issued again; `devices` holds each name's latest certificate."""

    crl_number: int = 0
    crl_last_update: dt.datetime | None = None
    devices: dict[str, DeviceRecord] = msgspec.field(default_factory=dict)
    revoked: list[RevokedSerial] = msgspec.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TLSDir:
    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def crl(self) -> Path:
        return self.root / "crl.pem"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    @property
    def index(self) -> Path:
        return self.root / "index.json"

    def device_cert(self, name: str) -> Path:
        return self.root / "devices" / f"{check_device_name(name)}.pem"

    def device_key(self, name: str) -> Path:
        return self.root / "devices" / f"{check_device_name(name)}.key"


@dataclass(frozen=True, slots=True)
class Issued:
    cert: Path
    key: Path
    serial: int
    not_after: dt.datetime


def check_device_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"device name {name!r} is not a safe file name: 1-64 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def check_tenant_name(tenant: str) -> str:
    if not is_tenant_name(tenant):
        raise InvalidNameError(f"tenant {tenant!r} must be {TENANT_RULE}")
    return tenant


def init_ca(root: Path, *, days: int = CA_DAYS) -> Issued:
    """Create the CA and an empty CRL in `root`; refuses to replace an existing CA."""
    d = TLSDir(Path(root))
    if d.ca_cert.exists() or d.ca_key.exists():
        raise AlreadyExistsError(f"{d.root} already holds a CA ({d.ca_cert.name}); not replacing it")
    d.root.mkdir(parents=True, exist_ok=True)
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
    _write_key(d.ca_key, key)
    _write_public(d.ca_cert, cert.public_bytes(serialization.Encoding.PEM))
    _publish_crl(d, cert, key, Index())
    return Issued(d.ca_cert, d.ca_key, cert.serial_number, cert.not_valid_after_utc)


def issue_server(root: Path, hosts: Sequence[str] = LOOPBACK_HOSTS, *, days: int = SERVER_DAYS) -> Issued:
    """The gateway's certificate for `hosts` (DNS names and IP addresses); replaces an earlier one."""
    if not hosts:
        raise InvalidNameError("a server certificate needs at least one host name or address")
    d = TLSDir(Path(root))
    ca_cert, ca_key = _load_ca(d)
    sans = [_general_name(h) for h in dict.fromkeys(hosts)]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ctxfuse gateway")])
    key, cert = _issue_leaf(ca_cert, ca_key, subject, sans, ExtendedKeyUsageOID.SERVER_AUTH, days)
    _write_key(d.server_key, key)
    _write_public(d.server_cert, cert.public_bytes(serialization.Encoding.PEM))
    return Issued(d.server_cert, d.server_key, cert.serial_number, cert.not_valid_after_utc)


def issue_device(root: Path, name: str, *, tenant: str | None = None, days: int = DEVICE_DAYS) -> Issued:
    """A client certificate and key for device `name`, of `tenant` if given (a SAN URI beside the
    device's own; the gateway serves the device as that tenant). A name may be issued again only once
    its previous certificate is revoked, so one name never has two valid certificates."""
    d = TLSDir(Path(root))
    if tenant is not None:
        check_tenant_name(tenant)
    cert_path, key_path = d.device_cert(name), d.device_key(name)
    ca_cert, ca_key = _load_ca(d)
    index = _read_index(d)
    _sync_crl(d, ca_cert, ca_key, index)
    earlier = index.devices.get(name)
    if earlier is not None and earlier.revoked_at is None:
        raise AlreadyExistsError(f"device {name!r} already has a valid certificate; revoke it first")
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(DEVICE_URI_PREFIX + name)]
    if tenant is not None:
        sans.append(x509.UniformResourceIdentifier(TENANT_URI_PREFIX + tenant))
    key, cert = _issue_leaf(ca_cert, ca_key, subject, sans, ExtendedKeyUsageOID.CLIENT_AUTH, days)
    # recorded before the files exist: a certificate that is out there can always be revoked by name
    serial = format(cert.serial_number, "x")
    index.devices[name] = DeviceRecord(name, serial, cert.not_valid_after_utc, tenant=tenant)
    _write_index(d, index)
    cert_path.parent.mkdir(exist_ok=True)
    _write_key(key_path, key)
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return Issued(cert_path, key_path, cert.serial_number, cert.not_valid_after_utc)


def revoke_device(root: Path, name: str) -> DeviceRecord:
    """Add device `name`'s current certificate to the CRL and rewrite crl.pem."""
    d = TLSDir(Path(root))
    check_device_name(name)
    ca_cert, ca_key = _load_ca(d)
    index = _read_index(d)
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
    return sorted(_read_index(d).devices.values(), key=lambda r: r.name)


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
    d: TLSDir, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, index: Index
) -> None:
    """A new CRL of everything `index` revokes: the index (with the CRL's number and time) first, then
    crl.pem built from it, so no crash leaves a CRL the index does not account for."""
    # shared.tls adds each new CRL beside the old ones in the live context, and OpenSSL then uses the
    # CRL with the latest lastUpdate (whole seconds). So each CRL must be strictly later than the last:
    # wait for the next second rather than date it in the future (a future CRL is "not yet valid").
    index.crl_last_update = _next_crl_time(index.crl_last_update)
    index.crl_number += 1
    _write_index(d, index)
    _write_crl(d, ca_cert, ca_key, index)


def _sync_crl(d: TLSDir, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, index: Index) -> None:
    """Publish a CRL again if crl.pem is not the one the index last recorded (a crash between the two)."""
    try:
        crl = x509.load_pem_x509_crl(d.crl.read_bytes())
        number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except (OSError, ValueError, x509.ExtensionNotFound):
        number = None
    if number != index.crl_number:
        _publish_crl(d, ca_cert, ca_key, index)


def _write_crl(
    d: TLSDir, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, index: Index
) -> None:
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
    crl = builder.sign(ca_key, hashes.SHA256())
    _write_public(d.crl, crl.public_bytes(serialization.Encoding.PEM))


def _next_crl_time(previous: dt.datetime | None) -> dt.datetime:
    deadline = time.monotonic() + 2.0
    while True:
        now = dt.datetime.now(dt.UTC).replace(microsecond=0)
        if previous is None or now > previous:
            return now
        if time.monotonic() > deadline:
            raise CertsError(f"the clock is behind the last CRL ({previous.isoformat()}); fix the clock")
        time.sleep(0.05)


def _load_ca(d: TLSDir) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not d.ca_cert.exists() or not d.ca_key.exists():
        raise CANotFoundError(f"no CA in {d.root}: run `ctxfuse certs init {d.root}` first")
    cert = x509.load_pem_x509_certificate(d.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(d.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertsError(f"{d.ca_key} is not an EC key; it was not made by `ctxfuse certs init`")
    return cert, key


def _read_index(d: TLSDir) -> Index:
    if not d.index.exists():
        return Index()
    try:
        return msgspec.json.decode(d.index.read_bytes(), type=Index)
    except msgspec.ValidationError as exc:
        raise CertsError(f"{d.index} is damaged: {exc}") from exc


def _write_index(d: TLSDir, index: Index) -> None:
    _write_public(d.index, msgspec.json.format(msgspec.json.encode(index)) + b"\n")


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_atomic(path, pem, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    write_atomic(path, data, 0o644)
