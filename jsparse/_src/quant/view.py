"""The rollout's view of the trainer's tree: :class:`RolloutView`, which quantizes the leaves the
rollout holds quantized (codes and scales, as qwix makes them) and passes the others through.

A plan made with ``make_plan(params, quantize=...)`` is made on this view: each quantized leaf
becomes a node (a qwix ``QArray``, a :class:`~jsparse._src.quant.spec.PackedQArray` for 4-bit
types, or whatever a user quantizer returns) whose leaves are ordinary arrays (codes, scales).
Everything downstream (diff, codings, shards, parts, streams, checkpoints) syncs those arrays
bit for bit; the plan applies the view to a trainer tree wherever it takes one.

>>> import jax.numpy as jnp
>>> from jsparse._src.quant.spec import Quantization
>>> view = make_view({'w': jnp.ones((4, 8)), 'b': jnp.ones(8)},
...                  lambda path, struct: Quantization("int8") if struct.ndim == 2 else None)
>>> out = view({'w': jnp.ones((4, 8)), 'b': jnp.ones(8)})
>>> type(out['w']).__name__, out['w'].qvalue.dtype.name, out['b'].dtype.name
('QArray', 'int8', 'float32')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from typing import Any, Callable, Iterator

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from qwix._src.core.qarray import HowToQuantize as QArrayHow

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.layout import Layout, no_context_mesh
from jsparse._src.core.placement import place_on_plan_layouts
from jsparse._src.core.plan import LeafSpec, Plan
from jsparse._src.errors import ConfigError
from jsparse._src.pytree import PyTree
from jsparse._src.quant.spec import Quantization

# What `quantize=` accepts: one spec for every floating leaf of 2+ dimensions, or a function
# (path, ShapeDtypeStruct) -> spec | None; a spec is a Quantization, a qwix HowToQuantize or a
# jittable function array -> pytree of arrays (a user quantizer).
QuantizeOption = Any


@dataclasses.dataclass(frozen=True)
class RolloutView:
  """Static description of the rollout's view: the trainer tree's structure and, per leaf, how
  the rollout holds it (None: as the plan's rollout dtype says; a :class:`Quantization`; a user
  quantizer function). Hashable; a static argument of the jitted view program.

  Attributes:
    treedef: the trainer tree's structure.
    leaves: one :class:`~jsparse.LeafSpec` per trainer leaf (its rollout dtype is its dtype).
    specs: per trainer leaf, its quantization or None.
  """

  treedef: Any
  leaves: tuple[LeafSpec, ...]
  specs: tuple[Quantization | Callable | None, ...]

  def matches(self, tree: PyTree) -> bool:
    """Whether ``tree`` has the trainer tree's structure (the view applies to it)."""
    return jax.tree.structure(tree) == self.treedef

  def of_trainer_tree(self, tree: PyTree, *, what: str) -> PyTree:
    """The rollout's view of a trainer tree, checked against the trainer's leaves (errors name
    the tree ``what``) and placed on their layouts first (see ``Plan.flatten``)."""
    source = Plan(self.treedef, self.leaves, (), 1)
    flat = place_on_plan_layouts(source, source.flatten(tree, what=what), what=what)
    return jax.tree.unflatten(self.treedef, self.flat(flat))

  def __call__(self, tree: PyTree) -> PyTree:
    """The rollout's view of ``tree`` (a trainer tree of the view's structure)."""
    flat = self.treedef.flatten_up_to(tree)
    return jax.tree.unflatten(self.treedef, self.flat(flat))

  def flat(self, flat: list) -> list:
    """The view's nodes for trainer leaves ``flat``: quantized leaves run in one jitted program,
    the others are passed as they are (no copy)."""
    picked = tuple(i for i, spec in enumerate(self.specs) if spec is not None)
    if not picked:
      return list(flat)
    with no_context_mesh():
      nodes = _view_program(self, picked)([flat[i] for i in picked])
    out = list(flat)
    for i, node in zip(picked, nodes):
      out[i] = node
    return out

  def description(self) -> list:
    """What the plan's fingerprint hashes: per leaf, its quantization (a user quantizer by what
    it computes on the leaf: see :func:`program_digest`)."""
    return [spec if spec is None or isinstance(spec, Quantization) else
            f"quantizer#{program_digest(spec, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))}"
            for spec, leaf in zip(self.specs, self.leaves)]

  @functools.cached_property
  def _nodes(self) -> list:
    return [_shape_of(spec, leaf) for spec, leaf in zip(self.specs, self.leaves)]

  def quantized_paths(self) -> frozenset[str]:
    """Paths (``keystr``) of the view's leaves that a quantizer makes: codes and scales are held
    exactly as made (the plan's rollout dtype does not apply to them)."""
    nodes = [n if spec is not None else 0 for spec, n in zip(self.specs, self._nodes)]
    flat = jax.tree.flatten_with_path(jax.tree.unflatten(self.treedef, nodes))[0]
    return frozenset(jax.tree_util.keystr(path) for path, x in flat
                     if isinstance(x, jax.ShapeDtypeStruct))

  def shapes(self) -> PyTree:
    """The view's tree of ``jax.ShapeDtypeStruct``, each with the sharding the view program
    gives it (what the plan is made from)."""
    return jax.tree.unflatten(self.treedef, self._nodes)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # in the repr of a function a primitive holds


