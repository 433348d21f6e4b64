"""The static description of what is synchronized: :class:`Plan` and :func:`build_plan`.

A plan is built once from the trainer's parameter tree (arrays or ``jax.ShapeDtypeStruct``) and
fixes everything the jitted functions need to know statically: the leaves (paths, shapes, the
trainer dtype and the rollout dtype each is cast to), how leaves are grouped into *segments*, and
each segment's static capacity. A :class:`~jsparse.Delta` has shapes that depend on the plan only,
so ``diff`` and ``apply`` compile once per plan.

Segments: a leaf of at least ``bucket_size`` elements is a segment of its own; smaller leaves are
pooled into shared segments of at most ``bucket_size`` elements and :data:`MAX_POOL_LEAVES`
leaves, one rollout dtype each: leaves of one shape first fill pools of their own (the norms of
every layer), the rest share pools in tree order. A model with hundreds of small biases and
norms costs a few segments, not hundreds, and its pools repeat.
A leaf that the trainer shards into blocks (a ``NamedSharding``) is a segment of its own with a
capacity per block, and is diffed block by block on the devices that hold it.

>>> import jax.numpy as jnp
>>> params = {'w': jnp.zeros((256, 512)), 'b': jnp.zeros((512,))}
>>> plan = build_plan(params, rollout_dtype=jnp.bfloat16, capacity=0.05)
>>> [(s.size, s.capacity, len(s.leaf_ids)) for s in plan.segments]
[(131072, 6554, 1), (512, 512, 1)]
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.layout import Layout, mesh_neutral
from jsparse._src.errors import ConfigError, PlanError, PlanMismatchError
from jsparse._src.options import int_option
from jsparse._src.pytree import PyTree
RolloutDtype = Any  # None | dtype | Callable[[str, jax.ShapeDtypeStruct], dtype | None]

MAX_SEGMENT_ELEMENTS = 2**31 - 1  # indices are int32 (jax without x64)
# Leaves per pool: a pool's programs take and return each of its leaves, and compile in time
# that grows with their number; pools of one composition share compilations (``chunks.py``).
MAX_POOL_LEAVES = 32


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One leaf of the synchronized tree.

  Attributes:
    path: ``jax.tree_util.keystr`` of the leaf's path, used in every error message.
    shape: the leaf's shape.
    dtype: the trainer-side dtype (e.g. float32 masters).
    rollout_dtype: the dtype the rollout holds (e.g. bfloat16); diff casts to it.
    layout: how the trainer splits the leaf into blocks over its mesh (None: not split); diff
      works block by block on it.

  >>> import jax.numpy as jnp, jsparse
  >>> leaf = jsparse.make_plan({'w': jnp.zeros((2, 3))}, rollout_dtype=jnp.bfloat16).leaves[0]
  >>> leaf.path, leaf.size, leaf.dtype.name, leaf.rollout_dtype.name
  ("['w']", 6, 'float32', 'bfloat16')
  """

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  rollout_dtype: np.dtype
  layout: Layout | None = None

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Segment:
  """A flat run of leaves that is diffed and carried as one unit.

  Attributes:
    leaf_ids: indices into ``Plan.leaves`` of the leaves laid end to end in this segment.
    offsets: start of each leaf inside the segment's flat index space.
    size: number of elements in the segment.
    capacity: static number of (index, value) slots a Delta holds for this segment.
    dtype: the rollout dtype of every leaf in the segment.
    blocks: how many trainer blocks the (single, sharded) leaf has; each block has
      ``capacity // blocks`` slots.
    ordered: whether its changes can be named by rank in an order of the whole segment (float
      leaves the trainer does not split into blocks: the rollout resolves ranks whatever its
      layout); otherwise they are named by position.

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'a': jnp.zeros(3), 'b': jnp.zeros(5, jnp.int32)})
  >>> [(s.leaf_ids, s.offsets, s.size, s.ordered) for s in plan.segments]
  [((0,), (0,), 3, True), ((1,), (0,), 5, False)]
  """

  leaf_ids: tuple[int, ...]
  offsets: tuple[int, ...]
  size: int
  capacity: int
  dtype: np.dtype
  blocks: int = 1
  ordered: bool = False

  @property
  def sparse_limit(self) -> int:
    """The most changes a sparse record of this segment may carry: its size (a sender widens
    its slots past the capacity when the changes outgrow it)."""
    return self.size

  @property
  def pooled(self) -> bool:
    return len(self.leaf_ids) > 1

  @property
  def bit_dtype(self) -> np.dtype:
    """Unsigned dtype of the rollout bit patterns of the segment's leaves."""
    return bits_lib.bit_dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static, hashable description of a synchronized tree. Build it with :func:`make_plan`.

  ``diff``, ``apply``, ``Sender``, ``Receiver`` and ``DeltaCheckpointManager`` take the plan
  as a static argument: everything with a shape is fixed by it, so each jitted program compiles
  once per plan. Trainer and rollout must build the same plan (same tree, same options); every
  payload carries its :attr:`fingerprint`, and a receiver with another plan refuses it.

  Attributes:
    treedef: the tree structure of the synchronized params.
    leaves: one :class:`LeafSpec` per leaf, in ``jax.tree.flatten`` order.
    segments: the :class:`Segment` s the leaves are grouped into (zero-size leaves belong to
      none).
    bucket_size: leaves smaller than this are pooled into shared segments.
    fingerprint: 16 bytes identifying the plan's layout (payloads and checkpoints carry it).
    num_elements: elements in the whole tree.
    rollout_bytes: bytes of the tree in rollout dtypes (what a dense sync sends).

  >>> import jax.numpy as jnp, jsparse
  >>> plan = jsparse.make_plan({'w': jnp.zeros((2, 3)), 'step': jnp.int32(0)},
  ...                          rollout_dtype=jnp.bfloat16)
  >>> [(l.path, l.shape, l.rollout_dtype.name) for l in plan.leaves]
  [("['step']", (), 'int32'), ("['w']", (2, 3), 'bfloat16')]
  >>> plan.num_elements, plan.rollout_bytes, len(plan.fingerprint)
  (7, 16, 16)
  """

  treedef: Any
  leaves: tuple[LeafSpec, ...]
  segments: tuple[Segment, ...]
  bucket_size: int
  view: Any = None  # how the rollout views the trainer tree (quantized rollouts, see
  # quant/view.py: a layer above the plan) or None

  @functools.cached_property
  def _hash(self) -> int:
    return hash((self.treedef, self.leaves, self.segments, self.bucket_size, self.view))

  def __hash__(self) -> int:
    return self._hash

  def __getstate__(self) -> dict:
    """Pickles the fields only: a hash cached in one process is not valid in another."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def __setstate__(self, state: dict) -> None:
    for name, value in state.items():
      object.__setattr__(self, name, value)

  @functools.cached_property
  def fingerprint(self) -> bytes:
    """16 bytes that identify the plan's layout; payloads carry it so a receiver with another plan
    refuses them."""
    leaves = [(l.path, l.shape, str(l.dtype), str(l.rollout_dtype),
               l.layout.parts if l.layout else None) for l in self.leaves]
    quantized = self.view.description() if self.view is not None else None
    description = repr((str(self.treedef), leaves, self.segments, self.bucket_size)
                       + ((quantized,) if quantized is not None else ()))
    return hashlib.blake2b(description.encode(), digest_size=16).digest()

  def __repr__(self) -> str:
    """One line: leaves, elements, segments, their slots, rollout dtypes (the fields are long)."""
    slots = sum(seg.capacity for seg in self.segments)
    share = f" ({slots / self.num_elements:.1%})" if self.num_elements else ""
    dtypes = "/".join(sorted({_short_dtype(l.rollout_dtype) for l in self.leaves})) or "none"
    split = sum(seg.blocks > 1 for seg in self.segments)
    return (f"Plan({len(self.leaves):,} leaves, {count_text(self.num_elements)} elements, "
            f"{len(self.segments):,} segments{f' ({split} split into blocks)' if split else ''}, "
            f"capacity {count_text(slots)}{share}, rollout {dtypes}, "
            f"fingerprint {self.fingerprint.hex()[:8]})")

  def describe_segment(self, s: int) -> str:
    """How errors name segment ``s``: its index and first leaves."""
    paths = [self.leaves[i].path for i in self.segments[s].leaf_ids]
    return f"segment {s} (leaves {paths[:3]}{' ...' if len(paths) > 3 else ''})"

  @property
  def num_elements(self) -> int:
    return sum(leaf.size for leaf in self.leaves)

  @property
  def rollout_bytes(self) -> int:
    """Bytes of the whole tree in rollout dtypes: what a dense bf16 (etc.) sync sends."""
    return sum(leaf.size * leaf.rollout_dtype.itemsize for leaf in self.leaves)

  def rollout_shapes(self, shardings: PyTree | None = None) -> PyTree:
    """The tree of ``jax.ShapeDtypeStruct`` the rollout side holds, placed by ``shardings`` (a
    tree of ``jax.sharding.Sharding`` with the plan's structure; None: the default device, not
    wherever the arrays were saved from). This is the abstract target to restore a rollout tree
    onto, e.g. with Orbax."""
    default = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
    placements = [default] * len(self.leaves)
    if shardings is not None:
      try:
        placements = self.treedef.flatten_up_to(shardings)
      except (ValueError, TypeError) as e:
        raise PlanMismatchError(f"shardings: {self.structure_difference(shardings)}") from e
    return jax.tree.unflatten(self.treedef, [
        jax.ShapeDtypeStruct(l.shape, l.rollout_dtype, sharding=s)
        for l, s in zip(self.leaves, placements)])

  def flatten(self, tree: PyTree, *, what: str, rollout_only: bool = False) -> list[Any]:
    """Flattens ``tree`` in plan order, checking structure, shapes and dtypes.

    Args:
      tree: a tree with the plan's structure.
      what: how to name the tree in errors (e.g. ``"new"``).
      rollout_only: if true every leaf must have its rollout dtype; otherwise the trainer dtype
        or the rollout dtype are both accepted.

    With a quantized rollout (``make_plan(..., quantize=...)``), a trainer tree (the structure
    the plan was made from) is accepted where the trainer dtypes are: it is checked, then
    quantized into the rollout's view (codes and scales), whose leaves are returned.

    Raises:
      PlanMismatchError: naming the first leaf whose structure, shape or dtype differs.
    """
    if self.view is not None and not rollout_only and self.view.matches(tree):
      tree = self.view.of_trainer_tree(tree, what=what)  # checked below
    flat_with_path, treedef = jax.tree.flatten_with_path(tree)
    if treedef != self.treedef:
      raise PlanMismatchError(f"{what}: {self.structure_difference(tree)}")
    flat = []
    for (_, value), leaf in zip(flat_with_path, self.leaves):
      shape = tuple(np.shape(value))
      dtype = _canonical(getattr(value, "dtype", None) or np.asarray(value).dtype)
      if shape != leaf.shape:
        raise PlanMismatchError(
            f"{what}: leaf {leaf.path} has shape {shape}, the plan expects {leaf.shape}: the plan "
            "was made from another tree; make it from this model's params (or their shapes)")
      allowed = (leaf.rollout_dtype,) if rollout_only else (leaf.dtype, leaf.rollout_dtype)
      if dtype not in allowed:
        names = " or ".join(sorted({str(d) for d in allowed}))
        hint = ("a rollout tree holds the rollout dtypes: plan.cast(params) makes one"
                if rollout_only and dtype == leaf.dtype else
                "the plan was made from another tree; make it from this model's params")
        raise PlanMismatchError(
            f"{what}: leaf {leaf.path} has dtype {dtype}, the plan expects {names}: {hint}")
      flat.append(value)
    return flat

  def structure_difference(self, tree: PyTree) -> str:
    """Where ``tree``'s structure first differs from the plan's, and how, in a few lines (not
    the whole tree definitions): a missing or unexpected leaf, or a node of another type (e.g.
    a dict where the plan was made from a ``flax.nnx.State``).

    >>> import jax.numpy as jnp, jsparse
    >>> plan = jsparse.make_plan({'layer': {'w': jnp.zeros(2), 'b': jnp.zeros(2)}})
    >>> print(plan.structure_difference({'layer': {'w': jnp.zeros(2)}}))
    tree structure differs from the plan at ['layer']['b']: the plan has a leaf there, the
    tree has none (plan has 2 leaves, got 1); give a tree of the same structure and container
    types as the one the plan was made from
    """
    expected = jax.tree.unflatten(self.treedef, [_Slot(l.path) for l in self.leaves])
    where, how = _first_difference(expected, tree, ())
    count = len(jax.tree.leaves(tree))
    return (f"tree structure differs from the plan at {jax.tree_util.keystr(where) or 'the root'}"
            f": {how} (plan has {len(self.leaves)} leaves, got {count}); give a tree of the same "
            "structure and container types as the one the plan was made from")

  @mesh_neutral
  def cast(self, tree: PyTree) -> PyTree:
    """Casts every leaf of ``tree`` to its rollout dtype (what the rollout side holds)."""
    flat = self.flatten(tree, what="tree")
    return jax.tree.unflatten(self.treedef, [
        jnp.asarray(x).astype(leaf.rollout_dtype) for x, leaf in zip(flat, self.leaves)])

  def leaf_segment(self) -> dict[int, tuple[int, int]]:
    """Maps each leaf id to (segment id, offset in segment); zero-size leaves are absent."""
    return {leaf_id: (seg_id, offset)
            for seg_id, seg in enumerate(self.segments)
            for leaf_id, offset in zip(seg.leaf_ids, seg.offsets)}


