"""The files of a TLS directory (`TLSDir` owns the paths), read with the checks that tell a damaged
one, and written so that a full or read-only disk changes nothing.

    DIR/ca.pem              CA certificate; the gateway and every device trust it
    DIR/ca.key              CA private key (0600); only `ctxfuse certs` needs it, keep it off the gateway host
    DIR/crl.pem             revocation list signed by the CA; written by `init`, rewritten on each revoke
    DIR/server.pem          the gateway's certificate (serverAuth; DNS names and IP addresses as SANs)
    DIR/server.key          its key (0600)
    DIR/devices/NAME.pem    a device certificate (clientAuth; CN = NAME, SAN URI urn:ctxfuse:device:NAME,
                            and urn:ctxfuse:tenant:TENANT for a device issued with a tenant)
    DIR/devices/NAME.key    its key (0600)
    DIR/index.json          issued devices and every revoked serial, the CRL number and time

Damage: every certificate and CRL read here must parse and carry a valid signature of its issuer,
every key must match its certificate, and index.json must decode with no unknown field and account
for every serial crl.pem revokes. Anything else is a `DamagedCAFile` naming the file and its fix; no
file is ever replaced because it could not be read. A disk that refuses a read or write is the
store "ca"'s `StorageFault` (shared/storage_faults.py).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shared.durable_file import NewFile, write_in_order
from shared.errors import CtxfuseError
from shared.storage_faults import FAULTS, StorageFault, storage_guard

STORE = "ca"

# a device name becomes a file name and a CN (at most 64 characters): no separators, no leading dot
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_T = TypeVar("_T")
_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class CertsError(CtxfuseError):
    """A certificate operation could not be done; the message says what to do instead."""


class CANotFoundError(CertsError):
    pass


class InvalidNameError(CertsError):
    pass


class DamagedCAFile(StorageFault, CertsError):
    """A file that is there but is not what `ctxfuse certs` wrote (truncated, altered bytes, a key that
    does not match its certificate): refused where it is read, never replaced silently."""

    def __init__(self, path: Path, why: str, fix: str) -> None:
        super().__init__(STORE, path, "damaged", why)
        self.operator_message = f"{path} is damaged ({why}): {fix}; it is never replaced silently"
        FAULTS.record(self)


class DeviceRecord(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    serial: str  # hex
    not_after: dt.datetime
    revoked_at: dt.datetime | None = None
    tenant: str | None = None  # None: the device is a tenant of its own


class RevokedSerial(msgspec.Struct, forbid_unknown_fields=True):
    serial: str  # hex
    name: str
    revoked_at: dt.datetime


# unknown fields are refused: a field name altered on disk would otherwise read as an empty default,
# and the next write would drop what it held
class Index(msgspec.Struct, forbid_unknown_fields=True):
    """index.json. `revoked` keeps every revoked serial (the CRL is rebuilt from it), also after a
    name is issued again; `devices` holds each name's latest certificate."""

    crl_number: int = 0
    crl_last_update: dt.datetime | None = None
    devices: dict[str, DeviceRecord] = msgspec.field(default_factory=dict)
    revoked: list[RevokedSerial] = msgspec.field(default_factory=list)


def check_device_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"device name {name!r} is not a safe file name: 1-64 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


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

    # what to do about each damaged file
    def ca_fix(self) -> str:
        return f"restore {self.root}'s CA files from a backup (a new CA means new certificates for all)"

    def crl_fix(self) -> str:
        return f"run `ctxfuse certs crl {self.root}` where the CA key is: it rebuilds crl.pem from index.json"

    def server_fix(self) -> str:
        return f"run `ctxfuse certs server {self.root} --host NAME` to issue it again, or restore a backup"

    def device_fix(self, name: str) -> str:
        return (
            f"copy devices/{name}.pem and {name}.key again from the CA's directory, or revoke and issue "
            f"them again (`ctxfuse certs revoke DIR {name}`, then `ctxfuse certs issue DIR {name}`)"
        )

    def index_fix(self) -> str:
        return (
            f"restore {self.index.name} from a backup (crl.pem lists the revoked serials and "
            "devices/*.pem the issued certificates, to check it against)"
        )


def read_cert(path: Path, fix: str, issuer: x509.Certificate | None = None) -> x509.Certificate:
    """The certificate in `path`, signed by `issuer` (itself when None: the CA's own)."""
    cert = _parse(path, fix, "a PEM certificate", x509.load_pem_x509_certificate)
    try:
        cert.verify_directly_issued_by(issuer or cert)
    except (ValueError, TypeError, InvalidSignature):
        raise DamagedCAFile(path, "its signature does not verify", fix) from None
    return cert


