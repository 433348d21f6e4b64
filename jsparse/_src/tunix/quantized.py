"""Tunix rollouts that serve qwix-quantized weights (a model made with ``qwix.quantize_model`` and
a ``PtqProvider``): the quantization each weight has, and the rollout's own tree structure.

A qwix PTQ model holds each quantized weight as ``WithAux(array=QArray, how=HowToQuantize)``:
its state has the codes and scales at ``...['kernel']['array']['qvalue']`` and ``['scale']``, and
``how`` in the graph. :func:`ptq_rule` reads ``how`` per weight, so the plan quantizes exactly as
the rollout does; :class:`RolloutStructure` carries the plan's rollout tree (qwix ``QArray`` nodes,
4-bit codes packed) into the rollout's structure and back, leaf for leaf.

>>> import jax.numpy as jnp, jsparse
>>> plan = jsparse.make_plan({'w': jnp.zeros(4)}, rollout_dtype=jnp.bfloat16)
>>> structure = RolloutStructure.of(plan, {'w': jnp.zeros(4, jnp.bfloat16)})
>>> structure.identity
True
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import numpy as np

from jsparse._src.core.bits import is_four_bit
from jsparse._src.core.plan import Plan
from jsparse._src.errors import PlanMismatchError
from jsparse._src.pytree import PyTree


def ptq_rule(model: Any) -> Callable | None:
  """The ``quantize=`` rule that quantizes each trainer leaf as ``model`` (a qwix PTQ model)
  holds it, scales in the dtype it holds them in; None when no weight of ``model`` is quantized.

  >>> from flax import nnx
  >>> ptq_rule(nnx.Linear(2, 2, rngs=nnx.Rngs(0))) is None
  True
  """
  try:
    from qwix._src.providers.ptq import WithAux
  except ImportError:  # qwix missing: no model can hold its quantized weights
    return None
  from flax import nnx
  from jsparse._src.quant.spec import Quantization
  specs = {}
  for path, module in nnx.iter_modules(model):
    for name, value in vars(module).items():
      if isinstance(value, WithAux):
        key = "".join(f"[{k!r}]" for k in (*path, name))
        specs[key] = Quantization.of(value.how, scale_dtype=value.array.scale.dtype)
  if not specs:
    return None

  def rule(path: str, struct: jax.ShapeDtypeStruct):
    del struct
    return specs.get(path.removesuffix(".value"))
  rule.__qualname__ = "ptq_rule"
  return rule


@dataclasses.dataclass(frozen=True)
class RolloutStructure:
  """The plan's rollout tree and the rollout model's state: the same leaves in the same order,
  in two structures (4-bit codes packed two a byte in the first, not in the second)."""

  view: Any  # the plan's rollout treedef
  rollout: Any  # the rollout state's treedef
  four_bit: tuple[Any, ...]  # per leaf: the rollout's 4-bit dtype where the plan packs, else None

  @property
  def identity(self) -> bool:
    return self.view == self.rollout and not any(d is not None for d in self.four_bit)

  @classmethod
  def of(cls, plan: Plan, rollout_state: PyTree) -> "RolloutStructure":
    """Checks that ``rollout_state`` holds the plan's rollout leaves, in order.

    Raises:
      PlanMismatchError: naming the first leaf whose shape or dtype differs, or the counts.
    """
    planned = jax.tree.flatten_with_path(plan.rollout_shapes())[0]
    held, rollout = jax.tree.flatten_with_path(rollout_state)
    if len(planned) != len(held):
      raise PlanMismatchError(f"jsparse.tunix: the plan's rollout tree has {len(planned)} "
                              f"leaves, the rollout holds {len(held)}")
    four_bit = []
    for (path, want), (rpath, x) in zip(planned, held):
      shape, dtype = tuple(np.shape(x)), np.dtype(x.dtype)
      packs = (want.dtype == np.uint8 and is_four_bit(dtype)
               and shape[:-1] == want.shape[:-1] and shape[-1:] == (2 * want.shape[-1],))
      if (_named(jax.tree_util.keystr(path)) != _named(jax.tree_util.keystr(rpath))
          or not packs and (shape != want.shape or dtype != want.dtype)):
        raise PlanMismatchError(
            f"jsparse.tunix: the plan's rollout leaf {jax.tree_util.keystr(path)} "
            f"{want.dtype}{list(want.shape)} does not match the rollout's "
            f"{jax.tree_util.keystr(rpath)} {dtype}{list(shape)}")
      four_bit.append(dtype if packs else None)
    return cls(jax.tree.structure(plan.rollout_shapes()), rollout, tuple(four_bit))

  def to_view(self, rollout_state: PyTree) -> PyTree:
    """The rollout's state as the plan's rollout tree (the same arrays; 4-bit codes packed)."""
    if self.identity:
      return rollout_state
    from jsparse._src.quant.spec import pack_codes  # qwix: only with a quantized plan
    leaves = [x if d is None else pack_codes(x)
              for x, d in zip(jax.tree.leaves(rollout_state), self.four_bit)]
    return jax.tree.unflatten(self.view, leaves)

  def to_rollout(self, tree: PyTree) -> PyTree:
    """The plan's rollout tree in the rollout state's structure (4-bit codes unpacked)."""
    if self.identity:
      return tree
    from jsparse._src.quant.spec import unpack_codes
    leaves = [x if d is None else unpack_codes(x, d)
              for x, d in zip(jax.tree.leaves(tree), self.four_bit)]
    return jax.tree.unflatten(self.rollout, leaves)


def _named(path: str) -> str:
  """A leaf's path with the nodes that only box it removed (``.value`` of an nnx Variable, a
  qwix PTQ weight's ``['array']``) and fields as keys: the plan's ``['w'].value.qvalue`` and a
  PTQ model's ``['w']['array']['qvalue'].value`` both read ``['w']['qvalue']``."""
  path = re.sub(r"\['array'\]|\.value\b", "", path)
  path = re.sub(r"\.packed\b", ".qvalue", path)
  return re.sub(r"\.(\w+)", r"['\1']", path)
