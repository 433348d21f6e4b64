"""Capacity is where a sender's diff starts, not a ceiling: a first delta runs wide, and a segment
whose changes outgrow its slots is coded sparsely (its diff widened ahead, compiled in the
background), on every coding and path, bit for bit; past ``max_capacity`` it goes dense, never
costing more than dense bytes plus headers."""

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import jsparse
from jsparse._src.sync import programs
from jsparse.testing import assert_trees_bitwise_equal

pytestmark = pytest.mark.compile_ahead  # the default: the diff widens and narrows ahead
FIXED = tuple(c for c in jsparse.Coding if c is not jsparse.Coding.AUTO)
DENSITIES = (0.06, 0.08, 0.12, 0.16, 0.2)  # past the default capacity (5%), as at lr 1e-5
JUMP = 0.12  # after steps at 0.5%: more than twice the headroom in one step


@pytest.fixture(scope="module")
def run():
  rng = np.random.default_rng(0)
  start = {"w": rng.standard_normal((256, 512)).astype(np.float32),
           "b": rng.standard_normal(512).astype(np.float32)}
  states = [start]
  for d in (*DENSITIES, 1.0, 0.005, 0.005, 0.005, JUMP, JUMP, JUMP):
    states.append(jax.tree.map(lambda x: np.where(rng.random(x.shape) < d, x * np.float32(1.01)
                                                  + np.float32(1e-3), x).astype(np.float32),
                               states[-1]))
  return start, states


def _sync(start, states, coding, *, capacity=None, max_capacity=None, path="payload"):
  """Syncs the run (``max_capacity`` None: the default)."""
  more = {} if max_capacity is None else {"max_capacity": max_capacity}
  plan = jsparse.make_plan(start, rollout_dtype=jnp.bfloat16, capacity=capacity)
  sender = jsparse.Sender(plan, start, coding=coding, **more)
  receiver = jsparse.Receiver(plan, plan.cast(start))
  rows = []
  for params in states[1:]:
    if path == "payload":
      data = sender.send(params)
      receiver.receive(data)
    else:
      data = sender.send(params)
      receiver.receive([data])
    assert_trees_bitwise_equal(receiver.params, plan.cast(params))
    rows.append((len(data), sender.last_stats.overflowed_segments))
    assert programs.SLOT_LEVELS.wait(timeout=600)  # the widened levels, for a fixed sequence
  return plan, sender, rows


@pytest.mark.parametrize("coding", FIXED, ids=lambda c: c.value)
def test_past_its_capacity_a_segment_is_coded_sparsely(run, coding):
  start, states = run
  plan, _, adaptive = _sync(start, states, coding)
  _, _, unbounded = _sync(start, states, coding, capacity=1.0)
  _, _, static = _sync(start, states, coding, max_capacity=0.0)
  n = len(DENSITIES)
  for step in range(n):  # sparse from the first delta: within 1.3x of capacity=1.0
    assert adaptive[step][1] == 0, (step, adaptive)
    assert adaptive[step][0] <= 1.3 * unbounded[step][0], (step, adaptive, unbounded)
    assert static[step][1] == 1 and static[step][0] > 3 * adaptive[step][0]
  assert adaptive[n][0] <= plan.rollout_bytes + 1024  # 100% changed: dense, plus headers
  assert adaptive[n + 3][1] == 0 and adaptive[n + 3][0] <= 1.3 * unbounded[n + 3][0]
  # The diff narrowed back (at 0.5%), so a jump overflows its slots: dense while the wider
  # level compiles and for one sync more (a receiver's compilation of it), then sparse again.
  for jumped in adaptive[n + 4:n + 6]:
    assert jumped[1] == 1 and jumped[0] <= plan.rollout_bytes + 1024
  after = adaptive[n + 6]
  assert after[1] == 0 and after[0] <= 1.3 * unbounded[n + 6][0]


@pytest.mark.parametrize("coding", ["ranked", "packed"])
def test_widened_parts_are_exact(run, coding):
  start, states = run
  _, _, rows = _sync(start, states, jsparse.Coding(coding), path="part")
  assert [overflowed for _, overflowed in rows[:len(DENSITIES)]] == [0] * len(DENSITIES)


def test_max_capacity_is_checked():
  plan = jsparse.make_plan({"w": jnp.zeros(8)})
  for bad in (-0.1, 1.5, True, "half"):
    with pytest.raises(jsparse.ConfigError, match="max_capacity"):
      jsparse.Sender(plan, {"w": jnp.zeros(8)}, max_capacity=bad)


def test_receivers_size_their_slots_past_the_capacity_up_to_the_segment():
  """A sparse record may carry up to a segment's size (a widened sender's); slots follow."""
  seg = jsparse.make_plan({"w": jnp.zeros(100_000)}).segments[0]
  assert seg.capacity == 5000 and seg.sparse_limit == 100_000
  plan = jsparse.make_plan({"w": jnp.zeros(100_000)})
  assert programs.level_slots(plan, [0], programs.MIN_LEVEL) == (100_000,)
  assert programs.needed_level(plan, [0], [60_000], lowest=programs.MIN_LEVEL) < 0
  assert programs.needed_level(plan, [0], [60_000]) == 0  # the old floor: the capacity
