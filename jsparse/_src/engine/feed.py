"""A *feed*: the versions a trainer has published, each one delta or anchor in parts, as a
rollout sees them. :class:`DirectoryFeed` keeps them in a directory (a local path, or a mounted
shared file system); ``ray_feed.py`` keeps them in Ray's object store, ``object_feed.py`` in an
object store.

A feed is storage only: parts, then a *commit* written create-only once every part is in (so a
rollout never sees half a version), the run's marker and the publishers' generation claims.
What a commit or claim says, and whether to trust it, is decided in ``records.py`` and
``ledger.py``, the same for every feed kind.

>>> import tempfile
>>> feed = DirectoryFeed(tempfile.mkdtemp())
>>> entry = Entry(version=1, kind="anchor", base=0, parts=2)
>>> feed.put(entry, 0, b"first half"); feed.put(entry, 1, b"second half")
>>> feed.entries(), feed.pending() == [entry]
([], True)
>>> feed.commit(entry, b"the commit record") == b"the commit record"
True
>>> feed.entries() == [entry], [bytes(p) for p in feed.parts(entry)]
(True, [b'first half', b'second half'])
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterator, Protocol, Sequence

from jsparse._src.errors import ArgumentError, ConfigError, PartsLostError
from jsparse._src.options import typed_argument

KINDS = ("delta", "anchor")
MAX_VERSION = 1 << 62  # versions, bases and generations are below it (they travel as int64)
MAX_PARTS = 99_999  # parts of one version
STATUS_BYTES = 4096  # a rollout's status record is at most this long
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_COMMIT_FIXED, _COMMIT_PER_PART = 1024, 64


def commit_bytes_cap(parts: int) -> int:
  """The most bytes a commit of ``parts`` parts takes: a read of a commit stops past it."""
  return _COMMIT_FIXED + _COMMIT_PER_PART * parts


@dataclasses.dataclass(frozen=True, order=True)
class Entry:
  """A published version: a ``"delta"`` from version ``base``, or an ``"anchor"`` (accepted on
  any older base), in ``parts`` parts, by the publisher of ``generation`` in run ``run`` (hex).

  >>> sorted([Entry(4, "delta", 3, 2), Entry(2, "anchor", 1, 2)])[0].version
  2
  """

  version: int
  kind: str
  base: int
  parts: int
  generation: int = 0
  run: str = ""

  def __post_init__(self):
    for name in ("version", "base", "generation"):
      value = getattr(self, name)
      if type(value) is not int or not 0 <= value < MAX_VERSION:
        raise ConfigError(f"an entry's {name} is an int in [0, 2**62), got {value!r}")
    if self.kind not in KINDS:
      raise ConfigError(f"an entry's kind is one of {KINDS}, got {self.kind!r}")
    if type(self.parts) is not int or not 1 <= self.parts <= MAX_PARTS:
      raise ConfigError(f"an entry has 1 to {MAX_PARTS} parts, got {self.parts!r}")
    if self.run and not _RUN_HEX.match(self.run):
      raise ConfigError(f"an entry's run is 32 hex digits, got {self.run!r}")

  @property
  def name(self) -> str:
    """The entry's name in a feed (its directory, or its objects' prefix)."""
    return (f"v{self.version:020d}-{self.kind}-from-{self.base:020d}-of-{self.parts:05d}"
            f"-g{self.generation:020d}-{self.run or _NO_RUN}")

  @classmethod
  def named(cls, name: str) -> "Entry | None":
    """The entry of a feed name (None: not an entry's name, or out of range)."""
    match = _NAME.match(name)
    if not match:
      return None
    version, kind, base, parts, generation, run = match.groups()
    try:
      return cls(int(version), kind, int(base), int(parts), int(generation),
                 "" if run == _NO_RUN else run)
    except ConfigError:
      return None


class Feed(Protocol):
  """Where a publisher puts parts and subscribers find them: storage only (opaque records
  and parts), so that another store (an object store API, a message queue) is one small class;
  what to trust is decided above it (``ledger.py``).

  :meth:`put` stores a part; :meth:`commit` stores a version's commit record once every part
  is in (create-only: the first record wins and is returned; :meth:`remove_commit` drops one
  that does not verify). :meth:`entries` lists the committed entries' names,
  :meth:`read_commit` returns a commit record (bounded by its part count); :meth:`pending`
  lists entries with parts and no commit, e.g. left by a publish that failed half-way, which
  the publisher (process 0) removes (:meth:`remove`). :meth:`parts` returns the parts of a
  committed entry as objects with ``len`` and slicing (``bytes``-like), each checked against
  the sizes (and checksums) its commit gives, or raises :class:`PartsLostError`.

  A feed belongs to one run: :meth:`claim_run` records the publisher's run id the first time
  (an atomic create-if-absent) and returns the id the feed holds, so that a second trainer is
  refused and a rollout restored from another run's state is told (:meth:`run_id`). Each
  publisher claims a generation (:meth:`claim_generation`, create-only; :meth:`generations`,
  :meth:`read_generation`) so that a replaced one is fenced off. Each rollout reports what it
  holds in a status record of its own, replaced at every report (:meth:`put_status`,
  :meth:`statuses`, :meth:`remove_status`).

  >>> import tempfile
  >>> isinstance(DirectoryFeed(tempfile.mkdtemp()).entries(), list)
  True
  """

  def put(self, entry: Entry, part: int, data: bytes) -> None: ...
  def commit(self, entry: Entry, record: bytes) -> bytes: ...
  def remove_commit(self, entry: Entry) -> None: ...
  def entries(self) -> list[Entry]: ...
  def read_commit(self, entry: Entry) -> bytes: ...
  def pending(self) -> list[Entry]: ...
  def parts(self, entry: Entry, expected: Sequence | None = None,
            check_digests: bool = False) -> Sequence: ...
  def remove(self, entry: Entry) -> None: ...
  def request_anchor(self) -> None: ...
  def take_anchor_request(self) -> bool: ...
  def run_id(self) -> bytes | None: ...
  def claim_run(self, run_id: bytes) -> bytes: ...
  def generations(self) -> list[int]: ...
  def read_generation(self, generation: int) -> bytes: ...
  def claim_generation(self, generation: int, record: bytes) -> bool: ...
  def put_status(self, rollout: str, record: bytes) -> None: ...
  def statuses(self) -> dict[str, bytes]: ...
  def remove_status(self, rollout: str) -> None: ...


_NO_RUN = "norun"
_RUN_HEX = re.compile(r"^[0-9a-f]{32}$")
_NAME = re.compile(r"^v(\d{20})-(delta|anchor)-from-(\d{20})-of-(\d{5})-g(\d{20})-"
                   r"([0-9a-f]{32}|norun)$")
_GENERATION = re.compile(r"^GENERATION-(\d{20})$")
_PART = re.compile(r"^part-(\d{5})\.bin$")
_COMMITTED = "COMMITTED"
_ANCHOR_REQUESTED = "ANCHOR_REQUESTED"
_RUN = "RUN"
_RUN_BYTES = 16
_STATUS = "status"
_GENERATION_BYTES = 512
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _sort_key(entry: Entry) -> tuple[int, int]:
  return entry.version, KINDS.index(entry.kind)


def _what(mode: int) -> str:
  """What kind of file ``mode`` (an ``st_mode``) is, in words."""
  for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                     (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                     (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                     (stat.S_ISBLK, "a block device")):
    if test(mode):
      return name
  return "an unknown kind of file"


class FilePart:
  """One part file, open for reading: ``len`` and slicing read only the bytes asked for, with
  ``os.pread`` on the file held open (not memory-mapped: a file truncated under a map would
  kill the reader with ``SIGBUS``). A read that comes back short (the file was truncated since
  it was opened) raises :class:`PartsLostError`. Close it (:meth:`close`, or ``with``), or let
  it be collected.

  >>> import tempfile
  >>> feed = DirectoryFeed(tempfile.mkdtemp())
  >>> feed.put(Entry(1, "delta", 0, 1), 0, b"0123456789")
  >>> with feed.parts(Entry(1, "delta", 0, 1))[0] as part:
  ...   len(part), part[2:5], part[-2:], part[3]
  (10, b'234', b'89', 51)
  """

  def __init__(self, fd: int, size: int, name: str):
    self._fd, self._size, self.name = fd, size, name

  def __len__(self) -> int:
    return self._size

  def __getitem__(self, index: slice | int) -> bytes | int:
    if isinstance(index, slice):
      start, stop, step = index.indices(self._size)
      if step != 1:
        raise ArgumentError(f"{self.name}: only contiguous slices of a part can be read")
      return self._read(start, max(stop - start, 0))
    position = index + self._size if index < 0 else index
    if not 0 <= position < self._size:
      raise IndexError(f"{self.name}: byte {index} is outside the part's {self._size} bytes")
    return self._read(position, 1)[0]

  def __bytes__(self) -> bytes:
    return self._read(0, self._size)

  def _read(self, start: int, length: int) -> bytes:
    if self._fd < 0:
      raise ConfigError(f"{self.name}: read from a closed part")
    chunks, done = [], 0
    while done < length:
      try:
        chunk = os.pread(self._fd, length - done, start + done)
      except OSError as e:
        raise PartsLostError(f"{self.name}: read failed ({e})") from e
      if not chunk:
        raise PartsLostError(f"{self.name}: truncated to {start + done} bytes while being read "
                             f"(it had {self._size})")
      chunks.append(chunk)
      done += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)

  def close(self) -> None:
    fd, self._fd = self._fd, -1
    if fd >= 0:
      os.close(fd)

  def __enter__(self) -> "FilePart":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:  # (no module globals: at interpreter exit they may be gone already)
      self.close()
    except Exception:  # noqa: BLE001 - nothing to report from a finalizer
      pass


class DirectoryFeed:
  """A feed in a directory: one sub-directory per entry, each part written atomically (a
  temporary file, synced, renamed), and a ``COMMITTED`` file holding the commit record, created
  once every part is in (written whole under a temporary name and linked into place, after
  syncing the directory, so a crash cannot leave a committed name over unwritten data).
  Generation claims are ``GENERATION-<n>`` files made the same way (only one claim of a number
  can succeed). Readers get :class:`FilePart` objects, so a rollout process reads only the bytes
  it needs, each part checked against the size its commit gives.

  Only regular files and directories that the feed made are used: nothing is followed through
  a symbolic link, opened if it is not a regular file (a FIFO cannot block a reader), or
  written or deleted outside the root; anything else found in a part's, entry's or marker's
  place is a :class:`PartsLostError` naming it, and :meth:`entries` does not list it.

  Args:
    root: the directory (created if missing).

  >>> import tempfile
  >>> feed = DirectoryFeed(tempfile.mkdtemp())
  >>> feed.put(Entry(1, "delta", 0, 1), 0, b"part")
  >>> _ = feed.commit(Entry(1, "delta", 0, 1), b"{}")
  >>> [e.version for e in feed.entries()], feed.take_anchor_request()
  ([1], False)
  """

  def __init__(self, root: str | os.PathLike):
    self.root = Path(typed_argument("root", root, (str, os.PathLike),
                                    "a path (str or os.PathLike)"))
    self.root.mkdir(parents=True, exist_ok=True)

  def _dir(self, entry: Entry) -> Path:
    return self.root / entry.name

  @contextlib.contextmanager
  def _root_fd(self) -> Iterator[int]:
    fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
      yield fd
    finally:
      os.close(fd)

  @contextlib.contextmanager
  def _entry_fd(self, root: int, entry: Entry, *, create: bool = False) -> Iterator[int]:
    """The entry's directory, open (never through a symbolic link)."""
    name = entry.name
    if create:
      with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=root)
    try:
      fd = os.open(name, _DIR, dir_fd=root)
    except FileNotFoundError as e:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) is no longer in the feed "
                           f"({self.root / name} is gone)") from e
    except OSError as e:
      raise PartsLostError(f"{self.root / name}: expected the entry's directory, found "
                           f"{_found(name, root)}") from e
    try:
      yield fd
    finally:
      os.close(fd)

  def put(self, entry: Entry, part: int, data: bytes) -> None:
    """Writes part ``part`` of ``entry`` (durably: synced before it is renamed into place).

    Raises:
      PartsLostError: something that the feed did not make is in the entry's or the part's
        place (e.g. a symbolic link): nothing is written through it.
    """
    check_part_number(entry, part)
    with self._root_fd() as root, self._entry_fd(root, entry, create=True) as where:
      _write_atomically(where, f"part-{part:05d}.bin", data, self._dir(entry))

  def commit(self, entry: Entry, record: bytes) -> bytes:
    """Commits ``entry`` with ``record`` (its commit), unless it is committed already; returns
    the record it holds (``record``, or the one written first).

    Raises:
      PartsLostError: a part is missing, or something the feed did not make is in the
        marker's place.
    """
    with self._root_fd() as root, self._entry_fd(root, entry) as where:
      if len(_part_files(where, entry.parts)) != entry.parts:
        raise PartsLostError(f"{self._dir(entry)}: not every part of version {entry.version} "
                             f"({entry.kind}) is there: not committed")
      os.fsync(where)  # the parts' names are durable before the marker is
      if _link_whole(where, _COMMITTED, record, self._dir(entry) / _COMMITTED):  # then synced
        return bytes(record)
    try:
      return self.read_commit(entry)
    except PartsLostError:
      return b""  # something that is not a commit is in the marker's place

  def remove_commit(self, entry: Entry) -> None:
    """Removes what is in the place of ``entry``'s commit (e.g. a forged one), not its parts:
    a file or link is unlinked (never its target), a directory removed without following
    links."""
    with self._root_fd() as root, self._entry_fd(root, entry) as where:
      try:
        found = os.stat(_COMMITTED, dir_fd=where, follow_symlinks=False)
      except FileNotFoundError:
        return
      if stat.S_ISDIR(found.st_mode):
        shutil.rmtree(_COMMITTED, dir_fd=where, ignore_errors=True)
      else:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(_COMMITTED, dir_fd=where)

  def read_commit(self, entry: Entry) -> bytes:
    """The commit record of ``entry`` (at most :func:`commit_bytes_cap` bytes read; a longer
    one is refused).

    Raises:
      PartsLostError: the entry is not committed (or was removed), or its marker is not a
        regular file of a commit's size.
    """
    with self._root_fd() as root, self._entry_fd(root, entry) as where:
      path = self._dir(entry) / _COMMITTED
      data = _read_small(where, _COMMITTED, path, commit_bytes_cap(entry.parts))
    if data is None:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) is not committed ({path})")
    if len(data) > commit_bytes_cap(entry.parts):
      raise PartsLostError(f"{path}: larger than a commit of {entry.parts} parts")
    return data

  def entries(self) -> list[Entry]:
    """The committed entries, by version (a delta before an anchor of the same version)."""
    return sorted((e for e, committed in self._scan() if committed), key=_sort_key)

  def pending(self) -> list[Entry]:
    """The entries begun and not committed (e.g. a publish that failed), by version."""
    return sorted((e for e, committed in self._scan() if not committed), key=_sort_key)

  def _scan(self) -> list[tuple[Entry, bool]]:
    """Every entry that is a real directory, and whether its marker is a regular file."""
    found = []
    with self._root_fd() as root, os.scandir(root) as listing:
      for item in listing:
        entry = Entry.named(item.name)
        if entry is None or not item.is_dir(follow_symlinks=False):
          continue
        try:
          marker = os.stat(f"{item.name}/{_COMMITTED}", dir_fd=root, follow_symlinks=False)
          committed = stat.S_ISREG(marker.st_mode)
        except (FileNotFoundError, NotADirectoryError):
          committed = False
        found.append((entry, committed))
    return found

  def parts(self, entry: Entry, expected: Sequence | None = None,
            check_digests: bool = False) -> list:
    """The parts of a committed entry, open for reading (:class:`FilePart`), each of the size
    its commit gives (``expected``: the commit's parts, each with ``size`` and ``digest``).
    With ``check_digests`` each part is read whole and checked against its checksum, and
    returned as ``bytes``.

    Raises:
      PartsLostError: the entry was removed (retention), a part is missing, of another size
        or checksum than its commit says, or something other than a regular file is in a
        part's place.
    """
    opened: list[FilePart] = []
    try:
      with self._root_fd() as root, self._entry_fd(root, entry) as where:
        for part in range(entry.parts):
          opened.append(_open_part(where, f"part-{part:05d}.bin",
                                   self._dir(entry) / f"part-{part:05d}.bin", entry, part))
      if expected is not None:
        check_sizes(opened, expected, entry)
        if check_digests:
          whole = [bytes(p) for p in opened]
          check_checksums(whole, expected, entry)
          return whole
    except BaseException:
      for p in opened:
        p.close()
      raise
    if check_digests:
      for p in opened:
        p.close()
    return opened

  def part_bytes(self, entry: Entry) -> int:
    """The bytes of the entry's part files (0 if it is gone)."""
    try:
      with self._root_fd() as root, self._entry_fd(root, entry) as where:
        return sum(os.stat(name, dir_fd=where, follow_symlinks=False).st_size
                   for name in _part_files(where, entry.parts))
    except PartsLostError:
      return 0

  def remove(self, entry: Entry) -> None:
    """Deletes an entry, committed or pending (its marker first, so that no reader starts on
    it), with any temporary files in it. Nothing outside the root is touched: a symbolic link
    in the entry's place is removed itself."""
    name = entry.name
    with self._root_fd() as root:
      try:
        found = os.stat(name, dir_fd=root, follow_symlinks=False)
      except FileNotFoundError:
        return
      if not stat.S_ISDIR(found.st_mode):
        with contextlib.suppress(FileNotFoundError):
          os.unlink(name, dir_fd=root)
        return
      try:
        with self._entry_fd(root, entry) as where, contextlib.suppress(OSError):
          os.unlink(_COMMITTED, dir_fd=where)
      except PartsLostError:
        return  # gone, or replaced since the stat: not ours to delete
      shutil.rmtree(name, dir_fd=root, ignore_errors=True)  # fd-based: follows no link

  def run_id(self) -> bytes | None:
    """The id of the run this feed belongs to (None before the first publisher claimed it).

    Raises:
      PartsLostError: the run marker is not a regular file holding a run id.
    """
    with self._root_fd() as root:
      return _run_of(_read_small(root, _RUN, self.root / _RUN, 2 * _RUN_BYTES + 1),
                     self.root / _RUN)

  def claim_run(self, run_id: bytes) -> bytes:
    """Makes ``run_id`` (16 bytes) this feed's run unless it has one; returns the feed's run.
    The marker is written whole under a temporary name and linked into place, which fails if
    one exists: two publishers racing for a feed cannot both win.

    >>> import tempfile
    >>> feed = DirectoryFeed(tempfile.mkdtemp())
    >>> feed.claim_run(bytes(range(16))) == feed.claim_run(bytes(16)) == feed.run_id()
    True
    """
    check_run_id(run_id)
    with self._root_fd() as root:
      _link_whole(root, _RUN, run_id.hex().encode("ascii") + b"\n", self.root / _RUN)
      return _run_of(_read_small(root, _RUN, self.root / _RUN, 2 * _RUN_BYTES + 1),
                     self.root / _RUN)

  @contextlib.contextmanager
  def _status_fd(self, root: int, create: bool) -> Iterator[int | None]:
    """The status directory, open (never through a link); None if absent and not created."""
    if create:
      with contextlib.suppress(FileExistsError):
        os.mkdir(_STATUS, 0o755, dir_fd=root)
    try:
      fd = os.open(_STATUS, _DIR, dir_fd=root)
    except FileNotFoundError:
      yield None
      return
    except OSError as e:
      raise PartsLostError(f"{self.root / _STATUS}: expected the status directory, found "
                           f"{_found(_STATUS, root)}") from e
    try:
      yield fd
    finally:
      os.close(fd)

  def put_status(self, rollout: str, record: bytes) -> None:
    """Replaces rollout ``rollout``'s status with ``record`` (atomically: a temporary file
    renamed over it; a link in its place is replaced, never followed)."""
    if not ROLLOUT_ID.match(rollout) or len(record) > STATUS_BYTES:
      raise ConfigError(f"a status of rollout {rollout!r:.80}: bad id, or over {STATUS_BYTES} B")
    with self._root_fd() as root, self._status_fd(root, create=True) as where:
      _write_atomically(where, rollout, record, self.root / _STATUS / rollout)

  def statuses(self) -> dict[str, bytes]:
    """Every rollout's status record, by rollout id (each read up to :data:`STATUS_BYTES`;
    anything else in the status directory is skipped)."""
    found = {}
    with self._root_fd() as root, self._status_fd(root, create=False) as where:
      if where is None:
        return found
      with os.scandir(where) as listing:
        names = [item.name for item in listing
                 if ROLLOUT_ID.match(item.name) and item.is_file(follow_symlinks=False)]
      for name in names:
        try:
          data = _read_small(where, name, self.root / _STATUS / name, STATUS_BYTES)
        except PartsLostError:
          continue  # replaced by something else since the listing
        if data is not None and len(data) <= STATUS_BYTES:
          found[name] = data
    return found

  def remove_status(self, rollout: str) -> None:
    """Deletes rollout ``rollout``'s status (a link itself, never its target)."""
    if not ROLLOUT_ID.match(rollout):
      return
    with self._root_fd() as root, self._status_fd(root, create=False) as where:
      if where is not None:
        with contextlib.suppress(FileNotFoundError):
          os.unlink(rollout, dir_fd=where)

  def generations(self) -> list[int]:
    """The generations claimed in this feed (their numbers, unchecked), ascending."""
    with self._root_fd() as root, os.scandir(root) as listing:
      found = [int(m.group(1)) for item in listing if (m := _GENERATION.match(item.name))]
    return sorted(g for g in found if g < MAX_VERSION)

  def read_generation(self, generation: int) -> bytes:
    """The record of a generation's claim (bounded; a longer one is refused).

    Raises:
      PartsLostError: it is gone, or not a regular file of a claim's size.
    """
    name = f"GENERATION-{generation:020d}"
    with self._root_fd() as root:
      data = _read_small(root, name, self.root / name, _GENERATION_BYTES)
    if data is None or len(data) > _GENERATION_BYTES:
      raise PartsLostError(f"{self.root / name}: " + (
          "gone" if data is None else f"larger than a claim ({_GENERATION_BYTES} bytes)"))
    return data

  def claim_generation(self, generation: int, record: bytes) -> bool:
    """Claims ``generation`` with ``record``: True if this call made the claim, False if the
    number was claimed before (by anyone)."""
    name = f"GENERATION-{generation:020d}"
    with self._root_fd() as root:
      return _link_whole(root, name, record, self.root / name)

  def request_anchor(self) -> None:
    """Asks the publisher for an anchor at its next version (a subscriber lost its state).

    Raises:
      PartsLostError: a directory is in the request marker's place.
    """
    with self._root_fd() as root:
      _create_marker(root, _ANCHOR_REQUESTED, self.root / _ANCHOR_REQUESTED,
                     accept=lambda mode: not stat.S_ISDIR(mode))  # a link: taken as a request

  def take_anchor_request(self) -> bool:
    """Whether an anchor was requested since the last call (and clears the request).

    Raises:
      PartsLostError: a directory is in the request marker's place.
    """
    with self._root_fd() as root:
      try:
        os.unlink(_ANCHOR_REQUESTED, dir_fd=root)  # removes a link itself, never its target
        return True
      except FileNotFoundError:
        return False
      except OSError as e:
        raise PartsLostError(f"{self.root / _ANCHOR_REQUESTED}: expected a request marker, "
                             f"found {_found(_ANCHOR_REQUESTED, root)}") from e


