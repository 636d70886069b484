"""The placement policy (:mod:`coordinator.speculation.placement`) on synthetic replicas: prompts in,
replica choices out."""

import random

import pytest

from coordinator.speculation.placement import BLOCK_SIZE, Placement, block_chain
from specdec.v1 import common_pb2

REPLICAS = ["10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"]


def prompt(seed: int, length: int = 64, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    return [*(prefix or []), *(rng.randrange(49152) for _ in range(length))]


def place(placement: Placement, prompts, down=()) -> dict[str, int]:
    counts = dict.fromkeys(REPLICAS, 0)
    for tokens in prompts:
        choice = placement.rank(REPLICAS, tokens, down)[0]
        placement.opening(choice, tokens, len(tokens))
        counts[choice] += 1
    return counts


def test_block_chains_name_prefixes():
    a, b = prompt(1, 40), prompt(2, 40)
    assert len(block_chain(a)) == 40 // BLOCK_SIZE
    assert block_chain(a[:32] + b[:8])[:2] == block_chain(a)[:2]
    assert block_chain(b[:16] + a[16:32])[1] != block_chain(a)[1]  # the same block after another one


def test_a_prompt_follows_only_the_blocks_of_its_own_cache_salt():
    """The services' caches are partitioned by cache salt, and so is what placement remembers of
    them: another salt's prompt matches nothing of the blocks placed for this one."""
    a = prompt(1, 64)
    assert block_chain(a, cache_salt="ka") != block_chain(a) and block_chain(a, cache_salt="kb") != block_chain(
        a, cache_salt="ka"
    )
    placement = Placement()
    placement.opening("r1", a, len(a), "ka")
    state = placement.state("r1")
    assert state.matched_blocks(block_chain(a, cache_salt="ka")) == 4
    assert state.matched_blocks(block_chain(a, cache_salt="kb")) == state.matched_blocks(block_chain(a)) == 0


def test_sessions_without_a_shared_prefix_spread_evenly():
    counts = place(Placement(), [prompt(i) for i in range(48)])
    assert max(counts.values()) - min(counts.values()) <= 2, counts  # ties within a session go by hash


def test_coordinators_with_their_own_memories_agree_on_a_new_prefix():
    """Two coordinators, each seeing a replica one session busier than the other does, send the
    first request of a new shared prompt to the same replica."""
    one, two = Placement(), Placement()
    one.opening(REPLICAS[0], prompt(1), 64)
    two.opening(REPLICAS[1], prompt(2), 64)
    for system in range(20):
        tokens = prompt(7, 16, prompt(300 + system, 128))
        assert one.rank(REPLICAS, tokens)[0] == two.rank(REPLICAS, tokens)[0]


def test_a_shared_prefix_stays_on_one_replica_until_it_is_a_share_busier():
    system = prompt(100, 256)
    counts = place(Placement(), [prompt(i, 16, system) for i in range(12)])
    assert max(counts.values()) == 9  # until it is 8 sessions and 1.5 times busier than another
    placement = Placement()
    place(placement, [prompt(i, 16, system) for i in range(4)])
    held = next(r for r in REPLICAS if placement.state(r).sessions)
    for r in REPLICAS:
        for _ in range(placement.state(r).sessions):
            placement.closed(r, 272)
    assert placement.rank(REPLICAS, prompt(99, 16, system))[0] == held  # remembered after its sessions ended


def test_four_system_prompts_keep_to_their_replicas():
    systems = [prompt(200 + s, 320) for s in range(4)]
    placement = Placement()
    homes: dict[int, set[str]] = {s: set() for s in range(4)}
    for i in range(48):
        tokens = prompt(i, 24, systems[i % 4])
        choice = placement.rank(REPLICAS, tokens)[0]
        placement.opening(choice, tokens, len(tokens))
        homes[i % 4].add(choice)
    assert sum(len(h) for h in homes.values()) <= 6  # each prompt on one replica, or two when it spilled


def test_round_robin_ignores_prefixes_and_load():
    system = prompt(100, 256)
    assert place(Placement("round-robin"), [prompt(i, 16, system) for i in range(12)]) == dict.fromkeys(REPLICAS, 4)
    with pytest.raises(ValueError, match="choose among prefix-load, round-robin"):
        Placement("random")  # type: ignore[arg-type]


def test_a_slow_replica_gets_fewer_sessions():
    placement = Placement()
    for replica, ms in zip(REPLICAS, (20.0, 20.0, 80.0), strict=True):
        placement.observe(replica, round_trip_ms=ms, compute_ms=14.0)  # the third held 60 ms before its compute
    counts = place(placement, [prompt(i) for i in range(48)])
    assert counts[REPLICAS[2]] <= 16 / 2, counts


def test_reported_load_and_full_kv_are_avoided():
    placement = Placement()
    placement.observe(REPLICAS[0], common_pb2.ServiceLoad(num_sessions=30, max_sessions=64))
    full = common_pb2.ServiceLoad(num_sessions=0, max_sessions=64, kv_blocks_total=100, kv_blocks_free=2)
    placement.observe(REPLICAS[1], full)
    assert placement.rank(REPLICAS, prompt(1))[0] == REPLICAS[2]
    assert placement.rank(REPLICAS, prompt(1), down=[REPLICAS[2]])[:2] == [REPLICAS[0], REPLICAS[1]]


def test_down_replicas_go_last_and_unknown_ones_are_forgotten():
    placement = Placement()
    order = placement.rank(REPLICAS, prompt(1), down=[REPLICAS[0]])
    assert order[-1] == REPLICAS[0] and set(order) == set(REPLICAS)
    placement.opening(REPLICAS[0], prompt(1), 64)
    placement.forget(REPLICAS[1:])
    assert placement.state(REPLICAS[0]).sessions == 0


def test_a_report_counts_the_other_coordinators_sessions_not_ours_that_ended():
    placement = Placement()
    for _ in range(2):
        placement.opening(REPLICAS[0], prompt(1), 64)
    placement.observe(REPLICAS[0], common_pb2.ServiceLoad(num_sessions=5, num_waiting_calls=1))
    assert placement.load(REPLICAS[0]) == 2 + 3
    placement.closed(REPLICAS[0], 64)
    placement.closed(REPLICAS[0], 64)
    assert placement.load(REPLICAS[0]) == 0 + 3  # ours ended since; the others' stay


def test_an_old_round_trip_does_not_keep_a_replica_out(monkeypatch):
    """A replica measured slow under a burst, then called no more: once its round trip is old it
    weighs as the others, and gets sessions again."""
    placement, now = Placement(), [100.0]
    monkeypatch.setattr("coordinator.speculation.placement.time.monotonic", lambda: now[0])
    placement.observe(REPLICAS[0], round_trip_ms=200.0, compute_ms=10.0)
    for replica in REPLICAS[1:]:
        placement.observe(replica, round_trip_ms=14.0, compute_ms=10.0)
    assert placement.rank(REPLICAS, prompt(1))[0] != REPLICAS[0]
    now[0] += 3.0
    counts = place(placement, [prompt(i) for i in range(6)])
    assert counts[REPLICAS[0]] == 2, counts


def test_short_prompts_break_ties_by_their_own_text():
    """Prompts of a few blocks all begin with the chat template's system prompt: the ties of
    idle replicas still go to different replicas, by the whole prompt."""
    template = prompt(500, 32)
    firsts = {Placement().rank(REPLICAS, prompt(i, 10, template))[0] for i in range(12)}
    assert firsts == set(REPLICAS)


def test_a_replica_only_busier_now_is_weighed_by_its_load_alone():
    """Its calls take longer because its steps are fuller, not because anything holds them: its
    sessions count once, not twice."""
    placement = Placement()
    placement.observe(REPLICAS[0], round_trip_ms=210.0, compute_ms=200.0)
    for replica in REPLICAS[1:]:
        placement.observe(replica, round_trip_ms=24.0, compute_ms=14.0)
    costs = placement._costs(REPLICAS)
    assert max(costs.values()) == min(costs.values()) == 1.0


def test_each_choice_is_explained_at_debug_level(caplog):
    """With --log-level debug the coordinator's log says why each session went where it went."""
    placement = Placement()
    placement.observe(REPLICAS[0], round_trip_ms=20.0, compute_ms=14.0)
    placement.observe(REPLICAS[1], round_trip_ms=80.0, compute_ms=14.0)
    caplog.set_level("DEBUG", logger="coordinator.speculation.placement")
    place(placement, [prompt(1)])
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("placed on ") and line.endswith("balanced True")
    explained = "cost 1.00 (sessions 0 of 0 tokens + 0 reported, overhead 66.0 ms, compute 14.0 ms, recent"
    assert f"{REPLICAS[1]} {explained}" in line


def test_the_step_line_is_the_newest_reports_that_has_one():
    """Adaptive K prices rounds by the verify service's published step line: any replica's newest,
    kept past the load's age limit (a step's cost does not go stale as a load does)."""
    placement = Placement()
    assert placement.step_line() is None
    placement.observe("a", load=common_pb2.ServiceLoad(step_intercept_ms=3.0, step_ms_per_token=0.5))
    placement.observe("b", load=common_pb2.ServiceLoad(num_sessions=1))  # a report without a line
    assert placement.step_line() == (3.0, 0.5)
    placement.observe("b", load=common_pb2.ServiceLoad(step_intercept_ms=4.0, step_ms_per_token=0.25))
    assert placement.step_line() == (4.0, 0.25)


def test_sessions_count_by_their_length_so_a_burst_spreads_its_work():
    """A burst of prompts of 30 to 1,000 tokens: each replica gets about a third of the tokens,
    not only of the sessions (by count, one replica took 41% of the verify CPU in a burst of 48)."""
    rng = random.Random(7)
    prompts = [prompt(i, rng.choice([30, 60, 120, 1000])) for i in range(48)]
    placement, tokens = Placement(), dict.fromkeys(REPLICAS, 0)
    for tokens_of in prompts:
        choice = placement.rank(REPLICAS, tokens_of)[0]
        placement.opening(choice, tokens_of, len(tokens_of) + 48)
        tokens[choice] += len(tokens_of) + 48
    even = sum(tokens.values()) / len(REPLICAS)
    assert all(abs(t - even) <= 0.15 * even for t in tokens.values()), tokens
    mean_length = sum(tokens.values()) / len(prompts)
    assert placement.load(REPLICAS[0]) == pytest.approx(placement.state(REPLICAS[0]).tokens / mean_length)
