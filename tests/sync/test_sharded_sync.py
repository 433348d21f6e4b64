"""Sender -> Receiver between differently sharded trainer and rollout meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from tests.meshes import PAIRS, assert_layout, place, trees


@pytest.mark.parametrize("trainer, rollout", PAIRS)
@pytest.mark.parametrize("density", [0.02, 0.6])
@pytest.mark.parametrize("coding", ["lists", "ranked"])
def test_sender_receiver_across_layouts(trainer, rollout, density, coding):
  base, _ = trees(1, 0.0)
  params = place(base, trainer)
  rollout_params = place(jax.tree.map(np.asarray, base), rollout)
  shardings = {k: v.sharding for k, v in rollout_params.items()}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.1, bucket_size=256,
                           rollout_shardings=shardings)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(rollout_params))
  rng = np.random.default_rng(2)
  for _ in range(2):  # density 0.6 overflows: those leaves travel densely
    base = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
    out = receiver.receive(sender.send(place(base, trainer)))
    assert_trees_bitwise_equal(out, plan.cast(base))
    assert_layout(out, shardings)


def test_compact_payload_for_a_leaf_the_plan_did_not_know_split_is_refused_unapplied():
  base, new = trees(4, 0.05)
  plan = jsparse.make_plan(base, rollout_dtype=jnp.bfloat16, bucket_size=256)  # no hint
  rollout = place(jax.tree.map(np.asarray, plan.cast(base)), "fsdp4")
  receiver = jsparse.Receiver(plan, rollout)
  with pytest.raises(jsparse.PlanMismatchError, match="rollout_shardings"):
    receiver.receive(jsparse.Sender(plan, base).send(new))
  assert receiver.version == 0
  assert_trees_bitwise_equal(receiver.params, plan.cast(base))
  out = receiver.receive(jsparse.Sender(plan, base, coding="lists").send(new))  # lists: fine
  assert_trees_bitwise_equal(out, plan.cast(new))
