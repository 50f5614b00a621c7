"""What a tenant's name may be: one rule for the gateway's key store (`ctxfuse keys create --tenant`)
and the CA (`ctxfuse certs issue --tenant`), which writes it into a device's certificate.

A tenant's name becomes a prefix-cache salt, a column in the gateway's stores and a URI in a
certificate, so it is kept to a plain token: 1-64 letters, digits, '.', '_' or '-', starting with a
letter or digit. It can never start with "device:", the name a device without a tenant runs under.
"""

from __future__ import annotations

import re

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def is_tenant_name(name: str) -> bool:
    # fullmatch: `$` would also accept a trailing newline
    return _TENANT.fullmatch(name) is not None
