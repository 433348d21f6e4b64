"""How a leaf is split into blocks over a mesh (:class:`Layout`), and the mesh context that
jsparse's programs run in (:func:`no_context_mesh`: the arrays' own meshes, whatever the caller
set with ``jax.set_mesh``).

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

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a leaf is split into blocks over a mesh: the mesh axes that split each dimension."""

  mesh: Mesh | AbstractMesh
  dim_axes: tuple[tuple[str, ...], ...]

  def __reduce__(self):
    """Pickles the mesh by axis names, sizes, types and device ids (devices do not pickle)."""
    mesh = self.mesh
    device_ids = (tuple(int(d.id) for d in mesh.devices.flat) if isinstance(mesh, Mesh)
                  else None)
    return (_rebuild_layout, (tuple(mesh.axis_names), tuple(mesh.axis_sizes),
                              tuple(t.name for t in mesh.axis_types), device_ids, self.dim_axes))

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
    """``fn`` mapped over this layout's mesh, whatever mesh the caller has set (``set_mesh``)."""
    mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def run(*args):
      with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
        return mapped(*args)
    return run


@contextlib.contextmanager
def no_context_mesh() -> Iterator[None]:
  """Runs jsparse's programs with no context mesh: their arrays keep the meshes they live on
  (trainer and rollout meshes may differ) whatever mesh the caller set with ``jax.set_mesh``.
  Inside the caller's ``shard_map`` (manual axes) the context is kept: there the leaves are
  local blocks."""
  if jax.sharding.get_abstract_mesh().manual_axes:
    yield
    return
  try:
    context = jax.set_mesh(None)  # clears the concrete mesh too; refused under jit
  except ValueError:
    context = jax.sharding.use_abstract_mesh(AbstractMesh((), ()))
  with context:
    yield


def mesh_neutral(fn: Callable) -> Callable:
  """``fn`` run under :func:`no_context_mesh` (a public entry point)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with no_context_mesh():
      return fn(*args, **kwargs)
  return wrapped


def _rebuild_layout(axis_names: tuple, axis_sizes: tuple, axis_types: tuple,
                    device_ids: tuple | None, dim_axes: tuple) -> Layout:
  """Inverse of ``Layout.__reduce__``: the same mesh where this process has its devices (one
  process, or the same job), else an ``AbstractMesh`` of the same shape (enough to check
  payloads and fingerprints; diffing on it needs the real devices)."""
  types = tuple(jax.sharding.AxisType[t] for t in axis_types)
  by_id = {d.id: d for d in jax.devices()}
  if device_ids is not None and all(i in by_id for i in device_ids):
    devices = np.array([by_id[i] for i in device_ids]).reshape(axis_sizes)
    return Layout(Mesh(devices, axis_names, axis_types=types), dim_axes)
  return Layout(AbstractMesh(axis_sizes, axis_names, axis_types=types), dim_axes)
