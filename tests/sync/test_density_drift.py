"""Exact at every density within one run: hypothesis drifts a run's density from 0.01% to 100%
and back, step by step, through whole payloads and streams, for every coding; every step's
bits are compared with the sender's (special values included), and the digests that sender
and receiver update from the changes with digests of their whole trees."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jsparse
from jsparse._src.core import bits as bits_lib
from jsparse._src.sync.state import digest_bytes, versioned_digest
from jsparse.testing import assert_trees_bitwise_equal
from tests.strategies import perturb, with_specials

FIXED = tuple(c for c in jsparse.Coding if c is not jsparse.Coding.AUTO)
# Densities of a step: the extremes and a log-uniform spread between them.
DENSITIES = st.sampled_from([1e-4, 1e-3, 0.01, 0.04, 0.3, 1.0]) | st.floats(-4, 0).map(
    lambda e: 10.0 ** e)


@pytest.fixture(scope="module")
def plan_and_start():
  rng = np.random.default_rng(0)
  start = {"w": rng.standard_normal((128, 512)).astype(np.float32),  # one segment, 5%
           "b": with_specials(rng, rng.standard_normal(512).astype(np.float32)),  # pooled
           "h": with_specials(rng, rng.standard_normal(2000).astype(np.float16)),
           "step": np.arange(16, dtype=np.int32)}
  plan = jsparse.make_plan(start, rollout_dtype=lambda path, s: jnp.bfloat16
                           if s.dtype == jnp.float32 else None)
  return plan, start


def _step(rng: np.random.Generator, tree: dict, density: float) -> dict:
  """``density`` of the elements of every leaf changed: half by a few ulps (RL-like), half to
  random bits (NaN payloads, infinities, subnormals, -0.0 among them)."""
  out = {}
  for name, x in tree.items():
    x = np.array(x)
    flat = x.reshape(-1)
    nudged = rng.random(flat.shape) < density / 2
    if jnp.issubdtype(x.dtype, jnp.floating):
      width = bits_lib.bit_dtype(x.dtype)
      moved = flat.view(width)[nudged].astype(np.int64) + rng.integers(-3, 4, nudged.sum()) * 65536
      flat.view(width)[nudged] = (moved % (1 << (8 * x.itemsize))).astype(width)
    else:
      flat[nudged] += 1
    out[name] = perturb(rng, x, density / 2)
  return out


@pytest.mark.parametrize("coding", FIXED, ids=lambda c: c.value)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1),
       steps=st.lists(st.tuples(DENSITIES, st.booleans()), min_size=3, max_size=6))
def test_every_density_of_a_run_syncs_exactly(plan_and_start, coding, seed, steps):
  plan, start = plan_and_start
  rng = np.random.default_rng(seed)
  sender = jsparse.Sender(plan, start, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(start))
  params = start
  for density, streamed in steps:
    params = _step(rng, params, density)
    if streamed:
      stream = receiver.open_stream()
      for part in sender.send_stream(params, chunk_bytes=1 << 16):
        stream.add(part)
      stream.commit()
    else:
      receiver.receive(sender.send(params))
    assert_trees_bitwise_equal(receiver.params, plan.cast(params))
    assert sender.last_stats.changed <= plan.num_elements
    whole = versioned_digest(digest_bytes(jsparse.bits_digest(sender.snapshot)), sender.version)
    assert sender.digest == whole
    assert receiver.digest == versioned_digest(
        digest_bytes(jsparse.bits_digest(receiver.params)), receiver.version)
  assert receiver.version == len(steps)
