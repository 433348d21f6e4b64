"""The jitted device programs of :class:`~jsparse.Sender` and :class:`~jsparse.Receiver`.

One program per side and step, with the plan (and the receiver's block layouts) static, so each
compiles once: the sender diffs, takes the next snapshot and digests it; the receiver turns a
decoded payload into positions and bits, applies it (in place when donated) and digests.
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
  """(delta, old bits at its positions, ranks of ordered segments (if ``ranked``), the next
  snapshot, its digest). The snapshot is donated."""
  delta, old_values = diff_flat_with_old(plan, snapshot, new)
  ranks = []
  for seg, positions, old in zip(plan.segments, delta.indices, old_values):
    if ranked and seg.ordered:
      classes = ulp.exponent_class(old, seg.dtype, jnp)
      ranks.append(ordering.ranks_of(_tables(plan, seg, snapshot),
                                     jnp.minimum(positions, seg.size - 1), classes))
    else:
      ranks.append(None)
  next_snapshot = cast_flat(plan, new)
  return (delta, old_values, tuple(ranks), next_snapshot,
          bits_digest(next_snapshot, trainer_layouts(plan)))


def _apply_bits(plan: Plan, layouts: tuple, flat: list, delta: Delta):
  out = apply_flat(plan, layouts, flat, delta)
  return out, bits_digest(out, layouts)


def _apply_steps(plan: Plan, layouts: tuple, flat: list, keys: tuple, codes: tuple,
                 counts: jax.Array):
  """Applies a compact payload: ``keys`` are ranks (ordered segments) or positions, ``codes``
  step codes; slots past ``counts`` are unused."""
  indices = []
  for s, (seg, key) in enumerate(zip(plan.segments, keys)):
    used = jnp.arange(seg.capacity) < counts[s]
    if seg.ordered:
      key = ordering.positions_of(_tables(plan, seg, flat), jnp.where(used, key, 0))
    indices.append(jnp.where(used, key, seg.size))
  delta = Delta(tuple(indices), tuple(codes), counts, jnp.zeros(counts.shape, bool))
  out = apply_flat(plan, layouts, flat, delta, step_coded=True)
  return out, bits_digest(out, layouts)


apply_bits = {True: jax.jit(_apply_bits, static_argnums=(0, 1), donate_argnums=2),
              False: jax.jit(_apply_bits, static_argnums=(0, 1))}
apply_steps = {True: jax.jit(_apply_steps, static_argnums=(0, 1), donate_argnums=2),
               False: jax.jit(_apply_steps, static_argnums=(0, 1))}
digest = jax.jit(bits_digest, static_argnums=1)
