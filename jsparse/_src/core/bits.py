"""Bit-pattern views of array leaves.

jsparse compares and transports bit patterns, never float values: ``+0.0`` and ``-0.0`` differ,
and so do two NaNs with different payloads. Every supported dtype maps to an unsigned integer
"bit dtype" of the same width (``bool`` maps to ``uint8`` holding 0 or 1).

>>> import jax.numpy as jnp
>>> to_bits(jnp.array([-0.0], jnp.bfloat16)).tolist()
[32768]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_UINT_BY_BYTES = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                  8: np.dtype(np.uint64)}


def is_supported_dtype(dtype: np.dtype) -> bool:
  """Whether jsparse can carry leaves of this dtype (bool, integers and floats of 1-8 bytes)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return True
  if jnp.issubdtype(dtype, jnp.integer):
    bits = jnp.iinfo(dtype).bits
  elif jnp.issubdtype(dtype, jnp.floating):
    bits = jnp.finfo(dtype).bits
  else:
    return False
  return dtype.itemsize in _UINT_BY_BYTES and bits == 8 * dtype.itemsize  # no int4, float4


def is_four_bit(dtype: np.dtype) -> bool:
  """Whether ``dtype`` is a 4-bit type (``int4``, ``uint4``, ``float4_e2m1fn``), which jsparse
  carries two to a byte."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).bits == 4
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 4


def is_float(dtype: np.dtype) -> bool:
  """Whether ``dtype`` is a floating dtype (bfloat16 and float8 included)."""
  return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))


def bit_dtype(dtype: np.dtype) -> np.dtype:
  """The unsigned integer dtype that holds the bit pattern of ``dtype``."""
  return _UINT_BY_BYTES[np.dtype(dtype).itemsize]


def to_bits(x: jax.Array) -> jax.Array:
  """Reinterprets ``x`` as unsigned integers of the same width (bool becomes 0/1 ``uint8``)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  target = bit_dtype(x.dtype)
  if x.dtype == target:
    return x
  return lax.bitcast_convert_type(x, target)


def from_bits(bits: jax.Array, dtype: np.dtype) -> jax.Array:
  """Inverse of :func:`to_bits`: reinterprets unsigned integers as ``dtype``."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return bits != 0
  if bits.dtype == dtype:
    return bits
  return lax.bitcast_convert_type(bits, dtype)


def gather_rollout_bits(source: jax.Array, positions: jax.Array,
                        rollout_dtype: np.dtype) -> jax.Array:
  """Bits of ``source[positions]`` (flat, positions in range) cast to ``rollout_dtype``.

  Gathers first and casts the few picked elements, so no full-size cast copy is made; and
  gathers bits, not floats: XLA may canonicalize NaN payloads when it moves emulated types
  (float8 on CPU) as floats.
  """
  picked = to_bits(source)[positions]
  if source.dtype != rollout_dtype:
    picked = to_bits(from_bits(picked, source.dtype).astype(rollout_dtype))
  return picked


def _scatters_natively(dtype: np.dtype) -> bool:
  """Whether to scatter in the leaf's own dtype rather than in its bits.

  A native scatter into a donated buffer is in place; going through the bits costs a full copy
  on CPU, where bitcast-convert is not free. But XLA emulates float8 by converting, which
  canonicalizes NaN payloads (float8_e5m2 on CPU), so those scatter bits.
  """
  return not (jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize == 1)


def gather_bits(flat: jax.Array, positions: jax.Array) -> jax.Array:
  """The bit patterns of ``flat[positions]`` (positions in range). Gathers in the leaf's own
  dtype where that is exact (no full-size bitcast copy), in bits for float8."""
  if _scatters_natively(flat.dtype):
    return to_bits(flat[positions])
  return to_bits(flat)[positions]


def scatter_bits(flat: jax.Array, positions: jax.Array, values: jax.Array) -> jax.Array:
  """``flat`` with the bit patterns ``values`` written at ``positions`` (out of range: skipped)."""
  if _scatters_natively(flat.dtype):
    return flat.at[positions].set(from_bits(values, flat.dtype), mode="drop")
  return from_bits(to_bits(flat).at[positions].set(values, mode="drop"), flat.dtype)


def np_to_bits(x: np.ndarray) -> np.ndarray:
  """Host (numpy) version of :func:`to_bits`."""
  x = np.asarray(x)
  if x.dtype == np.bool_:
    return x.astype(np.uint8)
  return x.view(bit_dtype(x.dtype))


def np_from_bits(bits: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Host (numpy) version of :func:`from_bits`."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return bits != 0
  return np.asarray(bits).view(dtype)