def check_part_number(entry: Entry, part: int) -> None:
  if type(part) is not int or not 0 <= part < entry.parts:
    raise ConfigError(f"part {part!r} of an entry of {entry.parts} parts")


def check_run_id(run_id: bytes) -> None:
  if not isinstance(run_id, bytes) or len(run_id) != _RUN_BYTES:
    raise ConfigError(f"a run id is {_RUN_BYTES} bytes, got {run_id!r:.60}")


def check_sizes(parts: Sequence, expected: Sequence, entry: Entry) -> None:
  """Refuses parts whose sizes are not those their commit gives."""
  for k, (part, meta) in enumerate(zip(parts, expected, strict=True)):
    if len(part) != meta.size:
      raise PartsLostError(f"version {entry.version} ({entry.kind}): part {k} has {len(part)} "
                           f"bytes, its commit says {meta.size}")


def check_checksums(parts: Sequence, expected: Sequence, entry: Entry) -> None:
  """Refuses parts whose BLAKE2b checksums are not those their commit gives."""
  for k, (part, meta) in enumerate(zip(parts, expected, strict=True)):
    if hashlib.blake2b(memoryview(part).cast("B"), digest_size=16).hexdigest() != meta.digest:
      raise PartsLostError(f"version {entry.version} ({entry.kind}): part {k}'s bytes are not "
                           "those committed (checksum)")


