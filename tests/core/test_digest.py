"""bits_digest: any pytree of arrays, a clear error for anything else, and leaves split over
Explicit mesh axes digested as the same values unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse


def _leaves():
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.normal(size=(64, 96)).astype(np.float32)),
          jnp.asarray(rng.normal(size=(8,)).astype(np.float32)).astype(jnp.bfloat16),
          jnp.asarray(rng.normal(size=(8,)).astype(np.float32)),
          jnp.zeros((0, 3)), jnp.asarray(True), jnp.arange(5, dtype=jnp.int32)]


def _digest(*args, **kwargs):
  return np.asarray(jsparse.bits_digest(*args, **kwargs))


def test_a_list_of_leaves_digests_as_before():
  # the digest of this list before bits_digest took pytrees (senders and receivers of
  # different releases must agree)
  assert _digest(_leaves()).tolist() == [4057423360, 3187212089]
  assert _digest(tuple(_leaves())).tolist() == [4057423360, 3187212089]


@pytest.mark.parametrize("jit", [False, True])
def test_a_pytree_digests_as_its_leaves_in_tree_order(jit):
  a, b, c, empty, flag, ints = _leaves()
  tree = {"layer": {"w": a, "b": c}, "emb": (b, ints), "flag": flag, "none": None,
          "empty": empty}
  digest = jax.jit(jsparse.bits_digest) if jit else jsparse.bits_digest
  expected = _digest(jax.tree.leaves(tree))
  assert np.array_equal(np.asarray(digest(tree)), expected)
  assert np.array_equal(_digest({"x": np.asarray(a)}), _digest([a]))  # numpy leaves too
  assert not np.array_equal(_digest({"w": c, "v": a}), _digest([c, a]))  # order is the tree's


@pytest.mark.parametrize("tree, named", [
    (["weights"], r"\[0\] is a str"),
    ({"w": jnp.zeros(2), "name": "layer"}, r"\['name'\] is a str"),
    ([1.5], r"\[0\] is a float"),
    ("weights", r"\(the root\) is a str"),
    (None, "None only"),
    ([None, {"a": None}], "None only"),
])
def test_anything_but_arrays_is_a_config_error_saying_what_was_expected(tree, named):
  with pytest.raises(jsparse.ConfigError, match="expected a pytree of arrays") as caught:
    jsparse.bits_digest(tree)
  assert caught.match(named)


def test_an_empty_tree_digests_to_zero():  # a split of a tree may hold no leaves
  assert _digest([]).tolist() == [0, 0] and _digest({}).tolist() == [0, 0]


EXPLICIT = [
    ((4,), ("x",), (16,), P("x")),
    ((4,), ("x",), (64, 96), P("x")),
    ((4,), ("x",), (64, 96), P(None, "x")),
    ((4,), ("x",), (8, 4), P(None, "x")),  # small: would be stacked if it were not split
    ((2, 4), ("a", "b"), (64, 96), P("a", "b")),
    ((2, 4), ("a", "b"), (64, 96), P("b", "a")),
    ((2, 4), ("a", "b"), (4, 8, 6), P(None, ("a", "b"))),
    ((2, 4), ("a", "b"), (4, 6, 8), P("a", None, "b")),
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mesh_shape, names, shape, spec", EXPLICIT)
def test_leaves_split_over_explicit_axes_digest_as_unsharded(mesh_shape, names, shape, spec,
                                                             jit):
  mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:int(np.prod(mesh_shape))])
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  rng = np.random.default_rng(1)
  values = [jnp.asarray(rng.normal(size=shape).astype(np.float32)) for _ in range(3)]
  values[1] = values[1].astype(jnp.bfloat16)
  sharded = [jax.device_put(v, NamedSharding(mesh, spec)) for v in values]
  unsplit = jnp.ones(shape[-1:])  # next to the split leaves, of the small ones' size
  digest = jax.jit(jsparse.bits_digest) if jit else jsparse.bits_digest
  got = np.asarray(digest([*sharded, unsplit]))
  assert np.array_equal(got, _digest([*values, unsplit]))
  first = (0,) * len(shape)
  flipped = jax.device_put(values[0].at[first].set(-values[0][first]), NamedSharding(mesh, spec))
  assert not np.array_equal(np.asarray(digest([flipped, *sharded[1:], unsplit])), got)
