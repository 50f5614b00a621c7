"""`ctxfuse keys`: tenants' API keys in the gateway's data directory (gateway/access/keys.py). The
secret is printed once, by `create` and `rotate`; lists show a key's id, never its secret. A running
gateway on the same data directory sees a change within seconds (gateway/access/auth.py). With
`--redis-url` (as given to the gateway replicas) the keys live in that Redis, for every replica."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ctxfuse.cli_values import duration_s, positive_int

if TYPE_CHECKING:
    from gateway.access.keys import Keys


def add_keys_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "API keys of tenants: each key belongs to a tenant and may carry an expiry, allowed models and "
        "limits (requests and tokens per minute, requests in flight). Keys are stored hashed in "
        "DATA_DIR/keys.sqlite (or, with --redis-url, in the Redis the gateway replicas share); once one "
        "exists, `ctxfuse serve` on that directory (or Redis) requires a key."
    )
    cmd = p.add_subparsers(dest="keys_command", required=True)

    create = cmd.add_parser("create", help="a new key of a tenant; prints the secret once")
    _data_dir(create)
    create.add_argument("--tenant", required=True, help="the tenant the key belongs to")
    create.add_argument("--name", default="", help="a label for lists (default none)")
    create.add_argument("--expires-in", type=duration_s, help="lifetime, e.g. 90d, 12h, 30m (default never)")
    create.add_argument(
        "--models", help="comma-separated models the key may use (default every model the server serves)"
    )
    create.add_argument("--rpm", type=positive_int, help="requests per minute (default unlimited)")
    create.add_argument(
        "--tpm", type=positive_int, help="tokens per minute, prompt + completion (default unlimited)"
    )
    create.add_argument("--max-concurrent", type=positive_int, help="requests in flight (default unlimited)")
    create.set_defaults(func=_cmd_create)

    ls = cmd.add_parser("list", help="keys (id, tenant, limits, expiry, revoked), never their secrets")
    _data_dir(ls)
    ls.add_argument("--tenant", help="only this tenant's keys")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(func=_cmd_list)

    rotate = cmd.add_parser(
        "rotate", help="a new secret for a key's tenant and limits; the old key is revoked"
    )
    _data_dir(rotate)
    rotate.add_argument("key_id", help="the key's id (from `ctxfuse keys list`)")
    rotate.set_defaults(func=_cmd_rotate)

    revoke = cmd.add_parser("revoke", help="revoke a key: refused within seconds, also by a running gateway")
    _data_dir(revoke)
    revoke.add_argument("key_id", help="the key's id (from `ctxfuse keys list`)")
    revoke.set_defaults(func=_cmd_revoke)


def _data_dir(p: argparse.ArgumentParser) -> None:
    from ctxfuse.shared_state_cli import REDIS_URL

    REDIS_URL.add(
        p,
        help="keep the keys in this Redis, as given to `ctxfuse serve --redis-url` (several replicas); "
        f"default ${REDIS_URL.env}, else the data directory",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the gateway's data directory, as given to `ctxfuse serve --data-dir` "
        "(default CTXFUSE_HOME/gateway)",
    )


def _store(args: argparse.Namespace) -> Keys:
    from ctxfuse.shared_state_cli import REDIS_URL
    from gateway.access.keys import KeyStore
    from gateway.config import GatewayConfig

    url = REDIS_URL.read(args)
    if url is not None:
        from gateway.access.keys_redis import RedisKeyStore
        from gateway.shared_state.redis_link import RedisLink

        return RedisKeyStore(RedisLink(url))
    return KeyStore(GatewayConfig(data_dir=args.data_dir).data / "keys.sqlite")


def _cmd_create(args: argparse.Namespace) -> int:
    from gateway.access.keys import KeyLimits

    models = None if args.models is None else tuple(m.strip() for m in args.models.split(",") if m.strip())
    limits = KeyLimits(models=models, rpm=args.rpm, tpm=args.tpm, max_concurrent=args.max_concurrent)
    expires = None if args.expires_in is None else time.time() + args.expires_in
    record, secret = _store(args).create(args.tenant, limits, name=args.name, expires_at=expires)
    print(f"created key {record.id} for tenant {record.tenant}; the secret is shown only now:")
    print(secret)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    for k in _store(args).list(args.tenant):
        row = {
            "id": k.id,
            "tenant": k.tenant,
            "name": k.name,
            "created_at": round(k.created_at),
            "expires_at": None if k.expires_at is None else round(k.expires_at),
            "revoked": k.revoked_at is not None,
            "models": None if k.limits.models is None else list(k.limits.models),
            "rpm": k.limits.rpm,
            "tpm": k.limits.tpm,
            "max_concurrent": k.limits.max_concurrent,
        }
        if args.json:
            print(json.dumps(row))
        else:
            state = "revoked" if row["revoked"] else "active"
            limits = ", ".join(
                f"{n}={v}" for n, v in row.items() if n in ("rpm", "tpm", "max_concurrent") and v
            )
            print(f"{k.id}  {k.tenant}  {state}  {k.name or '-'}  {limits or 'unlimited'}")
    return 0


def _cmd_rotate(args: argparse.Namespace) -> int:
    record, secret = _store(args).rotate(args.key_id)
    print(f"key {args.key_id} revoked; new key {record.id} for tenant {record.tenant}, shown only now:")
    print(secret)
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    record = _store(args).revoke(args.key_id)
    print(f"key {record.id} of tenant {record.tenant} revoked")
    return 0
