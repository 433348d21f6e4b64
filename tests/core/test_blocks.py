"""Block-local diff and apply: trainer and rollout on different meshes and layouts, exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse._src.core import delta as delta_lib
from jsparse._src.core import placement
from jsparse.testing import assert_trees_bitwise_equal
from tests.meshes import PAIRS, SHAPES, assert_layout, place, trees

@pytest.mark.parametrize("trainer, rollout", PAIRS)
def test_pure_diff_and_apply_across_layouts(trainer, rollout):
  base, new = trees(0, 0.03)
  t_base, t_new = place(base, trainer), place(new, trainer)
  plan = jsparse.make_plan(t_base, rollout_dtype=jnp.bfloat16, capacity=0.2, bucket_size=256)
  delta = jsparse.diff(plan, t_base, t_new)
  assert not bool(delta.overflow.any())
  r_base = place(jax.tree.map(np.asarray, plan.cast(base)), rollout)
  shardings = {k: v.sharding for k, v in r_base.items()}
  out = jsparse.apply(plan, r_base, delta)
  assert_trees_bitwise_equal(out, plan.cast(new))
  assert_layout(out, shardings)


def test_sharded_leaves_get_per_block_capacity_and_are_not_pooled():
  params = place({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, "fsdp4")
  plan = jsparse.make_plan(params, capacity=0.1, pooled_capacity=0.1, bucket_size=10**6)
  by_leaf = {plan.leaves[s.leaf_ids[0]].path: s for s in plan.segments if not s.pooled}
  assert by_leaf["['w']"].blocks == 4 and by_leaf["['w']"].capacity == 4 * 154
  assert by_leaf["['b']"].blocks == 4
  pooled = [s for s in plan.segments if s.pooled]
  assert [sorted(plan.leaves[i].path for i in s.leaf_ids) for s in pooled] == [
      ["['emb']", "['scalar']"]] or all(s.blocks == 1 for s in pooled)


def test_block_overflow_is_flagged_even_when_the_total_fits():
  w = np.zeros((64, 96), np.float32)
  params = place({"w": w}, "fsdp4")
  plan = jsparse.make_plan(params, capacity=0.1, pooled_capacity=0.1)  # a small split leaf
  new = w.copy()
  new[:16] = 1.0  # every change in the first block
  delta = jsparse.diff(plan, params, place({"w": new}, "fsdp4"))
  assert delta.counts.tolist() == [16 * 96] and delta.overflow.tolist() == [True]


def _per_device_temp(jitted, *args):
  return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_no_device_materializes_a_full_leaf():
  shape = (2048, 1024)  # 8 MiB per fp32 leaf, 1 MiB per fp32 shard on 8 devices
  rng = np.random.default_rng(3)
  base = rng.normal(size=shape).astype(np.float32)
  t_base = place({"w": base, "emb": base}, "fsdp8")
  plan = jsparse.make_plan(t_base, rollout_dtype=jnp.bfloat16, capacity=0.05)
  shard_bytes = base.nbytes // 8 * 2  # two fp32 leaves split 8 ways
  diff_temp = _per_device_temp(delta_lib.diff_program, plan, t_base, t_base)
  r_base = place(jax.tree.map(np.asarray, plan.cast({"w": base, "emb": base})), "dp2xtp4")
  delta = jsparse.diff(plan, t_base, t_base)
  r_flat = plan.flatten(r_base, what="rollout")
  layouts = placement.layouts_of(plan, r_flat)
  delta = delta_lib.colocate(plan, delta, r_flat)
  apply_temp = _per_device_temp(delta_lib.apply_program(True), plan, layouts, r_base, delta)
  rollout_shard_bytes = 2 * (base.size // 4) * 2  # two bf16 leaves split 4 ways by 'tensor'
  print(f"\nper-device temp: diff {diff_temp / shard_bytes:.3f}x the per-device trainer shard "
        f"bytes ({shard_bytes} B fp32); apply {apply_temp / rollout_shard_bytes:.3f}x the "
        f"per-device rollout shard bytes ({rollout_shard_bytes} B bf16)")
  full_leaf = base.nbytes
  assert diff_temp < full_leaf / 2 and apply_temp < full_leaf / 2
