"""`Supervisor`: a dead component is restarted after a backoff that doubles per restart, is
capped, and resets once the component stays up; live components are left alone."""

from __future__ import annotations

import pytest

from services.supervisor import RestartPolicy, Supervisor


class Processes:
    """The cluster as the supervisor sees it: names, exit statuses, restarts (recorded)."""

    def __init__(self, *names: str) -> None:
        self.status: dict[str, int | None] = dict.fromkeys(names)
        self.restarted: list[str] = []

    def component_names(self) -> list[str]:
        return list(self.status)

    def exit_status(self, name: str) -> int | None:
        return self.status[name]

    def restart(self, name: str) -> None:
        self.restarted.append(name)
        self.status[name] = None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _supervisor(*names: str) -> tuple[Supervisor, Processes, Clock]:
    procs, clock = Processes(*names), Clock()
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=4.0, reset_after_s=100.0)
    return Supervisor(procs, policy, clock), procs, clock


def test_dead_component_restarts_after_backoff_others_untouched() -> None:
    sup, procs, clock = _supervisor("scheduler", "prefill-0", "decode-0")
    assert sup.poll() == []
    procs.status["decode-0"] = -9
    assert sup.poll() == []  # noticed; due in 1 s
    clock.now = 0.9
    assert sup.poll() == []
    clock.now = 1.0
    assert sup.poll() == ["decode-0"]
    assert procs.restarted == ["decode-0"] and sup.restarts("decode-0") == 1 and sup.restarts("prefill-0") == 0


def test_backoff_doubles_to_the_cap_and_resets_after_a_long_run() -> None:
    sup, procs, clock = _supervisor("prefill-0")
    sup.poll()
    waits = []
    for _ in range(5):  # crash at once after every restart
        procs.status["prefill-0"] = 1
        sup.poll()
        died = clock.now
        while not sup.poll():
            clock.now += 0.25
        waits.append(clock.now - died)
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
    clock.now += 100.0  # up long enough: the next crash waits the initial backoff again
    sup.poll()
    procs.status["prefill-0"] = 1
    sup.poll()
    died = clock.now
    while not sup.poll():
        clock.now += 0.25
    assert clock.now - died == 1.0


@pytest.mark.parametrize(("kw", "reason"), [
    (dict(initial_backoff_s=0.0), "0 < initial_backoff_s"),
    (dict(initial_backoff_s=5.0, max_backoff_s=1.0), "initial_backoff_s <= max_backoff_s"),
    (dict(reset_after_s=0.0), "reset_after_s must be > 0"),
])
def test_bad_policy_is_refused(kw: dict[str, float], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        RestartPolicy(**kw)


def test_a_component_whose_port_is_taken_is_not_restarted_into_the_same_failure() -> None:
    from services.common.bound_ports import EXIT_PORT_IN_USE

    sup, procs, clock = _supervisor("scheduler", "decode-0")
    procs.status["scheduler"] = EXIT_PORT_IN_USE
    for clock.now in (0.0, 1.0, 10.0, 100.0):
        assert sup.poll() == []
    assert procs.restarted == [] and sup.failed == {"scheduler": EXIT_PORT_IN_USE}