def program_digest(fn: Callable, struct: jax.ShapeDtypeStruct) -> str:
  """A hash of what ``fn`` computes on arrays of ``struct``'s shape and dtype: its traced
  program (``jax.make_jaxpr``), with the bytes of every constant it holds (closed-over arrays,
  literal values, in nested programs too). Equal in every process for equal code and constants,
  whatever the function's name; a function a primitive holds (e.g. a host callback) enters by
  its name only.

  >>> import jax, jax.numpy as jnp
  >>> struct = jax.ShapeDtypeStruct((4,), jnp.float32)
  >>> scaled = lambda bound: (lambda x: (x / bound).astype(jnp.int8))
  >>> program_digest(scaled(127), struct) == program_digest(scaled(127), struct)
  True
  >>> program_digest(scaled(127), struct) == program_digest(scaled(7), struct)
  False
  """
  closed = jax.make_jaxpr(fn)(struct)
  digest = hashlib.blake2b(_ADDRESS.sub("", str(closed)).encode(), digest_size=8)
  for value in _constants(closed):
    array = np.asarray(value)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()


def _constants(program: Any) -> Iterator[Any]:
  """The constants of a traced program and of the programs nested in its equations' params."""
  yield from getattr(program, "consts", ())
  body = getattr(program, "jaxpr", program)  # JAX before 0.12: a ClosedJaxpr around a Jaxpr
  yield from (v.val for v in body.outvars if isinstance(v, jax_core.Literal))
  for eqn in body.eqns:
    yield from (v.val for v in eqn.invars if isinstance(v, jax_core.Literal))
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if isinstance(sub, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
          yield from _constants(sub)


def _shape_of(spec: Any, leaf: LeafSpec) -> Any:
  struct = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
  if spec is None:
    sharding = (NamedSharding(leaf.layout.mesh, leaf.layout.spec) if leaf.layout else None)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  if not isinstance(spec, Quantization):  # a user quantizer runs on the whole leaf
    return jax.eval_shape(spec, struct)
  shapes = jax.eval_shape(spec.quantize, struct)
  if leaf.layout is None:
    return shapes
  scale_spec = spec.scale_spec(leaf.layout)
  specs = spec._node(leaf.layout.spec, scale_spec, scale_spec)
  return jax.tree.map(
      lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                        sharding=NamedSharding(leaf.layout.mesh, p)),
      shapes, specs)


@functools.lru_cache(maxsize=64)
def _view_program(view: RolloutView, picked: tuple[int, ...]) -> Callable:
  def run(flat: list) -> list:
    return [_quantize_leaf(view.specs[i], view.leaves[i], x) for i, x in zip(picked, flat)]
  return jax.jit(run)


def _quantize_leaf(spec: Any, leaf: LeafSpec, x: jax.Array) -> Any:
  if not isinstance(spec, Quantization):
    return spec(x)
  if leaf.layout is not None:
    return spec.quantize_blocks(x, leaf.layout)
  return spec.quantize(x)


