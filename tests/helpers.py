"""Test helpers that reach into JAX: in one place, so a JAX upgrade touches one file."""

from __future__ import annotations

from typing import Callable


def compilations(jitted: Callable) -> int:
  """How many programs a ``jax.jit`` function has compiled so far (its cache size; a private
  JAX method, wrapped here only)."""
  return jitted._cache_size()


def drop_queued_compilations() -> None:
  """Drops the slot levels a finished test requested and the background thread has not started
  compiling (``programs.SlotLevels``): they are for that test's plans. Left queued, they
  compiled on while the next tests ran (on a 2-core machine, as much compile time in the
  background as in the tests themselves)."""
  from jsparse._src.sync import programs
  programs.cancel_slot_levels()


def release_compiled_programs_if_many(limit: int = 20000) -> None:
  """Drops JAX's compiled programs once this process maps more than ``limit`` memory regions.

  Each XLA:CPU executable maps a few regions; a long test session (hypothesis compiles a
  program per drawn plan) would reach the kernel's ``vm.max_map_count`` (65530 by default),
  where the next compilation segfaults. Seen here twice before this guard.
  """
  import gc
  from pathlib import Path

  import jax

  from jsparse._src.sync import staging
  maps = Path("/proc/self/maps")
  if maps.exists() and sum(1 for _ in maps.open()) > limit:
    jax.clear_caches()
    staging.forget_compiled()  # what jsparse knew compiled is gone too
    gc.collect()
