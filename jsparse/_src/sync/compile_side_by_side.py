"""A first sync's programs compiled side by side instead of one after another.

A sync runs one jitted program per chunk (``core/chunks.py``), and the first sync of a tree of
several chunk structures compiles one program per structure: as the chunks run, each waits for
its own. XLA releases the GIL while it compiles, so :func:`compile_distinct` compiles the
distinct programs of a stage on several threads first (their tracing still takes turns); the
calls then find them compiled. On a 2-core CPU, the first send of 1,000 leaves (five chunk
structures) took 3.7 s instead of 4.2 s.

>>> import jax, jax.numpy as jnp
>>> double = jax.jit(lambda x: 2 * x)
>>> calls = [(("double", 3), double, (jnp.zeros(3),), {}) for _ in range(4)]
>>> compile_distinct(calls), compile_distinct(calls)  # one distinct program, then none
(1, 0)
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Hashable, Iterable

import jax

from jsparse._src.threads import default_threads

Call = tuple[Hashable, Callable, tuple, dict]  # (key, jitted function, args, kwargs)

_DONE: set = set()  # keys compiled by this process
_LOCK = threading.Lock()
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def _abstract(x: Any) -> Any:
  """An array as a call with it compiles for (shape, dtype and sharding; None when
  uncommitted, as ``jit`` sees it); anything else as it is."""
  if not isinstance(x, jax.Array):
    return x
  return jax.ShapeDtypeStruct(x.shape, x.dtype,
                              sharding=x.sharding if getattr(x, "committed", True) else None)


def _compile(call: Call) -> None:
  _, fn, args, kwargs = call
  args, kwargs = jax.tree.map(_abstract, (args, kwargs))
  try:
    fn.lower(*args, **kwargs).compile()
  except Exception:  # pylint: disable=broad-except
    pass  # the call itself raises it, with its own checks' message first


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  with _LOCK:  # its own pool: a call from a host-coding thread must not wait on its pool
    if not _POOL:
      _POOL.append(concurrent.futures.ThreadPoolExecutor(default_threads(), "jsparse-compile"))
    return _POOL[0]


def compile_distinct(calls: Iterable[Call]) -> int:
  """Compiles the program of each call whose ``key`` (what tells its program apart: the
  function's static arguments, its arrays' shapes and placements) this process has not
  compiled yet, one per key, on up to ``JSPARSE_THREADS`` threads at once; returns how many.
  Arrays are taken by their shapes, dtypes and shardings (nothing is run). A key that does
  not match what ``jit`` keys on costs a compilation at the call, never a wrong result; a
  call that fails to compile here is left to fail at the call, with its message."""
  todo: dict[Hashable, Call] = {}
  with _LOCK:
    for call in calls:
      if call[0] not in _DONE:
        todo.setdefault(call[0], call)
  if len(todo) > 1 and default_threads() > 1:
    list(_pool().map(_compile, todo.values()))
  with _LOCK:  # a single one compiles at its call, as it would anyway
    _DONE.update(todo)
  return len(todo)
