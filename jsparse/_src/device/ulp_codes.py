"""Values as ulp codes against the old bits, and the exponent class that predicts a change.

Both sides of a sync hold the old bit patterns, so a new value can travel as the signed number of
representable values (ulps) it moved: ``order_key`` maps float bit patterns to unsigned integers
in the order of the values (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN), and an *ulp
code* is the difference of two keys modulo ``2**width``. It decodes to the exact new bits for any
pair of patterns (NaN payloads, -0.0 and infs included); most RL updates move 1-3 ulps, so the
codes are small integers that compress well. Integer and bool leaves use their bits as keys.

The *exponent class* of an old value (its exponent field, clipped into 16 classes) predicts
whether it changes: an update of a given size crosses half an ulp far more often for small
exponents. Positions ordered by class compress better (see ``ranks.py``).

Every function takes the array module (``numpy`` on the host, ``jax.numpy`` on device).

>>> import numpy as np
>>> old = np.array([0x3F80, 0x8000], np.uint16)   # bf16 1.0 and -0.0
>>> new = np.array([0x3F81, 0x0000], np.uint16)   # the next bf16 after 1.0, and +0.0
>>> codes = ulp_codes(old, new, _bf16(), np)
>>> zigzag(codes).tolist(), apply_ulp_codes(old, codes, _bf16(), np).tolist()
([2, 2], [16257, 0])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jsparse._src.core import bits as bits_lib
from jsparse._src.core.bits import is_float
from jsparse._src.core.delta import Decoder

NUM_CLASSES = 16


def _bf16() -> np.dtype:
  return np.dtype(ml_dtypes.bfloat16)


def _sign(dtype: np.dtype) -> np.generic:
  width = bits_lib.bit_dtype(dtype)
  return width.type(1 << (8 * width.itemsize - 1))


def order_key(bits: Any, dtype: np.dtype, xp: Any) -> Any:
  """Unsigned keys in the order of the values of ``dtype`` (bits themselves for non-floats)."""
  if not is_float(dtype):
    return bits
  # Every bit of a negative flipped, the sign bit of a positive set: XOR with the sign bit
  # copied down (arithmetic shift), or'd with the sign bit.
  width = 8 * np.dtype(bits.dtype).itemsize
  return bits ^ ((bits.view(_signed(bits.dtype)) >> (width - 1)).view(bits.dtype) | _sign(dtype))


def from_order_key(key: Any, dtype: np.dtype, xp: Any) -> Any:
  """Inverse of :func:`order_key`."""
  if not is_float(dtype):
    return key
  sign = _sign(dtype)
  return xp.where((key & sign) != 0, key ^ sign, ~key)


def ulp_codes(old: Any, new: Any, dtype: np.dtype, xp: Any) -> Any:
  """``key(new) - key(old)`` modulo ``2**width``, as unsigned ints of the bit width."""
  return order_key(new, dtype, xp) - order_key(old, dtype, xp)


def apply_ulp_codes(old: Any, codes: Any, dtype: np.dtype, xp: Any) -> Any:
  """The new bits: inverse of :func:`ulp_codes` given the old bits."""
  return from_order_key(order_key(old, dtype, xp) + codes, dtype, xp)


def decoder(dtype: np.dtype) -> Decoder:
  """The core's :data:`~jsparse._src.core.delta.Decoder` for ulp codes of ``dtype``: gathers the
  old bits at the positions (out of range: any valid one, its result is dropped) and applies
  the codes on device."""
  def decode(flat: jax.Array, positions: jax.Array, codes: jax.Array) -> jax.Array:
    old = bits_lib.gather_bits(flat, jnp.minimum(positions, flat.shape[0] - 1))
    return apply_ulp_codes(old, codes.astype(old.dtype), dtype, jnp)
  return decode


def _signed(dtype: np.dtype) -> np.dtype:
  return np.dtype(f"int{8 * np.dtype(dtype).itemsize}")


def zigzag(codes: np.ndarray) -> np.ndarray:
  """Maps ulp codes (modular, read as signed) to unsigned ints, small magnitudes first:
  0, -1, 1, -2, 2 ... become 0, 1, 2, 3, 4 ... (host only)."""
  signed = codes.view(_signed(codes.dtype))
  bits = 8 * codes.dtype.itemsize
  return ((signed << 1) ^ (signed >> (bits - 1))).view(codes.dtype)


def unzigzag(z: np.ndarray) -> np.ndarray:
  """Inverse of :func:`zigzag` (host only)."""
  return (z >> z.dtype.type(1)) ^ (np.zeros_like(z) - (z & z.dtype.type(1)))


def exponent_class(bits: Any, dtype: np.dtype, xp: Any) -> Any:
  """The class (0..15) of each old value: its exponent field, clipped to the 16 exponents just
  below 1.0 (where RL-sized updates cross half an ulp); 0 for non-float dtypes."""
  if not is_float(dtype):
    return xp.zeros(bits.shape, np.uint8)
  info = ml_dtypes.finfo(dtype)
  width = 8 * np.dtype(dtype).itemsize
  exponent_bits = width - 1 - info.nmant
  bias = (1 << (exponent_bits - 1)) - 1
  low = max(0, bias - (NUM_CLASSES - 1))
  exponent = (bits >> info.nmant).astype(np.int32) & ((1 << exponent_bits) - 1)
  return xp.clip(exponent - low, 0, NUM_CLASSES - 1).astype(np.uint8)
