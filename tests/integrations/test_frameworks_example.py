"""examples/frameworks.py, small: the same FP16 training through Lightning and through accelerate, with
FusedAdamW, mpfused.GradScaler and clipping; the forced overflow is skipped, and every printed row logs
the skipped-step count and the scale."""

import math

import pytest

from example_helpers import load_example

example = load_example("frameworks")
STEPS, OVERFLOW, EVERY, INIT_SCALE = 24, 2, 4, 2.0**12
SMALL = ["--steps", str(STEPS), "--overflow-step", str(OVERFLOW), "--log-every", str(EVERY)]


def check_rows(result):
    rows = result["rows"]
    assert [r[0] for r in rows] == list(range(EVERY, STEPS + 1, EVERY))
    # every row is after the overflow: one skipped step, the scale halved once (no growth in 24 steps)
    assert all(skipped == 1 and scale == INIT_SCALE / 2 for _, _, skipped, scale in rows)
    assert result["skipped_steps"] == 1 and result["scale"] == INIT_SCALE / 2
    losses = [loss for _, loss, _, _ in rows]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]  # it trains


def test_lightning(fresh_accelerate_state):
    pytest.importorskip("lightning", reason="lightning is not installed (make test-integrations installs it)")
    check_rows(example.main(["lightning"] + SMALL))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_accelerate(algorithm, fresh_accelerate_state):
    pytest.importorskip("accelerate", reason="accelerate is not installed (make test-integrations installs it)")
    clip = "1.0" if algorithm == "norm" else "0.05"
    result = example.main(["accelerate", "--clip-algorithm", algorithm, "--clip", clip] + SMALL)
    check_rows(result)
    assert result["overflow_step_was_skipped"] is True
    assert result["schedule_steps"] == STEPS - 1  # the schedule held on the skipped step


def test_a_short_run_forces_its_overflow_on_its_last_step():
    assert example.parse(["accelerate", "--steps", "3"]).overflow_step == 2  # (the default 5 is past the run)
    assert example.parse(["accelerate"]).overflow_step == 5


def test_bad_arguments():
    for argv in (["keras"], ["accelerate", "--clip", "0"], ["accelerate", "--steps", "0"],
                 ["accelerate", "--log-every", "0"], ["accelerate", "--steps", "6", "--overflow-step", "6"],
                 ["accelerate", "--overflow-step", "-1"], ["accelerate", "--lr", "-1"]):
        with pytest.raises(SystemExit):
            example.parse(argv)
