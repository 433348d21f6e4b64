"""The pure core: :class:`Delta`, :func:`diff` and :func:`apply`.

``diff`` finds, per segment of the plan, the elements whose rollout bit patterns changed and
records up to ``capacity`` of them as (index, new bits) pairs; ``apply`` scatters them into the
rollout tree. Both are jitted with the plan static, so they compile once per plan, and a Delta's
shapes depend on the plan only.

>>> import jax, jax.numpy as jnp
>>> import jsparse
>>> old = {'w': jnp.zeros((4,), jnp.float32)}
>>> new = {'w': jnp.array([0.0, 1.0, 0.0, -0.0], jnp.float32)}
>>> plan = jsparse.make_plan(old, rollout_dtype=jnp.bfloat16)
>>> delta = jsparse.diff(plan, old, new)
>>> delta.counts.tolist()  # -0.0 differs from +0.0 in its bits
[2]
>>> jsparse.apply(plan, plan.cast(old), delta)['w'].tolist()
[0.0, 1.0, 0.0, -0.0]
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.blocks import apply_blocks, count_blocks, diff_blocks
from jsparse._src.core.chunks import sub_plan
from jsparse._src.core.layout import Layout, mesh_neutral
from jsparse._src.core.placement import (commit_leaves, distinct_buffers, is_traced, layouts_of,
                                         place_on_plan_layouts, replicated_on)
from jsparse._src.core.plan import LeafSpec, Plan, Segment, count_text
from jsparse._src.core.select import changed_elements
from jsparse._src.errors import ConfigError, OverflowedDeltaError, PlanMismatchError
from jsparse._src.options import typed_argument
from jsparse._src.pytree import PyTree

# ``(flat leaf or segment bits, positions, values) -> new bits at the positions``: how values
# that are not bit patterns (e.g. codes relative to the old bits) become bits. Positions out of
# range are skipped by the scatter; the decoder may return anything there.
Decoder = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


class Delta(NamedTuple):
  """Sparse difference between two versions of a tree, with shapes fixed by the plan.

  Attributes:
    indices: per segment, ``int32[capacity]`` flat positions of changed elements in ascending
      order (for a block-sharded leaf: global positions, ascending within each block's
      ``capacity // blocks`` slots); unused slots hold the segment size (out of range).
    values: per segment, the new bit patterns (unsigned ints of the rollout dtype's width); 0 in
      unused slots.
    counts: ``int32[num_segments]``, how many elements of each segment changed (may exceed its
      capacity).
    overflow: ``bool[num_segments]``, whether a segment (or one of its blocks) had more changes
      than its capacity: those segments are incomplete here and must be carried densely
      (``Sender`` does that).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(6)}, capacity_slots=2)
  >>> delta = jsparse.diff(plan, {'w': jnp.zeros(6)}, {'w': jnp.zeros(6).at[4].set(1.0)})
  >>> delta.indices[0].tolist(), delta.values[0].tolist(), delta.counts.tolist()
  ([4, 6, 6, 6, 6, 6], [1065353216, 0, 0, 0, 0, 0], [1])
  """

  indices: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  counts: jax.Array
  overflow: jax.Array

  def __repr__(self) -> str:
    """One line: changes, slots and overflowed segments. It reads ``counts`` and ``overflow``
    (a few bytes, once the diff that makes them is done); traced or deleted arrays are not read.

    >>> import jax.numpy as jnp, jsparse
    >>> plan = jsparse.make_plan({'w': jnp.zeros(100)}, capacity_slots=3, bucket_size=100)
    >>> jsparse.diff(plan, {'w': jnp.zeros(100)}, {'w': jnp.ones(100)})
    Delta(changed 100 in 1 segment of 3 slots; overflowed: segment 0)
    """
    slots = count_text(sum(int(np.prod(np.shape(i))) for i in self.indices))
    segments = f"{len(self.indices)} segment{'s' if len(self.indices) != 1 else ''}"
    try:
      counts, overflow = np.asarray(self.counts), np.asarray(self.overflow, bool)
    except Exception:  # noqa: BLE001 - traced (inside jit) or deleted arrays: shapes only
      return f"Delta({segments} of {slots} slots; not concrete)"
    flagged = np.flatnonzero(overflow).tolist()
    said = "none" if not flagged else \
        f"segment{'s' if len(flagged) > 1 else ''} {', '.join(map(str, flagged[:5]))}" + \
        (f" and {len(flagged) - 5} more" if len(flagged) > 5 else "")
    return (f"Delta(changed {count_text(int(counts.sum(dtype=np.int64)))} in {segments} of "
            f"{slots} slots; overflowed: {said})")


def _cast_bits(leaf: jax.Array, dtype: np.dtype) -> jax.Array:
  return bits_lib.to_bits(jnp.asarray(leaf).astype(dtype).reshape(-1))


def segment_bits(plan: Plan, segment: Segment, flat: list[jax.Array]) -> jax.Array:
  """The flat rollout bit patterns of one segment (leaves cast and laid end to end)."""
  parts = [_cast_bits(flat[i], plan.leaves[i].rollout_dtype) for i in segment.leaf_ids]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _diff_segment(plan: Plan, segment: Segment, base: list, new: list) -> tuple[jax.Array, ...]:
  """(positions, new values, old values, count, overflow, per-block counts or None) of one
  segment."""
  if segment.blocks > 1:
    leaf_id = segment.leaf_ids[0]
    leaf = plan.leaves[leaf_id]
    per_block = segment.capacity // segment.blocks
    positions, values, old_values, block_counts = diff_blocks(
        leaf.layout, leaf.shape, leaf.rollout_dtype, per_block, jnp.asarray(base[leaf_id]),
        jnp.asarray(new[leaf_id]))
    return (positions, values.astype(segment.bit_dtype), old_values.astype(segment.bit_dtype),
            jnp.sum(block_counts), jnp.any(block_counts > per_block), block_counts)
  if not segment.pooled:
    leaf_id = segment.leaf_ids[0]
    positions, values, old_values, count = changed_elements(
        jnp.asarray(base[leaf_id]).reshape(-1), jnp.asarray(new[leaf_id]).reshape(-1),
        plan.leaves[leaf_id].rollout_dtype, segment.capacity)
  else:  # small leaves, already cast to bits and laid end to end
    positions, values, old_values, count = changed_elements(
        segment_bits(plan, segment, base), segment_bits(plan, segment, new), segment.bit_dtype,
        segment.capacity)
  return (positions, values.astype(segment.bit_dtype), old_values.astype(segment.bit_dtype),
          count, count > segment.capacity, None)


@functools.partial(jax.jit, static_argnums=0)
def _segment_diff(single: Plan, base: list, new: list) -> tuple[jax.Array, ...]:
  """:func:`_diff_segment` of the one segment of ``single`` (a :func:`sub_plan`, which names no
  paths): inside a program, segments of one structure share one trace and one lowering."""
  return _diff_segment(single, single.segments[0], base, new)


def diff_flat_with_old(plan: Plan, base: list, new: list
                       ) -> tuple[Delta, tuple[jax.Array, ...], tuple[jax.Array | None, ...]]:
  """:func:`diff_flat`, and per segment the old bits at the delta's positions (0 where unused)
  and, for a leaf split into blocks, ``int32[blocks]`` changes per block (else None)."""
  parts = [_segment_diff(sub_plan(plan, (s,)), [base[i] for i in seg.leaf_ids],
                         [new[i] for i in seg.leaf_ids]) for s, seg in enumerate(plan.segments)]
  if not parts:
    return Delta((), (), jnp.zeros((0,), jnp.int32), jnp.zeros((0,), bool)), (), ()
  delta = Delta(tuple(p[0] for p in parts), tuple(p[1] for p in parts),
                jnp.stack([p[3] for p in parts]), jnp.stack([p[4] for p in parts]))
  return delta, tuple(p[2] for p in parts), tuple(p[5] for p in parts)


def change_counts(plan: Plan, base: list, new: list
                  ) -> tuple[jax.Array, tuple[jax.Array | None, ...]]:
  """What :func:`diff_flat_with_old` counts, without finding the changes: ``int32[segments]``
  changed elements per segment and, for a leaf split into blocks, ``int32[blocks]`` per block
  (else None). One compare-and-count pass: a small program, quick to compile."""
  counts, block_counts = [], []
  for seg in plan.segments:
    leaf_id = seg.leaf_ids[0]
    leaf = plan.leaves[leaf_id]
    if seg.blocks > 1:
      per_block = count_blocks(leaf.layout, leaf.shape, leaf.rollout_dtype,
                               jnp.asarray(base[leaf_id]), jnp.asarray(new[leaf_id]))
      counts.append(jnp.sum(per_block))
      block_counts.append(per_block)
      continue
    counts.append(sum(jnp.sum(_cast_bits(base[i], plan.leaves[i].rollout_dtype)
                              != _cast_bits(new[i], plan.leaves[i].rollout_dtype),
                              dtype=jnp.int32) for i in seg.leaf_ids))
    block_counts.append(None)
  return (jnp.stack(counts) if counts else jnp.zeros((0,), jnp.int32)), tuple(block_counts)


def diff_flat(plan: Plan, base: list, new: list) -> Delta:
  """:func:`diff` on already flattened and checked leaves (used inside larger jitted programs)."""
  return diff_flat_with_old(plan, base, new)[0]


@functools.partial(jax.jit, static_argnums=0)
def diff_program(plan: Plan, base: PyTree, new: PyTree) -> Delta:
  """The jitted program behind :func:`diff` (plan static)."""
  return diff_flat(plan, plan.flatten(base, what="base"), plan.flatten(new, what="new"))


@mesh_neutral
def diff(plan: Plan, base: PyTree, new: PyTree) -> Delta:
  """Computes the sparse, bit-exact difference from ``base`` to ``new`` in rollout dtypes.

  Args:
    plan: from :func:`make_plan`.
    base: the last synced tree, in trainer or rollout dtypes.
    new: the new tree, in trainer or rollout dtypes (cast to the rollout dtypes here).

  Returns:
    A :class:`Delta`. If ``delta.overflow`` is false everywhere,
    ``apply(plan, plan.cast(base), delta)`` equals ``plan.cast(new)`` bit for bit.

  Raises:
    PlanMismatchError: ``base`` or ``new`` differs from the plan in structure, a leaf's shape or
      dtype (the leaf is named).

  >>> import jax.numpy as jnp, jsparse
  >>> old = {'w': jnp.zeros(1000)}
  >>> plan = jsparse.make_plan(old, rollout_dtype=jnp.bfloat16, capacity_slots=10,
  ...                          bucket_size=1000)
  >>> delta = jsparse.diff(plan, old, {'w': old['w'].at[::50].set(1.0)})
  >>> delta.counts.tolist(), delta.overflow.tolist(), delta.indices[0][:3].tolist()
  ([20], [True], [0, 50, 100])
  """
  typed_argument("plan", plan, Plan, "a jsparse.Plan (from make_plan)")
  base, new = (jax.tree.unflatten(plan.treedef, place_on_plan_layouts(
      plan, plan.flatten(tree, what=what), what=what)) for tree, what in ((base, "base"),
                                                                            (new, "new")))
  return diff_program(plan, base, new)


def check_delta(plan: Plan, delta: Delta) -> None:
  """Raises :class:`PlanMismatchError` unless ``delta`` has the shapes and dtypes the plan fixes."""
  n = len(plan.segments)
  if not isinstance(delta, Delta) or len(delta.indices) != n or len(delta.values) != n:
    raise PlanMismatchError(f"delta: expected a jsparse.Delta with {n} segments, as "
                            "jsparse.diff with this plan makes")
  for s, seg in enumerate(plan.segments):
    for name, arr, dtype in (("indices", delta.indices[s], np.dtype(np.int32)),
                             ("values", delta.values[s], seg.bit_dtype)):
      if tuple(arr.shape) != (seg.capacity,) or np.dtype(arr.dtype) != dtype:
        paths = [plan.leaves[i].path for i in seg.leaf_ids][:3]
        raise PlanMismatchError(
            f"delta: segment {s} (leaves {paths}) {name} is {arr.dtype}{list(arr.shape)}, the plan "
            f"expects {dtype}[{seg.capacity}]: a delta from another plan; diff and apply with the "
            "same plan")


def _apply_leaf(leaf: LeafSpec, layout: Layout | None, base: jax.Array, idx: jax.Array,
                vals: jax.Array, decode: Decoder | None) -> jax.Array:
  """Scatters bits ``vals`` (or values ``decode`` turns into bits) at flat positions ``idx``
  (out of range: skipped) into one leaf."""
  if layout is not None:
    return apply_blocks(layout, leaf.shape, base, idx, vals, decode)
  flat = jnp.asarray(base).reshape(-1)
  if decode is not None:
    vals = decode(flat, idx, vals)
  return bits_lib.scatter_bits(flat, idx, vals).reshape(leaf.shape)


def apply_flat(plan: Plan, layouts: tuple[Layout | None, ...], base: list,
               indices: Sequence[jax.Array], values: Sequence[jax.Array], *,
               decoders: Callable[[Segment], Decoder] | None = None) -> list[jax.Array]:
  """Writes, per segment, ``values`` at flat positions ``indices`` (out of range: skipped) into
  already flattened and checked rollout leaves, each split into blocks as ``layouts`` says (then
  every device scatters into its own block only). ``values`` are new bit patterns, or, with
  ``decoders``, values that ``decoders(segment)`` turns into bits against the old ones."""
  out = list(base)
  for seg, idx, vals in zip(plan.segments, indices, values):
    decode = decoders(seg) if decoders is not None else None
    if not seg.pooled:
      leaf_id = seg.leaf_ids[0]
      out[leaf_id] = _apply_leaf(plan.leaves[leaf_id], layouts[leaf_id], base[leaf_id], idx, vals,
                                 decode)
    elif all(layouts[i] is None for i in seg.leaf_ids):  # small leaves: one scatter for the pool
      bits = segment_bits(plan, seg, base)
      if decode is not None:
        vals = decode(bits, idx, vals)
      merged = bits.at[idx].set(vals, mode="drop")
      for leaf_id, offset in zip(seg.leaf_ids, seg.offsets):
        leaf = plan.leaves[leaf_id]
        part = merged[offset:offset + leaf.size]
        out[leaf_id] = bits_lib.from_bits(part, leaf.rollout_dtype).reshape(leaf.shape)
    else:  # the rollout splits some pooled leaves into blocks: leaf by leaf, block-local
      for leaf_id, offset in zip(seg.leaf_ids, seg.offsets):
        leaf = plan.leaves[leaf_id]
        inside = (idx >= offset) & (idx < offset + leaf.size)
        out[leaf_id] = _apply_leaf(leaf, layouts[leaf_id], base[leaf_id],
                                   jnp.where(inside, idx - offset, leaf.size), vals, decode)
  return out


def _apply_tree(plan: Plan, layouts: tuple, base: PyTree, delta: Delta) -> PyTree:
  check_delta(plan, delta)
  flat = apply_flat(plan, layouts, plan.flatten(base, what="base", rollout_only=True),
                    delta.indices, delta.values)
  return jax.tree.unflatten(plan.treedef, flat)


_APPLY_PROGRAMS = {False: jax.jit(_apply_tree, static_argnums=(0, 1)),
                   True: jax.jit(_apply_tree, static_argnums=(0, 1), donate_argnums=2)}


def apply_program(donate: bool) -> Callable:
  """The jitted program behind :func:`apply`: ``(plan, layouts, base, delta) -> tree``, with
  ``plan`` and ``layouts`` (from :func:`layouts_of`) static. For compiled-memory analysis."""
  return _APPLY_PROGRAMS[bool(donate)]


@mesh_neutral
def apply(plan: Plan, base: PyTree, delta: Delta, *, donate: bool = False,
          return_exact: bool = False) -> PyTree | tuple[PyTree, jax.Array]:
  """Writes the changes of ``delta`` into ``base`` (a tree in rollout dtypes).

  Jitted with the plan static. Leaves of ``base`` that are split into blocks over a mesh
  (``NamedSharding``) are updated block by block: each device keeps the changes inside its own
  block, so no device gathers a full leaf, and each result keeps its sharding.

  A delta holds at most its capacity of changes per segment: where ``delta.overflow`` is set,
  some changes are missing (``Sender`` and ``Receiver`` carry those segments densely; the pure
  functions cannot). So ``apply`` is never silently inexact: by default it reads
  ``delta.overflow`` (``bool[segments]``, a few bytes, once the diff is done) and raises
  :class:`~jsparse.errors.OverflowedDeltaError` if any is set. With ``return_exact=True`` it
  reads nothing and returns ``(tree, exact)``, ``exact`` a device bool that is true when the
  tree is exact: the form for a caller's ``jit`` or ``shard_map``, where the flags cannot be
  read (there the default raises :class:`~jsparse.ConfigError` at trace time, asking for it).

  Args:
    plan: from :func:`make_plan`.
    base: the rollout tree the delta applies to.
    delta: from :func:`diff`.
    donate: update ``base`` in place (its buffers are dead after the call).
    return_exact: return ``(tree, exact)`` instead of checking the overflow flags.

  Returns:
    The updated tree, in rollout dtypes, with the structure of the plan; with ``return_exact``,
    ``(tree, exact)``.

  Raises:
    OverflowedDeltaError: ``delta`` overflowed (the segments, changes and slots are named, and
      the capacity that would have held them).
    PlanMismatchError: ``base`` is not in the plan's rollout dtypes and shapes, or ``delta``
      has other shapes than the plan fixes (the leaf or segment is named).

  >>> import jax, jax.numpy as jnp, jsparse
  >>> old = {'w': jnp.zeros(4)}
  >>> plan = jsparse.make_plan(old, rollout_dtype=jnp.bfloat16)
  >>> delta = jsparse.diff(plan, old, {'w': jnp.array([0.0, 2.0, 0.0, -0.0])})
  >>> jsparse.apply(plan, plan.cast(old), delta)['w'].tolist()
  [0.0, 2.0, 0.0, -0.0]

  An update denser than the plan's capacity, applied inside the caller's ``jit``:

  >>> small = jsparse.make_plan(old, pooled_capacity_slots=1)
  >>> step = jax.jit(lambda r, new: jsparse.apply(small, r, jsparse.diff(small, r, new),
  ...                                             return_exact=True))
  >>> out, exact = step(old, {'w': jnp.ones(4)})
  >>> bool(exact)  # some changes are missing from ``out``: resend the segment, or raise capacity
  False
  >>> jsparse.apply(small, old, jsparse.diff(small, old, {'w': jnp.ones(4)}))
  ... # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  jsparse.errors.OverflowedDeltaError: delta overflowed in segment 0 (leaves ["['w']"]): 4 changes
  for 1 slot, ... (pooled_capacity=1.0 or pooled_capacity_slots=4 would have held this one)...
  """
  typed_argument("plan", plan, Plan, "a jsparse.Plan (from make_plan)")
  flat = plan.flatten(base, what="base", rollout_only=True)
  if not return_exact:
    check_delta(plan, delta)
    _check_overflow(plan, delta)
  if any(is_traced(x) for x in [*flat, *jax.tree.leaves(delta)]):  # inside the caller's jit
    out = _apply_tree(plan, layouts_of(plan, flat), base, delta)
  else:
    flat = commit_leaves(distinct_buffers(flat) if donate else flat)
    layouts = layouts_of(plan, flat)
    moved = colocate(plan, delta, flat)
    out = apply_program(donate)(plan, layouts, jax.tree.unflatten(plan.treedef, flat), moved)
  return (out, ~jnp.any(jnp.asarray(delta.overflow))) if return_exact else out


def capacity_that_fits(plan: Plan, s: int, changes: int) -> str:
  """The ``make_plan`` options that would give segment ``s`` room for ``changes`` changes.

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros(100_000)})
  >>> capacity_that_fits(plan, 0, 6_000)
  'capacity=0.06 or capacity_slots=6000'
  """
  seg = plan.segments[s]
  option = "capacity" if not seg.pooled and seg.size >= plan.bucket_size else "pooled_capacity"
  fraction = min(1.0, math.ceil(1000 * changes / seg.size) / 1000)
  return f"{option}={fraction!r} or {option}_slots={changes}"


def _check_overflow(plan: Plan, delta: Delta) -> None:
  """Raises unless every overflow flag of ``delta`` is known to be false (see :func:`apply`)."""
  if is_traced(delta.overflow) or is_traced(delta.counts):
    raise ConfigError(
        "jsparse.apply inside jit (or shard_map) cannot read delta.overflow to refuse an "
        "overflowed delta: pass return_exact=True and check the returned exact flag (the tree "
        "is exact when it is true)")
  overflow, counts = jax.device_get((delta.overflow, delta.counts))
  flagged = np.flatnonzero(np.asarray(overflow, bool)).tolist()
  if not flagged:
    return
  counts = np.asarray(counts, np.int64)
  s = flagged[0]
  seg = plan.segments[s]
  slots = f"{seg.capacity:,} slot{'s' if seg.capacity != 1 else ''}" if seg.blocks == 1 else \
      f"{seg.blocks} blocks of {seg.capacity // seg.blocks:,} slots"
  others = f" and {len(flagged) - 1} more segment(s)" if len(flagged) > 1 else ""
  needed = int(counts[s])
  raise OverflowedDeltaError(
      f"delta overflowed in {plan.describe_segment(s)}{others}: {needed:,} changes for "
      f"{slots}, so apply would miss some. Sender and Receiver carry such segments densely by "
      f"themselves; with the pure functions, make the plan with room for them "
      f"({capacity_that_fits(plan, s, needed)} would have held this one), or pass "
      "return_exact=True to get (params, exact) and check exact")


def colocate(plan: Plan, delta: Delta, flat: list) -> Delta:
  """Moves the (small) delta next to the leaves it updates, replicated on their devices: the
  trainer's mesh may differ from the rollout's."""
  if not isinstance(delta, Delta) or len(delta.indices) != len(plan.segments):
    return delta  # check_delta reports it
  def move(x: Any, leaf_id: int) -> Any:
    target = replicated_on(flat[leaf_id])
    return x if target is None else jax.device_put(x, target)

  first = plan.segments[0].leaf_ids[0] if plan.segments else None
  return Delta(
      tuple(move(i, seg.leaf_ids[0]) for seg, i in zip(plan.segments, delta.indices)),
      tuple(move(v, seg.leaf_ids[0]) for seg, v in zip(plan.segments, delta.values)),
      delta.counts if first is None else move(delta.counts, first),
      delta.overflow if first is None else move(delta.overflow, first))
