"""The trainer states and plan the engine tests share (with their rollout processes too)."""

import jax.numpy as jnp
import numpy as np

import jsparse
from tests import strategies


def nudged_states(count: int, seed: int = 0, size: int = 4096) -> list[dict]:
  """A weight and a bias vector, then ``count`` RL-like updates of them."""
  rng = np.random.default_rng(seed)
  states = [{"w": rng.normal(size=size).astype(np.float32),
             "b": rng.normal(size=64).astype(np.float32)}]
  for _ in range(count):
    states.append({k: strategies.nudge_leaf(rng, v, 0.02) for k, v in states[-1].items()})
  return [{k: jnp.asarray(v) for k, v in s.items()} for s in states]


STATES = nudged_states(24)
PLAN = jsparse.make_plan(STATES[0], rollout_dtype=jnp.bfloat16, bucket_size=1024)