def read_key(path: Path, fix: str, cert: x509.Certificate) -> ec.EllipticCurvePrivateKey:
    """The EC key in `path`, which must be the key of `cert`."""

    def load(data: bytes) -> object:
        return serialization.load_pem_private_key(data, password=None)

    key = _parse(path, fix, "an unencrypted PEM private key", load)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise DamagedCAFile(path, "not an EC key, so not one `ctxfuse certs` made", fix)
    if key.public_key().public_bytes(*_SPKI) != cert.public_key().public_bytes(*_SPKI):
        raise DamagedCAFile(path, "it is not the key of its certificate", fix)
    return key


def read_crl(d: TLSDir, ca_cert: x509.Certificate) -> x509.CertificateRevocationList:
    """crl.pem, signed by `ca_cert` and numbered."""
    crl = _parse(d.crl, d.crl_fix(), "a PEM revocation list", x509.load_pem_x509_crl)
    public = ca_cert.public_key()
    try:
        signed = isinstance(public, ec.EllipticCurvePublicKey) and crl.is_signature_valid(public)
        crl.extensions.get_extension_for_class(x509.CRLNumber)
    except (TypeError, x509.ExtensionNotFound):
        signed = False
    if not signed or crl.issuer != ca_cert.subject:
        raise DamagedCAFile(d.crl, "its signature does not verify with ca.pem", d.crl_fix())
    return crl


def load_ca(d: TLSDir) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA's certificate and key, checked against each other."""
    if not d.ca_cert.exists() or not d.ca_key.exists():
        raise CANotFoundError(f"no CA in {d.root}: run `ctxfuse certs init {d.root}` first")
    cert = read_cert(d.ca_cert, d.ca_fix())
    return cert, read_key(d.ca_key, d.ca_fix(), cert)


def read_index(d: TLSDir) -> Index:
    """index.json, or an empty one where there is none yet (`check_index_covers` tells a lost one)."""
    if not d.index.exists():
        return Index()
    with storage_guard(STORE, d.index):
        data = d.index.read_bytes()
    try:
        index = msgspec.json.decode(data, type=Index)
        for serial in [r.serial for r in index.devices.values()] + [r.serial for r in index.revoked]:
            int(serial, 16)
    except (msgspec.DecodeError, ValueError) as exc:
        raise DamagedCAFile(d.index, _one_line(str(exc)), d.index_fix()) from None
    return index


def check_index_covers(d: TLSDir, index: Index, crl: x509.CertificateRevocationList) -> int:
    """crl.pem's number, once checked that `index` accounts for it: the index is written before each
    CRL, so it is never older and revokes every serial the CRL does. One that does not (lost, restored
    from an older backup, altered) would drop revocations from the next CRL, so it is refused."""
    number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    missing = {r.serial_number for r in crl} - {int(r.serial, 16) for r in index.revoked}
    if number > index.crl_number or missing:
        why = (
            f"crl.pem is number {number}, the index records {index.crl_number}"
            if number > index.crl_number
            else f"it does not revoke serial {min(missing):x}, which crl.pem does"
        )
        lost = "missing" if not d.index.exists() else "older than crl.pem, or altered"
        raise DamagedCAFile(d.index, f"{lost}: {why}", d.index_fix())
    return number


def write_files(d: TLSDir, files: Sequence[NewFile]) -> None:
    """Write `files` in order (shared.durable_file.write_in_order); a disk that refuses them raises the
    store's StorageFault naming the TLS directory, with nothing changed."""
    with storage_guard(STORE, d.root):
        for directory in dict.fromkeys(f.path.parent for f in files):
            directory.mkdir(parents=True, exist_ok=True)
        write_in_order(files)


def key_file(path: Path, key: ec.EllipticCurvePrivateKey) -> NewFile:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return NewFile(path, pem, 0o600)


def public_file(path: Path, data: bytes) -> NewFile:
    return NewFile(path, data, 0o644)


def _parse(path: Path, fix: str, what: str, load: Callable[[bytes], _T]) -> _T:
    with storage_guard(STORE, path):
        data = path.read_bytes()
    try:
        return load(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        cut = "" if data.rstrip().endswith(b"-----") else ", truncated"
        raise DamagedCAFile(path, f"not {what}{cut}", fix) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]
