"""Discovery: the addresses of a service's replicas, from the targets the coordinator is given.

A target is ``host:port``. An IP address is one replica. A name is every address it resolves to:
a Kubernetes headless Service resolves to one address per ready pod, so the coordinator finds
each pod and connects to each (a ClusterIP Service, one address, would give it one connection,
to one pod, for good: gRPC keeps a connection open). Names are resolved again every
``refresh_s`` seconds and after a replica fails, so pods that come are used and pods that go are
dropped (:class:`coordinator.speculation.upstream.ReplicaSet` acts on the changes).

Resolution goes through the operating system's resolver (``getaddrinfo``: ``/etc/hosts``, the
search domains of ``/etc/resolv.conf``, as every other client in the pod), or, with
``nameservers`` (``host:port`` of DNS servers), straight to them with dnspython (A and AAAA
queries; what the tests use to serve records they change while the coordinator runs).
"""

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

log = logging.getLogger(__name__)
FAMILIES = (socket.AF_INET, socket.AF_INET6)


@dataclass(frozen=True)
class Address:
    """One replica's address, ``host:port`` with an IP; ``name``: the DNS name it was found under
    (TLS checks the replica's certificate against it), empty for a target given as an IP."""

    address: str
    name: str = ""


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for an IPv6 address) as (host, port). Raises ValueError."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{target!r} is not host:port: give each replica or DNS name with its port")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IP address (v4 or v6) rather than a DNS name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _joined(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Discovery:
    """Resolves ``targets`` (see the module docstring). Raises ValueError for a malformed one."""

    def __init__(self, targets: Sequence[str], nameservers: Sequence[str] = (), timeout_s: float = 2.0):
        self.targets = [(target, *split_target(target)) for target in targets]
        self.timeout_s = timeout_s
        self._resolver: dns.asyncresolver.Resolver | None = None
        if nameservers:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [split_target(server)[0] for server in nameservers]
            self._resolver.port = split_target(nameservers[0])[1]
            self._resolver.lifetime = timeout_s
        self._last: dict[str, list[Address]] = {}  # a name's addresses at its last successful resolution

    @property
    def given(self) -> list[str]:
        """The targets as given."""
        return [target for target, _, _ in self.targets]

    def known(self) -> list[Address]:
        """The addresses known without resolving: the IP targets, and each name's last ones."""
        found: list[Address] = []
        for target, host, port in self.targets:
            found.extend([Address(_joined(host, port))] if is_ip(host) else self._last.get(target, []))
        return list(dict.fromkeys(found))

    @property
    def names(self) -> bool:
        """Whether any target is a name (else there is nothing to resolve again)."""
        return any(not is_ip(host) for _, host, _ in self.targets)

    async def resolve(self) -> list[Address]:
        """Every target's addresses, in the targets' order, each once. A name that does not
        resolve now keeps its last addresses (a DNS hiccup must not drop every replica), or has
        none if it never resolved; that is logged."""
        for target, host, port in self.targets:
            if is_ip(host):
                continue
            try:
                ips = await asyncio.wait_for(self._lookup(host, port), self.timeout_s)
            except (OSError, TimeoutError, dns.exception.DNSException) as err:
                known = len(self._last.get(target, []))
                log.warning("%s does not resolve (%s); keeping its %d known replicas", target, err, known)
                continue
            self._last[target] = [Address(_joined(ip, port), host) for ip in ips]
        return self.known()

    async def _lookup(self, host: str, port: int) -> list[str]:
        """The IP addresses of ``host``, sorted: its IPv4 ones, or its IPv6 ones when it has none
        (a name with both, such as ``localhost``, is one host, not two replicas)."""
        if self._resolver is None:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            by_family = {
                family: sorted({str(info[4][0]) for info in infos if info[0] == family}) for family in FAMILIES
            }
            return by_family[socket.AF_INET] or by_family[socket.AF_INET6]
        for kind in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(host, kind)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                continue
            return sorted({record.address for record in answer})
        raise OSError(f"no A or AAAA record for {host}")
