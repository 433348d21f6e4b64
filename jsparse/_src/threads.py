"""Host work on a thread pool: zstd and NumPy release the GIL, so independent units of a payload
part are coded and decoded in parallel. ``JSPARSE_THREADS`` sets the number of threads (default:
the CPU count, at most 8); 1 runs everything in the calling thread.

>>> parallel_map(lambda x: x * 2, [1, 2, 3], threads=2)
[2, 4, 6]
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from typing import Callable, Iterable, Iterator, TypeVar

import jax

T = TypeVar("T")
R = TypeVar("R")
_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def default_threads() -> int:
  """``JSPARSE_THREADS``, else the CPU count (at most 8)."""
  value = os.environ.get("JSPARSE_THREADS")
  return max(1, int(value)) if value else max(1, min(8, os.cpu_count() or 1))


def in_callers_context(fn: Callable[[T], R]) -> Callable[[T], R]:
  """``fn`` to run on another thread as on the calling one: under the caller's
  ``jax.enable_x64`` setting, which JAX keeps per thread (a 64-bit leaf staged on a pool
  thread would otherwise be cut to 32 bits).

  >>> import jax, jax.numpy as jnp
  >>> with jax.enable_x64(True):
  ...   parallel_map(in_callers_context(lambda x: jnp.asarray(x).dtype.name), [2**40], threads=2)
  ['int64']
  """
  x64 = bool(jax.config.jax_enable_x64)

  def call(x: T) -> R:
    with jax.enable_x64(x64):
      return fn(x)
  return call


def parallel_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None
                 ) -> list[R]:
  """``[fn(x) for x in items]``, in order, on ``threads`` threads (the first error raised), in
  the caller's JAX context (:func:`in_callers_context`)."""
  items = list(items)
  threads = default_threads() if threads is None else threads
  if threads <= 1 or len(items) <= 1:
    return [fn(x) for x in items]
  return list(_pool(threads).map(in_callers_context(fn), items))


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
  if threads not in _POOLS:
    _POOLS[threads] = concurrent.futures.ThreadPoolExecutor(threads, "jsparse")
  return _POOLS[threads]


def bounded_map(pool: concurrent.futures.Executor, fn: Callable[[T], R], items: Iterable[T],
                window: int) -> list[R]:
  """``[fn(x) for x in items]``, in order, on ``pool`` with at most ``window`` calls in flight.
  After the first error no call is started, and those in flight are waited for before it is
  raised: nothing keeps running after this returns.

  >>> pool = concurrent.futures.ThreadPoolExecutor(2)
  >>> bounded_map(pool, lambda x: 10 // x, [1, 2, 5], window=2)
  [10, 5, 2]
  >>> started = []
  >>> def fails(x):
  ...   started.append(x)
  ...   return 1 // (x - 3)
  >>> bounded_map(pool, fails, range(1000), window=2)
  Traceback (most recent call last):
  ...
  ZeroDivisionError: integer division or modulo by zero
  >>> len(started) < 10
  True
  """
  numbered = enumerate(items)
  results: dict[int, R] = {}
  running: dict[concurrent.futures.Future, int] = {}
  error: BaseException | None = None

  def start_next() -> None:
    for i, x in numbered:
      running[pool.submit(fn, x)] = i
      return

  for _ in range(max(1, window)):
    start_next()
  while running:
    done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
    for future in done:
      i = running.pop(future)
      try:
        results[i] = future.result()
      except BaseException as e:  # noqa: BLE001 - the first is raised once nothing runs
        error = error or e
      if error is None:
        start_next()
  if error is not None:
    raise error
  return [results[i] for i in range(len(results))]


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None
                ) -> Iterator[R]:
  """Yields ``fn(x)`` for ``items`` in order, computing up to ``threads`` results ahead of the
  consumer on the pool (so at most that many wait in memory), in the caller's JAX context
  (:func:`in_callers_context`). ``fn`` must not use the pool.

  >>> list(ordered_map(lambda x: x + 1, range(4), threads=2))
  [1, 2, 3, 4]
  """
  threads = default_threads() if threads is None else threads
  if threads <= 1:
    yield from (fn(x) for x in items)
    return
  fn = in_callers_context(fn)
  pending: collections.deque = collections.deque()
  for x in items:
    pending.append(_pool(threads).submit(fn, x))
    if len(pending) > threads:
      yield pending.popleft().result()
  while pending:
    yield pending.popleft().result()
