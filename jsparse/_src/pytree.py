"""The one type alias for user trees.

A ``PyTree`` is any JAX pytree: dicts, lists, ``flax.nnx.State``, Linen param dicts,
dataclasses registered as pytrees. jsparse flattens it with ``jax.tree.flatten_with_path`` and
names leaves by ``jax.tree_util.keystr`` of their paths.
"""

from typing import Any

PyTree = Any
