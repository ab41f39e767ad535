"""The progress bar's time left: steps and the evaluations still to come, on a fake clock."""

import jax
import pytest

from configs import demo
from refusion_jax.training.loop import _eval_steps
from refusion_jax.training.metrics import COMPILE_EVENTS, MetricsLogger, TimeLeft, compile_seconds, format_seconds


class FakeClock:
  """Seconds that move only when the test says so."""

  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


def test_time_left_counts_the_evaluations_to_come():
  clock = FakeClock()
  left = TimeLeft(total_steps=100, eval_steps=[50, 100], clock=clock)
  assert left.seconds_left() is None and left.describe() == "?"
  clock.now += 30.0  # 10 steps, the first ones compiling
  left.steps_done(10)
  assert left.step_seconds == pytest.approx(3.0)
  assert left.seconds_left() is None  # an evaluation's time is not known yet
  assert left.describe() == "4m30s + 2 evals"
  clock.now += 20.0  # 40 steps at 0.5 s: the compiled step's time replaces the first stretch's
  left.steps_done(50)
  assert left.step_seconds == pytest.approx(0.5)
  with left.evaluating(50):
    clock.now += 20.0
    jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[-1], 8.0)  # compiling the decoder, not to be repeated
  assert left.evals_to_go == 1
  # 50 steps at 0.5 s and the last evaluation at 20 - 8 s; the evaluation's time is not step time
  assert left.seconds_left() == pytest.approx(50 * 0.5 + 12.0)
  clock.now += 10.0
  left.steps_done(70)
  assert left.step_seconds == pytest.approx(30.0 / 60)
  assert left.describe() == "27s"
  clock.now += 15.0
  left.steps_done(100)
  with left.evaluating(100):
    clock.now += 8.0
  assert left.seconds_left() == 0.0


def test_time_left_after_a_resume_counts_only_what_is_left():
  clock = FakeClock()
  left = TimeLeft(total_steps=100, initial_step=60, eval_steps=[20, 40, 60, 80, 100], clock=clock)
  assert left.evals_to_go == 2  # 80 and 100
  clock.now += 8.0
  left.steps_done(80)
  with left.evaluating(80):
    clock.now += 5.0
  assert left.seconds_left() == pytest.approx(20 * 0.4 + 5.0)


def test_time_left_without_evaluations_is_the_steps_alone():
  clock = FakeClock()
  left = TimeLeft(total_steps=10, clock=clock)
  clock.now += 4.0
  left.steps_done(4)
  assert left.seconds_left() == pytest.approx(6.0)


@pytest.mark.parametrize("seconds, text", [(7.4, "7s"), (65, "1m05s"), (3725, "1h02m")])
def test_format_seconds(seconds, text):
  assert format_seconds(seconds) == text


def test_the_bar_shows_the_estimate_with_evaluations(tmp_path):
  clock = FakeClock()
  logger = MetricsLogger(str(tmp_path), total_steps=20, eval_steps=[10, 20], clock=clock)
  try:
    clock.now += 5.0
    logger.steps_done(5, [3.0, 2.5, 2.0, 1.9, 1.8])
    clock.now += 5.0
    logger.steps_done(10, [1.7] * 5)
    with logger.evaluating(10):
      clock.now += 4.0
    assert logger.time_left.seconds_left() == pytest.approx(10 * 1.0 + 4.0)
    assert "loss=1.7000" in str(logger._bar) and "left=14s" in str(logger._bar)
  finally:
    logger.close()


def test_the_loop_expects_the_evaluations_it_will_run():
  """The bar counts the evaluations `_due` schedules after the start step, the last step's included."""
  config = demo.get_config()
  config.eval_every = 4
  assert _eval_steps(config, 0, 10, evaluates=True) == [4, 8, 10]
  assert _eval_steps(config, 8, 10, evaluates=True) == [10]  # resumed at step 8
  assert _eval_steps(config, 0, 10, evaluates=False) == []


def test_compile_seconds_count_only_compile_events_inside_the_block():
  jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[0], 5.0)  # before: not counted
  with compile_seconds() as compiling:
    jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[0], 1.5)
    jax.monitoring.record_event_duration_secs("/jax/some/other_event", 9.0)
    assert compiling() == 1.5
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(5.0))  # a real compilation reports under these event names
    inside = compiling()
    assert inside > 1.5
  jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[-1], 7.0)  # after: the listener is gone
  assert compiling() == inside
