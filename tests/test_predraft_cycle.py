"""Pre-drafting's cycle check (drafter_service/engine/predraft_cycle.py): passes stay on only while they shorten the
engine's step cycle, measured in turns with and without them, on the arrivals of one engine's requests."""
import types

import torch

from conftest import make_config
from drafter_service.engine.predraft_cycle import SETTLE, CycleCheck
from drafter_service.engine.scheduler import PendingRequest, StepScheduler
from drafter_service.engine.step_io import StepInput
from drafter_service.runtime import build_runtime


def turn(check: CycleCheck, seconds: float, steps: int | None = None) -> None:
    """One turn's cycles (SETTLE + trial_steps), the settling ones far off, to show that they do not count."""
    for i in range(SETTLE + (steps or check.trial_steps)):
        check.on_step()
        check.observe_cycle(10.0 if i < SETTLE else seconds)


def test_passes_that_slow_the_engine_are_turned_off_and_tried_again_later():
    check = CycleCheck(trial_steps=8, first_off_steps=20, max_off_steps=40)
    assert check.passes_allowed() and check.state == "trial_on"
    turn(check, 0.012)  # with passes: 12 ms per cycle
    assert check.state == "trial_off" and not check.passes_allowed()
    turn(check, 0.010)  # without: 10 ms
    assert check.state == "hold_off" and not check.passes_allowed() and check.last == (0.012, 0.010, False)
    for _ in range(19):
        check.on_step()
        check.observe_cycle(0.001)  # (a hold ignores cycles)
    assert check.state == "hold_off"
    check.on_step()
    assert check.state == "trial_on" and check.passes_allowed()  # after the back-off: another turn with passes
    turn(check, 0.0101)  # not 2% shorter: off again, for twice as long
    turn(check, 0.0100)
    assert check.state == "hold_off" and check._steps_left == 40
    for _ in range(40):
        check.on_step()
    turn(check, 0.011)
    turn(check, 0.010)
    assert check._steps_left == 40  # (at most max_off_steps)


def test_passes_that_shorten_the_cycle_stay_on_and_are_checked_again():
    check = CycleCheck(trial_steps=8, hold_steps=30, first_off_steps=20)
    turn(check, 0.011)
    turn(check, 0.010)
    assert check.state == "hold_off" and check._off_steps == 40
    for _ in range(20):
        check.on_step()
    turn(check, 0.006)  # passes pay now
    turn(check, 0.010)
    assert check.state == "hold_on" and check.passes_allowed() and check.last == (0.006, 0.010, True)
    assert check._off_steps == 20  # (a win resets the back-off)
    for _ in range(30):
        assert check.passes_allowed()
        check.on_step()
    assert check.state == "trial_on"


def test_the_scheduler_reports_cycles_of_one_engine_only():
    seen = []
    proposer = types.SimpleNamespace(predraft=types.SimpleNamespace(observe_cycle=lambda s, n: seen.append((s, n)),
                                                                    cycle_check=True))
    sched = StepScheduler(proposer, max_batch_tokens=1024, max_batch_seqs=64)

    def request(owner, at, branches=4):
        step = StepInput("ns", f"s-{owner}", 0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4), 1, 3,
                         owner=owner, predraft_branches=branches)
        return PendingRequest(steps=[step], deliver=lambda *result: None, enqueued_at=at)

    sched._observe_cycle([request("channel 1", 1.0)])
    sched._observe_cycle([request("channel 1", 1.012)])  # the same engine 12 ms later
    sched._observe_cycle([request("channel 2", 1.014)])  # another engine: no cycle
    sched._observe_cycle([request("channel 1", 1.020)])  # (nor back to the first)
    sched._observe_cycle([request("channel 1", 1.030), request("channel 2", 1.031)])  # merged engines: none
    sched._observe_cycle([request(None, 1.040)])  # unary calls: no owner, no engine to tell apart
    sched._observe_cycle([request(None, 1.050)])
    sched._observe_cycle([request("channel 3", 1.060, branches=0)])
    sched._observe_cycle([request("channel 3", 1.070, branches=0)])  # no pre-drafting asked: none
    assert len(seen) == 1 and abs(seen[0][0] - 0.012) < 1e-9 and seen[0][1] == 1
    proposer.predraft.cycle_check = False  # (off: the scheduler does not even look)
    sched._observe_cycle([request("channel 1", 1.080)])
    sched._observe_cycle([request("channel 1", 1.090)])
    assert len(seen) == 1


def test_a_drafter_whose_check_keeps_passes_off_drafts_plainly(tiny_model, tmp_path):
    """While the check keeps passes off, a pre-drafting step keeps nothing for a pass and no pass runs (the step
    costs what it costs with pre-drafting off); when a trial turns them on again, the next step prepares."""
    rt = build_runtime(make_config(*tiny_model, tmp_path, predraft_cycle_check=True))
    proposer, width = rt.proposer, rt.limits.hidden_states_width
    pd = proposer.predraft
    check = pd.cycle_for(1)  # (requests of one sequence)
    check.state, check._steps_left = "hold_off", 2
    assert pd.cycle_for(4).passes_allowed()  # (requests of 4-7 sequences have a check of their own)

    def step(p: int, m: int):
        out = proposer.step([StepInput("ns", "s", p, torch.arange(m), torch.randn(m, width), 3, 3,
                                       predraft_branches=4)])[0]
        assert out.code == 0 and not out.predrafted

    step(0, 5)
    assert not pd.has_work() and proposer.table.get("ns", "s").predraft.basis is None
    assert pd.counters.passes_skipped == 1 and not pd._skips  # (not a skip of the fit check: no probe counted)
    pd.observe_cycle(0.01, 1)
    pd.observe_cycle(0.01, 1)  # the hold's last request: the check turns to a trial with passes
    assert check.state == "trial_on"
    step(5, 1)
    assert pd.has_work() and pd.prepare(lambda: False) and pd.counters.branches_prepared > 0


def test_the_check_can_be_turned_off(tiny_model, tmp_path):
    rt = build_runtime(make_config(*tiny_model, tmp_path, predraft_cycle_check=False))
    pd = rt.proposer.predraft
    check = pd.cycle_for(1)
    assert not pd.cycle_check
    check.state = "hold_off"
    assert pd._passes_allowed(1) and pd.worth_preparing(1)  # (the check's state is not consulted)
    for _ in range(SETTLE + check.trial_steps):
        pd.observe_cycle(0.02, 1)
    assert check.state == "hold_off" and check.last is None


def test_cli_flag():
    from drafter_service.cli import parse_args
    assert parse_args([]).predraft_cycle_check is False  # (off by default: docs/predraft.md says why)
    assert parse_args(["--predraft-cycle-check"]).predraft_cycle_check is True
