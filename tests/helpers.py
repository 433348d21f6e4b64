"""Test helpers that reach into JAX: in one place, so a JAX upgrade touches one file."""

from __future__ import annotations

from typing import Callable


def compilations(jitted: Callable) -> int:
  """How many programs a ``jax.jit`` function has compiled so far (its cache size; a private
  JAX method, wrapped here only)."""
  return jitted._cache_size()
