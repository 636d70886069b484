"""A network between the services (``specdec bench --network-rtt-ms``): delaying TCP proxies.

Every benchmark before ran its services over loopback, where a round trip costs tens of
microseconds; between machines it costs 0.1-1 ms in one data centre and tens of ms between
regions. To measure what that does to the pipeline, the bench puts a :class:`DelayProxy` between
the coordinator and each service it calls (the draft and the verify service) and gives the
coordinator the proxies' addresses instead of the services'. Each proxy delays each direction by
half the link's round-trip time (RTT), optionally with jitter; the client's link to the
coordinator is not delayed (the user sits beside the coordinator).

Why a proxy of our own: Linux ``tc netem`` would delay the loopback device, but needs the
``sch_netem`` kernel module and CAP_NET_ADMIN, which these machines lack; and no packaged proxy
(toxiproxy, which does the same in Go) installs here. An asyncio proxy of about a hundred lines
does what the benchmark needs:

- every chunk read on one side is written to the other ``one_way_ms`` later, drawn per chunk
  uniformly from [one_way - jitter / 2, one_way + jitter / 2] (:meth:`DelayProxy.configure`);
  a chunk is never written before one read earlier on the same connection and direction (it
  waits for it, as TCP's in-order delivery would), so jitter never reorders bytes;
- bandwidth is unbounded: reading goes on while earlier chunks wait out their delay;
- a connection's close travels like its data: when one side closes (or resets), the data it
  sent before is delivered with its delay, then both connections are closed. Half-closed
  connections are not kept: gRPC over HTTP/2 never half-closes, and a proxy that kept them would
  hold the other side's connection open after its peer was gone;
- the TCP handshake is not delayed (a gRPC channel connects once and keeps its connection).

:class:`DelayedLinks` runs the proxies of one cluster in a thread of its own with its own event
loop, so that the bench's clients (another event loop) and plain decoding in process do not
stall them. The proxies' delays change between methods (:meth:`DelayedLinks.apply`), so every
network setting runs on the same services.

Network settings (:class:`NetworkSetting`): an RTT and a topology, which of the coordinator's
two links the RTT is on:

- ``apart``: both (coordinator, draft and verify service each on its own machine);
- ``beside-verify``: the draft link only (the coordinator on the verify service's machine);
- ``beside-draft``: the verify link only (the coordinator on the draft service's machine).

At RTT 0 the topologies are the same setting: the proxies forward without delay, so every
setting's figures include the proxies' own cost and differ by the delay alone.
"""

import asyncio
import random
import re
import threading
from dataclasses import dataclass, field

APART, BESIDE_VERIFY, BESIDE_DRAFT = "apart", "beside-verify", "beside-draft"
TOPOLOGIES = (APART, BESIDE_VERIFY, BESIDE_DRAFT)
LINKS = ("draft", "verify")  # the coordinator's links, by the service at the other end
DELAYED_LINKS = {APART: LINKS, BESIDE_VERIFY: ("draft",), BESIDE_DRAFT: ("verify",)}
CHUNK_BYTES = 256 * 1024
_SUFFIX = re.compile(r"@rtt(\d+(?:\.\d+)?)ms(?:-([a-z-]+))?")


@dataclass(frozen=True)
class NetworkSetting:
    """An RTT (ms) on the links ``topology`` names (:data:`DELAYED_LINKS`); ``jitter_ms`` the
    width of each direction's delay's uniform spread (at most the RTT; none at RTT 0)."""

    rtt_ms: float
    topology: str = APART
    jitter_ms: float = 0.0

    @property
    def suffix(self) -> str:
        """What a method's name carries for this setting: ``@rtt0ms``, ``@rtt5ms-apart``."""
        return "@rtt0ms" if not self.rtt_ms else f"@rtt{self.rtt_ms:g}ms-{self.topology}"

    @property
    def label(self) -> str:
        if not self.rtt_ms:
            return "RTT 0 ms (through the proxies, no delay)"
        jitter = f", jitter {self.jitter_ms:g} ms" if self.jitter_ms else ""
        links = " and ".join(DELAYED_LINKS[self.topology]) + " link" + "s" * (self.topology == APART)
        return f"RTT {self.rtt_ms:g} ms{jitter}, {self.topology} (on the {links})"

    def one_way_ms(self, link: str) -> tuple[float, float]:
        """(mean delay, jitter) of each direction of ``link`` (``draft`` or ``verify``), ms."""
        if not self.rtt_ms or link not in DELAYED_LINKS[self.topology]:
            return 0.0, 0.0
        return self.rtt_ms / 2, self.jitter_ms

    def to_json(self) -> dict:
        return {"rtt_ms": self.rtt_ms, "topology": self.topology if self.rtt_ms else None, "jitter_ms": self.jitter_ms}