class _Slot:
  """A leaf of the plan's tree rebuilt from its definition (to compare structures)."""

  def __init__(self, path: str):
    self.path = path


def _type_name(node: Any) -> str:
  if isinstance(node, _Slot):
    return "a leaf"
  if node is None:
    return "None (an empty node)"
  kind = type(node)
  name = kind.__qualname__ if kind.__module__ == "builtins" else \
      f"{kind.__module__}.{kind.__qualname__}"
  if _is_leaf(node) and hasattr(node, "shape") and hasattr(node, "dtype"):
    return f"a leaf ({np.dtype(node.dtype).name}{list(node.shape)})"
  return f"a leaf ({name})" if _is_leaf(node) else f"a {name}"


def _is_leaf(node: Any) -> bool:
  structure = jax.tree.structure(node)
  return structure.num_nodes == 1 and structure.num_leaves == 1


def _children(node: Any) -> list[tuple[Any, Any]]:
  """(key, child) of ``node``'s direct children."""
  items, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
  return [(path[0], child) for path, child in items]


def _first_difference(expected: Any, given: Any, path: tuple) -> tuple[tuple, str]:
  """(path, how) of the first node where ``given`` differs in structure from ``expected`` (the
  plan's tree, :class:`_Slot` leaves); they differ somewhere below ``path``."""
  if isinstance(expected, _Slot) or _is_leaf(given) or type(expected) is not type(given):
    return path, f"the plan has {_type_name(expected)} there, the tree has {_type_name(given)}"
  want, got = _children(expected), _children(given)
  want_keys, got_keys = [k for k, _ in want], [k for k, _ in got]
  for key, child in want:
    if key not in got_keys:
      return path + (key,), f"the plan has {_type_name(child)} there, the tree has none"
  for key, child in got:
    if key not in want_keys:
      return path + (key,), f"the tree has {_type_name(child)} there, the plan has none"
  if want_keys != got_keys:
    return path, "the same keys in another order"
  for (key, e), (_, g) in zip(want, got):
    if jax.tree.structure(e) != jax.tree.structure(g):
      return _first_difference(e, g, path + (key,))
  return path, f"{_type_name(given)} whose metadata differs from the plan's"


