"""The verify client's view of the verify replicas (:mod:`coordinator.speculation.verify_client`)."""

import asyncio

import pytest

from coordinator.speculation.placement import Placement
from coordinator.speculation.upstream import ServiceClients
from coordinator.speculation.verify_client import VerifyClient
from specdec.rpc.errors import Unavailable
from specdec_app.launcher import free_port


def test_a_getinfo_does_not_take_a_placements_turn():
    """Round robin places sessions one replica after the other: the GetInfo of every request
    (which asks any replica) must not move the turn on, or every other replica would be skipped."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens: GetInfo fails

    async def run() -> list[str]:
        placements = {"draft": Placement("round-robin"), "verify": Placement("round-robin")}
        clients = ServiceClients([addresses[0]], addresses, 0.5, 0.5, placements=placements)
        replicas, firsts = VerifyClient(clients), []
        try:
            for _ in range(2):
                firsts.append(replicas.order()[0])
                with pytest.raises(Unavailable):
                    await replicas.info()
                replicas._down_until.clear()  # as if they answered
        finally:
            await clients.close()
        return firsts

    assert sorted(asyncio.run(run())) == sorted(addresses)
