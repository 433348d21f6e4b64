"""Chunks: a partition of the segments into small programs shared by same-shaped leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.core import chunks as chunks_lib
from jsparse._src.core.chunks import chunks_of, sum_digests
from jsparse._src.core.plan import MAX_POOL_LEAVES
from jsparse._src.sync import programs
from tests import strategies
from jsparse.testing import assert_trees_bitwise_equal, special_values


def _layers(n, rng, width=64):
  return {f"layer{i:03d}": {"w": jnp.asarray(rng.standard_normal((width, width)), jnp.float32),
                            "up": jnp.asarray(rng.standard_normal((width, 2 * width)),
                                              jnp.float32),
                            "norm": jnp.asarray(rng.standard_normal(width), jnp.float32),
                            "step": jnp.int32(i)}
          for i in range(n)}


@pytest.mark.parametrize("layers", [1, 7, 50])
def test_chunks_partition_the_segments_and_share_structures(layers):
  plan = jsparse.make_plan(_layers(layers, np.random.default_rng(0)),
                           rollout_dtype=jnp.bfloat16, bucket_size=4096)
  chunks = chunks_of(plan)
  assert sorted(s for c in chunks for s in c.segment_ids) == list(range(len(plan.segments)))
  for c in chunks:
    assert c.leaf_ids == tuple(i for s in c.segment_ids for i in plan.segments[s].leaf_ids)
    assert len(c.segment_ids) <= max(chunks_lib.MAX_SEGMENTS, chunks_lib.MAX_MIXED_SEGMENTS)
    assert len(c.leaf_ids) <= chunks_lib.MAX_LEAVES or len(c.segment_ids) == 1
    for s, sub in zip(c.segment_ids, c.plan.segments):  # the same structure, paths aside
      assert (sub.size, sub.capacity, sub.dtype, sub.offsets) == (
          plan.segments[s].size, plan.segments[s].capacity, plan.segments[s].dtype,
          plan.segments[s].offsets)
      assert [c.plan.leaves[i].shape for i in sub.leaf_ids] == [
          plan.leaves[i].shape for i in plan.segments[s].leaf_ids]
  assert all(len(seg.leaf_ids) <= MAX_POOL_LEAVES for seg in plan.segments)
  # 50 layers: 100 matrices of two shapes by 4, pools of norms and steps: a handful of programs
  distinct = {c.plan for c in chunks}
  assert len(distinct) <= 8, len(distinct)
  assert len(chunks) <= -(-len(plan.segments) // 4) + len(distinct)


def test_the_digest_of_a_tree_is_the_sum_of_its_chunks_digests():
  """Chunk by chunk with global leaf ids, the digest is the one of the whole tree (the digest
  payloads and saved states carry), for any split of the leaves."""
  rng = np.random.default_rng(1)
  tree = _layers(9, rng)
  tree["empty"] = jnp.zeros((0, 3))
  tree["special"] = jnp.asarray(special_values(np.float32))
  plan = jsparse.make_plan(tree, rollout_dtype=jnp.bfloat16, bucket_size=4096)
  flat = programs.cast_flat(plan, plan.flatten(tree, what="tree"))
  whole = jsparse.bits_digest(flat)
  by_chunk = programs.leaves_digest(plan, flat, (None,) * len(flat))
  assert np.array_equal(np.asarray(whole), np.asarray(by_chunk))
  halves = [jsparse.bits_digest(flat[i::2], None, np.arange(i, len(flat), 2, dtype=np.uint32))
            for i in (0, 1)]
  assert np.array_equal(np.asarray(sum_digests(halves)), np.asarray(whole))


def test_a_many_leaf_tree_syncs_exactly_through_shared_programs():
  rng = np.random.default_rng(2)
  params = _layers(12, rng)
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, bucket_size=4096, capacity=0.02)
  sender = jsparse.Sender(plan, params)
  receiver = jsparse.Receiver(plan, plan.cast(params))
  for density in (0.01, 0.5, 0.0):  # sparse, overflowing (dense segments), nothing
    params = jax.tree.map(lambda x: jnp.asarray(strategies.perturb(rng, np.asarray(x), density)),
                          params)
    assert_trees_bitwise_equal(receiver.receive(sender.send(params)), plan.cast(params))
  assert receiver.digest == sender.digest


def test_unlike_leaves_share_mixed_chunks():
  """Leaves whose structure occurs once gain nothing from programs of their own: they run
  together, a few per chunk."""
  tree = {f"w{i}": jnp.zeros((100 + i, 10)) for i in range(12)}
  plan = jsparse.make_plan(tree, bucket_size=500)
  assert len(plan.segments) == 12
  assert [len(c.segment_ids) for c in chunks_of(plan)] == [chunks_lib.MAX_MIXED_SEGMENTS, 4]
