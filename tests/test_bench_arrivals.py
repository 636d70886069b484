"""The arrival patterns of `specdec bench concurrency --arrivals`: each schedule on its own
(closed loop, burst at t = 0, seeded Poisson with the rate's mean gap), the prompt slices, the
cell runner sending one schedule the same way for every method, and the warm-up burst before a
larger N than any before."""

import asyncio

import numpy as np
import pytest

from specdec_app.bench.arrivals import (
    Burst,
    ClosedLoop,
    PoissonArrivals,
    arrival_pattern,
    parse_arrivals,
    prompt_slices,
)
from specdec_app.bench.concurrency import ConcurrencyConfig, RequestRecord, _pattern_cells, run_cell
from specdec_app.bench.questions import Question


def flat(schedule):
    return [request for requests in schedule for request in requests]


def test_closed_loop_sends_each_next_request_when_the_previous_finished():
    schedule = ClosedLoop().schedule(3, 2)
    assert len(schedule) == 3 and all(len(requests) == 2 for requests in schedule)
    assert [r.send_at_s for r in schedule[1]] == [0.0, None]  # the second waits for the first
    assert sorted(r.index for r in flat(schedule)) == list(range(6))
    assert [r.index for r in schedule[2]] == [2, 5]  # request j of client c: j * N + c


def test_burst_sends_n_requests_at_once():
    schedule = Burst().schedule(16, 2)  # requests_per_client does not apply
    assert len(flat(schedule)) == 16
    assert {r.send_at_s for r in flat(schedule)} == {0.0}
    assert sorted(r.index for r in flat(schedule)) == list(range(16))
    assert all(len(requests) == 1 for requests in schedule)


def test_poisson_is_seeded_and_open_loop():
    a = PoissonArrivals(2.0, seed=7).schedule(4, 3)
    assert a == PoissonArrivals(2.0, seed=7).schedule(4, 3)  # the same arrival times for every method
    assert a != PoissonArrivals(2.0, seed=8).schedule(4, 3)
    assert PoissonArrivals(2.0, seed=7).schedule(8, 3)[:2] != a[:2]  # each N its own draw
    times = [r.send_at_s for r in flat(a)]
    assert len(times) == 12 and times[0] == 0.0 and times == sorted(times)
    assert all(len(requests) == 1 for requests in a)  # each request its own client: none waits for another


def test_poisson_mean_gap_matches_the_rate():
    """Over many draws the gaps between arrivals are exponential with mean 1 / (N x rate)."""
    times = np.array(PoissonArrivals(0.5, seed=1).arrival_times_s(concurrency=4, num_requests=20_001))
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / (4 * 0.5), rel=0.03)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)  # exponential: standard deviation = mean
    assert (gaps >= 0).all()


def test_parsing_and_patterns_by_name():
    assert parse_arrivals("poisson,closed") == ["closed", "poisson"]
    for bad in ("", "trickle", "closed,trickle"):
        with pytest.raises(ValueError, match="--arrivals"):
            parse_arrivals(bad)
    assert isinstance(arrival_pattern("burst"), Burst)
    assert arrival_pattern("poisson", 3.0, seed=5) == PoissonArrivals(3.0, 5)
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_pattern("poisson")


def test_prompt_slices_are_disjoint_and_cover_the_prompts():
    slices = prompt_slices(10, ["closed", "burst", "poisson"])
    assert [list(r) for r in slices.values()] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert list(prompt_slices(4, ["burst"])["burst"]) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="need at least 3 prompts"):
        prompt_slices(2, ["closed", "burst", "poisson"])


class FakeClient:
    """A method whose every request takes ``latency_s``."""

    def __init__(self, name: str, latency_s: float):
        self.name, self.latency_s = name, latency_s

    async def run(self, question: Question, max_new_tokens: int, seed: int) -> RequestRecord:
        await asyncio.sleep(self.latency_s)
        return RequestRecord(self.name, question.question_id, question.category, num_tokens=max_new_tokens)


@pytest.mark.parametrize(
    "pattern", [ClosedLoop(), Burst(), PoissonArrivals(20.0, seed=3)], ids=["closed", "burst", "poisson"]
)
def test_the_cell_runner_sends_one_schedule_alike_for_every_method(tmp_path, pattern):
    """A fast and a slow method get the same prompts from the same clients, each request at its
    scheduled time (within 150 ms, half the slow method's latency: a loaded 2-core runner has
    started a request 75 ms late); in the closed loop a client's next request waits for its
    previous one."""
    prompts = [Question(i, "qa", f"p{i}") for i in range(3)]
    config = ConcurrencyConfig(questions=tmp_path, out=tmp_path, command="", max_new_tokens=5)
    schedule = pattern.schedule(2, 2)
    sent = {}
    for client in (FakeClient("fast", 0.01), FakeClient("slow", 0.3)):
        records, wall_ms = asyncio.run(run_cell(client, schedule, prompts, config, lambda: None))
        assert wall_ms >= 1000 * client.latency_s
        sent[client.name] = sorted((r.client, r.question_id, r.start_ms) for r in records)
    expected = sorted((r.client, r.index % 3, r.send_at_s) for r in flat(schedule))
    for records in sent.values():
        assert [(c, q) for c, q, _ in records] == [(c, q) for c, q, _ in expected]  # the same prompts
        for (_, _, start_ms), (_, _, send_at_s) in zip(records, expected, strict=True):
            if send_at_s is not None:  # on time, whatever the method's speed
                assert start_ms == pytest.approx(1000 * send_at_s, abs=150)
            else:  # the closed loop: after the client's previous request finished
                assert start_ms >= 1000 * (0.01 if records is sent["fast"] else 0.3)


class RecordingClient(FakeClient):
    """A FakeClient that records every prompt it is sent, in order."""

    def __init__(self, name: str):
        super().__init__(name, 0.001)
        self.prompts: list[str] = []

    async def run(self, question: Question, max_new_tokens: int, seed: int) -> RequestRecord:
        self.prompts.append(question.prompt)
        return await super().run(question, max_new_tokens, seed)


class Quiet:
    """What the cells ask of the CPU clock and the progress display."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_a_larger_n_than_any_before_is_warmed_up_first_with_prompts_no_cell_sends(tmp_path):
    """Before the first cell at N = 4 every method gets a burst of 4 unmeasured requests, each
    with its own prompt that no cell sends; N = 1 (after the per-method warm-up) and N = 2 (below
    the 4 warmed before) get none, and neither does a later pattern's N = 4."""
    prompts = [Question(i, "qa", f"p{i}") for i in range(3)]
    config = ConcurrencyConfig(questions=tmp_path, out=tmp_path, command="", max_new_tokens=5, concurrency=[1, 4, 2])
    clients = [RecordingClient("a"), RecordingClient("b")]
    cells: list = []
    for name in ("closed", "burst"):
        asyncio.run(_pattern_cells(clients, name, prompts, config, cells, Quiet(), Quiet()))
    measured = {f"p{i}" for i in range(3)}
    for client in clients:
        warm_ups = [prompt for prompt in client.prompts if prompt not in measured]
        assert len(warm_ups) == len(set(warm_ups)) == 4
        assert all(prompt.startswith("(Warm-up") for prompt in warm_ups)
        # right after its closed-loop N = 1 cell (requests_per_client requests), before any at N = 4
        first = config.requests_per_client
        assert client.prompts[first : first + 4] == warm_ups
