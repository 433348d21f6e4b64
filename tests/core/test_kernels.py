"""The device kernels, tested directly against plain references: first-K selection, exponent-class
ranks and positions, ulp codes, bit views and the digest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.digest import bits_digest
from jsparse._src.core.layout import Layout
from jsparse._src.core.select import first_set_positions, sorted_search
from jsparse._src.device import ranks, ulp_codes
from jsparse.testing import special_values
from tests import strategies
from tests.meshes import place


@settings(max_examples=25)
@given(st.integers(1, 3000), st.floats(0.0, 1.0), st.integers(1, 400), st.integers(0, 2**32 - 1))
def test_first_set_positions_equal_nonzero(size, density, capacity, seed):
  mask = np.random.default_rng(seed).random(size) < density
  positions, count = jax.jit(first_set_positions, static_argnums=1)(jnp.asarray(mask), capacity)
  (expected,) = jnp.nonzero(mask, size=capacity, fill_value=size)
  assert positions.tolist() == expected.tolist()
  assert int(count) == int(mask.sum())


@pytest.mark.parametrize("capacity", [1, 31, 32, 33, 1024, 1500])
def test_first_set_positions_at_any_capacity(capacity):
  """Capacities around a word and up to past the mask's size, with more and fewer changes than
  slots, words full and empty, and a mask whose size is not a multiple of a word."""
  for size, density in ((1024, 0.01), (1024, 0.3), (1024, 1.0), (1000, 0.9), (37, 0.5)):
    mask = np.random.default_rng(capacity).random(size) < density
    mask[:64] = density > 0.5  # whole words set (or clear)
    positions, count = jax.jit(first_set_positions, static_argnums=1)(jnp.asarray(mask), capacity)
    (expected,) = jnp.nonzero(mask, size=capacity, fill_value=size)
    assert positions.tolist() == expected.tolist()
    assert int(count) == int(mask.sum())


@pytest.mark.parametrize("method", ["scan", "scan_unrolled", None])
def test_sorted_search_by_every_method_equals_numpy(method):
  """The platform's default and the unrolled search other platforms run, checked here on CPU."""
  rng = np.random.default_rng(7)
  values = np.sort(rng.integers(0, 50, 1000)).astype(np.int32)
  queries = rng.integers(-5, 55, 3000).astype(np.int32)
  for side in ("left", "right"):
    got = jax.jit(sorted_search, static_argnums=(2, 3))(values, queries, side, method)
    assert got.tolist() == np.searchsorted(values, queries, side=side).tolist()


def _bf16_bits_with_every_class(rng, size):
  """bf16 bit patterns whose exponents span all 16 classes (and beyond, both clipped ends),
  with random signs and mantissas, NaNs, infs and zeros."""
  exponent = rng.integers(100, 140, size=size)  # classes are exponents 112..127, clipped
  bits = (rng.integers(0, 2, size) << 15) | (exponent << 7) | rng.integers(0, 128, size)
  bits = bits.astype(np.uint16)
  specials = strategies.special_values(jnp.bfloat16).view(np.uint16)
  where = rng.choice(size, min(size, len(specials)), replace=False)
  bits[where] = specials[:len(where)]
  return bits


@settings(max_examples=15)
@given(st.integers(1, 2000).filter(lambda n: n % 256), st.integers(0, 2**32 - 1))
def test_positions_of_ranks_of_is_the_identity_and_ranks_sort_by_class(size, seed):
  bits = _bf16_bits_with_every_class(np.random.default_rng(seed), size)
  classes = ulp_codes.exponent_class(bits, jnp.bfloat16, np)
  if size >= 1000:
    assert len(np.unique(classes)) == ulp_codes.NUM_CLASSES

  @jax.jit
  def roundtrip(bits, positions):
    tables = ranks.class_tables(bits, jnp.bfloat16)
    classes = ulp_codes.exponent_class(bits[positions], jnp.bfloat16, jnp)
    r = ranks.ranks_of(tables, positions, classes)
    return r, ranks.positions_of(tables, r)

  r, back = roundtrip(jnp.asarray(bits), jnp.arange(size))
  assert back.tolist() == list(range(size))
  # The rank order is (class, position): a stable sort by class.
  assert r.tolist() == np.argsort(np.argsort(classes, kind="stable"), kind="stable").tolist()


