"""Ready-made quantization rules for ``make_plan(..., quantize=...)``: which leaves a rollout holds
quantized, and how (FP8 per tensor, per channel or in 128x128 tiles, MXFP8, MXFP4, NVFP4, INT8
per channel, INT4 tiles).

A rule is a function ``(path, ShapeDtypeStruct) -> Quantization | None``. The presets quantize
floating leaves of two or more dimensions, read as ``(..., in, out)`` kernels (a Flax ``Linear``
or ``Dense`` kernel, possibly stacked over layers): leading axes always get scales of their own,
tiles run along ``in`` (the contraction axis), and a leaf whose axes a tile does not divide
stays in the plan's rollout dtype. Vectors (biases, norms) and integer leaves are never quantized.

>>> import jax, jax.numpy as jnp
>>> rule = fp8_tiles(128)
>>> rule("['w']", jax.ShapeDtypeStruct((256, 512), jnp.float32)).tiled_axes
((0, 128), (1, 128))
>>> rule("['w']", jax.ShapeDtypeStruct((100, 512), jnp.float32)) is None  # 128 does not divide
True
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jsparse._src.quant.spec import Quantization

Rule = Callable[[str, jax.ShapeDtypeStruct], Quantization | None]


def _rule(name: str, qtype: str, *, tiles: dict[int, int] | None = None,
          per_channel: bool = False, scale_dtype: Any = None,
          calibration_method: str = "absmax") -> Rule:
  tiles = tiles or {}

  def rule(path: str, struct: jax.ShapeDtypeStruct) -> Quantization | None:
    del path
    ndim = len(struct.shape)
    if ndim < 2 or not jnp.issubdtype(struct.dtype, jnp.floating):  # bfloat16 included
      return None
    tiled = {a % ndim: t for a, t in tiles.items()}
    if any(struct.shape[a] % t for a, t in tiled.items()):
      return None
    channelwise = list(range(ndim - 2))  # stacked layers: a scale per layer
    if per_channel:
      channelwise.append(ndim - 1)
    channelwise = [a for a in channelwise if a not in tiled]
    return Quantization(qtype, tuple(channelwise), tuple(sorted(tiled.items())),
                        calibration_method, scale_dtype)

  rule.__qualname__ = f"{name}({qtype})"
  return rule


def fp8_per_tensor(qtype: str = "float8_e4m3fn", *, scale_dtype: Any = None) -> Rule:
  """FP8 with one scale per matrix (per layer of a stacked kernel).

  >>> import jax, jax.numpy as jnp
  >>> fp8_per_tensor()("['w']", jax.ShapeDtypeStruct((4, 64, 32), jnp.float32)).channelwise_axes
  (0,)
  """
  return _rule("fp8_per_tensor", qtype, scale_dtype=scale_dtype)


def fp8_per_channel(qtype: str = "float8_e4m3fn", *, scale_dtype: Any = None) -> Rule:
  """FP8 with one scale per output channel.

  >>> import jax, jax.numpy as jnp
  >>> fp8_per_channel()("['w']", jax.ShapeDtypeStruct((64, 32), jnp.float32)).channelwise_axes
  (1,)
  """
  return _rule("fp8_per_channel", qtype, per_channel=True, scale_dtype=scale_dtype)


def fp8_tiles(tile: int = 128, qtype: str = "float8_e4m3fn", *, scale_dtype: Any = None) -> Rule:
  """FP8 with one scale per ``tile x tile`` block (DeepSeek-V3 style 128x128).

  >>> import jax, jax.numpy as jnp
  >>> fp8_tiles(64)("['w']", jax.ShapeDtypeStruct((128, 64), jnp.float32)).tiled_axes
  ((0, 64), (1, 64))
  """
  return _rule("fp8_tiles", qtype, tiles={-2: tile, -1: tile}, scale_dtype=scale_dtype)


def mxfp8(*, scale_dtype: Any = None) -> Rule:
  """MXFP8: e4m3 codes, a power-of-two scale per 32 inputs of each output channel.

  >>> import jax, jax.numpy as jnp
  >>> q = mxfp8()("['w']", jax.ShapeDtypeStruct((64, 16), jnp.float32))
  >>> q.qtype, q.tiled_axes, q.channelwise_axes
  ('mxfp8', ((0, 32),), (1,))
  """
  return _rule("mxfp8", "mxfp8", tiles={-2: 32}, per_channel=True, scale_dtype=scale_dtype)


def mxfp4(*, scale_dtype: Any = None) -> Rule:
  """MXFP4: e2m1 codes (two to a byte), a power-of-two scale per 32 inputs of each channel.

  >>> import jax, jax.numpy as jnp
  >>> mxfp4()("['w']", jax.ShapeDtypeStruct((64, 16), jnp.float32)).packed
  True
  """
  return _rule("mxfp4", "mxfp4", tiles={-2: 32}, per_channel=True, scale_dtype=scale_dtype)


def nvfp4(*, scale_dtype: Any = None) -> Rule:
  """NVFP4: e2m1 codes (two to a byte), an e4m3-valued scale per 16 inputs of each channel.

  >>> import jax, jax.numpy as jnp
  >>> nvfp4()("['w']", jax.ShapeDtypeStruct((64, 16), jnp.float32)).tiled_axes
  ((0, 16),)
  """
  return _rule("nvfp4", "nvfp4", tiles={-2: 16}, per_channel=True, scale_dtype=scale_dtype)


def int8_per_channel(*, scale_dtype: Any = None, calibration_method: str = "absmax") -> Rule:
  """INT8 with one scale per output channel (``calibration_method="minmax"`` adds zero
  points).

  >>> import jax, jax.numpy as jnp
  >>> int8_per_channel()("['b']", jax.ShapeDtypeStruct((16,), jnp.float32)) is None  # a vector
  True
  """
  return _rule("int8_per_channel", "int8", per_channel=True, scale_dtype=scale_dtype,
               calibration_method=calibration_method)


def int4_tiles(tile: int = 128, *, scale_dtype: Any = None) -> Rule:
  """INT4 (two to a byte) with one scale per ``tile`` inputs of each output channel.

  >>> import jax, jax.numpy as jnp
  >>> int4_tiles(32)("['w']", jax.ShapeDtypeStruct((64, 16), jnp.float32)).tiled_axes
  ((0, 32),)
  """
  return _rule("int4_tiles", "int4", tiles={-2: tile}, per_channel=True,
               scale_dtype=scale_dtype)


PRESETS: dict[str, Callable[[], Rule]] = {
    "fp8 per tensor": fp8_per_tensor, "fp8 per channel": fp8_per_channel,
    "fp8 128x128 tiles": fp8_tiles, "mxfp8": mxfp8, "mxfp4": mxfp4, "nvfp4": nvfp4,
    "int8 per channel": int8_per_channel, "int4 128 tiles": int4_tiles,
}