def count_text(n: int) -> str:
  """``n`` for a one-line summary: exact below 10,000, else to 2 significant digits.

  >>> count_text(1234), count_text(24576), count_text(1_234_567), count_text(7_000_000_000)
  ('1,234', '25K', '1.2M', '7.0B')
  """
  if n < 10_000:
    return f"{n:,}"
  for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
    if n >= scale:
      value = n / scale
      return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
  return f"{n:,}"


def _short_dtype(dtype: np.dtype) -> str:
  return {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float64": "f64"}.get(
      dtype.name, dtype.name)


def _canonical(dtype: Any) -> np.dtype:
  """``dtype`` as JAX holds it (64-bit types are 32-bit without x64); unsupported dtypes as
  they are, for :func:`make_plan` to name."""
  try:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
  except (TypeError, ValueError):
    return np.dtype(dtype)


def _resolve_rollout_dtype(rollout_dtype: RolloutDtype, path: str,
                           struct: jax.ShapeDtypeStruct) -> np.dtype:
  if callable(rollout_dtype) and not isinstance(rollout_dtype, (type, np.dtype)):
    chosen = rollout_dtype(path, struct)
    return np.dtype(struct.dtype if chosen is None else chosen)
  if rollout_dtype is None or not jnp.issubdtype(struct.dtype, jnp.floating):
    return np.dtype(struct.dtype)
  try:
    return np.dtype(rollout_dtype)
  except TypeError:
    raise ConfigError(f"rollout_dtype must be a dtype (e.g. jnp.bfloat16), None or a function "
                      f"(path, ShapeDtypeStruct) -> dtype, got {rollout_dtype!r}") from None


