"""Shard-local diff and apply for leaves split into blocks (see :class:`Layout`).

Each device works on its own block only: the diff finds changes inside its block and gives them
global flat coordinates; the apply receives the (small, replicated) list of global coordinates,
keeps those inside its block and scatters them locally. No device ever holds a full leaf.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> mesh = jax.make_mesh((jax.device_count(),), ("x",))
>>> sharding = NamedSharding(mesh, P("x"))
>>> layout = Layout.of(sharding, (8 * jax.device_count(),)) or Layout(mesh, (("x",),))
>>> n = 8 * jax.device_count()
>>> base = jax.device_put(jnp.zeros(n), sharding)
>>> new = jax.device_put(jnp.zeros(n).at[3].set(1.0), sharding)
>>> positions, _, _, counts = diff_blocks(layout, (n,), np.dtype("float32"), 2, base, new)
>>> int(counts.sum()), int(positions.min())
(1, 3)
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.layout import Layout
from jsparse._src.core.select import changed_elements


def block_positions(layout: Layout, shape: tuple[int, ...]) -> jax.Array:
  """Inside ``shard_map``: the global flat position of every element of this device's block
  (int32, in the block's shape)."""
  block = layout.block_shape(shape)
  multi = [lax.broadcasted_iota(jnp.int32, block, d) + s
           for d, s in enumerate(layout.block_start(shape))]
  return ravel(multi, shape)


def ravel(multi: list[jax.Array], shape: tuple[int, ...]) -> jax.Array:
  flat = jnp.zeros_like(multi[0]) if multi else jnp.int32(0)
  for m, n in zip(multi, shape):
    flat = flat * n + m
  return flat


def unravel(flat: jax.Array, shape: tuple[int, ...]) -> list[jax.Array]:
  multi = []
  for n in reversed(shape):
    multi.append(flat % n)
    flat = flat // n
  return multi[::-1]


def diff_blocks(layout: Layout, shape: tuple[int, ...], rollout_dtype: np.dtype,
                block_capacity: int, base: jax.Array, new: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-block changes of one leaf, in global flat coordinates.

  Returns ``int32[blocks * block_capacity]`` positions (ascending within each block; unused slots
  hold the leaf size), their new and old rollout bits, and ``int32[blocks]`` per-block change
  counts.
  """
  size = math.prod(shape)
  block = layout.block_shape(shape)

  def local(base_block, new_block):
    source = new_block.reshape(-1)
    positions, values, old_values, count = changed_elements(
        base_block.reshape(-1), source, rollout_dtype, block_capacity)
    valid = positions < source.shape[0]
    local_multi = unravel(jnp.minimum(positions, source.shape[0] - 1), block)
    starts = layout.block_start(shape)
    global_flat = ravel([m + s for m, s in zip(local_multi, starts)], shape)
    return jnp.where(valid, global_flat, size), values, old_values, count.reshape(1)

  out = PartitionSpec(layout.split_axes)
  return layout.shard_map(local, (layout.spec, layout.spec), (out,) * 4)(base, new)


def count_blocks(layout: Layout, shape: tuple[int, ...], rollout_dtype: np.dtype,
                 base: jax.Array, new: jax.Array) -> jax.Array:
  """``int32[blocks]``: the changes in each block of a leaf (what :func:`diff_blocks` counts),
  each device counting its own block."""
  def local(base_block, new_block):
    changed = (bits_lib.to_bits(base_block.astype(rollout_dtype))
               != bits_lib.to_bits(new_block.astype(rollout_dtype)))
    return jnp.sum(changed, dtype=jnp.int32).reshape(1)

  return layout.shard_map(local, (layout.spec, layout.spec),
                          PartitionSpec(layout.split_axes))(base, new)


def apply_blocks(layout: Layout, shape: tuple[int, ...], base: jax.Array, indices: jax.Array,
                 values: jax.Array, decode: Callable | None = None) -> jax.Array:
  """Scatters (global flat index, bits) pairs into a block-sharded leaf, each device keeping only
  the pairs inside its own block. ``indices`` and ``values`` are replicated. With ``decode``,
  ``values`` are codes: ``decode(block, local positions, values)`` gives the bits."""
  size = math.prod(shape)
  block = layout.block_shape(shape)
  block_size = math.prod(block)

  def local(base_block, idx, vals):
    starts = layout.block_start(shape)
    multi = unravel(jnp.minimum(idx, size - 1), shape)
    inside = idx < size
    for m, s, b in zip(multi, starts, block):
      inside &= (m >= s) & (m < s + b)
    local_flat = jnp.where(inside, ravel([m - s for m, s in zip(multi, starts)], block),
                           block_size)
    flat = base_block.reshape(-1)
    if decode is not None:
      vals = decode(flat, local_flat, vals)
    return bits_lib.scatter_bits(flat, local_flat, vals).reshape(block)

  return layout.shard_map(local, (layout.spec, PartitionSpec(), PartitionSpec()),
                          layout.spec)(base, indices, values)
