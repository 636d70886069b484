"""coordinator.speculation.policy.regime: the trials of the two ways to choose K under load."""

from coordinator.speculation.policy.regime import PER_REQUEST, TOGETHER, RegimeTrials, load_bucket


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_window(trials: RegimeTrials, clock: Clock, running: int, tokens_per_s: dict[str, float]) -> str:
    """One window of ``trials.window_s`` at ``running`` requests, committing at the rate of the way
    it runs; returns that way."""
    way = trials.regime(running)
    for _ in range(4):  # quarters of a window: exact in binary
        trials.committed(int(tokens_per_s[way] * trials.window_s / 4))
        clock.now += trials.window_s / 4
        assert trials.regime(running) == way or clock.now % trials.window_s == 0  # a window runs one way
    return way


def test_a_closed_loop_of_n_and_n_minus_one_stays_in_one_bucket():
    for n in (4, 8, 16, 32, 64):
        assert load_bucket(n) == load_bucket(n - 1)
    assert len({load_bucket(n) for n in (2, 4, 8, 16, 32, 64)}) == 6


def test_each_way_is_tried_then_the_better_runs_until_the_other_is_stale():
    clock = Clock()
    trials = RegimeTrials(window_s=1.0, windows_per_trial=2, stale_s=10.0, clock=clock)
    rates = {PER_REQUEST: 30.0, TOGETHER: 40.0}
    ways = [run_window(trials, clock, 4, rates) for _ in range(16)]
    # two measured windows each; the first after a change settles, unmeasured
    assert ways[:5] == [PER_REQUEST, PER_REQUEST, TOGETHER, TOGETHER, TOGETHER]
    assert set(ways[5:12]) == {TOGETHER}  # the better, while the other's figure is fresh
    assert PER_REQUEST in ways[12:]  # tried again once stale
    assert trials.goodput[(load_bucket(4), TOGETHER)][0] == 40.0


def test_each_load_has_its_own_choice_and_alone_is_per_request():
    clock = Clock()
    trials = RegimeTrials(window_s=1.0, clock=clock)
    for _ in range(6):
        run_window(trials, clock, 4, {PER_REQUEST: 30.0, TOGETHER: 40.0})
        run_window(trials, clock, 16, {PER_REQUEST: 90.0, TOGETHER: 60.0})
    assert trials.regime(4) == TOGETHER and trials.regime(16) == PER_REQUEST
    assert trials.regime(1) == PER_REQUEST


def test_a_window_that_saw_no_round_measures_nothing():
    clock = Clock()
    trials = RegimeTrials(window_s=1.0, clock=clock)
    assert trials.regime(4) == PER_REQUEST
    clock.now = 5.0  # every request still prefilling: the window's clock has not started
    assert trials.regime(4) == PER_REQUEST and not trials.goodput


def test_a_window_counts_the_decode_steps_alone():
    """While a request prefills the window's clock stops and the rounds committed meanwhile are not
    counted: a window of 1 s of decode at 40 tokens/s reads 40, whatever prefill fell in it."""
    clock = Clock()
    trials = RegimeTrials(window_s=1.0, clock=clock)
    assert trials.regime(4) == PER_REQUEST
    trials.committed(20)  # the window's clock starts here
    clock.now += 0.5
    with trials.prefilling():
        clock.now += 0.25
        trials.committed(50)
        assert trials.regime(4) == PER_REQUEST
        clock.now += 0.25
    trials.committed(20)  # starts the clock again
    clock.now += 0.5
    assert trials.regime(4) == PER_REQUEST  # 1 s counted: the window ends, measured
    assert trials.goodput[(load_bucket(4), PER_REQUEST)][0] == 40.0
