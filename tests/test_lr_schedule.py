"""The learning-rate schedule's horizon (distill.lr_schedule_steps) and its place among the settings
a resumed run may not change; the demo's training budget is in steps, not minutes."""

import math

import pytest

from common.config import ConfigError, load_config, save_config
from distill.training.optimizer import lr_lambda
from distill.training.resume import check_resumable


TINY = "configs/tiny.yaml"


def schedule(*overrides: str):
    return lr_lambda(load_config(TINY, ["distill.warmup_steps=2", *overrides]).distill)


def test_lr_schedule_steps_sets_the_cosine_horizon():
    # Stopping at step 10 of a schedule planned for 100 steps: the same LR at every step as the
    # first 10 steps of a 100-step run, still near the peak at the end.
    short_run = schedule("distill.max_steps=10", "distill.lr_schedule_steps=100")
    long_run = schedule("distill.max_steps=100")
    assert [short_run(step) for step in range(11)] == [long_run(step) for step in range(11)]
    assert short_run(10) > 0.95
    # Cosine to 10% of the peak at the horizon: half way (step 51 of 2..100) is 0.1 + 0.9 / 2.
    assert short_run(51) == pytest.approx(0.55) and short_run(100) == pytest.approx(0.1)


def test_zero_lr_schedule_steps_means_max_steps():
    factor = schedule("distill.max_steps=10", "distill.lr_schedule_steps=0")
    assert factor(0) == 0.5 and factor(10) == pytest.approx(0.1)
    assert factor(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))


def test_negative_lr_schedule_steps_is_refused():
    with pytest.raises(ConfigError, match="distill.lr_schedule_steps=-1 must be >= 0"):
        load_config(TINY, ["distill.lr_schedule_steps=-1"])


def test_resume_with_a_changed_lr_schedule_steps_is_refused(tmp_path):
    save_config(load_config(TINY), tmp_path / "config.yaml")
    checkpoint = tmp_path / "checkpoints" / "step-3"
    with pytest.raises(ConfigError, match=r"distill\.lr_schedule_steps: 0 -> 2000"):
        check_resumable(load_config(TINY, ["distill.lr_schedule_steps=2000"]), tmp_path, checkpoint)
    check_resumable(load_config(TINY, ["distill.max_minutes=5"]), tmp_path, checkpoint)  # a bound may change


def test_demo_trains_a_fixed_number_of_steps():
    # A wall-clock cap would make the demo's draft depend on the machine's load.
    dc = load_config("configs/smollm2.yaml").distill
    assert dc.max_minutes == 0 and dc.max_steps > 0
    assert dc.lr_schedule_steps > dc.max_steps  # the schedule outlasts the budget: training stops near peak LR
