"""Helpers for tests of code that uses jsparse: bitwise tree comparison and special values.

>>> import jax.numpy as jnp
>>> assert_trees_bitwise_equal({'a': jnp.array([-0.0])}, {'a': jnp.array([-0.0])})
>>> trees_bitwise_equal({'a': jnp.array([0.0])}, {'a': jnp.array([-0.0])})
False
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._src.core import bits as bits_lib


def _host_bits(tree: Any) -> list[tuple[str, np.ndarray]]:
  return [(jax.tree_util.keystr(path), bits_lib.np_to_bits(np.asarray(leaf)))
          for path, leaf in jax.tree.flatten_with_path(tree)[0]]


def bitwise_mismatches(actual: Any, expected: Any) -> list[str]:
  """Describes every leaf whose structure, dtype, shape or bit pattern differs."""
  a, e = _host_bits(actual), _host_bits(expected)
  if [p for p, _ in a] != [p for p, _ in e]:
    return [f"structure differs: {[p for p, _ in a]} vs {[p for p, _ in e]}"]
  problems = []
  for (path, x), (_, y), leaf_a, leaf_e in zip(a, e, jax.tree.leaves(actual),
                                               jax.tree.leaves(expected)):
    if np.dtype(leaf_a.dtype) != np.dtype(leaf_e.dtype) or x.shape != y.shape:
      problems.append(f"{path}: {leaf_a.dtype}{list(x.shape)} vs {leaf_e.dtype}{list(y.shape)}")
    elif not np.array_equal(x, y):
      where = np.argwhere(x != y)
      problems.append(f"{path}: {len(where)} elements differ, first at {where[0].tolist()}")
  return problems


def trees_bitwise_equal(actual: Any, expected: Any) -> bool:
  """Whether two trees have the same structure, dtypes, shapes and bit patterns."""
  return not bitwise_mismatches(actual, expected)


def assert_trees_bitwise_equal(actual: Any, expected: Any) -> None:
  """Raises ``AssertionError`` listing the leaves whose bit patterns differ."""
  problems = bitwise_mismatches(actual, expected)
  if problems:
    raise AssertionError("trees differ bitwise:\n  " + "\n  ".join(problems))


def special_values(dtype: Any) -> np.ndarray:
  """Values that float ``!=`` gets wrong or that stress a codec: +-0, +-inf, NaNs with several
  payloads and signs, the smallest and largest subnormals, the largest finite value, +-1."""
  dtype = np.dtype(dtype)
  info = jnp.finfo(dtype)
  width = bits_lib.bit_dtype(dtype)
  nbits = dtype.itemsize * 8
  exponent_bits = info.nexp
  mantissa_bits = nbits - 1 - exponent_bits
  sign = 1 << (nbits - 1)
  exp_all = ((1 << exponent_bits) - 1) << mantissa_bits
  patterns = [0, sign, 1, (1 << mantissa_bits) - 1, sign | 1,
              exp_all | 1, exp_all | (1 << (mantissa_bits - 1)), sign | exp_all | 3,
              exp_all | ((1 << mantissa_bits) - 1)]
  if not np.isnan(np.array([exp_all], width).view(dtype)[0]):
    patterns += [exp_all, sign | exp_all]  # +-inf (float8_e4m3fn has none)
  values = np.array(patterns, width).view(dtype)
  return np.concatenate([values, np.array([1, -1, info.max, info.min], dtype)])


def host_device_flags(devices: int, flags: str | None = None) -> str:
  """``XLA_FLAGS`` for a process that simulates ``devices`` CPU devices: ``flags`` (by default
  this process's ``XLA_FLAGS``) with its host device count replaced, every other flag kept.

  >>> host_device_flags(2, "--xla_backend_optimization_level=0 "
  ...                      "--xla_force_host_platform_device_count=8")
  '--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2'
  """
  kept = [flag for flag in (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split()
          if not flag.startswith("--xla_force_host_platform_device_count")]
  return " ".join([*kept, f"--xla_force_host_platform_device_count={int(devices)}"])
