"""The auto thread policy: threads follow the cores other processes leave free."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moectl.cli.main import app
from moectl.engine.core.config import EngineConfig, KnobError
from moectl.engine.core.threads import AdaptiveThreads


class FakeMachine:
    """A clock and cumulative CPU counters the test advances by hand."""

    def __init__(self):
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.set_calls: list[int] = []
        self.torch_threads = 0

    def advance(self, seconds: float, others_cores: float, own_cores: float = 1.0) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (others_cores + own_cores) * seconds

    def policy(self, cores: int, reserved: int = 0) -> AdaptiveThreads:
        def set_threads(n):
            self.set_calls.append(n)
            self.torch_threads = n

        return AdaptiveThreads(cores=cores, reserved=reserved, clock=lambda: self.now,
                               sample=lambda: (self.busy, self.own), set_threads=set_threads,
                               get_threads=lambda: self.torch_threads)


def _settle(m: FakeMachine, policy: AdaptiveThreads, others: float) -> int:
    """Two measurements (the second comes early, to confirm a change) under the same load."""
    m.advance(1.0, others_cores=others)
    policy.maybe_update()
    m.advance(0.5, others_cores=others)
    return policy.maybe_update()


def test_threads_follow_the_cores_others_leave_free():
    m = FakeMachine()
    policy = m.policy(cores=4)
    assert policy.threads == 4 and m.set_calls == [4]
    m.advance(0.25, others_cores=0.1)  # the first measurement comes early
    assert policy.maybe_update() == 4
    assert _settle(m, policy, 1.0) == 3  # one core taken
    assert _settle(m, policy, 2.7) == 1  # 2.7 cores' worth: the third counts as taken
    assert _settle(m, policy, 0.3) == 4  # a sub-core share does not count
    assert m.set_calls == [4, 3, 1, 4] and policy.change_count == 3 and len(policy.changes) == 3
    assert _settle(m, policy, 9.0) == 1  # never below one thread


def test_a_single_burst_does_not_move_the_count():
    m = FakeMachine()
    policy = m.policy(cores=4)
    m.advance(0.25, others_cores=0.0)
    policy.maybe_update()
    m.advance(1.0, others_cores=3.0)  # one interval of a heavy burst ...
    assert policy.maybe_update() == 4
    m.advance(0.5, others_cores=0.0)  # ... gone when the confirming measurement comes
    assert policy.maybe_update() == 4 and m.set_calls == [4] and policy.change_count == 0


def test_own_work_is_not_mistaken_for_contention_and_reserved_cores_are_left():
    m = FakeMachine()
    policy = m.policy(cores=2)
    m.advance(1.0, others_cores=0.0, own_cores=2.0)  # this process kept both cores busy itself
    assert policy.maybe_update() == 2 and policy._proposed is None
    ui = m.policy(cores=2, reserved=1)
    assert ui.threads == 1
    m.advance(1.0, others_cores=0.0)
    assert ui.maybe_update() == 1


def test_between_measurements_a_changed_torch_setting_is_put_back():
    m = FakeMachine()
    policy = m.policy(cores=2)
    m.advance(0.25, others_cores=0.0)
    policy.maybe_update()
    m.torch_threads = 7  # e.g. a benchmark set torch's threads for another library
    m.advance(0.1, others_cores=0.0)
    assert policy.maybe_update() == 2 and m.torch_threads == 2


def test_the_real_counters_give_a_sane_measurement():
    policy = AdaptiveThreads(interval_s=0.05, set_threads=lambda n: None, get_threads=lambda: policy.threads)
    import time

    time.sleep(0.1)
    threads = policy.maybe_update()
    assert 1 <= threads <= policy.cores and policy.updates == 1 and policy.others_busy >= 0


@pytest.mark.parametrize("value", ["fast", 0, -2])
def test_a_bad_thread_setting_is_refused(value):
    with pytest.raises(KnobError, match="num_threads"):
        EngineConfig(model="m", num_threads=value)


def test_cli_refuses_a_bad_threads_option():
    result = CliRunner().invoke(app, ["generate", "x", "--threads", "many"])
    assert result.exit_code == 2
    assert "--threads: must be a positive integer or auto, got 'many'" in result.output
