"""Quantized rollouts: sync a trainer's masters into the FP8 / INT8 / MX / 4-bit weights a rollout
serves, sparsely and bit for bit (needs ``qwix``: ``pip install jsparse[quantized]``).

The rollout's exact target is qwix's quantizer run on the trainer's masters: the codes and scales
of ``qwix``'s ``quantize(master, how)``. With ``make_plan(params, quantize=rule)`` the plan is
made on that target: each quantized leaf is a qwix ``QArray`` (4-bit codes: a
:class:`PackedQArray`, two codes a byte) whose codes and scales sync like any other leaves, so a
code that does not flip costs nothing, scales travel as their own small arrays, and an overflowing
segment goes dense as usual. ``Sender.send`` takes the trainer's tree and quantizes it (where its
blocks live, on a mesh); the ``Receiver`` holds what the rollout model consumes.

>>> import jax, jax.numpy as jnp, jsparse
>>> from jsparse import quantized
>>> params = {'w': jax.random.normal(jax.random.key(0), (256, 256)), 'b': jnp.zeros(256)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16, quantize=quantized.fp8_tiles())
>>> sender = jsparse.Sender(plan, params)
>>> receiver = jsparse.Receiver(plan, plan.cast(params))
>>> params = jax.tree.map(lambda x: x * 1.001, params)
>>> _ = receiver.receive(sender.send(params))
>>> receiver.params['w'].qvalue.dtype.name, receiver.params['w'].scale.shape
('float8_e4m3fn', (2, 2))
"""

from __future__ import annotations

import jax

from jsparse._src.pytree import PyTree
from jsparse._src.quant.presets import (PRESETS, fp8_per_channel, fp8_per_tensor, fp8_tiles,
                                        int4_tiles, int8_per_channel, mxfp4, mxfp8, nvfp4)
from jsparse._src.quant.spec import QTYPES, PackedQArray, Quantization


def unpack(tree: PyTree) -> PyTree:
  """``tree`` with every :class:`PackedQArray` (4-bit codes, two a byte) turned into the qwix
  ``QArray`` with 4-bit codes that a model consumes; other nodes are returned as they are.

  >>> import jax.numpy as jnp
  >>> q = Quantization("int4").quantize(jnp.linspace(-1.0, 1.0, 8).reshape(2, 4))
  >>> unpack({'w': q})['w'].qvalue.shape
  (2, 4)
  """
  return jax.tree.map(lambda x: x.unpack() if isinstance(x, PackedQArray) else x, tree,
                      is_leaf=lambda x: isinstance(x, PackedQArray))


__all__ = [
    "PRESETS", "PackedQArray", "QTYPES", "Quantization", "fp8_per_channel",
    "fp8_per_tensor", "fp8_tiles", "int4_tiles", "int8_per_channel", "mxfp4", "mxfp8", "nvfp4",
    "unpack",
]
