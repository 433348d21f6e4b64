"""How the rollout quantizes one leaf: :class:`Quantization`, a hashable form of qwix's
``HowToQuantize``, and the programs that run it whole or block by block over a mesh.

The rollout's exact target is qwix's quantizer run on the trainer's masters: the codes and scales
of ``qwix``'s ``quantize(master, how)``, bit for bit. A leaf split over a mesh is quantized where
its blocks live: each device calibrates its own block, and the reductions over split dimensions
(absmax, min, max) are finished with ``pmax``/``pmin``, which are exact, so no device gathers a
parameter it does not own and the bits equal qwix's on the whole leaf.

Codes of 4-bit types (``int4``, ``mxfp4``, ``nvfp4``) are held two to a byte along the last axis
(:class:`PackedQArray`); :meth:`PackedQArray.unpack` gives qwix's ``QArray``.

>>> import jax.numpy as jnp
>>> q = Quantization("float8_e4m3fn", tiled_axes=((0, 2),))
>>> codes = q.quantize(jnp.arange(8.0).reshape(4, 2))
>>> codes.qvalue.dtype.name, codes.scale.shape
('float8_e4m3fn', (2, 1))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from qwix._src.core import qarray as qwix_qarray

from jsparse._src.core.bits import is_four_bit
from jsparse._src.core.layout import Layout
from jsparse._src.errors import ConfigError

QArray = qwix_qarray.QArray

# qtype name -> storage dtype of its codes
QTYPES = {
    "int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2,
    "mxfp8": jnp.float8_e4m3fn, "int4": jnp.int4, "mxfp4": jnp.float4_e2m1fn,
    "nvfp4": jnp.float4_e2m1fn,
}
_NAMED = ("mxfp8", "mxfp4", "nvfp4")  # qwix takes these as strings, the others as dtypes
_CALIBRATIONS = ("absmax", "minmax", "fixed", "rms")


@flax.struct.dataclass
class PackedQArray:
  """A 4-bit quantized array whose codes are held two to a byte along the last axis.

  Attributes:
    packed: ``uint8`` codes, shape ``(..., n // 2)``: element ``2i`` in the low nibble (as
      ``lax.bitcast_convert_type`` lays out 4-bit types), ``2i + 1`` in the high one.
    scale: the scales, as qwix makes them.
    zero_point: always None (4-bit types are synced with symmetric calibration only).
    qtype: the logical type, as qwix names it (``jnp.int4``, ``'mxfp4'`` or ``'nvfp4'``).

  >>> import jax.numpy as jnp
  >>> q = Quantization("int4").quantize(jnp.linspace(-1.0, 1.0, 8).reshape(2, 4))
  >>> q.packed.shape, q.unpack().qvalue.dtype.name
  ((2, 2), 'int4')
  """

  packed: jax.Array
  scale: jax.Array
  zero_point: jax.Array | None = None
  qtype: Any = flax.struct.field(pytree_node=False, default=None)

  def unpack(self) -> QArray:
    """The qwix ``QArray`` with 4-bit codes, as the rollout model consumes it."""
    return QArray(unpack_codes(self.packed, _code_dtype(self.qtype)), self.scale,
                  self.zero_point, self.qtype)


def pack_codes(codes: jax.Array) -> jax.Array:
  """4-bit codes ``(..., n)`` (n even) as ``uint8`` ``(..., n // 2)``, bit for bit."""
  return lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2),
                                  jnp.uint8)


def unpack_codes(packed: jax.Array, dtype: Any) -> jax.Array:
  """Inverse of :func:`pack_codes`."""
  codes = lax.bitcast_convert_type(packed, dtype)
  return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _code_dtype(qtype: Any) -> Any:
  return QTYPES[qtype if isinstance(qtype, str) else np.dtype(qtype).name]



