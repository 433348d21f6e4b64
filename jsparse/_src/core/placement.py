"""Where leaves live: placing them so that one jitted program can take them all, moving no
more data than needed, and owning buffers before donating them.

>>> import jax.numpy as jnp, numpy as np
>>> [x.committed for x in commit_leaves([np.zeros(3), jnp.ones(2)])]
[True, True]
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jsparse._src.core.layout import Layout
from jsparse._src.core.plan import LeafSpec, Plan
from jsparse._src.errors import PlanMismatchError


def is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _splits_nothing(sharding: Any) -> bool:
  """A NamedSharding whose spec names only mesh axes of size 1: every device holds the whole
  array, though an Explicit mesh types it as sharded (and then refuses e.g. a cumsum)."""
  if not isinstance(sharding, NamedSharding):
    return False
  axes = [a for entry in sharding.spec if entry is not None
          for a in ((entry,) if isinstance(entry, str) else entry)]
  return bool(axes) and all(sharding.mesh.shape[a] == 1 for a in axes)


def commit_leaves(flat: list) -> list:
  """Places every leaf where one jitted program can take them all, moving no data.

  Committed arrays stay where they are; a leaf whose sharding splits nothing (only size-1 mesh
  axes) is relabelled replicated on its mesh; uncommitted leaves (numpy, plain ``jnp``) go
  replicated onto the mesh the other leaves live on, else to the default device. Traced leaves
  (inside the caller's ``jit``) are left alone. jit caches by committedness too: committing up
  front keeps later calls, whose inputs are jit outputs (committed), on the first compilation.
  """
  meshes = [x.sharding.mesh for x in flat if isinstance(x, jax.Array) and not is_traced(x)
            and isinstance(x.sharding, NamedSharding) and getattr(x, "committed", True)]
  default = (NamedSharding(meshes[0], PartitionSpec()) if meshes
             else jax.sharding.make_single_device_sharding(jax.local_devices()[0]))
  out, moves = list(flat), {}  # leaf -> sharding, placed in one batched device_put
  for i, x in enumerate(flat):
    if is_traced(x):
      continue
    if not isinstance(x, jax.Array) or not getattr(x, "committed", True):
      moves[i] = default
    elif _splits_nothing(x.sharding):
      moves[i] = NamedSharding(x.sharding.mesh, PartitionSpec())
    # else committed already: stays as it is (no call)
  if moves:
    placed = jax.device_put([flat[i] for i in moves], list(moves.values()))
    for i, x in zip(moves, placed):
      out[i] = x
  return out


def _layout_of(x: Any, leaf: LeafSpec) -> Layout | None:
  sharding = x.sharding if isinstance(x, jax.Array) else None
  return Layout.of(sharding, leaf.shape)


def _describe(layout: Layout | None) -> str:
  return "not split into blocks" if layout is None else \
      f"split as {layout.spec} over mesh {dict(layout.mesh.shape)}"


def place_on_plan_layouts(plan: Plan, flat: list, *, what: str) -> list:
  """``flat`` with every concrete trainer leaf laid out as the plan says. A jitted train step
  may return a leaf laid out otherwise than the plan recorded (XLA split a bias, or gathered a
  matrix); host numpy leaves have no layout. Moving them costs one reshard (what the jitted diff
  would otherwise do implicitly, or refuse on an Explicit mesh).

  Raises:
    PlanMismatchError: naming the leaf, when the plan's mesh is abstract (an unpickled plan in
      a process without the trainer's devices) and the leaf is laid out otherwise.
  """
  out = []
  for x, leaf in zip(flat, plan.leaves):
    actual = None if is_traced(x) or not isinstance(x, jax.Array) else _layout_of(x, leaf)
    if is_traced(x) or actual == leaf.layout:
      out.append(x)
      continue
    if leaf.layout is None:  # split, the plan holds it whole: whole on the same mesh
      target = NamedSharding(x.sharding.mesh, PartitionSpec())
    elif isinstance(leaf.layout.mesh, jax.sharding.Mesh):
      target = NamedSharding(leaf.layout.mesh, leaf.layout.spec)
    else:
      raise PlanMismatchError(
          f"{what}: leaf {leaf.path} is {_describe(actual)}, the plan's is "
          f"{_describe(leaf.layout)} on an abstract mesh (this process lacks the trainer's "
          "devices): diff where the trainer's arrays live")
    out.append(jax.device_put(x, target))
  return out


def _same_placement(x: jax.Array, like: jax.Array) -> bool:
  return x.sharding == like.sharding or x.sharding.is_equivalent_to(like.sharding, x.ndim)


def _same_mesh(x: jax.Array, like: jax.Array) -> bool:
  """Whether ``x`` lies on the mesh of ``like`` (any layout): one program can take both."""
  return (isinstance(x.sharding, NamedSharding) and isinstance(like.sharding, NamedSharding)
          and x.sharding.mesh == like.sharding.mesh)


# (plan fingerprint, leaf path) of every leaf warned about in this process: a leaf is laid out
# otherwise for every sender of its plan (e.g. the senders a checkpoint chain makes at each base),
# and the warning says so once.
_WARNED: set[tuple[bytes, str]] = set()


def placed_for_diff(plan: Plan, flat: list, snapshot: list, warned: set[str]) -> list:
  """A sender's trainer leaves, ready to be diffed against its ``snapshot`` (which lies on the
  plan's layouts).

  A jitted train step lays its outputs out as XLA chooses: it may split a bias or a norm scale
  that the plan (made from the params before the step) holds whole. Such a leaf stays as it
  is: the plan's segments, units and wire format do not depend on how a leaf they hold whole
  is laid out, and the diff program casts it and gathers it where the snapshot lies, inside the
  program, as it gathers the pooled leaves (no warning, no reshard of its own). A leaf that
  the plan splits into blocks must come in those blocks, and every leaf must lie on the
  snapshot's mesh: one laid out otherwise is resharded for every diff (the plan or the trainer
  should change), with a warning the first time for each leaf in this process, whatever the
  number of senders (its path is also added to ``warned``).

  >>> import jax, jax.numpy as jnp, jsparse
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
  >>> params = {'b': jax.device_put(jnp.zeros(64), NamedSharding(mesh, P()))}
  >>> plan = jsparse.make_plan(params)
  >>> split = jax.device_put(jnp.ones(64), NamedSharding(mesh, P("fsdp")))  # as a step returns it
  >>> warned = set()
  >>> placed_for_diff(plan, [split], [params['b']], warned)[0] is split, warned
  (True, set())
  """
  out = []
  for x, old, leaf in zip(flat, snapshot, plan.leaves):
    if _same_placement(x, old) or (leaf.layout is None and _same_mesh(x, old)):
      out.append(x)
      continue
    if leaf.path not in warned and (plan.fingerprint, leaf.path) not in _WARNED:
      _WARNED.add((plan.fingerprint, leaf.path))
      warned.add(leaf.path)
      where = (f"{_describe(_layout_of(x, leaf))}, the plan's leaf {_describe(leaf.layout)}"
               if _same_mesh(x, old) else f"on {x.sharding}, the plan's on {old.sharding}")
      logging.getLogger("jsparse").warning(
          "jsparse: params leaf %s is laid out otherwise than the plan (%s): resharded for "
          "every diff; make the plan from the params as the train step returns them (e.g. "
          "after one step), or have the step return them laid out as planned", leaf.path,
          where)
    out.append(jax.device_put(x, old.sharding))
  return out


def diff_targets(flat: list, snapshot: list) -> list:
  """Per leaf, the snapshot's sharding where the leaf is laid out otherwise (on the same mesh,
  see :func:`placed_for_diff`), else None: where the diff program gathers the leaf."""
  return [None if _same_placement(x, old) or not _same_mesh(x, old) else old.sharding
          for x, old in zip(flat, snapshot)]


def owned_leaves(flat: list) -> list:
  """Copies of ``flat``'s leaves that nobody else holds (same shardings), for a caller that
  will donate them: the caller's arrays, tied weights (one array at two leaves) and arrays
  shared with a sender in the same process stay alive. Copied by the runtime, buffer by
  buffer: nothing to compile, whatever the number of leaves (a jitted copy of 10,000 leaves
  compiled for seconds)."""
  flat = list(flat)
  return jax.device_put(flat, [x.sharding for x in flat], may_alias=False)


def distinct_buffers(flat: list) -> list:
  """``flat`` with every leaf that repeats an earlier one (tied weights) copied, so that a
  donating program does not donate one buffer twice."""
  seen: set[int] = set()
  out = []
  for x in flat:
    out.append(jnp.copy(x) if id(x) in seen else x)
    seen.add(id(x))
  return out


def layouts_of(plan: Plan, flat: list) -> tuple[Layout | None, ...]:
  """The block layout of each concrete leaf of ``flat`` (None for traced or unsplit leaves)."""
  return tuple(Layout.of(getattr(x, "sharding", None) if isinstance(x, jax.Array)
                         and not isinstance(x, jax.core.Tracer) else None, leaf.shape)
               for x, leaf in zip(flat, plan.leaves))


def replicated_on(x: Any) -> Any:
  """A replicated sharding on the devices that hold ``x`` (None if ``x`` is not an array)."""
  sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return sharding