def _write_synced(fd: int, data) -> None:
  """Writes all of ``data`` to ``fd``, syncs it and closes it."""
  try:
    view = memoryview(data).cast("B")
    while view:
      view = view[os.write(fd, view):]
    os.fsync(fd)
  finally:
    os.close(fd)


def _link_whole(where: int, name: str, data: bytes, path: Path) -> bool:
  """Creates ``name`` in ``where`` holding ``data``, atomically and only if absent: written
  whole under a unique temporary name, synced, and linked into place (a link fails if the name
  exists: of two writers, one wins). True if this call created it."""
  tmp = f".{name}.{os.urandom(8).hex()}.tmp"  # unique across hosts sharing the feed
  try:
    fd = _create(where, tmp)
  except OSError as e:
    raise PartsLostError(f"{path}: cannot create a temporary file ({e.strerror})") from e
  try:
    _write_synced(fd, data)
    try:
      os.link(tmp, name, src_dir_fd=where, dst_dir_fd=where, follow_symlinks=False)
    except FileExistsError:
      return False
    os.fsync(where)
    return True
  finally:
    with contextlib.suppress(OSError):
      os.unlink(tmp, dir_fd=where)


def _read_small(where: int, name: str, path: Path, size: int) -> bytes | None:
  """The contents of the regular file ``name`` (at most ``size`` bytes), None if absent."""
  try:
    fd = os.open(name, _READ, dir_fd=where)
  except FileNotFoundError:
    return None
  except OSError as e:
    raise PartsLostError(f"{path}: expected a regular file, found {_found(name, where)}") from e
  try:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      raise PartsLostError(f"{path}: expected a regular file, found "
                           f"{_what(os.fstat(fd).st_mode)}")
    return os.pread(fd, size + 1, 0)
  finally:
    os.close(fd)