DEFAULT_CAPACITY = 0.05
DEFAULT_POOLED_CAPACITY = 1.0


@dataclasses.dataclass(frozen=True)
class _Capacity:
  """How many slots a segment (or block) of ``size`` elements gets: a ``fraction`` of its
  elements, or a count of ``slots``; never more than it has elements, never fewer than 1."""
  fraction: float | None = None
  slots: int | None = None

  def of(self, size: int) -> int:
    if self.slots is not None:
      return min(size, self.slots)
    return min(size, max(1, math.ceil(self.fraction * size)))


def _capacity(name: str, fraction: Any, slots: Any, default: float) -> _Capacity:
  """The capacity rule of option ``name`` (a fraction) or ``name_slots`` (a count).

  >>> _capacity("capacity", None, 5, 0.05), _capacity("capacity", 0.5, None, 0.05).of(9)
  (_Capacity(fraction=None, slots=5), 5)
  >>> _capacity("capacity", 5, None, 0.05)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  jsparse.errors.ConfigError: capacity=5: capacity is a fraction ... write capacity_slots=5
  """
  if slots is not None:
    if fraction is not None:
      raise ConfigError(f"give {name} (a fraction of the elements) or {name}_slots (a number "
                        f"of slots), not both: got {name}={fraction!r}, {name}_slots={slots!r}")
    return _Capacity(slots=int_option(f"{name}_slots", slots, minimum=1))
  if fraction is None:
    fraction = default
  if isinstance(fraction, (int, np.integer)) and not isinstance(fraction, (bool, np.bool_)):
    raise ConfigError(
        f"{name}={int(fraction)}: {name} is a fraction of each segment's elements in (0, 1] "
        f"(e.g. {name}=0.05; {name}=1.0: every element); for a number of slots write "
        f"{name}_slots={int(fraction)}")
  if isinstance(fraction, (bool, np.bool_)) or not isinstance(fraction, (float, np.floating)):
    raise ConfigError(f"{name} must be a fraction in (0, 1] (or give {name}_slots, a number "
                      f"of slots), got {fraction!r}")
  fraction = float(fraction)  # a float16 fraction times a large size would overflow
  if not 0.0 < fraction <= 1.0:
    raise ConfigError(f"{name} is a fraction of each segment's elements and must be in (0, 1], "
                      f"got {fraction} (for a number of slots give {name}_slots)")
  return _Capacity(fraction=fraction)


