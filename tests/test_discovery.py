"""Discovery (:mod:`coordinator.speculation.discovery`): targets to replica addresses, through a real
DNS server whose records change, and the operating system's resolver."""

import asyncio

import pytest

from coordinator.speculation.discovery import Address, Discovery, split_target


def test_targets_are_host_and_port():
    assert split_target("verify:50053") == ("verify", 50053)
    assert split_target("[::1]:50053") == ("::1", 50053)
    for bad in ("verify", "verify:http", ":50053"):
        with pytest.raises(ValueError, match="is not host:port"):
            Discovery([bad])


def test_a_name_stands_for_every_address_it_resolves_to_as_they_change(dns_server):
    dns_server.records["verify.specdec.test"] = ["127.0.0.2", "127.0.0.3"]
    discovery = Discovery(["verify.specdec.test:50053", "127.0.0.9:50053"], nameservers=[dns_server.address])
    assert discovery.names and discovery.known() == [Address("127.0.0.9:50053")]  # nothing resolved yet

    def resolved() -> list[Address]:
        return asyncio.run(discovery.resolve())

    name = "verify.specdec.test"
    assert resolved() == [
        Address("127.0.0.2:50053", name),
        Address("127.0.0.3:50053", name),
        Address("127.0.0.9:50053"),
    ]
    dns_server.records[name] = ["127.0.0.3", "127.0.0.4"]  # a pod went, another came
    assert [a.address for a in resolved()] == ["127.0.0.3:50053", "127.0.0.4:50053", "127.0.0.9:50053"]
    del dns_server.records[name]  # a DNS hiccup: the last addresses stay
    assert [a.address for a in resolved()] == ["127.0.0.3:50053", "127.0.0.4:50053", "127.0.0.9:50053"]


def test_the_systems_resolver_reads_hosts_and_gives_one_family():
    (address,) = asyncio.run(Discovery(["localhost:50053"]).resolve())
    assert address == Address("127.0.0.1:50053", "localhost")  # not also [::1]: one host