def _found(name: str, dir_fd: int) -> str:
  """What is at ``name`` in ``dir_fd``, in words (not following a link)."""
  try:
    return _what(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
  except OSError as e:
    return f"nothing readable ({e.strerror})"


def _run_of(data: bytes | None, path: Path) -> bytes | None:
  if data is None:
    return None
  try:
    run = bytes.fromhex(data.decode("ascii").strip())
  except (UnicodeDecodeError, ValueError):
    run = b""
  if len(run) != _RUN_BYTES:
    raise PartsLostError(f"{path}: not a run id ({len(data)} bytes)")
  return run


def _part_files(where: int, parts: int) -> list[str]:
  """The names of the regular files of parts ``0 .. parts - 1`` in the directory ``where``."""
  with os.scandir(where) as listing:
    return [item.name for item in listing
            if (match := _PART.match(item.name)) and int(match.group(1)) < parts
            and item.is_file(follow_symlinks=False)]


def _open_part(where: int, name: str, path: Path, entry: Entry, part: int) -> FilePart:
  """Opens a regular part file for reading, never blocking (a FIFO) or following a link."""
  try:
    found = os.stat(name, dir_fd=where, follow_symlinks=False)
    if not stat.S_ISREG(found.st_mode):
      raise PartsLostError(f"{path}: expected part {part} as a regular file, found "
                           f"{_what(found.st_mode)}")
    fd = os.open(name, _READ, dir_fd=where)
  except FileNotFoundError as e:
    raise PartsLostError(f"version {entry.version} ({entry.kind}): part {part} is gone "
                         f"({path})") from e
  except PartsLostError:
    raise
  except OSError as e:  # replaced since the stat (a link: ELOOP), or unreadable
    raise PartsLostError(f"{path}: part {part} cannot be opened: found {_found(name, where)} "
                         f"({e.strerror})") from e
  try:
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):
      raise PartsLostError(f"{path}: expected part {part} as a regular file, found "
                           f"{_what(opened.st_mode)}")
  except BaseException:
    os.close(fd)
    raise
  return FilePart(fd, opened.st_size, str(path))