def build_plan(tree: PyTree, *, rollout_dtype: RolloutDtype = None, capacity: float | None = None,
              capacity_slots: int | None = None, pooled_capacity: float | None = None,
              pooled_capacity_slots: int | None = None, bucket_size: int = 2**16,
              view: Any = None) -> Plan:
  """The plan of ``tree``, or of ``view.shapes()`` when a rollout view is given: what
  :func:`jsparse.make_plan` builds once its options are resolved (see it for the options).

  ``view`` (quantized rollouts, ``quant/view.py``) is used through its ``shapes()``,
  ``quantized_paths()``, ``matches(tree)``, ``of_trainer_tree(tree, what=)`` and
  ``description()``: the plan knows nothing of quantization.

  >>> import jax.numpy as jnp
  >>> [s.capacity for s in build_plan({'w': jnp.zeros(100_000)}).segments]
  [5000]
  """
  capacity = _capacity("capacity", capacity, capacity_slots, DEFAULT_CAPACITY)
  pooled_capacity = _capacity("pooled_capacity", pooled_capacity, pooled_capacity_slots,
                              DEFAULT_POOLED_CAPACITY)
  bucket_size = int_option("bucket_size", bucket_size, minimum=1)
  if bucket_size > MAX_SEGMENT_ELEMENTS:
    raise ConfigError(f"bucket_size must be at most {MAX_SEGMENT_ELEMENTS} (int32 indices), got "
                      f"{bucket_size}")
  exact = frozenset()
  if view is not None:
    tree = view.shapes()
    exact = view.quantized_paths()  # codes and scales: held as the quantizer makes them
  flat_with_path, treedef = jax.tree.flatten_with_path(tree)
  leaves = []
  for path, value in flat_with_path:
    name = jax.tree_util.keystr(path)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      raise PlanError(f"leaf {name} is a typed PRNG key; unwrap it with jax.random.key_data")
    if dtype is None:
      value = np.asarray(value)
    # As JAX holds it: without x64, a numpy float64 leaf is float32 on device.
    struct = jax.ShapeDtypeStruct(tuple(np.shape(value)), _canonical(value.dtype))
    target = _canonical(struct.dtype if name in exact else
                        _resolve_rollout_dtype(rollout_dtype, name, struct))
    layout = Layout.of(getattr(value, "sharding", None), struct.shape)
    for label, d in (("dtype", struct.dtype), ("rollout dtype", target)):
      if not bits_lib.is_supported_dtype(d):
        raise PlanError(f"leaf {name} has unsupported {label} {d}")
    leaf = LeafSpec(name, struct.shape, np.dtype(struct.dtype), target, layout)
    if leaf.size > MAX_SEGMENT_ELEMENTS:
      raise PlanError(
          f"leaf {name} has {leaf.size} elements, more than {MAX_SEGMENT_ELEMENTS} (int32 "
          "indices); split it into several leaves")
    leaves.append(leaf)
  return Plan(treedef, tuple(leaves),
              _segments(leaves, capacity, pooled_capacity, bucket_size), bucket_size, view)


