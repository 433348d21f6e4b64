"""Ranks resolved block by block (``block_ranks.py``) equal the whole-segment reference, for any
layout of the segment's leaves."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from jsparse._src.core.layout import Layout
from jsparse._src.device import block_ranks, ranks, ulp_codes
from tests.core.test_kernels import _bf16_bits_with_every_class

# A rollout mesh, and the specs its leaves may have (2-D leaves, dimensions multiples of 8).
MESHES = {((8,), ("x",)): [P("x"), P(None, "x")],
          ((2, 4), ("a", "b")): [P("a", "b"), P("b", "a"), P(("b", "a"), None), P(None, "b")],
          ((1, 8), ("a", "b")): [P("a", "b"), P(None, ("a", "b"))]}


@settings(max_examples=5)
@given(st.sampled_from(sorted(MESHES)), st.data(), st.integers(0, 2**32 - 1))
def test_positions_of_ranks_equal_the_whole_segment_reference(mesh_key, data, seed):
  rng = np.random.default_rng(seed)
  mesh = jax.make_mesh(*mesh_key, devices=jax.devices()[:8])
  specs = st.sampled_from([None] + MESHES[mesh_key])
  leaf_specs = data.draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5), specs),
                                  min_size=1, max_size=3))
  leaves, layouts, shapes, flat = [], [], [], []
  for rows, cols, spec in leaf_specs:
    shape = (8 * rows, 8 * cols)
    bits = _bf16_bits_with_every_class(rng, shape[0] * shape[1])
    flat.append(bits)
    leaf = jax.device_put(bits.view(jnp.bfloat16).reshape(shape),
                          NamedSharding(mesh, P() if spec is None else spec))
    layout = Layout.of(leaf.sharding, shape)
    leaves.append(leaf)
    layouts.append(layout)
    shapes.append(shape)
  segment = np.concatenate(flat)
  size = len(segment)
  queries = jnp.asarray(rng.choice(size, size=min(size, 300), replace=False).astype(np.int32))
  tables = ranks.class_tables(jnp.asarray(segment), jnp.bfloat16)
  classes = ulp_codes.exponent_class(jnp.asarray(segment)[queries], jnp.bfloat16, jnp)
  query_ranks = ranks.ranks_of(tables, queries, classes)
  found = jax.jit(block_ranks.positions_of_ranks, static_argnums=(1, 2, 3))(
      leaves, tuple(layouts), tuple(shapes), jnp.bfloat16, query_ranks)
  assert found.tolist() == queries.tolist()