@dataclasses.dataclass(frozen=True)
class Quantization:
  """How the rollout quantizes a leaf: qwix's ``HowToQuantize`` in a hashable form.

  Attributes:
    qtype: one of ``int8``, ``float8_e4m3fn``, ``float8_e5m2``, ``mxfp8``, ``int4``, ``mxfp4``,
      ``nvfp4`` (a name or the dtype).
    channelwise_axes: axes with a scale per index.
    tiled_axes: ``((axis, tile_size), ...)``: axes with a scale per tile (sub-channel).
    calibration_method: qwix's calibration (``absmax``, ``minmax``, ``fixed,a,b``, ``rms,k``).
    scale_dtype: the dtype the rollout holds scales in (None: the master's dtype, as qwix).

  The axes of a spec are resolved against a leaf's shape by :meth:`for_leaf` (negative axes,
  ``1 / tile_count`` tile sizes); the rollout's target is exactly
  ``qwix.quantize(master, how)`` (then ``scale.astype(scale_dtype)``), run under ``jax.jit``
  (eager qwix may differ by one ulp in the scale: under jit, XLA divides by the type's bound as
  a multiplication by its reciprocal).

  >>> import jax.numpy as jnp
  >>> q = Quantization(jnp.int8, channelwise_axes=(-1,)).for_leaf("['w']", (4, 6),
  ...                                                             jnp.dtype("float32"), None)
  >>> q.qtype, q.channelwise_axes, q.quantize(jnp.ones((4, 6))).scale.shape
  ('int8', (1,), (1, 6))
  """

  qtype: Any
  channelwise_axes: tuple[int, ...] = ()
  tiled_axes: tuple[tuple[int, Any], ...] = ()
  calibration_method: str = "absmax"
  scale_dtype: Any = None

  def __post_init__(self):
    qtype = self.qtype if isinstance(self.qtype, str) else _dtype_name(self.qtype)
    if qtype not in QTYPES:
      raise ConfigError(f"unsupported qtype {self.qtype!r}: jsparse syncs {sorted(QTYPES)}")
    object.__setattr__(self, "qtype", qtype)
    object.__setattr__(self, "channelwise_axes", tuple(int(a) for a in self.channelwise_axes))
    tiled = self.tiled_axes.items() if isinstance(self.tiled_axes, dict) else self.tiled_axes
    object.__setattr__(self, "tiled_axes", tuple(
        (int(a), float(t) if isinstance(t, (float, np.floating)) else int(t)) for a, t in tiled))
    if self.scale_dtype is not None:
      object.__setattr__(self, "scale_dtype", np.dtype(self.scale_dtype))
    method = "".join(self.calibration_method.lower().split())  # one spelling, one fingerprint
    object.__setattr__(self, "calibration_method", method)
    if self.method not in _CALIBRATIONS:
      raise ConfigError(f"unsupported calibration_method {self.calibration_method!r}: one of "
                        f"{_CALIBRATIONS} (with qwix's arguments)")

  @classmethod
  def of(cls, how: Any, scale_dtype: Any = None) -> "Quantization":
    """A :class:`Quantization` from qwix's ``HowToQuantize`` (or a Quantization, returned)."""
    if isinstance(how, Quantization):
      return how
    if not isinstance(how, qwix_qarray.HowToQuantize):
      raise ConfigError(f"expected a jsparse.quantized.Quantization or qwix HowToQuantize, got "
                        f"{type(how).__name__}")
    if how.noise_fn is not None:
      raise ConfigError("a HowToQuantize with noise_fn (stochastic rounding) gives other codes on "
                        "every run: the rollout could not reproduce them; drop noise_fn")
    return cls(how.qtype, tuple(how.channelwise_axes), tuple(how.tiled_axes.items()),
               how.calibration_method, scale_dtype)

  @property
  def method(self) -> str:
    """The calibration method's name (``absmax``, ``minmax``, ``fixed`` or ``rms``)."""
    return self.calibration_method.split(",")[0]

  @property
  def method_args(self) -> list[float]:
    """The calibration method's arguments (a factor, or a fixed range)."""
    try:
      return [float(a) for a in self.calibration_method.split(",")[1:]]
    except ValueError:
      raise ConfigError(f"calibration_method {self.calibration_method!r}: its arguments must be "
                        "numbers") from None

  @property
  def has_zero_point(self) -> bool:
    """Whether qwix makes zero points (asymmetric calibration: ``minmax``, or an asymmetric
    ``fixed`` range)."""
    args = self.method_args
    return self.method == "minmax" or (self.method == "fixed" and len(args) == 2
                                       and args[0] + args[1] != 0)

  @property
  def qwix_qtype(self) -> Any:
    """The qtype as qwix takes it (a name for the MX/NV formats, else the dtype)."""
    return self.qtype if self.qtype in _NAMED else QTYPES[self.qtype]

  @property
  def code_dtype(self) -> np.dtype:
    return np.dtype(QTYPES[self.qtype])

  @property
  def packed(self) -> bool:
    """Whether codes are 4-bit and held two to a byte."""
    return is_four_bit(self.code_dtype)

  def how(self) -> Any:
    """qwix's ``HowToQuantize`` for this spec."""
    return qwix_qarray.HowToQuantize(qtype=self.qwix_qtype,
                                     channelwise_axes=self.channelwise_axes,
                                     tiled_axes=dict(self.tiled_axes),
                                     calibration_method=self.calibration_method)

  def for_leaf(self, path: str, shape: tuple[int, ...], dtype: np.dtype,
               layout: Layout | None) -> "Quantization":
    """This spec resolved for one leaf (axes made non-negative and sorted, tile sizes
    integers, the scale dtype named), checked against its shape and its blocks over the
    trainer's mesh, and traced once (abstractly) with qwix.

    Raises:
      ConfigError: naming the leaf, for an axis out of range, a tile size that does not divide
        its axis, a tile split across devices, odd 4-bit rows, a 4-bit zero point, a non-float
        leaf, or a calibration qwix refuses.
    """
    ndim = len(shape)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ConfigError(f"leaf {path}: only floating leaves can be quantized, it is {dtype}")

    def axis_of(a: int) -> int:
      if not -ndim <= a < ndim:
        raise ConfigError(f"leaf {path}: axis {a} out of range for shape {shape}")
      return a % ndim

    channelwise = tuple(sorted(axis_of(a) for a in self.channelwise_axes))
    tiled = []
    for a, tile in self.tiled_axes:
      a = axis_of(a)
      size = round(shape[a] * tile) if isinstance(tile, float) else int(tile)
      if size <= 0 or shape[a] % size:
        raise ConfigError(f"leaf {path}: tile size {tile} does not divide axis {a} of shape "
                          f"{shape}")
      tiled.append((a, size))
    resolved = dataclasses.replace(self, channelwise_axes=channelwise,
                                   tiled_axes=tuple(sorted(tiled)),
                                   scale_dtype=np.dtype(self.scale_dtype or dtype))
    if self.packed:
      if resolved.has_zero_point:
        raise ConfigError(f"leaf {path}: {self.qtype} is synced with symmetric calibration only "
                          "(a 4-bit zero point cannot be packed)")
      if not shape or shape[-1] % 2:
        raise ConfigError(f"leaf {path}: {self.qtype} codes are packed two to a byte along the "
                          f"last axis, which must be even (shape {shape})")
    try:
      jax.eval_shape(resolved.quantize, jax.ShapeDtypeStruct(shape, dtype))
    except (ValueError, TypeError) as e:
      raise ConfigError(f"leaf {path}: qwix cannot quantize it as {resolved}: {e}") from None
    if layout is not None:
      resolved._check_blocks(path, shape, layout)
    return resolved

  def _check_blocks(self, path: str, shape: tuple[int, ...], layout: Layout) -> None:
    block = layout.block_shape(shape)
    for a, tile in self.tiled_axes:
      if block[a] % tile:
        raise ConfigError(
            f"leaf {path}: a tile of {tile} along axis {a} is split across devices (the trainer's "
            f"blocks hold {block[a]} of {shape[a]}); shard that axis in multiples of the tile, "
            "or choose a tile that divides the block")
    if self.packed and block[-1] % 2:
      raise ConfigError(f"leaf {path}: {self.qtype} codes are packed in pairs along the last "
                        f"axis, but the trainer's blocks hold {block[-1]} (odd) of it")
    split_reduced = [a for a in self.reduced_axes(len(shape)) if layout.parts[a] > 1]
    if self.method == "rms" or (split_reduced and self.method != "fixed"
                                and any(x < 0 for x in self.method_args[:1])):
      raise ConfigError(
          f"leaf {path}: calibration {self.calibration_method!r} is not exact when each device "
          "calibrates its own block; use absmax or minmax (non-negative factors) or a fixed "
          "range, or do not split the leaf")

  def reduced_axes(self, ndim: int) -> list[int]:
    """The axes the calibration reduces over (neither channelwise nor tiled)."""
    tiled = dict(self.tiled_axes)
    return [a for a in range(ndim) if a not in self.channelwise_axes and a not in tiled]

  def scale_spec(self, layout: Layout) -> jax.sharding.PartitionSpec:
    """How the scales (and zero points) of a leaf split over ``layout`` are split: along the
    split axes that have a scale per index or per tile; whole along the reduced ones, and
    everywhere for a fixed range (qwix makes it per tensor)."""
    ndim = len(layout.dim_axes)
    reduced = self.reduced_axes(ndim)
    return jax.sharding.PartitionSpec(*[
        None if self.method == "fixed" or a in reduced or not layout.dim_axes[a]
        else layout.spec[a] for a in range(ndim)])

  def quantize(self, x: jax.Array) -> QArray | PackedQArray:
    """Quantizes a whole leaf, exactly as qwix (the reference)."""
    return self._finish(x, qwix_qarray.calibrate(x, self.how()))

  def quantize_blocks(self, x: jax.Array, layout: Layout) -> QArray | PackedQArray:
    """Quantizes a leaf split over ``layout``'s mesh where its blocks are, with the same bits as
    :meth:`quantize` on the whole leaf."""
    mesh_axes = tuple(m for a in self.reduced_axes(x.ndim) for m in layout.dim_axes[a])

    def block(xb: jax.Array):
      calibration = qwix_qarray.calibrate(xb, self.how())
      if mesh_axes and self.method != "fixed":  # max and min are exact across devices
        calibration = {k: (lax.pmin if k == "min" else lax.pmax)(v, mesh_axes)
                       for k, v in calibration.items()}
      return self._finish(xb, calibration)

    scale = self.scale_spec(layout)
    return layout.shard_map(block, in_specs=(layout.spec,),
                            out_specs=self._node(layout.spec, scale, scale))(x)

  def _finish(self, x: jax.Array, calibration: dict) -> QArray | PackedQArray:
    scale, zero_point = qwix_qarray.compute_scale_zero_point(calibration, self.qwix_qtype)
    q = qwix_qarray.quantize_with_scale_zero_point(x, self.qwix_qtype, scale, zero_point)
    scale = q.scale if self.scale_dtype is None else q.scale.astype(self.scale_dtype)
    return self._node(q.qvalue, scale, q.zero_point)

  def _node(self, codes: Any, scale: Any, zero_point: Any) -> QArray | PackedQArray:
    zero_point = zero_point if self.has_zero_point else None
    if self.packed:
      packed = pack_codes(codes) if isinstance(codes, jax.Array) else codes
      return PackedQArray(packed, scale, zero_point, self.qwix_qtype)
    return QArray(codes, scale, zero_point, self.qwix_qtype)


def _dtype_name(dtype: Any) -> str:
  try:
    return np.dtype(dtype).name
  except TypeError:
    return repr(dtype)
