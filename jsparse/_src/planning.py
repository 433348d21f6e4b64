"""The public :func:`make_plan`: the plan's options, and the rollout's quantized view when
``quantize=`` asks for one (``quant/view.py``), handed to the core's plan builder.

The core (``core/plan.py``) knows nothing of quantization; this module sits above both.
"""

from __future__ import annotations

from typing import Any

from jsparse._src.core.plan import Plan, RolloutDtype, build_plan
from jsparse._src.pytree import PyTree


def make_plan(tree: PyTree, *, rollout_dtype: RolloutDtype = None, capacity: float | None = None,
              capacity_slots: int | None = None, pooled_capacity: float | None = None,
              pooled_capacity_slots: int | None = None, bucket_size: int = 2**16,
              quantize: Any = None) -> Plan:
  """Builds the static plan that ``diff``, ``apply``, ``Sender`` and ``Receiver`` share.

  Args:
    tree: the trainer's parameter tree: arrays or ``jax.ShapeDtypeStruct`` leaves, in any pytree
      (dicts, ``flax.nnx.State``, Linen param dicts, dataclasses).
    rollout_dtype: the dtype the rollout holds. ``None`` keeps every leaf's dtype; a dtype (e.g.
      ``jnp.bfloat16``) applies to floating leaves (integer and bool leaves keep theirs); a callable
      ``(path, ShapeDtypeStruct) -> dtype | None`` chooses per leaf.
    capacity: static slots per unpooled segment (one large leaf; for a leaf split over a mesh,
      per block), as a fraction of its elements in (0, 1] (default 0.05). An ``int`` here is
      refused: a count is ``capacity_slots``. Updates denser than this overflow and are carried
      densely. A leaf smaller than ``bucket_size`` split over a mesh is not pooled (its blocks
      live apart) but takes ``pooled_capacity`` per block, as a small leaf does.
    capacity_slots: instead of ``capacity``, the number of slots per unpooled segment (or
      block), an ``int >= 1`` (a segment never gets more slots than it has elements).
    pooled_capacity, pooled_capacity_slots: the same for segments that pool small leaves
      (default ``pooled_capacity=1.0``). Small leaves (biases, norms) change far more often than
      large matrices, and a pool is small, so the default carries every element.
    bucket_size: leaves smaller than this are pooled into shared segments of at most this size
      (and at most 32 leaves).
    quantize: leaves the rollout holds quantized (see :mod:`jsparse.quantized`): a preset such
      as ``jsparse.quantized.fp8_tiles()``, one ``Quantization`` / qwix ``HowToQuantize`` for
      every floating leaf of 2+ dimensions, or a function ``(path, ShapeDtypeStruct) -> spec |
      None``, where a spec may also be a jittable quantizer ``array -> (codes, scales)`` (given
      directly, it applies to every floating leaf of 2+ dimensions). Each such leaf becomes a
      node of codes and scales (a qwix ``QArray``; a ``PackedQArray`` for 4-bit codes; what a
      user quantizer returns) that syncs bit for bit; ``rollout_dtype`` applies to the other
      leaves.

  Returns:
    A hashable :class:`Plan`.

  Raises:
    PlanError: for an unsupported dtype, a typed PRNG key or a leaf over 2**31 - 1 elements
      (named).
    ConfigError: for a bad ``capacity``, ``pooled_capacity``, their ``_slots`` or
      ``bucket_size``, an ``int`` fraction, or both forms of one option.

  >>> import jax.numpy as jnp, jsparse
  >>> params = {'w': jnp.zeros((512, 512)), 'b': jnp.zeros(512), 'scale': jnp.ones(512)}
  >>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.02)
  >>> [(len(s.leaf_ids), s.size, s.capacity) for s in plan.segments]  # biases share a pool
  [(1, 262144, 5243), (2, 1024, 1024)]
  >>> plan = jsparse.make_plan(params, capacity_slots=1000, pooled_capacity_slots=64)
  >>> [s.capacity for s in plan.segments]
  [1000, 64]
  """
  view = None
  if quantize is not None:
    from jsparse._src.quant.view import make_view  # qwix is imported for quantized plans only
    view = make_view(tree, quantize)
  return build_plan(tree, rollout_dtype=rollout_dtype, capacity=capacity,
                    capacity_slots=capacity_slots, pooled_capacity=pooled_capacity,
                    pooled_capacity_slots=pooled_capacity_slots, bucket_size=bucket_size,
                    view=view)