def _create(where: int, name: str) -> int:
  """Creates ``name`` in ``where`` exclusively (never through a link); a stale file of that
  name (a temporary name left by a dead writer) is unlinked, once."""
  try:
    return os.open(name, _CREATE, 0o644, dir_fd=where)
  except FileExistsError:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(name, dir_fd=where)
    return os.open(name, _CREATE, 0o644, dir_fd=where)


def _write_atomically(where: int, name: str, data: bytes, path: Path) -> None:
  """Writes ``name`` in directory ``where``: a temporary file, synced, then renamed."""
  tmp = f".{name}.{os.getpid()}.tmp"
  try:
    fd = _create(where, tmp)
  except OSError as e:
    raise PartsLostError(f"{path.parent / tmp}: cannot create a temporary part ({e.strerror}; "
                         f"found {_found(tmp, where)})") from e
  try:
    _write_synced(fd, data)
    try:
      os.replace(tmp, name, src_dir_fd=where, dst_dir_fd=where)  # replaces a link, not its target
    except OSError as e:
      raise PartsLostError(f"{path}: cannot be written: found {_found(name, where)} "
                           f"({e.strerror})") from e
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp, dir_fd=where)
    raise


def _create_marker(where: int, name: str, path: Path, accept=stat.S_ISREG) -> None:
  """Creates the empty marker ``name`` in ``where`` (atomic: it has no contents to half-write,
  and it is never created through a link); one already there counts if ``accept`` accepts its
  ``st_mode`` (e.g. another writer's)."""
  try:
    fd = os.open(name, _CREATE, 0o644, dir_fd=where)
  except FileExistsError as e:
    try:
      mode = os.stat(name, dir_fd=where, follow_symlinks=False).st_mode
    except FileNotFoundError:
      return  # taken (a request) or removed (retention) since
    if accept(mode):
      return
    raise PartsLostError(f"{path}: expected a marker (a regular file), found {_what(mode)}") \
        from e
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
