"""A feed in an object store (S3 and S3-compatible stores, GCS, Azure Blob, a local directory,
memory), so that a trainer and its rollouts can be in different clusters or datacenters.

An object store has no rename, so a version is made atomic by a *commit object*, written last
and only if absent (a create-only conditional put: ``If-None-Match: *`` on S3 and Azure,
``ifGenerationMatch=0`` on GCS, an exclusive link on a local disk). The commit (``records.py``)
gives every part's size and BLAKE2b checksum; readers list commit objects only, and check each
part they read against its commit, so they never see half a version, a mix of two versions, or
bytes changed since the commit. Every read is bounded by what the reader expects: a commit by
its part count, a part by its committed size (refused as soon as the store says it is larger,
before its body is read), a marker by a few hundred bytes.

Layout under the feed's URL (``<entry>`` names the version, its kind, base, part count,
generation and run)::

  RUN                               the run id (create-only, as DirectoryFeed's)
  ANCHOR_REQUESTED                  a rollout asked for an anchor (take = delete)
  generations/<n>                   a publisher's claim of generation n (create-only)
  status/<rollout>                  a rollout's status, overwritten at each report
  commits/<entry>                   the commit object (JSON): the version is visible
  parts/<entry>/part-<k>.bin        part k, put by whichever trainer process made it
  removed/<entry>@<unix ms>         a tombstone: its parts go after the grace period

The client is `obstore <https://developmentseed.org/obstore>`_, the Python binding of the Rust
``object_store`` crate (the one Arrow, DataFusion and Delta use): one small dependency and one
API for all these stores (boto3, google-cloud-storage and azure-storage-blob are one store
each), with the conditional (create-only) put needed for the commit, multipart uploads for
large parts, bounded retries with backoff (5xx, throttling, dropped connections) and
per-request timeouts, and credentials from each store's usual configuration (environment,
instance metadata, or options passed through).

>>> feed = ObjectStoreFeed("memory://", grace_seconds=0)
>>> delta = Entry(version=1, kind="delta", base=0, parts=2)
>>> feed.put(delta, 1, b"second"); feed.put(delta, 0, b"first")
>>> [feed.entries(), feed.pending() == [delta]]
[[], True]
>>> feed.commit(delta, b"the commit record")
b'the commit record'
>>> from jsparse._src.engine.records import part_meta
>>> parts = feed.parts(delta, [part_meta(b"first"), part_meta(b"second")])
>>> [bytes(p) for p in parts], feed.remove(delta), feed.entries()
([b'first', b'second'], None, [])
"""

from __future__ import annotations

import concurrent.futures
import datetime
import re
import threading
import time
from typing import Any, Callable, Sequence

import obstore
from obstore.exceptions import AlreadyExistsError, NotSupportedError
from obstore.exceptions import BaseError as StoreError

from jsparse._src.engine.feed import (_GENERATION_BYTES, _RUN_BYTES, MAX_VERSION, ROLLOUT_ID,
                                      STATUS_BYTES, Entry, _run_of, _sort_key, check_checksums,
                                      check_part_number, check_run_id, check_sizes,
                                      commit_bytes_cap)
from jsparse._src.errors import ConfigError, PartsLostError
from jsparse._src.options import float_option, int_option
from jsparse._src.threads import bounded_map

_RUN, _ANCHOR_REQUESTED = "RUN", "ANCHOR_REQUESTED"
_COMMITS, _PARTS, _REMOVED, _GENERATIONS = "commits", "parts", "removed", "generations"
_STATUS = "status"
_PART = re.compile(r"^part-(\d{5})\.bin$")
_GENERATION = re.compile(r"^(\d{20})$")
_TOMBSTONE = re.compile(r"^(.+)@(\d{1,15})$")
_LOCAL = ("file", "memory")


class _TooLarge(Exception):
  """An object larger than a read expects (its size, or the bytes read when it was stopped)."""


