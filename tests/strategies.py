"""Shared test data: random pytrees of bit patterns, sparse random updates, and a mixed tree
with RL-like updates."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from jsparse._src.core import bits as bits_lib
from jsparse.testing import special_values

FLOAT_DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2]
OTHER_DTYPES = [jnp.int8, jnp.int32, jnp.uint16, jnp.bool_]
ALL_DTYPES = FLOAT_DTYPES + OTHER_DTYPES


def random_bits(rng: np.random.Generator, shape, dtype) -> np.ndarray:
  """Uniformly random bit patterns (every NaN payload, subnormal and -0.0 included)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  width = bits_lib.bit_dtype(dtype)
  raw = rng.integers(0, np.iinfo(width).max, size=shape, dtype=width, endpoint=True)
  return raw.view(dtype)


def with_specials(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
  """Writes special values (for float dtypes) at random places of a copy of ``x``."""
  x = np.array(x)
  if x.size and jnp.issubdtype(x.dtype, jnp.floating):
    specials = special_values(x.dtype)
    where = rng.choice(x.size, size=min(x.size, len(specials)), replace=False)
    x.reshape(-1)[where] = specials[:len(where)]
  return x


def perturb(rng: np.random.Generator, x: np.ndarray, density: float) -> np.ndarray:
  """A copy of ``x`` with a random ``density`` fraction of elements given new random bits."""
  x = np.array(x)
  flat = x.reshape(-1)
  chosen = rng.random(flat.shape) < density
  flat[chosen] = random_bits(rng, flat.shape, x.dtype)[chosen]
  return x


@st.composite
def trees_and_updates(draw, dtypes=ALL_DTYPES, max_leaves=5, max_dim=70):
  """(base, new) dicts of numpy arrays with random shapes, dtypes and a random density."""
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  n = draw(st.integers(1, max_leaves))
  shapes = draw(st.lists(st.lists(st.integers(0, max_dim), min_size=0, max_size=3).map(tuple),
                         min_size=n, max_size=n))
  leaf_dtypes = draw(st.lists(st.sampled_from(dtypes), min_size=n, max_size=n))
  density = draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0))
  base = {f"leaf{i}": with_specials(rng, random_bits(rng, s, d))
          for i, (s, d) in enumerate(zip(shapes, leaf_dtypes))}
  new = {k: with_specials(rng, perturb(rng, v, density)) for k, v in base.items()}
  return base, new


def mixed_tree(rng: np.random.Generator) -> dict:
  """Weights of several scales (exponent classes), a pooled bias, an int leaf and a float8."""
  return {"w": (rng.normal(size=(300, 200)) * 0.02).astype(np.float32),
          "emb": rng.normal(size=(100, 64)).astype(np.float32),
          "b": (rng.normal(size=(200,)) * 1e-3).astype(np.float32),
          "steps": rng.integers(0, 100, size=(7,)).astype(np.int32),
          "f8": rng.normal(size=(50,)).astype(jnp.float8_e4m3fn)}


def mixed_plan_options() -> dict:
  """fp32 leaves to bf16 on the rollout, the others kept; small segments pooled."""
  return {"rollout_dtype": lambda path, s: jnp.bfloat16 if s.dtype == np.float32 else None,
          "bucket_size": 1024}


def nudge_leaf(rng: np.random.Generator, v: np.ndarray, density: float) -> np.ndarray:
  """An RL-like update of an fp32 leaf: a ``density`` fraction of its elements moves by ~2%
  (a few bf16 ulps); other dtypes are returned unchanged (and draw nothing from ``rng``)."""
  v = np.array(v)
  if v.dtype == np.float32:
    moved = rng.random(v.shape) < density
    with np.errstate(invalid="ignore", over="ignore"):  # special values (inf, NaN) stay special
      v = np.where(moved, v * (1 + rng.normal(size=v.shape) * 2e-2), v).astype(v.dtype)
  return v


def nudge(rng: np.random.Generator, tree: dict, density: float) -> dict:
  """:func:`nudge_leaf` on every leaf of a dict."""
  return {k: nudge_leaf(rng, v, density) for k, v in tree.items()}
