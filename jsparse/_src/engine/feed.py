"""A *feed*: the versions a trainer has published, each one delta or anchor in parts, as a
rollout sees them. :class:`DirectoryFeed` keeps them in a directory (a local path, or a mounted
shared file system); ``ray_feed.py`` keeps them in Ray's object store.

A version is visible only once every part of it is there (:meth:`Feed.entries` lists committed
entries only), so a rollout never sees half a version.

>>> import tempfile
>>> feed = DirectoryFeed(tempfile.mkdtemp())
>>> entry = Entry(version=1, kind="anchor", base=0, parts=2)
>>> feed.put(entry, 0, b"first half")
>>> feed.entries()
[]
>>> feed.put(entry, 1, b"second half")
>>> feed.entries() == [entry], [bytes(p) for p in feed.parts(entry)]
(True, [b'first half', b'second half'])
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import shutil
from pathlib import Path
from typing import Protocol, Sequence

from jsparse._src.errors import JsparseError

KINDS = ("delta", "anchor")


class PartsLostError(JsparseError):
  """A committed version's parts can no longer be read (deleted, or their owner died)."""


@dataclasses.dataclass(frozen=True, order=True)
class Entry:
  """A published version: a ``"delta"`` from version ``base``, or an ``"anchor"`` (accepted on
  any older base), in ``parts`` parts.

  >>> sorted([Entry(4, "delta", 3, 2), Entry(2, "anchor", 1, 2)])[0].version
  2
  """

  version: int
  kind: str
  base: int
  parts: int


class Feed(Protocol):
  """Where a publisher puts parts and subscribers find them: six methods, so that another
  store (an object store API, a message queue) is one small class.

  >>> import tempfile
  >>> isinstance(DirectoryFeed(tempfile.mkdtemp()).entries(), list)
  True
  """

  def put(self, entry: Entry, part: int, data: bytes) -> None: ...
  def entries(self) -> list[Entry]: ...
  def parts(self, entry: Entry) -> Sequence: ...
  def remove(self, entry: Entry) -> None: ...
  def request_anchor(self) -> None: ...
  def take_anchor_request(self) -> bool: ...


_NAME = re.compile(r"^v(\d{20})-(delta|anchor)-from-(\d{20})-of-(\d{5})$")
_COMMITTED = "COMMITTED"


class DirectoryFeed:
  """A feed in a directory: one sub-directory per entry, each part written atomically
  (a temporary file renamed), and a ``COMMITTED`` marker written by whichever writer sees the
  last part arrive. Readers ``mmap`` the parts, so a rollout process reads only the bytes it
  needs.

  Args:
    root: the directory (created if missing).

  >>> import tempfile
  >>> feed = DirectoryFeed(tempfile.mkdtemp())
  >>> feed.put(Entry(1, "delta", 0, 1), 0, b"part")
  >>> [e.version for e in feed.entries()], feed.take_anchor_request()
  ([1], False)
  """

  def __init__(self, root: str | os.PathLike):
    self.root = Path(root)
    self.root.mkdir(parents=True, exist_ok=True)

  def _dir(self, entry: Entry) -> Path:
    return self.root / (f"v{entry.version:020d}-{entry.kind}-from-{entry.base:020d}"
                        f"-of-{entry.parts:05d}")

  def put(self, entry: Entry, part: int, data: bytes) -> None:
    """Writes part ``part`` of ``entry``; commits the entry when all its parts are there."""
    where = self._dir(entry)
    where.mkdir(parents=True, exist_ok=True)
    _write_atomically(where / f"part-{part:05d}.bin", data)
    if len(list(where.glob("part-*.bin"))) == entry.parts:
      _write_atomically(where / _COMMITTED, b"")

  def entries(self) -> list[Entry]:
    """The committed entries, by version (a delta before an anchor of the same version)."""
    found = []
    for path in self.root.iterdir():
      match = _NAME.match(path.name)
      if match and (path / _COMMITTED).exists():
        version, kind, base, parts = match.groups()
        found.append(Entry(int(version), kind, int(base), int(parts)))
    return sorted(found, key=lambda e: (e.version, KINDS.index(e.kind)))

  def parts(self, entry: Entry) -> list:
    """The parts of a committed entry, memory-mapped.

    Raises:
      PartsLostError: the entry was removed (retention) or a part is missing.
    """
    maps = []
    for part in range(entry.parts):
      try:
        with open(self._dir(entry) / f"part-{part:05d}.bin", "rb") as handle:
          maps.append(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                      if os.fstat(handle.fileno()).st_size else b"")
      except FileNotFoundError as e:
        raise PartsLostError(f"version {entry.version} ({entry.kind}): part {part} is gone") \
            from e
    return maps

  def part_bytes(self, entry: Entry) -> int:
    return sum(p.stat().st_size for p in self._dir(entry).glob("part-*.bin"))

  def remove(self, entry: Entry) -> None:
    """Deletes an entry (its marker first, so that no reader starts on it)."""
    where = self._dir(entry)
    (where / _COMMITTED).unlink(missing_ok=True)
    shutil.rmtree(where, ignore_errors=True)

  def request_anchor(self) -> None:
    """Asks the publisher for an anchor at its next version (a subscriber lost its state)."""
    _write_atomically(self.root / "ANCHOR_REQUESTED", b"")

  def take_anchor_request(self) -> bool:
    """Whether an anchor was requested since the last call (and clears the request)."""
    try:
      (self.root / "ANCHOR_REQUESTED").unlink()
      return True
    except FileNotFoundError:
      return False


def _write_atomically(path: Path, data: bytes) -> None:
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_bytes(data)
  os.replace(tmp, path)
