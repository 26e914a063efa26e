"""What `sssd serve` says at start about speculation: a plan that turns it off everywhere says
why, in one WARNING line, and how to override it."""

from __future__ import annotations

import logging

from sssd.commands.serve import plan_summary
from sssd.serving.planning.planner import BudgetPlanner, ForwardProfile

ROWS, TOKENS = [1, 4, 16, 64], [1, 2, 3, 5, 9, 17, 33, 65]
BATCHES = (1, 4, 16, 32)


def profile(fixed: float, per_token: float, **conditions) -> ForwardProfile:
    prof = ForwardProfile(ROWS, TOKENS, [[fixed + per_token * r * t for t in TOKENS] for r in ROWS], context=256)
    if conditions:
        prof.meta = {"conditions": conditions}
    return prof


def warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sssd.serve" and r.levelno >= logging.WARNING]


def test_off_everywhere_says_why_and_how_to_override_in_one_warning(caplog):
    # every token verified costs a full pass: no MAT below budget + 1 pays for it
    planner = BudgetPlanner(None, profile=profile(0.0, 0.02), adaptive=False)
    with caplog.at_level(logging.INFO, logger="sssd.serve"):
        mode = plan_summary(planner, True, BATCHES)
    assert mode == "budget per batch size: B=1->0, B=4->0, B=16->0, B=32->0 (off)"
    (record,) = warnings(caplog)
    text = record.getMessage()
    assert record.levelname == "WARNING" and "\n" not in text
    assert text.startswith("speculation is off at every batch size")
    assert "at batch size 1, a step verifying budget" in text and "tokens/s plain" in text
    assert "`--budget N`" in text and "--reprofile" not in text  # a quiet measurement: nothing to re-measure


def test_a_profile_measured_beside_a_busy_process_says_so(caplog):
    planner = BudgetPlanner(None, profile=profile(0.0, 0.02, other_processes_cpu_share=0.6), adaptive=False)
    with caplog.at_level(logging.INFO, logger="sssd.serve"):
        plan_summary(planner, True, BATCHES)
    (record,) = warnings(caplog)
    assert "other processes used 60% of the CPU" in record.getMessage() and "`--reprofile`" in record.getMessage()


def test_a_plan_that_speculates_somewhere_is_not_a_warning(caplog):
    planner = BudgetPlanner(None, profile=profile(0.05, 0.0002), adaptive=False)  # memory-bound: drafts pay
    with caplog.at_level(logging.INFO, logger="sssd.serve"):
        mode = plan_summary(planner, True, (1, 4, 16, 16))
    assert mode.startswith("budget per batch size: B=1->") and "(off)" not in mode
    assert mode.count("B=16") == 1 and planner.model_budget(1) > 0
    assert not warnings(caplog)


def test_fixed_budgets_and_no_speculation_need_no_plan(caplog):
    with caplog.at_level(logging.INFO, logger="sssd.serve"):
        assert plan_summary(BudgetPlanner(4), True, BATCHES) == "budget 4"
        assert plan_summary(BudgetPlanner(0), False, BATCHES) == "off"
    assert not warnings(caplog)
