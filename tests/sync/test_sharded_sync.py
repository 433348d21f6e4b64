"""Sender -> Receiver between differently sharded trainer and rollout meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from jsparse.testing import assert_trees_bitwise_equal
from tests import strategies
from jsparse._src.wire.parts import read_index
from jsparse._src.wire.payload import Mode
from tests.meshes import PAIRS, assert_layout, place, trees


# Every layout pair with "ranked"; "positioned" and "packed" (other record paths, same
# layouts) on three pairs. tests/sync/test_parts.py runs the same pairs through payload parts.
CASES = ([(t, r, "ranked") for t, r in PAIRS]
         + [(t, r, c) for t, r in (PAIRS[0], PAIRS[4], PAIRS[5]) for c in ("positioned", "packed")])


@pytest.mark.parametrize("trainer, rollout, coding", CASES)
@pytest.mark.parametrize("density", [0.02, 0.6])
def test_sender_receiver_across_layouts(trainer, rollout, density, coding):
  base, _ = trees(1, 0.0)
  params = place(base, trainer)
  rollout_params = place(jax.tree.map(np.asarray, base), rollout)
  shardings = {k: v.sharding for k, v in rollout_params.items()}
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.1, bucket_size=256)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, plan.cast(rollout_params))
  rng = np.random.default_rng(2)
  for _ in range(2):  # density 0.6 overflows: those leaves travel densely
    base = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
    out = receiver.receive(sender.send(place(base, trainer)))
    assert_trees_bitwise_equal(out, plan.cast(base))
    assert_layout(out, shardings)


def test_one_payload_stream_serves_rollouts_with_different_meshes():
  """The plan knows no rollout layout: the same bytes apply, exactly and block-locally, to a
  whole copy, an 8-way column split, a 2x4 split and tensor-parallel 1, 2 and 4 replicas."""
  base, _ = trees(4, 0.0)
  plan = jsparse.make_plan(base, rollout_dtype=jnp.bfloat16, bucket_size=256)
  sender = jsparse.Sender(plan, base, coding="ranked")  # ranks resolved block by block
  layouts = ["single", "fsdp2", "fsdp4", "fsdp8", "dp2xtp4", "tp4xdp2", "fsdp2xtp2"]
  receivers = [jsparse.Receiver(plan, place(jax.tree.map(np.asarray, plan.cast(base)), name))
               for name in layouts]
  rng = np.random.default_rng(5)
  for _ in range(3):
    base = {k: strategies.nudge_leaf(rng, v, 0.05) for k, v in base.items()}
    data = sender.send(base)
    assert read_index(plan, data).entries[0].mode == Mode.BY_RANK
    for receiver in receivers:
      assert_trees_bitwise_equal(receiver.receive(data), plan.cast(base))
  assert len(data) / sender.last_stats.changed < 2.2  # a small tree: ~95 B of index per unit


MESH_SHAPES = [(8,), (1, 8), (8, 1), (2, 4), (4, 2), (1, 2, 4), (2, 1, 2, 2), (1, 1)]
AXIS_TYPES = [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto]


@st.composite
def meshes(draw):
  """A random mesh: size-1 axes included, Explicit or Auto axis types."""
  mesh_shape = draw(st.sampled_from(MESH_SHAPES))
  names = tuple(f"m{i}" for i in range(len(mesh_shape)))
  axis_type = draw(st.sampled_from(AXIS_TYPES))
  return jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names),
                       devices=jax.devices()[:int(np.prod(mesh_shape))])


@st.composite
def placements(draw, mesh, shape):
  """A spec for ``shape`` on ``mesh`` whose split dimensions divide evenly."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  names = mesh.axis_names
  free, spec = list(names), []
  for n in shape:
    chosen = draw(st.lists(st.sampled_from(free), unique=True, max_size=2)) if free else []
    if n % int(np.prod([mesh.shape[a] for a in chosen] or [1])):
      chosen = []
    free = [a for a in free if a not in chosen]
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return NamedSharding(mesh, P(*spec))


@settings(max_examples=5)
@given(st.data(), st.sampled_from(list(jsparse.Coding)), st.sampled_from([0.02, 0.5]))
def test_random_meshes_with_size_1_and_explicit_axes(data, coding, density):
  """Trainer and rollout on random meshes, next to an uncommitted leaf: exact, layouts kept."""
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
  shapes = {"w": (16, 48), "v": (32,)}
  base = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
  trainer_mesh, rollout_mesh = data.draw(meshes()), data.draw(meshes())
  trainer = {k: data.draw(placements(trainer_mesh, s)) for k, s in shapes.items()}
  rollout = {k: data.draw(placements(rollout_mesh, s)) for k, s in shapes.items()}
  params = {k: jax.device_put(v, trainer[k]) for k, v in base.items()}
  params["bias"] = jnp.zeros(5)  # uncommitted, next to sharded leaves
  plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.1, bucket_size=64)
  rollout_params = {k: jax.device_put(v.astype(jnp.bfloat16), rollout[k])
                    for k, v in base.items()}
  rollout_params["bias"] = jnp.zeros(5, jnp.bfloat16)
  sender = jsparse.Sender(plan, params, coding=coding)
  receiver = jsparse.Receiver(plan, rollout_params)
  for _ in range(2):
    base = {k: strategies.perturb(rng, v, density) for k, v in base.items()}
    new = {k: jax.device_put(v, trainer[k]) for k, v in base.items()}
    new["bias"] = jnp.asarray(rng.normal(size=5).astype(np.float32))
    out = receiver.receive(sender.send(new))
    assert_trees_bitwise_equal(out, plan.cast(new))
    for k in shapes:
      assert out[k].sharding.is_equivalent_to(rollout[k], len(shapes[k])), (k, out[k].sharding)
