"""The trainer states and plan the fleet tests share with their rollout processes."""

import jax.numpy as jnp
import numpy as np

import jsparse
from tests import strategies


def _states(count, seed=0):
  rng = np.random.default_rng(seed)
  states = [{"w": rng.normal(size=4096).astype(np.float32),
             "b": rng.normal(size=64).astype(np.float32)}]
  for _ in range(count):
    states.append({k: strategies.nudge_leaf(rng, v, 0.02) for k, v in states[-1].items()})
  return [{k: jnp.asarray(v) for k, v in s.items()} for s in states]


STATES = _states(24)
PLAN = jsparse.make_plan(STATES[0], rollout_dtype=jnp.bfloat16, bucket_size=1024)
