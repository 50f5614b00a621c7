"""`ctxfuse certs`: the edge listener's certificate authority (shared/certs.py holds the layout).
Prints the paths it wrote, never key contents. A disk that refuses a write, or a damaged file, ends
the command with one line naming the file or directory and the fix (ctxfuse.cli.main), nothing
changed."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared import certs


def add_certs_parser(p: argparse.ArgumentParser) -> None:
    p.description = (
        "A CA in DIR (ca.pem, ca.key, crl.pem, index.json), the gateway's server.pem/server.key "
        "and one devices/NAME.pem/NAME.key per device. Keys are written with mode 0600."
    )
    cmd = p.add_subparsers(dest="certs_command", required=True)

    init = cmd.add_parser("init", help="create the CA and an empty revocation list in DIR (never replaced)")
    _dir(init)
    _days(init, certs.CA_DAYS)
    init.set_defaults(func=_cmd_init)

    server = cmd.add_parser("server", help="the gateway's certificate for its names and addresses")
    _dir(server)
    server.add_argument(
        "--host",
        action="append",
        dest="hosts",
        metavar="NAME",
        help="a DNS name or IP address clients use to reach the gateway; repeatable "
        f"(default: {', '.join(certs.LOOPBACK_HOSTS)})",
    )
    _days(server, certs.SERVER_DAYS)
    server.set_defaults(func=_cmd_server)

    issue = cmd.add_parser("issue", help="a device's client certificate and key (devices/NAME.pem, NAME.key)")
    _dir(issue)
    issue.add_argument("name", help="the device name (its certificate's CN; letters, digits, . _ -)")
    issue.add_argument(
        "--tenant",
        metavar="TENANT",
        help="the tenant the device belongs to: it shares that tenant's files, batches, chunks and prefix "
        "cache with the tenant's API keys (default: none, the device is a tenant of its own)",
    )
    _days(issue, certs.DEVICE_DAYS)
    issue.set_defaults(func=_cmd_issue)

    revoke = cmd.add_parser(
        "revoke", help="revoke a device's certificate: rewrites crl.pem, which the gateway reloads"
    )
    _dir(revoke)
    revoke.add_argument("name", help="the device name")
    revoke.set_defaults(func=_cmd_revoke)

    crl = cmd.add_parser(
        "crl", help="publish crl.pem again from index.json (the fix for a damaged crl.pem; needs ca.key)"
    )
    _dir(crl)
    crl.set_defaults(func=_cmd_crl)

    ls = cmd.add_parser("list", help="issued devices: serial, tenant, expiry, revoked or not")
    _dir(ls)
    ls.set_defaults(func=_cmd_list)


def _dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, metavar="DIR", help="the TLS directory")


def _days(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--days", type=int, default=default, help=f"validity in days (default {default})")


def _cmd_init(args: argparse.Namespace) -> int:
    issued = certs.init_ca(args.dir, days=args.days)
    d = certs.TLSDir(args.dir)
    print(f"CA certificate:  {issued.cert} (valid until {issued.not_after:%Y-%m-%d})")
    print(f"CA key:          {issued.key} (0600; keep it off the gateway host)")
    print(f"revocation list: {d.crl}")
    return 0


def _cmd_server(args: argparse.Namespace) -> int:
    hosts = args.hosts or list(certs.LOOPBACK_HOSTS)
    issued = certs.issue_server(args.dir, hosts, days=args.days)
    print(f"server certificate: {issued.cert} for {', '.join(hosts)}")
    print(f"valid until:        {issued.not_after:%Y-%m-%d}")
    print(f"server key:         {issued.key} (0600)")
    return 0


def _cmd_issue(args: argparse.Namespace) -> int:
    issued = certs.issue_device(args.dir, args.name, tenant=args.tenant, days=args.days)
    print(f"device certificate: {issued.cert} (serial {issued.serial:x})")
    if args.tenant is not None:
        print(f"tenant:             {args.tenant}")
    print(f"valid until:        {issued.not_after:%Y-%m-%d}")
    print(f"device key:         {issued.key} (0600)")
    print(f"give the device these two files and {certs.TLSDir(args.dir).ca_cert}")
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    record = certs.revoke_device(args.dir, args.name)
    print(f"revoked {record.name} (serial {record.serial}); wrote {certs.TLSDir(args.dir).crl}")
    return 0


def _cmd_crl(args: argparse.Namespace) -> int:
    path = certs.rebuild_crl(args.dir)
    print(f"revocation list: {path} (rebuilt from {certs.TLSDir(args.dir).index.name})")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    records = certs.list_devices(args.dir)
    if not records:
        print("no devices")
    for r in records:
        status = f"revoked {r.revoked_at:%Y-%m-%d %H:%M:%S}" if r.revoked_at else "valid"
        tenant = r.tenant if r.tenant is not None else "-"
        print(f"{r.name}\tserial {r.serial}\ttenant {tenant}\texpires {r.not_after:%Y-%m-%d}\t{status}")
    return 0