def _segments(leaves: Sequence[LeafSpec], capacity: _Capacity, pooled_capacity: _Capacity,
              bucket_size: int) -> tuple[Segment, ...]:
  segments: list[Segment] = []

  def close(pool: list[int], dtype: np.dtype) -> None:
    offsets = tuple(np.cumsum([0] + [leaves[i].size for i in pool[:-1]]).tolist())
    size = sum(leaves[i].size for i in pool)
    cap = capacity if len(pool) == 1 and size >= bucket_size else pooled_capacity
    ordered = bits_lib.is_float(dtype)
    segments.append(Segment(tuple(pool), offsets, size, cap.of(size), dtype, ordered=ordered))

  # Small leaves of one shape fill pools of their own (alike pools share compiled programs,
  # see chunks.py); what is left of each shape is pooled by dtype in tree order.
  alike: dict[tuple, list[int]] = {}
  for leaf_id, leaf in enumerate(leaves):
    if leaf.size == 0:
      continue
    dtype = leaf.rollout_dtype
    if leaf.layout is not None:  # sharded: never pooled, a capacity per block; a small leaf's
      blocks = leaf.layout.blocks  # as a pool's (it changes as often: e.g. a weight's scales)
      per_block = (capacity if leaf.size >= bucket_size else pooled_capacity).of(
          leaf.size // blocks)
      segments.append(Segment((leaf_id,), (0,), leaf.size, per_block * blocks, dtype, blocks))
      continue
    if leaf.size >= bucket_size:
      close([leaf_id], dtype)
      continue
    group = alike.setdefault((dtype, leaf.shape), [])
    group.append(leaf_id)
    if len(group) == min(MAX_POOL_LEAVES, bucket_size // leaf.size):
      close(group, dtype)
      alike[(dtype, leaf.shape)] = []
  mixed: dict[np.dtype, list[int]] = {}  # one dtype per pool: values are coded by dtype
  for leaf_id in sorted(i for group in alike.values() for i in group):
    dtype = leaves[leaf_id].rollout_dtype
    pool = mixed.setdefault(dtype, [])
    if pool and (sum(leaves[i].size for i in pool) + leaves[leaf_id].size > bucket_size
                 or len(pool) == MAX_POOL_LEAVES):
      close(pool, dtype)
      pool = mixed[dtype] = []
    pool.append(leaf_id)
  for dtype, pool in mixed.items():
    if pool:
      close(pool, dtype)
  return tuple(segments)
