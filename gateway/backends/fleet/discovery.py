"""Workers found through DNS (`[discovery]` in the fleet file): every `refresh_s` the name is resolved
again (a Kubernetes headless Service answers with the addresses of its ready pods), an address that
appeared becomes a backend and one that went away is dropped from the running fleet.

- Resolution runs in a thread (`getaddrinfo` blocks); the event loop never waits on DNS.
- A name that does not exist or has no address (a headless Service with no ready pod answers so) means
  no workers; any other failure (a DNS server that does not answer) changes nothing: dropping every
  worker because DNS hiccuped would turn a blip into an outage.
- A new backend takes no request before a health check reaches it (`Fleet.add_backend`); a dropped one
  keeps the requests it runs, and the prefix index forgets it. Backends named in the file stay,
  whatever DNS says, and an address one of them already has is not added twice.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from gateway.backends.fleet.backend import FleetBackend
from gateway.backends.fleet.config import DiscoverySpec

if TYPE_CHECKING:  # fleet.py holds the resolver it is given, so it imports this module
    from gateway.backends.fleet.fleet import Fleet

log = structlog.get_logger("ctxfuse.fleet")

# socket.getaddrinfo's shape: (host, port) -> [(family, type, proto, canonname, sockaddr)]
Resolver = Callable[[str, int], Sequence[tuple[Any, Any, Any, Any, tuple[Any, ...]]]]
Checker = Callable[[list[FleetBackend]], Awaitable[None]]

_NO_ADDRESS = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


@dataclass(frozen=True, slots=True)
class Change:
    added: tuple[str, ...]  # backend names
    dropped: tuple[str, ...]


async def resolve(resolver: Resolver, spec: DiscoverySpec) -> frozenset[str] | None:
    """The addresses `spec.dns` has now; None when DNS could not say (keep what is known)."""
    try:
        infos = await asyncio.to_thread(resolver, spec.dns, spec.port)
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESS:
            return frozenset()
        log.warning("discovery_failed", dns=spec.dns, reason=str(exc))
        return None
    except OSError as exc:
        log.warning("discovery_failed", dns=spec.dns, reason=str(exc))
        return None
    return frozenset(str(info[4][0]) for info in infos)


def apply(fleet: Fleet, spec: DiscoverySpec, addresses: Iterable[str], found: set[str]) -> Change:
    """Make the fleet's discovered backends (`found`, their names, updated here) those at `addresses`."""
    wanted = {s.name: s for s in (spec.backend(a) for a in sorted(addresses))}
    dropped = [name for name in sorted(found) if name not in wanted]
    for name in dropped:
        fleet.drop_backend(name)
        found.discard(name)
    known = {b.url for b in fleet.backends} | {b.name for b in fleet.backends}
    added = [s for s in wanted.values() if s.name not in known and s.url not in known]
    for s in added:
        fleet.add_backend(s)
        found.add(s.name)
    return Change(tuple(s.name for s in added), tuple(dropped))


class Discovery:
    """The discovered part of one fleet: what its name resolved to, kept in step every refresh_s."""

    def __init__(self, fleet: Fleet, spec: DiscoverySpec) -> None:
        self.fleet = fleet
        self.spec = spec
        self.found: set[str] = set()  # the backends this added and has not dropped, by name

    async def refresh(self) -> Change | None:
        """Resolve once and apply it; None when DNS could not say."""
        addresses = await resolve(self.fleet.resolver, self.spec)
        if addresses is None:
            return None
        change = apply(self.fleet, self.spec, addresses, self.found)
        if change.added or change.dropped:
            log.info("discovery", dns=self.spec.dns, added=change.added, dropped=change.dropped)
        return change

    async def run(self, check: Checker) -> None:
        """Forever: refresh, and give what was added its first health check at once (`check`)."""
        while True:
            change = await self.refresh()
            if change is not None and change.added:
                await check([b for b in self.fleet.backends if b.name in change.added])
            await asyncio.sleep(self.spec.refresh_s)
