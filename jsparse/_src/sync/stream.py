"""A version as a stream of parts: which units each part carries, and producing the parts one
by one, coded ahead on a thread pool.

Every trainer process cuts the units it sends (``core/units.py``) into *pieces* of at most
``chunk_bytes`` of rollout data (a unit larger than that is a piece alone), in the order the
device programs run (``core/chunks.py``), so a piece is coded as soon as its chunks are
diffed. All processes make the same number of parts (the most pieces any process has; a
process with fewer sends empty parts), so part ``process * pieces + k`` is known everywhere
without communication. Each part is a self-contained, checksummed part of the version
(``wire/parts.py``): a receiver checks and decodes it on arrival and applies the version when
all have arrived.

>>> import jax.numpy as jnp, jsparse
>>> params = {'a': jnp.zeros(70000), 'b': jnp.zeros(70000), 'c': jnp.zeros(10)}
>>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
>>> mine, per_process = stream_pieces(plan, jax.tree.leaves(plan.cast(params)), 150_000)
>>> [[u.segment for u in piece] for piece in mine], per_process
([[0], [1, 2]], 2)
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import jax

from jsparse._src.core.chunks import chunks_of
from jsparse._src.core.plan import Plan
from jsparse._src.core.units import Unit, owned_units, unit_slot
from jsparse._src.sync.programs import DeviceChanges
from jsparse._src.threads import default_threads, ordered_map

Piece = tuple[Unit, ...]


def _pieces(plan: Plan, units: Sequence[Unit], chunk_bytes: int) -> list[Piece]:
  order = {s: k for k, c in enumerate(chunks_of(plan)) for s in c.segment_ids}
  pieces: list[list[Unit]] = []
  filled = chunk_bytes
  for unit in sorted(units, key=lambda u: (order[u.segment], u.segment)):
    slot = unit_slot(plan, unit)
    size = slot.size * slot.dtype.itemsize
    if filled + size > chunk_bytes:
      pieces.append([])
      filled = 0
    pieces[-1].append(unit)
    filled += size
  return [tuple(p) for p in pieces]


def stream_pieces(plan: Plan, snapshot: Sequence[jax.Array], chunk_bytes: int
                  ) -> tuple[list[Piece], int]:
  """This process's pieces (padded with empty ones to the common count) and the number of
  pieces every process sends."""
  per_process = [_pieces(plan, owned_units(plan, snapshot, p), chunk_bytes)
                 for p in range(jax.process_count())]
  count = max(1, max(len(p) for p in per_process))
  mine = per_process[jax.process_index()]
  return mine + [()] * (count - len(mine)), count


class Version:
  """One version as a sender sends it: this process's parts of it, produced as they are
  iterated (coded ahead on a thread pool while the device copies and the link move the parts
  before), from :meth:`~jsparse.Sender.send_stream` and :meth:`~jsparse.Sender.anchor_stream`.
  :meth:`join` makes them one payload; :meth:`~jsparse.Sender.send` returns that of a version
  of one part.

  Attributes:
    parts: how many parts the version has (all processes together).
    numbers: the numbers of this process's parts, in the order they are produced.
    version: the version the parts produce; ``base_version``: the version a delta applies to.
    anchor: whether the version is an anchor (accepted on any older base), whether it was asked
      for or the sender had to resync (a version it moved to was never delivered whole).

  >>> import jax.numpy as jnp, jsparse
  >>> params = {'a': jnp.zeros(70000), 'b': jnp.zeros(70000)}
  >>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
  >>> stream = jsparse.Sender(plan, params).send_stream(params, chunk_bytes=150_000)
  >>> stream.parts, list(stream.numbers), [len(part) for part in stream]
  (2, [0, 1], [103, 103])
  >>> stream.version, stream.base_version, stream.anchor
  (1, 0, False)
  """

  def __init__(self, numbers: range, parts: int, produced: Iterator[bytes], *, version: int,
               base_version: int, anchor: bool):
    self.numbers, self.parts = numbers, parts
    self.version, self.base_version, self.anchor = version, base_version, anchor
    self._produced = produced

  def __iter__(self) -> "Version":
    return self

  def __next__(self) -> bytes:
    return next(self._produced)

  def join(self) -> bytes:
    """The parts not yet iterated as one payload (the version's, if none was): what
    :meth:`~jsparse.Receiver.receive` takes like the list of the parts. In a job of several
    processes each joins its own parts; the processes' payloads joined, in any order, are
    the version's.

    >>> import jax.numpy as jnp, jsparse
    >>> params = {'a': jnp.zeros(70000), 'b': jnp.zeros(70000)}
    >>> plan = jsparse.make_plan(params, rollout_dtype=jnp.bfloat16)
    >>> sender, receiver = jsparse.Sender(plan, params), jsparse.Receiver(plan, plan.cast(params))
    >>> version = sender.send_stream({'a': jnp.ones(70000), 'b': params['b']}, chunk_bytes=150_000)
    >>> payload = version.join()
    >>> version.parts, float(receiver.receive(payload)['a'][0])
    (2, 1.0)
    """
    return b"".join(self)

  def close(self) -> None:
    """Stops producing (the sender then sends an anchor next)."""
    self._produced.close()


def produce(pieces: Sequence[Piece], encode: Callable[[int, Piece], bytes],
            done: Callable[[int], None],
            prefetch: Callable[[Piece], None] | None = None) -> Iterator[bytes]:
  """Yields ``encode(k, piece)`` for every piece, in order, coded ahead on the thread pool;
  calls ``done(total bytes)`` after the last. ``prefetch(piece)``, if given, starts what a
  piece's coding will wait for (its arrays' copies to the host), a few pieces before it is
  coded."""
  ahead = default_threads() + 1
  for piece in pieces[:ahead] if prefetch else ():
    prefetch(piece)

  def encode_next(item: tuple[int, Piece]) -> bytes:
    k, piece = item
    if prefetch and k + ahead < len(pieces):
      prefetch(pieces[k + ahead])
    return encode(k, piece)

  total = 0
  for data in ordered_map(encode_next, list(enumerate(pieces))):
    total += len(data)
    yield data
  done(total)


def start_host_copies(changes: DeviceChanges, piece: Piece) -> None:
  """Starts copying the diff's outputs that ``piece``'s units are coded from to the host
  (``jax.Array.copy_to_host_async``), so that on an accelerator the copies of the next pieces
  overlap the coding of this one instead of each array waiting for its own transfer."""
  columns = (changes.delta.indices, changes.delta.values, changes.old_values, changes.ranks,
             changes.block_counts)
  for unit in piece:
    start_segment_copies(columns, unit.segment)


def start_segment_copies(columns: Iterable[Sequence | None], segment: int) -> None:
  """Starts copying ``segment``'s entry of each per-segment column (None: no such column; an
  entry that is not a device array: nothing to copy) to the host."""
  for arrays in columns:
    if arrays is not None and isinstance(arrays[segment], jax.Array):
      arrays[segment].copy_to_host_async()