def _brief(error: BaseException) -> str:
  """The first line of a store error (obstore appends a long debug dump)."""
  text = str(error).strip().splitlines()
  return (text[0] if text else type(error).__name__)[:400]


class ObjectStoreFeed:
  """A feed in an object store (see the module docstring for the layout and the protocol).

  Every trainer process puts its parts (:meth:`put`); once all are in, the publisher's
  process 0 commits the version (:meth:`commit`): one listing of its parts, then the commit
  object, create-only.
  Entry names carry the run and the publisher's generation, so the parts of two runs or two
  publishers are never committed together.

  Every request is bounded: ``timeout`` per attempt, and transient failures (5xx, throttling,
  dropped connections, timeouts of reads) are retried with exponential backoff, at most
  ``retries`` times and not after ``retry_seconds``; what still fails raises
  :class:`PartsLostError`, so each request ends within about ``retry_seconds + timeout``
  (a call makes a few, :meth:`parts` reads the parts in parallel), and a subscriber whose
  read fails asks for an anchor.

  Retention is graceful: :meth:`remove` deletes a committed version's commit object at once
  (no new reader starts on it) and leaves a tombstone; its parts are deleted only by a later
  :meth:`remove` (or :meth:`collect`) once ``grace_seconds`` have passed, so a slow reader in
  the middle of the version is not cut off. The grace period is measured on the clock of the
  process that removes (the trainer's process 0). Uncommitted (pending) parts have no readers
  and go at once.

  Args:
    url: ``s3://bucket/prefix`` (S3, or an S3-compatible store with ``endpoint=...``),
      ``gs://bucket/prefix``, ``az://container/prefix`` (or ``abfs://``...),
      ``file:///path`` (created if missing) or ``memory://`` (held by this object: tests).
    timeout: seconds one request may take, body included (raise it for large parts over slow
      links: a part of ``chunk_bytes`` must arrive within it).
    connect_timeout: seconds to establish a connection.
    retries: how many times a failed request is retried.
    retry_seconds: no retry starts this long after the first attempt.
    grace_seconds: a removed version's parts stay readable this long.
    max_concurrency: parts read in parallel by :meth:`parts`.
    client_options, retry_config: passed to obstore over the ones made from the options
      above (e.g. ``{"allow_http": True}`` for a local S3 endpoint), remote stores only.
    **config: the store's configuration (``endpoint``, ``region``, ``access_key_id``...), on
      top of what the store's environment variables say (``AWS_*``, ``GOOGLE_*``,
      ``AZURE_*``); nothing is hard-coded here.

  The feed pickles (to hand it to other processes) with its store's configuration, except
  ``memory://``, which lives in this object.

  >>> import tempfile
  >>> feed = ObjectStoreFeed(f"file://{tempfile.mkdtemp()}/feed", grace_seconds=0)
  >>> feed.put(Entry(1, "delta", 0, 1), 0, b"part")
  >>> _ = feed.commit(Entry(1, "delta", 0, 1), b"{}")
  >>> [e.version for e in feed.entries()], feed.take_anchor_request()
  ([1], False)
  >>> feed.remove(Entry(1, "delta", 0, 1)); feed.entries(), feed.pending()
  ([], [])
  """

  def __init__(self, url: str, *, timeout: float = 30.0, connect_timeout: float = 5.0,
               retries: int = 4, retry_seconds: float = 60.0, grace_seconds: float = 300.0,
               max_concurrency: int = 8, client_options: dict | None = None,
               retry_config: dict | None = None, **config: Any):
    scheme, sep, rest = str(url).partition("://")
    if not sep or not scheme.isidentifier():
      raise ConfigError(f"ObjectStoreFeed needs a URL such as s3://bucket/prefix, got {url!r}")
    scheme = scheme.lower()
    self.url = f"{scheme}://{rest.rstrip('/')}"
    self.timeout = float_option("timeout", timeout, minimum=0.001)
    self.connect_timeout = float_option("connect_timeout", connect_timeout, minimum=0.001)
    self.retries = int_option("retries", retries, minimum=0)
    self.retry_seconds = float_option("retry_seconds", retry_seconds)
    self.grace_seconds = float_option("grace_seconds", grace_seconds)
    self.max_concurrency = int_option("max_concurrency", max_concurrency, minimum=1)
    try:
      if scheme == "file":
        self._store = obstore.store.from_url(self.url, mkdir=True, automatic_cleanup=True)
      elif scheme == "memory":
        self._store = obstore.store.from_url(self.url)
      else:
        span = lambda s: datetime.timedelta(seconds=s)  # noqa: E731
        client = {"timeout": span(self.timeout), "connect_timeout": span(self.connect_timeout),
                  **(client_options or {})}
        retry = {"max_retries": self.retries, "retry_timeout": span(self.retry_seconds),
                 **(retry_config or {})}
        if scheme in ("s3", "s3a"):  # create-only puts by If-None-Match (explicit: older
          config.setdefault("conditional_put", "etag")  # obstore versions had it off)
        self._store = obstore.store.from_url(self.url, client_options=client,
                                             retry_config=retry, **config)
    except (StoreError, ValueError, OSError) as e:
      raise ConfigError(f"ObjectStoreFeed({self.url!r}): {_brief(e)}") from e
    self._local = scheme in _LOCAL
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._lock = threading.Lock()

  def __getstate__(self) -> dict:
    state = dict(self.__dict__)
    state.update(_pool=None, _lock=None)
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def __repr__(self) -> str:
    return f"ObjectStoreFeed({self.url!r})"

  # -- the store, every call bounded and its failures named ------------------------------------

  def _call(self, what: str, fn: Callable, *args, **kwargs):
    """``fn(self._store, ...)``; a failure other than absence (FileNotFoundError) or a
    create-only put finding the object (AlreadyExistsError) is a :class:`PartsLostError`."""
    try:
      return fn(self._store, *args, **kwargs)
    except (FileNotFoundError, AlreadyExistsError):
      raise
    except NotSupportedError as e:
      raise ConfigError(f"{self.url}: {what}: the store does not support it ({_brief(e)}); "
                        "the feed needs create-only (conditional) puts") from e
    except (StoreError, OSError) as e:
      raise PartsLostError(f"{self.url}: {what} failed: {_brief(e)}") from e

  def _get(self, key: str, cap: int):
    """The object's bytes, at most ``cap`` of them: one larger is refused as soon as the store
    gives its size (before its body is read), and its body is read as a stream, stopped past
    the cap (a store that gives a wrong size). FileNotFoundError if absent."""
    def get(store, key):
      found = obstore.get(store, key)
      if found.meta["size"] > cap:
        raise _TooLarge(found.meta["size"])
      chunks, size = [], 0
      for chunk in found.stream(min_chunk_size=1 << 20):
        size += len(chunk)
        if size > cap:
          raise _TooLarge(size)
        chunks.append(chunk)
      return chunks[0] if len(chunks) == 1 else b"".join(bytes(c) for c in chunks) \
          if chunks else b""
    try:
      return self._call(f"reading {key}", get, key)
    except _TooLarge as e:
      raise PartsLostError(f"{self.url}/{key}: {e.args[0]} bytes or more, more than the "
                           f"{cap} expected: not read") from None

  def _list(self, prefix: str) -> list[str]:
    """The keys of every object under ``prefix/`` (recursive), relative to the feed."""
    def listing(store, prefix):
      return [meta["path"] for chunk in obstore.list(store, prefix, chunk_size=1000)
              for meta in chunk]
    return self._call(f"listing {prefix}/", listing, prefix)

  def _dirs(self, prefix: str) -> list[str]:
    """The names of the "directories" directly under ``prefix/``."""
    found = self._call(f"listing {prefix}/", obstore.list_with_delimiter, prefix)
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]

  def _delete(self, keys: list[str]) -> None:
    """Deletes ``keys`` (absent ones too); in bulk where the store can."""
    if not keys:
      return
    try:
      self._call(f"deleting {keys[0]}", obstore.delete, keys)
    except FileNotFoundError:  # local stores refuse absent keys: one by one
      for key in keys:
        try:
          self._call(f"deleting {key}", obstore.delete, key)
        except FileNotFoundError:
          pass

  def _exists(self, key: str) -> bool:
    try:
      self._call(f"reading {key}", obstore.head, key)
      return True
    except FileNotFoundError:
      return False

  # -- writing -------------------------------------------------------------------------------

  def put(self, entry: Entry, part: int, data) -> None:
    """Uploads part ``part`` of ``entry`` (a multipart upload when large).

    Raises:
      PartsLostError: the store failed (after the retries).
    """
    check_part_number(entry, part)
    key = f"{_PARTS}/{entry.name}/part-{part:05d}.bin"
    self._call(f"writing {key}", obstore.put, key, memoryview(data).cast("B"))

  def commit(self, entry: Entry, record: bytes) -> bytes:
    """Commits ``entry`` with ``record`` (a create-only put of its commit object) unless it is
    committed already; returns the record it holds. One listing of the entry's parts checks
    that all are there: a publish of N parts costs N puts, one listing and one commit.

    Raises:
      PartsLostError: a part is missing, or the store failed (after the retries).
    """
    names = {path.rsplit("/", 1)[-1] for path in self._list(f"{_PARTS}/{entry.name}")}
    missing = [k for k in range(entry.parts) if f"part-{k:05d}.bin" not in names]
    if missing:
      raise PartsLostError(f"{self.url}: part {missing[0]} of version {entry.version} "
                           f"({entry.kind}) is not there: not committed")
    key = f"{_COMMITS}/{entry.name}"
    try:
      self._call(f"committing {key}", obstore.put, key, bytes(record), mode="create")
      return bytes(record)
    except AlreadyExistsError:
      try:
        return self.read_commit(entry)
      except PartsLostError:
        return b""  # something that is not a commit (too large) is in its place

  def remove_commit(self, entry: Entry) -> None:
    """Deletes ``entry``'s commit object (e.g. a forged one), not its parts."""
    self._delete([f"{_COMMITS}/{entry.name}"])

  # -- reading -------------------------------------------------------------------------------

  def entries(self) -> list[Entry]:
    """The committed entries (their commit objects' names, unchecked), by version."""
    return sorted(self._named(self._list(_COMMITS)), key=_sort_key)

  def read_commit(self, entry: Entry) -> bytes:
    """The commit record of ``entry`` (at most :func:`commit_bytes_cap` bytes read).

    Raises:
      PartsLostError: the entry is not committed (or was removed), its commit is too large,
        or the store failed.
    """
    try:
      return bytes(self._get(f"{_COMMITS}/{entry.name}", commit_bytes_cap(entry.parts)))
    except FileNotFoundError as e:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) is no longer in the feed "
                           f"({self.url}/{_COMMITS}/{entry.name} is gone)") from e

  def pending(self) -> list[Entry]:
    """The entries with part objects but neither a commit nor a tombstone (e.g. a publish
    that failed), by version."""
    done = {e.name for e in self.entries()} | set(self._tombstones())
    return sorted(self._named(n for n in self._dirs(_PARTS) if n not in done), key=_sort_key)

  @staticmethod
  def _named(names) -> list[Entry]:
    found = (Entry.named(name.rsplit("/", 1)[-1]) for name in names)
    return [e for e in found if e is not None]

  def parts(self, entry: Entry, expected: Sequence | None = None,
            check_digests: bool = True) -> list:
    """The parts of a committed entry, as ``obstore.Bytes`` (bytes-like: ``len``, slicing, the
    buffer protocol), each read only up to the size its commit gives (``expected``: the
    commit's parts, each with ``size`` and ``digest``) and checked against its checksum (parts
    are read whole here, so the check is always made).

    At most ``max_concurrency`` reads are in flight; the first that fails stops the others
    (none is started after it, those started are waited for) before this returns, so a forged
    commit naming many parts cannot leave requests running.

    Raises:
      PartsLostError: ``expected`` is not given, a part is missing, larger or of other bytes
        than its commit says, or the store failed (after the retries).
    """
    if expected is None or len(expected) != entry.parts:
      raise PartsLostError(f"version {entry.version} ({entry.kind}): its parts are read as "
                           "its commit gives them")
    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency,
                                                           thread_name_prefix="jsparse-feed")
    found = bounded_map(self._pool, lambda k: self._part(entry, k, expected[k].size),
                        range(entry.parts), self.max_concurrency)
    check_sizes(found, expected, entry)
    check_checksums(found, expected, entry)
    return found

  def _part(self, entry: Entry, k: int, size: int):
    """Part ``k`` of ``entry``, read only up to ``size`` bytes."""
    key = f"{_PARTS}/{entry.name}/part-{k:05d}.bin"
    try:
      return self._get(key, size)
    except FileNotFoundError as e:
      raise PartsLostError(f"{self.url}/{key}: part {k} is gone") from e

  # -- retention -----------------------------------------------------------------------------

  def remove(self, entry: Entry) -> None:
    """Removes an entry: a committed one's commit object at once (a tombstone is written
    first) and its parts after ``grace_seconds``; a pending one's parts at once. Then deletes
    the parts of entries removed longer ago than the grace period (:meth:`collect`)."""
    name = entry.name
    if self._exists(f"{_COMMITS}/{name}"):
      stamp = f"{_REMOVED}/{name}@{int(time.time() * 1000)}"
      self._call(f"writing {stamp}", obstore.put, stamp, b"")
      self._delete([f"{_COMMITS}/{name}"])
    else:
      self._delete(self._list(f"{_PARTS}/{name}"))
    self.collect()

  def _tombstones(self) -> dict[str, list[tuple[str, int]]]:
    """Per removed entry's name, its tombstones (key, removal time in ms)."""
    found: dict[str, list[tuple[str, int]]] = {}
    for key in self._list(_REMOVED):
      match = _TOMBSTONE.match(key.rsplit("/", 1)[-1])
      if match and Entry.named(match.group(1)) is not None:
        found.setdefault(match.group(1), []).append((key, int(match.group(2))))
    return found

  def collect(self, now: float | None = None) -> int:
    """Deletes the parts of the entries removed ``grace_seconds`` ago or more (then their
    tombstones); returns how many entries it cleared.

    >>> feed = ObjectStoreFeed("memory://", grace_seconds=60)
    >>> feed.put(Entry(1, "delta", 0, 1), 0, b"part")
    >>> _ = feed.commit(Entry(1, "delta", 0, 1), b"{}")
    >>> feed.remove(Entry(1, "delta", 0, 1))
    >>> feed.entries(), feed.collect(), feed.collect(now=time.time() + 60)
    ([], 0, 1)
    """
    now_ms = (time.time() if now is None else now) * 1000
    cleared = 0
    for name, stamps in self._tombstones().items():
      if now_ms - min(ms for _, ms in stamps) < self.grace_seconds * 1000:
        continue
      self._delete([f"{_COMMITS}/{name}"])  # a crash may have left it
      self._delete(self._list(f"{_PARTS}/{name}"))
      self._delete([key for key, _ in stamps])
      cleared += 1
    return cleared

  # -- run identity and anchor requests ------------------------------------------------------

  def run_id(self) -> bytes | None:
    """The id of the run this feed belongs to (None before the first publisher claimed it).

    Raises:
      PartsLostError: the run object does not hold a run id, or the store failed.
    """
    try:
      data = bytes(self._get(_RUN, 2 * _RUN_BYTES + 1))
    except FileNotFoundError:
      return None
    return _run_of(data, f"{self.url}/{_RUN}")

  def claim_run(self, run_id: bytes) -> bytes:
    """Makes ``run_id`` (16 bytes) this feed's run unless it has one (a create-only put: of
    two publishers racing, one wins); returns the feed's run.

    >>> feed = ObjectStoreFeed("memory://")
    >>> feed.claim_run(bytes(range(16))) == feed.claim_run(bytes(16)) == feed.run_id()
    True
    """
    check_run_id(run_id)
    try:
      self._call(f"writing {_RUN}", obstore.put, _RUN, bytes(run_id).hex().encode() + b"\n",
                 mode="create")
    except AlreadyExistsError:
      pass
    run = self.run_id()
    if run is None:
      raise PartsLostError(f"{self.url}/{_RUN}: gone right after it was claimed")
    return run

  def generations(self) -> list[int]:
    """The generations claimed in this feed (their numbers, unchecked), ascending."""
    found = (_GENERATION.match(k.rsplit("/", 1)[-1]) for k in self._list(_GENERATIONS))
    return sorted(g for m in found if m and (g := int(m.group(1))) < MAX_VERSION)

  def read_generation(self, generation: int) -> bytes:
    """The record of a generation's claim (bounded).

    Raises:
      PartsLostError: it is gone, too large, or the store failed.
    """
    key = f"{_GENERATIONS}/{generation:020d}"
    try:
      return bytes(self._get(key, _GENERATION_BYTES))
    except FileNotFoundError as e:
      raise PartsLostError(f"{self.url}/{key}: gone") from e

  def claim_generation(self, generation: int, record: bytes) -> bool:
    """Claims ``generation`` with ``record`` (a create-only put): True if this call made the
    claim, False if the number was claimed before."""
    try:
      self._call(f"claiming generation {generation}", obstore.put,
                 f"{_GENERATIONS}/{generation:020d}", bytes(record), mode="create")
      return True
    except AlreadyExistsError:
      return False

  def put_status(self, rollout: str, record: bytes) -> None:
    """Replaces rollout ``rollout``'s status object with ``record``."""
    if not ROLLOUT_ID.match(rollout) or len(record) > STATUS_BYTES:
      raise ConfigError(f"a status of rollout {rollout!r:.80}: bad id, or over {STATUS_BYTES} B")
    self._call(f"writing {_STATUS}/{rollout}", obstore.put, f"{_STATUS}/{rollout}",
               bytes(record))

  def statuses(self) -> dict[str, bytes]:
    """Every rollout's status record, by rollout id (each read up to :data:`STATUS_BYTES`;
    one larger, or of another name, is skipped)."""
    names = [n for k in self._list(_STATUS) if ROLLOUT_ID.match(n := k.rsplit("/", 1)[-1])]
    found = {}
    for name in names:
      try:
        found[name] = bytes(self._get(f"{_STATUS}/{name}", STATUS_BYTES))
      except (FileNotFoundError, PartsLostError):
        continue  # removed since the listing, or too large
    return found

  def remove_status(self, rollout: str) -> None:
    """Deletes rollout ``rollout``'s status object."""
    if ROLLOUT_ID.match(rollout):
      self._delete([f"{_STATUS}/{rollout}"])

  def request_anchor(self) -> None:
    """Asks the publisher for an anchor at its next version (a subscriber lost its state)."""
    self._call(f"writing {_ANCHOR_REQUESTED}", obstore.put, _ANCHOR_REQUESTED, b"")

  def take_anchor_request(self) -> bool:
    """Whether an anchor was requested since the last call (and clears the request). A
    request made while this runs is either taken now or left for the next call."""
    if not self._exists(_ANCHOR_REQUESTED):
      return False
    self._delete([_ANCHOR_REQUESTED])
    return True
