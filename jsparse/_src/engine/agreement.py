"""What every process of a multi-controller job must decide alike: a flag or an entry,
decided by process 0 and broadcast (one small collective), so that no process runs a program
the others skip. In a single process these return their argument.

>>> agreed_flag(True), agreed_entry(None), agreed_bytes(b"run"), agreed_int(-1)
(True, None, b'run', -1)
>>> raise_if_any_failed(None)  # no process failed: returns
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jsparse._src.engine.feed import KINDS, Entry
from jsparse._src.errors import PartsLostError
from jsparse._src.engine.records import PartMeta


def agreed_flag(flag: bool) -> bool:
  """Process 0's ``flag``, on every process."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(multihost_utils.broadcast_one_to_all(np.array(bool(flag), np.int32)))


def agreed_entry(entry: Entry | None) -> Entry | None:
  """Process 0's choice of ``entry``, on every process."""
  if jax.process_count() == 1:
    return entry
  row = np.array([-1, 0, 0, 0, 0] if entry is None else
                 [entry.version, KINDS.index(entry.kind), entry.base, entry.parts,
                  entry.generation], np.int64)
  version, kind, base, parts, generation = (
      int(x) for x in multihost_utils.broadcast_one_to_all(row))
  run = agreed_bytes(b"" if entry is None else entry.run.encode("ascii")).decode("ascii")
  return None if version < 0 else Entry(version, KINDS[kind], base, parts, generation, run)


def gathered_parts(numbers: Sequence[int], metas: Sequence[PartMeta], parts: int
                   ) -> list[PartMeta] | None:
  """Every process's parts (``numbers[k]`` is described by ``metas[k]``; every process puts as
  many), as a list of ``parts`` by number on process 0 (one all-gather); None on the others,
  or where a part is not described by any process."""
  if jax.process_count() == 1:
    rows = [(n, m.size, m.digest) for n, m in zip(numbers, metas)]
  else:
    table = np.array([[n, m.size, *np.frombuffer(bytes.fromhex(m.digest), np.int64)]
                      for n, m in zip(numbers, metas)], np.int64).reshape(-1, 4)
    table = np.asarray(multihost_utils.process_allgather(table)).reshape(-1, 4)
    if jax.process_index() != 0:
      return None
    rows = [(int(n), int(size), np.array([a, b], np.int64).tobytes().hex())
            for n, size, a, b in table]
  found = {n: PartMeta(size, digest) for n, size, digest in rows}
  return [found[k] for k in range(parts)] if len(found) == parts else None


def agreed_bytes(data: bytes) -> bytes:
  """Process 0's ``data`` (at most 64 bytes), on every process."""
  if jax.process_count() == 1:
    return bytes(data)
  row = np.zeros(65, np.int32)
  row[0] = len(data)
  row[1:1 + len(data)] = np.frombuffer(data, np.uint8)
  row = np.asarray(multihost_utils.broadcast_one_to_all(row))
  return bytes(row[1:1 + int(row[0])].astype(np.uint8))


def agreed_blob(data: bytes) -> bytes:
  """Process 0's ``data`` (any length), on every process (two small broadcasts)."""
  if jax.process_count() == 1:
    return bytes(data)
  size = agreed_int(len(data))
  row = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    row[:] = np.frombuffer(data, np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(row)).astype(np.uint8))


def agreed_int(value: int) -> int:
  """Process 0's ``value`` (an int64), on every process."""
  if jax.process_count() == 1:
    return int(value)
  return int(multihost_utils.broadcast_one_to_all(np.array(value, np.int64)))


def raise_if_any_failed(error: BaseException | None) -> None:
  """Raises ``error`` on this process, or a :class:`PartsLostError` if another process failed
  (one small all-gather): every process of a job leaves a step alike, so that none waits for
  the others in a collective they skipped."""
  if jax.process_count() > 1:
    flags = np.asarray(multihost_utils.process_allgather(np.array([error is not None],
                                                                   np.int32)))
    failed = np.flatnonzero(flags.reshape(-1)).tolist()
  else:
    failed = [0] if error is not None else []
  if error is not None:
    raise error
  if failed:
    raise PartsLostError(f"process(es) {failed} failed to put their parts: the version is not "
                         "committed")