def make_view(tree: PyTree, quantize: QuantizeOption) -> RolloutView | None:
  """The rollout view of ``tree`` under ``quantize`` (see ``make_plan``); None when it
  quantizes no leaf.

  Raises:
    ConfigError: naming the leaf, for a spec that does not fit it (see
      :meth:`Quantization.for_leaf`), a user quantizer that does not trace under ``jax.jit``,
      returns a 4-bit or other unsupported dtype, or gives other bits on a second run.
  """
  flat_with_path, treedef = jax.tree.flatten_with_path(tree)
  leaves, specs, checked = [], [], set()
  for path, value in flat_with_path:
    name = jax.tree_util.keystr(path)
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(
        getattr(value, "dtype", None) or np.asarray(value).dtype))  # as JAX holds it
    leaf = LeafSpec(name, tuple(np.shape(value)), dtype, dtype,
                    Layout.of(getattr(value, "sharding", None), tuple(np.shape(value))))
    spec = _spec_for(quantize, leaf)
    if spec is not None and not isinstance(spec, Quantization):
      # Once per quantizer and leaf shape (its traces depend on nothing else): each check
      # compiles it twice.
      key = (spec, leaf.shape, leaf.dtype)
      try:
        seen = key in checked
      except TypeError:  # an unhashable quantizer: checked on every leaf
        seen, key = False, None
      if not seen:
        _check_user_quantizer(spec, leaf, value)
        if key is not None:
          checked.add(key)
    leaves.append(leaf)
    specs.append(spec)
  if all(spec is None for spec in specs):
    return None
  return RolloutView(treedef, tuple(leaves), tuple(specs))


def _spec_for(quantize: QuantizeOption, leaf: LeafSpec) -> Quantization | Callable | None:
  struct = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
  if callable(quantize) and _takes_two(quantize):
    spec = quantize(leaf.path, struct)
  elif len(leaf.shape) >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating):
    spec = quantize  # one spec for every floating matrix
  else:
    spec = None
  if spec is None:
    return None
  if _is_how(spec) or isinstance(spec, Quantization):
    try:
      return Quantization.of(spec).for_leaf(leaf.path, leaf.shape, leaf.dtype, leaf.layout)
    except ConfigError as e:
      if str(e).startswith("leaf "):
        raise
      raise ConfigError(f"leaf {leaf.path}: {e}") from None
  if callable(spec):
    return spec
  raise ConfigError(f"leaf {leaf.path}: quantize gave {spec!r}; expected a "
                    "jsparse.quantized.Quantization, a qwix HowToQuantize, a jittable function "
                    "array -> (codes, scales) pytree, or None")


def _is_how(x: Any) -> bool:
  return isinstance(x, QArrayHow)


def _takes_two(fn: Callable) -> bool:
  """Whether ``fn`` is a rule (path, struct) -> spec rather than a quantizer array -> codes."""
  import inspect
  try:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
  except (TypeError, ValueError):
    return False
  return len(params) == 2


def _check_user_quantizer(fn: Callable, leaf: LeafSpec, value: Any) -> None:
  struct = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
  try:
    shapes = jax.eval_shape(fn, struct)
  except Exception as e:  # noqa: BLE001 -- any tracing failure is the user's quantizer's
    raise ConfigError(f"leaf {leaf.path}: the quantizer {fn!r} does not trace under jax.jit "
                      f"({type(e).__name__}: {e})") from e
  for s in jax.tree.leaves(shapes):
    if not bits_lib.is_supported_dtype(s.dtype):
      raise ConfigError(f"leaf {leaf.path}: the quantizer returns {s.dtype}; jsparse syncs "
                        "arrays of 1-8 byte dtypes (pack 4-bit codes two to a byte)")
  concrete = isinstance(value, np.ndarray) or (
      isinstance(value, jax.Array) and value.is_fully_addressable)
  probe = value if concrete else \
      np.random.default_rng(0).standard_normal(leaf.shape).astype(leaf.dtype)
  first, second = (jax.jit(lambda x: fn(x))(probe) for _ in range(2))  # noqa: PLW0108 -- retraced
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    if not np.array_equal(np.asarray(bits_lib.to_bits(a)), np.asarray(bits_lib.to_bits(b))):
      raise ConfigError(f"leaf {leaf.path}: the quantizer {fn!r} gave other bits on a second "
                        "run of the same input; the rollout could not reproduce its codes")