@pytest.mark.parametrize("dtype", strategies.ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_ulp_codes_decode_to_the_exact_new_bits_for_any_pair(dtype):
  rng = np.random.default_rng(0)
  old = bits_lib.np_to_bits(strategies.with_specials(rng, strategies.random_bits(rng, 5000, dtype)))
  new = bits_lib.np_to_bits(strategies.with_specials(rng, strategies.random_bits(rng, 5000, dtype)))
  codes = ulp_codes.ulp_codes(old, new, dtype, np)
  assert np.array_equal(ulp_codes.apply_ulp_codes(old, codes, dtype, np), new)
  assert np.array_equal(ulp_codes.unzigzag(ulp_codes.zigzag(codes)), codes)
  on_device = ulp_codes.apply_ulp_codes(jnp.asarray(old), jnp.asarray(codes), dtype, jnp)
  assert np.array_equal(np.asarray(on_device), new)


@pytest.mark.parametrize("dtype", strategies.ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_bit_views_roundtrip_every_pattern_on_device(dtype):
  rng = np.random.default_rng(1)
  x = strategies.with_specials(rng, strategies.random_bits(rng, 4096, dtype))
  bits = jax.jit(bits_lib.to_bits)(jnp.asarray(x))
  assert np.array_equal(np.asarray(bits), bits_lib.np_to_bits(x))
  back = jax.jit(bits_lib.from_bits, static_argnums=1)(bits, np.dtype(dtype))
  assert np.array_equal(bits_lib.np_to_bits(np.asarray(back)), bits_lib.np_to_bits(x))


def _np_fmix(x):
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> np.uint32(13))
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> np.uint32(16))


def _np_digest(leaves, leaf_ids):
  """The digest's formula, leaf by leaf in NumPy: per element, its 32-bit word mixed with its
  position and its leaf's id, two lanes, summed mod 2**32."""
  total = np.zeros(2, np.uint32)
  with np.errstate(over="ignore"):
    for leaf, leaf_id in zip(leaves, leaf_ids):
      bits = bits_lib.np_to_bits(np.asarray(leaf)).reshape(-1)
      if bits.dtype == np.uint64:
        words = bits.astype(np.uint32) ^ _np_fmix((bits >> np.uint64(32)).astype(np.uint32))
      else:
        words = bits.astype(np.uint32)
      positions = np.arange(words.size, dtype=np.uint32)
      for k, (c_bits, c_pos) in enumerate(((0x9E3779B1, 0x85EBCA77), (0xC2B2AE3D, 0x27D4EB2F))):
        seed = np.uint32(leaf_id) * np.uint32(0x632BE5AB) + np.uint32(k)
        lane = _np_fmix(words * np.uint32(c_bits) + positions * np.uint32(c_pos) + seed)
        total[k] += lane.sum(dtype=np.uint32)
  return total


def test_the_digest_is_its_formula_whether_leaves_are_stacked_or_not():
  """Runs of equal-sized small leaves are digested stacked (one program op for the run): the
  sums are the formula's, leaf by leaf, across dtypes, empty leaves, split leaves and ids."""
  rng = np.random.default_rng(7)
  leaves = [rng.normal(size=128).astype(np.float32) for _ in range(5)]
  leaves += [np.zeros((0, 3), np.float32), rng.normal(size=(16, 8)).astype(jnp.bfloat16),
             rng.integers(-9, 9, size=128).astype(np.int32), rng.random(128) < 0.5,
             np.resize(special_values(np.float32), 128),
             rng.normal(size=(64, 96)).astype(np.float32), rng.normal(size=7).astype(np.float32)]
  ids = rng.permutation(1000)[:len(leaves)].astype(np.uint32)
  expected = _np_digest(leaves, ids)
  as_arrays = [jnp.asarray(x) for x in leaves]
  for program in (bits_digest, jax.jit(bits_digest, static_argnums=1)):
    assert np.array_equal(np.asarray(program(as_arrays, None, ids)), expected)
  split = list(as_arrays)
  split[-2] = place({"w": leaves[-2]}, "fsdp2xtp2")["w"]
  layouts = [None] * len(leaves)
  layouts[-2] = Layout.of(split[-2].sharding, leaves[-2].shape)
  assert np.array_equal(np.asarray(bits_digest(split, layouts, ids)), expected)
  wide = [rng.normal(size=64).astype(np.float64).view(np.uint64) for _ in range(3)]
  with jax.enable_x64(True):
    assert np.array_equal(np.asarray(bits_digest([jnp.asarray(x) for x in wide])),
                          _np_digest(wide, range(3)))


def test_digest_sees_every_single_bit_and_is_the_same_block_by_block():
  rng = np.random.default_rng(2)
  w = rng.normal(size=(64, 96)).astype(np.float32)
  reference = np.asarray(bits_digest([jnp.asarray(w)]))
  for flat_index, bit in [(0, 0), (3000, 31), (6143, 17)]:
    flipped = w.copy()
    flipped.reshape(-1).view(np.uint32)[flat_index] ^= np.uint32(1 << bit)
    assert not np.array_equal(np.asarray(bits_digest([jnp.asarray(flipped)])), reference)
  sharded = place({"w": w}, "fsdp2xtp2")["w"]
  layout = Layout.of(sharded.sharding, w.shape)
  assert layout is not None and layout.blocks == 4
  assert np.array_equal(np.asarray(bits_digest([sharded], [layout])), reference)
