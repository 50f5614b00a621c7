"""API keys of tenants, stored hashed (SQLite `keys.sqlite` in the gateway's data directory).

A key is `cfk_<id>_<secret>`: `id` names it in lists and logs (12 hex digits), the secret is 32
random bytes (base64url). Only the SHA-256 of the whole key is stored: a 256-bit random secret needs
no slow hash, and a stored hash cannot be presented as a key. A presented key is looked up by its
hash, and the stored hash is compared once more in constant time (hmac.compare_digest), so neither
the lookup nor the comparison leaks by timing how much of a guess was right.

Each key belongs to a tenant and carries its limits: an expiry, the models it may use, requests and
tokens per minute and concurrent requests (None: unlimited). `ctxfuse keys` creates, lists, rotates
and revokes keys; the secret is shown once, at creation or rotation. Writes are `synchronous=FULL`:
a revocation that was acknowledged survives a power cut.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.errors import InvalidRequestError, NotFoundError
from shared.sqlite_store import open_db
from shared.tenant_name import TENANT_RULE, is_tenant_name

KEY_PREFIX = "cfk_"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,
    hash BLOB NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    expires_at REAL,
    revoked_at REAL,
    models TEXT,             -- comma-separated model names; NULL: every model
    rpm INTEGER,             -- requests per minute; NULL: unlimited
    tpm INTEGER,             -- tokens per minute (prompt + completion); NULL: unlimited
    max_concurrent INTEGER   -- requests in flight; NULL: unlimited
);
CREATE INDEX IF NOT EXISTS keys_tenant ON keys (tenant);
"""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    models: tuple[str, ...] | None = None  # None: every model
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(
                    f"{name} must be at least 1 (leave it out for no limit)", param=name
                )
        if self.models is not None and not all(self.models):
            raise InvalidRequestError("model names must not be empty", param="models")


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    tenant: str
    name: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    limits: KeyLimits

    @property
    def shown(self) -> str:
        """How lists and logs name the key: never the secret."""
        return f"{KEY_PREFIX}{self.id}_..."

    def usable(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def check_tenant(tenant: str) -> str:
    if not is_tenant_name(tenant):
        raise InvalidRequestError(f"tenant {tenant!r} must be {TENANT_RULE}", param="tenant")
    return tenant


class KeyStore:
    """The keys table. Safe to share across threads (one connection behind a lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = open_db(path, durable=True, store="keys")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(
        self,
        tenant: str,
        limits: KeyLimits | None = None,
        *,
        name: str = "",
        expires_at: float | None = None,
        now: float | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key of `tenant`: its record and the secret key (shown once; only its hash is kept)."""
        record, key = new_key(tenant, limits, name=name, expires_at=expires_at, now=now)
        limits, key_id, tenant, created = record.limits, record.id, record.tenant, record.created_at
        with self._lock:
            self._db.execute(
                "INSERT INTO keys (id, hash, tenant, name, created_at, expires_at, models, rpm, tpm, "
                "max_concurrent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key_id,
                    key_hash(key),
                    tenant,
                    name,
                    created,
                    expires_at,
                    None if limits.models is None else ",".join(limits.models),
                    limits.rpm,
                    limits.tpm,
                    limits.max_concurrent,
                ),
            )
        return record, key

    def lookup(self, key: str, now: float | None = None) -> ApiKey | None:
        """The usable key (not revoked, not expired) whose secret is `key`, else None."""
        if not key.startswith(KEY_PREFIX) or len(key) > 128:
            return None
        digest = key_hash(key)
        with self._lock:
            row = self._db.execute(f"SELECT hash, {_COLUMNS} FROM keys WHERE hash = ?", (digest,)).fetchone()
        if row is None or not hmac.compare_digest(row[0], digest):
            return None
        record = _record(row[1:])
        return record if record.usable(time.time() if now is None else now) else None

    def get(self, key_id: str) -> ApiKey:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM keys WHERE id = ?", (key_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no key with id {key_id!r}")
        return _record(row)

    def has_keys(self) -> bool:
        """Whether any key was ever created (revoked ones too): then the server requires one."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM keys LIMIT 1").fetchone() is not None

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        query = f"SELECT {_COLUMNS} FROM keys"
        args: tuple[str, ...] = ()
        if tenant is not None:
            query, args = query + " WHERE tenant = ?", (tenant,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at, id", args).fetchall()
        return [_record(r) for r in rows]

    def revoke(self, key_id: str, now: float | None = None) -> ApiKey:
        """Revoke a key (idempotent: a revoked key keeps its first revocation time)."""
        self.get(key_id)
        with self._lock:
            self._db.execute(
                "UPDATE keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                (time.time() if now is None else now, key_id),
            )
        return self.get(key_id)

    def rotate(self, key_id: str, now: float | None = None) -> tuple[ApiKey, str]:
        return rotate(self, key_id, now)


class Keys(Protocol):
    """A store of tenants' keys: this SQLite one, or access/keys_redis.py's (several replicas)."""

    def create(
        self,
        tenant: str,
        limits: KeyLimits | None = None,
        *,
        name: str = "",
        expires_at: float | None = None,
        now: float | None = None,
    ) -> tuple[ApiKey, str]: ...

    def lookup(self, key: str, now: float | None = None) -> ApiKey | None: ...

    def get(self, key_id: str) -> ApiKey: ...

    def has_keys(self) -> bool: ...

    def list(self, tenant: str | None = None) -> list[ApiKey]: ...

    def revoke(self, key_id: str, now: float | None = None) -> ApiKey: ...

    def rotate(self, key_id: str, now: float | None = None) -> tuple[ApiKey, str]: ...

    def close(self) -> None: ...


def new_key(
    tenant: str,
    limits: KeyLimits | None = None,
    *,
    name: str = "",
    expires_at: float | None = None,
    now: float | None = None,
) -> tuple[ApiKey, str]:
    """A new key's record and its secret (`cfk_<id>_<secret>`), not yet stored."""
    limits = limits or KeyLimits()
    created = time.time() if now is None else now
    if expires_at is not None and expires_at <= created:
        raise InvalidRequestError("the expiry must be in the future", param="expires_at")
    key_id = secrets.token_hex(6)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    record = ApiKey(key_id, check_tenant(tenant), name, created, expires_at, None, limits)
    return record, f"{KEY_PREFIX}{key_id}_{secret}"


def rotate(store: Keys, key_id: str, now: float | None = None) -> tuple[ApiKey, str]:
    """A new key with the old one's tenant, name, expiry and limits; the old one is revoked."""
    old = store.get(key_id)
    if old.revoked_at is not None:
        raise InvalidRequestError(f"key {key_id!r} is revoked; create a new one", param="key_id")
    new = store.create(old.tenant, old.limits, name=old.name, expires_at=old.expires_at, now=now)
    store.revoke(key_id, now)
    return new


_COLUMNS = "id, tenant, name, created_at, expires_at, revoked_at, models, rpm, tpm, max_concurrent"


def _record(row: tuple[object, ...]) -> ApiKey:
    key_id, tenant, name, created, expires, revoked, models, rpm, tpm, conc = row
    limits = KeyLimits(
        models=None if models is None else tuple(str(models).split(",")),
        rpm=None if rpm is None else int(str(rpm)),
        tpm=None if tpm is None else int(str(tpm)),
        max_concurrent=None if conc is None else int(str(conc)),
    )
    return ApiKey(
        str(key_id),
        str(tenant),
        str(name),
        float(str(created)),
        None if expires is None else float(str(expires)),
        None if revoked is None else float(str(revoked)),
        limits,
    )
