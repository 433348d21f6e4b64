"""Shard-local diff and apply for leaves laid out by a ``NamedSharding``.

Each device works on its own block only: the diff finds changes inside its block and gives them
global flat coordinates; the apply receives the (small, replicated) list of global coordinates,
keeps those inside its block and scatters them locally. No device ever holds a full leaf.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> mesh = jax.make_mesh((1,), ("x",))
>>> Layout.of(NamedSharding(mesh, P("x")), (8,)) is None  # one block: nothing to split
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jsparse._src import bits as bits_lib
from jsparse._src.compaction import changed_elements


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a leaf is split into blocks over a mesh: the mesh axes that split each dimension."""

  mesh: Mesh
  dim_axes: tuple[tuple[str, ...], ...]

  @staticmethod
  def of(sharding, shape: tuple[int, ...]) -> "Layout | None":
    """The layout of a leaf, or None when it is not split into blocks (replicated, a single
    device, not a NamedSharding, or a dimension not divisible by its number of parts)."""
    if not isinstance(sharding, NamedSharding) or not shape:
      return None
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    dim_axes = tuple(() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec)
    layout = Layout(sharding.mesh, dim_axes)
    if layout.blocks == 1 or any(n % p for n, p in zip(shape, layout.parts)):
      return None
    return layout

  @property
  def parts(self) -> tuple[int, ...]:
    return tuple(math.prod(self.mesh.shape[a] for a in axes) for axes in self.dim_axes)

  @property
  def blocks(self) -> int:
    return math.prod(self.parts)

  @property
  def spec(self) -> PartitionSpec:
    return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else a for a in self.dim_axes])

  @property
  def split_axes(self) -> tuple[str, ...]:
    return tuple(a for axes in self.dim_axes for a in axes)

  def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n // p for n, p in zip(shape, self.parts))

  def block_start(self, shape: tuple[int, ...]) -> list[jax.Array]:
    """Inside ``shard_map``: this device's block start along each dimension."""
    starts = []
    for axes, block in zip(self.dim_axes, self.block_shape(shape)):
      index = jnp.int32(0)
      for axis in axes:
        index = index * self.mesh.shape[axis] + lax.axis_index(axis)
      starts.append(index * block)
    return starts

  def shard_map(self, fn: Callable, in_specs, out_specs) -> Callable:
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)


def block_positions(layout: Layout, shape: tuple[int, ...]) -> jax.Array:
  """Inside ``shard_map``: the global flat position of every element of this device's block
  (int32, in the block's shape)."""
  block = layout.block_shape(shape)
  multi = [lax.broadcasted_iota(jnp.int32, block, d) + s
           for d, s in enumerate(layout.block_start(shape))]
  return _ravel(multi, shape)


def _ravel(multi: list[jax.Array], shape: tuple[int, ...]) -> jax.Array:
  flat = jnp.zeros_like(multi[0]) if multi else jnp.int32(0)
  for m, n in zip(multi, shape):
    flat = flat * n + m
  return flat


def _unravel(flat: jax.Array, shape: tuple[int, ...]) -> list[jax.Array]:
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
    local_multi = _unravel(jnp.minimum(positions, source.shape[0] - 1), block)
    starts = layout.block_start(shape)
    global_flat = _ravel([m + s for m, s in zip(local_multi, starts)], shape)
    return jnp.where(valid, global_flat, size), values, old_values, count.reshape(1)

  out = PartitionSpec(layout.split_axes)
  return layout.shard_map(local, (layout.spec, layout.spec), (out,) * 4)(base, new)


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
    multi = _unravel(jnp.minimum(idx, size - 1), shape)
    inside = idx < size
    for m, s, b in zip(multi, starts, block):
      inside &= (m >= s) & (m < s + b)
    local_flat = jnp.where(inside, _ravel([m - s for m, s in zip(multi, starts)], block),
                           block_size)
    flat = base_block.reshape(-1)
    if decode is not None:
      vals = decode(flat, local_flat, vals)
    return bits_lib.scatter_bits(flat, local_flat, vals).reshape(block)

  return layout.shard_map(local, (layout.spec, PartitionSpec(), PartitionSpec()),
                          layout.spec)(base, indices, values)
