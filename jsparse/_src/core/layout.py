"""How a leaf is split into blocks over a mesh: :class:`Layout`.

A leaf held as a ``NamedSharding`` that splits some dimensions is a grid of equal blocks, one per
device group; jsparse diffs, applies and digests such leaves block by block (``blocks.py``).
Leaves that are replicated, on one device, or not evenly divisible have no layout (None) and are
handled whole.

>>> import jax
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
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


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