def parse_rtts(spec: str) -> list[float]:
    """``0,5,20`` as ``[0.0, 5.0, 20.0]`` (sorted, each once). Raises ValueError."""
    try:
        values = sorted({float(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 0:
        raise ValueError(f"--network-rtt-ms {spec!r}: use comma-separated round-trip times in ms (0 or more): 0,5,20")
    return values


def parse_topologies(spec: str) -> list[str]:
    """``apart,beside-verify`` as a list in the order of :data:`TOPOLOGIES`. Raises ValueError."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names or any(name not in TOPOLOGIES for name in names):
        raise ValueError(f"--network-topology {spec!r}: use a comma-separated subset of {', '.join(TOPOLOGIES)}")
    return [name for name in TOPOLOGIES if name in names]


def network_settings(rtts_ms: list[float], topologies: list[str], jitter_ms: float = 0.0) -> list[NetworkSetting]:
    """Every setting of a run: RTT 0 once (if listed), then each RTT above 0 in each topology.
    Raises ValueError for a jitter below 0 or above the smallest RTT above 0 (a direction's delay
    would go below 0)."""
    nonzero = [rtt for rtt in rtts_ms if rtt > 0]
    if jitter_ms < 0 or (nonzero and jitter_ms > min(nonzero)):
        raise ValueError(
            f"--network-jitter-ms {jitter_ms:g}: use 0 up to the smallest RTT above 0 "
            f"({min(nonzero, default=0):g} ms): each direction's delay is drawn from RTT/2 +- jitter/2"
        )
    zero = [NetworkSetting(0.0)] if 0 in rtts_ms else []
    return zero + [NetworkSetting(rtt, topology, jitter_ms) for rtt in nonzero for topology in topologies]


@dataclass(kw_only=True)
class NetworkOptions:
    """The network options of a benchmark mode (``--network-rtt-ms``, ``--network-jitter-ms``,
    ``--network-topology``): RTTs in ms (empty: no network, the services on loopback as before),
    the jitter, the topologies of every RTT above 0."""

    network_rtts_ms: list[float] = field(default_factory=list)
    network_jitter_ms: float = 0.0
    network_topologies: list[str] = field(default_factory=lambda: [APART])

    def network(self) -> list[NetworkSetting]:
        """Every setting the run's pipeline methods run under (none without RTTs). Raises ValueError."""
        if not self.network_rtts_ms:
            return []
        return network_settings(self.network_rtts_ms, self.network_topologies, self.network_jitter_ms)

    def network_json(self) -> dict:
        """A report's ``network`` entry before its rows: the options and every setting run (its
        method-name suffix, label and figures)."""
        return {
            "rtts_ms": self.network_rtts_ms,
            "jitter_ms": self.network_jitter_ms,
            "topologies": self.network_topologies,
            "settings": [s.to_json() | {"suffix": s.suffix, "label": s.label} for s in self.network()],
        }


def split_setting(name: str) -> tuple[str, NetworkSetting | None]:
    """A method name as (the name without its network suffix, the setting it names; None for
    none): ``llama-cpp/K=8@split@rtt5ms-apart`` -> (``llama-cpp/K=8@split``, RTT 5 apart). The
    setting's jitter is not in the name (one jitter per run)."""
    match = _SUFFIX.search(name)
    if match is None or match.end() != len(name):
        return name, None
    return name[: match.start()], NetworkSetting(float(match[1]), match[2] or APART)


class DelayProxy:
    """Listens on ``host:port`` and forwards every connection to ``upstream`` (``host:port``),
    each direction delayed (:meth:`configure`; none until then). Runs on the event loop that
    calls :meth:`start`."""

    def __init__(self, host: str, port: int, upstream: str):
        self.host, self.port = host, port
        self.upstream_host, _, upstream_port = upstream.rpartition(":")
        self.upstream_port = int(upstream_port)
        self.delay_s = (0.0, 0.0)  # each direction's (mean delay, jitter), one tuple: set from another thread
        self._random = random.Random(port)
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, list[asyncio.StreamWriter]] = {}  # each connection's sides

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def configure(self, one_way_ms: float, jitter_ms: float = 0.0) -> None:
        """Each direction's delay from now on: uniform in [one_way - jitter / 2, one_way + jitter / 2] ms.
        Raises ValueError where that would go below 0."""
        if one_way_ms < 0 or jitter_ms < 0 or jitter_ms / 2 > one_way_ms:
            raise ValueError(f"a delay of {one_way_ms:g} +- {jitter_ms / 2:g} ms would go below 0")
        self.delay_s = (one_way_ms / 1000, jitter_ms / 1000)

    def _delay_s(self) -> float:
        one_way, jitter = self.delay_s
        return one_way + self._random.uniform(-jitter / 2, jitter / 2) if jitter else one_way

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)

    async def close(self) -> None:
        """Stops listening and closes every connection (both sides reset at once)."""
        if self._server is not None:
            self._server.close()
        for writers in self._connections.values():
            for writer in writers:
                writer.transport.abort()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writers = [writer]
        try:
            await self._serve(reader, writers)
        finally:
            del self._connections[task]

    async def _serve(self, client_reader: asyncio.StreamReader, writers: list[asyncio.StreamWriter]) -> None:
        """One connection (``writers``: the client's side, then the upstream's once open):
        upstream opened, both directions forwarded until either side closes, then both closed
        (an upstream that cannot be reached closes the client's at once)."""
        client_writer = writers[0]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
            writers.append(upstream_writer)
            directions = [
                asyncio.create_task(self._forward(client_reader, upstream_writer)),
                asyncio.create_task(self._forward(upstream_reader, client_writer)),
            ]
            try:
                await asyncio.wait(directions, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for direction in directions:
                    direction.cancel()
                await asyncio.gather(*directions, return_exceptions=True)
        except OSError:
            pass
        finally:
            for writer in writers:
                writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: each chunk read is due its delay after it was read, never before the
        chunk before it; the close (EOF, or a reset) is due after the last chunk, with its own
        delay. Returns once the close is due: the caller then closes both sides."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writing = asyncio.create_task(self._write_when_due(due, writer))
        last = 0.0
        try:
            while not writing.done():  # done early: the other side is gone
                try:
                    data = await reader.read(CHUNK_BYTES)
                except OSError:
                    data = b""
                last = max(last, loop.time() + self._delay_s())
                due.put_nowait((last, data))
                if not data:
                    break
            await writing
        finally:
            writing.cancel()

    @staticmethod
    async def _write_when_due(due: "asyncio.Queue[tuple[float, bytes]]", writer: asyncio.StreamWriter) -> None:
        """Writes each queued chunk at its due time, in order; returns at the close (b"") or when
        the other side is gone."""
        loop = asyncio.get_running_loop()
        while True:
            at, data = await due.get()
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            if not data:
                return
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                return


class DelayedLinks:
    """One delaying proxy per link in front of each service (``upstreams``: link name ->
    ``host:port``), listening on ``listen`` (link name -> ``host:port``), run by a thread of their
    own with their own event loop between :meth:`start` and :meth:`stop`."""

    def __init__(self, upstreams: dict[str, str], listen: dict[str, str]):
        self.proxies = {}
        for link, upstream in upstreams.items():
            host, _, port = listen[link].rpartition(":")
            self.proxies[link] = DelayProxy(host, int(port), upstream)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def addresses(self) -> dict[str, str]:
        """Where each link's proxy listens (the address to give the coordinator)."""
        return {link: proxy.address for link, proxy in self.proxies.items()}

    def _call(self, coroutine, timeout_s: float = 30.0):
        assert self._loop is not None, "start() the links first"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def start(self) -> None:
        """Starts the thread and every proxy. Raises OSError when a proxy cannot listen."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="network-proxies", daemon=True)
        self._thread.start()
        try:
            for proxy in self.proxies.values():
                self._call(proxy.start())
        except BaseException:
            self.stop()
            raise

    def apply(self, setting: NetworkSetting) -> None:
        """Every link's delays from now on as ``setting`` puts them (:meth:`NetworkSetting.one_way_ms`)."""
        for link, proxy in self.proxies.items():
            proxy.configure(*setting.one_way_ms(link))

    def stop(self) -> None:
        """Closes every proxy and its connections, then the loop and its thread."""
        if self._loop is None or self._thread is None:
            return
        try:
            for proxy in self.proxies.values():
                self._call(proxy.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()
            self._loop = self._thread = None
