"""The jitted device programs of :class:`~jsparse.Sender` and :class:`~jsparse.Receiver`.

The plan (and the receiver's block layouts) are static: the sender's diff step and the digest
compile once per plan; the per-change programs (ranks, positions, the receiver's apply) take
slots sized to the step's changes and compile at most 4 variants (:func:`slots_needed`). The
sender diffs, takes the next snapshot and digests it; the receiver turns a decoded payload into
positions and bits, applies it (in place when donated) and digests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jsparse._src import ordering, ulp
from jsparse._src.delta import Delta, apply_flat, diff_flat_with_old, segment_bits
from jsparse._src.digest import bits_digest
from jsparse._src.plan import Plan, Segment


def cast_flat(plan: Plan, flat: list) -> list[jax.Array]:
  return [jnp.asarray(x).astype(leaf.rollout_dtype) for x, leaf in zip(flat, plan.leaves)]


def trainer_layouts(plan: Plan) -> tuple:
  return tuple(leaf.layout for leaf in plan.leaves)


@functools.partial(jax.jit, static_argnums=0)
def snapshot_and_digest(plan: Plan, flat: list) -> tuple[list[jax.Array], jax.Array]:
  snapshot = cast_flat(plan, flat)
  return snapshot, bits_digest(snapshot, trainer_layouts(plan))


def _tables(plan: Plan, seg: Segment, flat: list) -> ordering.ClassTables:
  return ordering.class_tables(segment_bits(plan, seg, flat), seg.dtype)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def sender_step(plan: Plan, ranked: bool, snapshot: list, new: list):
  """(delta, old bits at its positions, class tables of the ordered segments (if ``ranked``;
  for :func:`ranks`), the next snapshot, its digest). The snapshot is donated."""
  delta, old_values = diff_flat_with_old(plan, snapshot, new)
  tables = tuple(_tables(plan, seg, snapshot) if ranked and seg.ordered else None
                 for seg in plan.segments)
  next_snapshot = cast_flat(plan, new)
  return (delta, old_values, tables, next_snapshot,
          bits_digest(next_snapshot, trainer_layouts(plan)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def ranks(plan: Plan, slots: tuple[int, ...], tables: tuple, positions: tuple,
          old_values: tuple) -> tuple:
  """Ranks of the first ``slots[s]`` changes of each ordered segment (None for the others)."""
  out = []
  for seg, n, table, pos, old in zip(plan.segments, slots, tables, positions, old_values):
    if table is None:
      out.append(None)
      continue
    classes = ulp.exponent_class(old[:n], seg.dtype, jnp)
    out.append(ordering.ranks_of(table, jnp.minimum(pos[:n], seg.size - 1), classes))
  return tuple(out)


def _apply_bits(plan: Plan, layouts: tuple, flat: list, delta: Delta):
  out = apply_flat(plan, layouts, flat, delta)
  return out, bits_digest(out, layouts)


def _positions(plan: Plan, ranked: tuple[bool, ...], flat: list, keys: tuple,
               counts: jax.Array) -> tuple:
  """The positions of a compact payload's changes: ``keys`` are ranks (where ``ranked``) or
  positions; slots past ``counts`` get the segment size (skipped)."""
  indices = []
  for s, (seg, key) in enumerate(zip(plan.segments, keys)):
    used = jnp.arange(key.shape[0]) < counts[s]
    if ranked[s]:
      key = ordering.positions_of(_tables(plan, seg, flat), jnp.where(used, key, 0))
    indices.append(jnp.where(used, key, seg.size))
  return tuple(indices)


def _apply_steps(plan: Plan, layouts: tuple, flat: list, indices: tuple, codes: tuple,
                 counts: jax.Array):
  """Applies step codes at positions (from :func:`positions`)."""
  delta = Delta(indices, tuple(codes), counts, jnp.zeros(counts.shape, bool))
  out = apply_flat(plan, layouts, flat, delta, step_coded=True)
  return out, bits_digest(out, layouts)


def slots_needed(plan: Plan, counts) -> tuple[int, ...]:
  """Per segment, how many slots a payload with ``counts`` changes is padded to: the capacity
  halved up to 3 times while every segment still fits. Compiled shapes stay few (4 variants),
  and the per-change work of a sparse step follows its density rather than the capacity."""
  for halvings in (3, 2, 1):
    slots = tuple(-(-seg.capacity // 2**halvings) for seg in plan.segments)
    if all(int(c) <= n for c, n in zip(counts, slots)):
      return slots
  return tuple(seg.capacity for seg in plan.segments)


# Positions and the apply are two programs: fused into one, XLA:CPU ran them 2x slower.
positions = jax.jit(_positions, static_argnums=(0, 1))
apply_bits = {True: jax.jit(_apply_bits, static_argnums=(0, 1), donate_argnums=2),
              False: jax.jit(_apply_bits, static_argnums=(0, 1))}
apply_steps = {True: jax.jit(_apply_steps, static_argnums=(0, 1), donate_argnums=2),
               False: jax.jit(_apply_steps, static_argnums=(0, 1))}
digest = jax.jit(bits_digest, static_argnums=1)
