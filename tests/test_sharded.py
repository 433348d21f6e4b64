"""Sharded sync: trainer and rollout on different meshes and layouts, exact, block-local."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies

# name -> (mesh shape, axis names, {leaf: spec})
LAYOUTS = {
    "single": ((1,), ("x",), {}),
    "fsdp2": ((2,), ("fsdp",), {"w": P("fsdp", None), "emb": P(None, "fsdp")}),
    "fsdp4": ((4,), ("fsdp",), {"w": P("fsdp", None), "emb": P("fsdp", None), "b": P("fsdp")}),
    "fsdp8": ((8,), ("fsdp",), {"w": P("fsdp", None), "emb": P("fsdp", None)}),
    "dp2xtp4": ((2, 4), ("data", "tensor"), {"w": P(None, "tensor"), "emb": P("tensor", None)}),
    "fsdp2xtp2": ((2, 2), ("fsdp", "tensor"), {"w": P("fsdp", "tensor"),
                                               "emb": P(("fsdp", "tensor"), None)}),
    "tp4xdp2": ((4, 2), ("tensor", "data"), {"w": P("tensor", "data"), "b": P(("tensor", "data"))}),
}
SHAPES = {"w": (64, 96), "emb": (128, 48), "b": (96,), "scalar": ()}


def _place(tree, layout_name):
  mesh_shape, names, specs = LAYOUTS[layout_name]
  n = int(np.prod(mesh_shape))
  mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:n])
  return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in tree.items()}


def _trees(seed, density):
  rng = np.random.default_rng(seed)
  base = {k: strategies.with_specials(rng, rng.normal(size=s).astype(np.float32))
          for k, s in SHAPES.items()}
  new = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
  return base, new


def _assert_layout(tree, shardings):
  for k, v in tree.items():
    assert v.sharding.is_equivalent_to(shardings[k], v.ndim), (k, v.sharding, shardings[k])


PAIRS = [("fsdp8", "dp2xtp4"), ("dp2xtp4", "fsdp8"), ("fsdp2", "fsdp4"), ("fsdp4", "single"),
         ("single", "tp4xdp2"), ("fsdp2xtp2", "tp4xdp2"), ("tp4xdp2", "fsdp2xtp2"),
         ("fsdp8", "fsdp8")]


@pytest.mark.parametrize("trainer, rollout", PAIRS)
def test_pure_diff_and_apply_across_layouts(trainer, rollout):
  base, new = _trees(0, 0.03)
  t_base, t_new = _place(base, trainer), _place(new, trainer)
  plan = jsparse.make_plan(t_base, rollout_dtype=jnp.bfloat16, capacity=0.2, bucket_size=256)
  delta = jsparse.diff(plan, t_base, t_new)
  assert not bool(delta.overflow.any())
  r_base = _place(jax.tree.map(np.asarray, plan.cast(base)), rollout)
  shardings = {k: v.sharding for k, v in r_base.items()}
  out = jsparse.apply(plan, r_base, delta)
  assert_trees_bitwise_equal(out, plan.cast(new))
  _assert_layout(out, shardings)


@pytest.mark.parametrize("trainer, rollout", PAIRS)
@pytest.mark.parametrize("density", [0.02, 0.6])
@pytest.mark.parametrize("wire_format", [1, 2])
def test_sender_receiver_across_layouts(trainer, rollout, density, wire_format):
  base, _ = _trees(1, 0.0)
  params = _place(base, trainer)
  rollout_params = _place(jax.tree.map(np.asarray, base), rollout)
  shardings = {k: v.sharding for k, v in rollout_params.items()}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.1, bucket_size=256,
                           rollout_shardings=shardings)
  sender = jsparse.Sender(plan, params, wire_format=wire_format)
  receiver = jsparse.Receiver(plan, plan.cast(rollout_params))
  rng = np.random.default_rng(2)
  for _ in range(2):  # density 0.6 overflows: those leaves travel densely
    base = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
    out = receiver.receive(sender.send(_place(base, trainer)))
    assert_trees_bitwise_equal(out, plan.cast(base))
    _assert_layout(out, shardings)


def test_compact_payload_for_a_leaf_the_plan_did_not_know_split_is_refused_unapplied():
  base, new = _trees(4, 0.05)
  plan = jsparse.make_plan(base, rollout_dtype=jnp.bfloat16, bucket_size=256)  # no hint
  rollout = _place(jax.tree.map(np.asarray, plan.cast(base)), "fsdp4")
  receiver = jsparse.Receiver(plan, rollout)
  with pytest.raises(jsparse.PlanMismatchError, match="rollout_shardings"):
    receiver.receive(jsparse.Sender(plan, base).send(new))
  assert receiver.version == 0
  assert_trees_bitwise_equal(receiver.params, plan.cast(base))
  out = receiver.receive(jsparse.Sender(plan, base, wire_format=1).send(new))  # lists: fine
  assert_trees_bitwise_equal(out, plan.cast(new))


def test_sharded_leaves_get_per_block_capacity_and_are_not_pooled():
  params = _place({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, "fsdp4")
  plan = jsparse.make_plan(params, capacity=0.1, bucket_size=10**6)
  by_leaf = {plan.leaves[s.leaf_ids[0]].path: s for s in plan.segments if not s.pooled}
  assert by_leaf["['w']"].blocks == 4 and by_leaf["['w']"].capacity == 4 * 154
  assert by_leaf["['b']"].blocks == 4
  pooled = [s for s in plan.segments if s.pooled]
  assert [sorted(plan.leaves[i].path for i in s.leaf_ids) for s in pooled] == [
      ["['emb']", "['scalar']"]] or all(s.blocks == 1 for s in pooled)


def test_block_overflow_is_flagged_even_when_the_total_fits():
  w = np.zeros((64, 96), np.float32)
  params = _place({"w": w}, "fsdp4")
  plan = jsparse.make_plan(params, capacity=0.1)
  new = w.copy()
  new[:16] = 1.0  # every change in the first block
  delta = jsparse.diff(plan, params, _place({"w": new}, "fsdp4"))
  assert delta.counts.tolist() == [16 * 96] and delta.overflow.tolist() == [True]


def _per_device_temp(jitted, *args):
  return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_no_device_materializes_a_full_leaf():
  from jsparse._src import delta as delta_lib
  shape = (2048, 1024)  # 8 MiB per fp32 leaf, 1 MiB per fp32 shard on 8 devices
  rng = np.random.default_rng(3)
  base = rng.normal(size=shape).astype(np.float32)
  t_base = _place({"w": base, "emb": base}, "fsdp8")
  plan = jsparse.make_plan(t_base, rollout_dtype=jnp.bfloat16, capacity=0.05)
  shard_bytes = base.nbytes // 8 * 2  # two fp32 leaves split 8 ways
  diff_temp = _per_device_temp(jsparse.diff, plan, t_base, t_base)
  r_base = _place(jax.tree.map(np.asarray, plan.cast({"w": base, "emb": base})), "dp2xtp4")
  delta = jsparse.diff(plan, t_base, t_base)
  r_flat = plan.flatten(r_base, what="rollout")
  layouts = delta_lib.receiver_layouts(plan, r_flat)
  delta = delta_lib._colocate(plan, delta, r_flat)
  apply_temp = _per_device_temp(delta_lib._apply_donating, plan, layouts, r_base, delta)
  rollout_shard_bytes = 2 * (base.size // 4) * 2  # two bf16 leaves split 4 ways by 'tensor'
  print(f"\nper-device temp: diff {diff_temp / shard_bytes:.3f}x the per-device trainer shard "
        f"bytes ({shard_bytes} B fp32); apply {apply_temp / rollout_shard_bytes:.3f}x the "
        f"per-device rollout shard bytes ({rollout_shard_bytes} B bf16)")
  full_leaf = base.nbytes
  assert diff_temp < full_leaf / 2 and apply_temp < full_leaf / 2
