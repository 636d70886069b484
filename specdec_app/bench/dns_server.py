"""A real DNS server on loopback whose records its owner changes while it runs: the replicas
behind one name, as a Kubernetes headless Service resolves them, for ``specdec bench replicas``
and the tests' fleets (dnslib's server; installed with the test tools, scripts/setup.sh --test)."""

import dnslib
import dnslib.server

from specdec_app.launcher import free_port


class DnsServer:
    """A real DNS server (dnslib's) on 127.0.0.1, UDP, answering A queries from ``records`` (name ->
    IP addresses; NXDOMAIN for others), which a test may change while it runs. ``address``:
    its host:port, for the coordinator's ``--dns-nameservers``."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        server = self

        class Records(dnslib.server.BaseResolver):
            def resolve(self, request, handler):
                reply = request.reply()
                name = str(request.q.qname).rstrip(".")
                if name not in server.records:
                    reply.header.rcode = dnslib.RCODE.NXDOMAIN
                elif request.q.qtype == dnslib.QTYPE.A:
                    for ip in server.records[name]:
                        reply.add_answer(dnslib.RR(name, dnslib.QTYPE.A, rdata=dnslib.A(ip), ttl=1))
                return reply

        self.port = free_port()
        self.server = dnslib.server.DNSServer(Records(), address="127.0.0.1", port=self.port, logger=_QuietDns())
        self.server.start_thread()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop()


class _QuietDns(dnslib.server.DNSLogger):
    def __init__(self) -> None:
        super().__init__(log="-request,-reply,-truncated,-data,-recv,-send")
