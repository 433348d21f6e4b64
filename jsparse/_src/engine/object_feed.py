"""A feed in an object store (S3 and S3-compatible stores, GCS, Azure Blob, a local directory,
memory), so that a trainer and its rollouts can be in different clusters or datacenters.

An object store has no rename, so a version is made atomic by a *commit object*, written last
and only if absent (a create-only conditional put: ``If-None-Match: *`` on S3 and Azure,
``ifGenerationMatch=0`` on GCS, an exclusive link on a local disk). The commit names every
part object of the version with its size and BLAKE2b checksum; readers list commit objects
only, and check each part they read against its commit, so they never see half a version, a
mix of two versions, or bytes changed since the commit.

Layout under the feed's URL (``<entry>`` names the version, its kind, base and part count)::

  RUN                               the run id (create-only, as DirectoryFeed's)
  ANCHOR_REQUESTED                  a rollout asked for an anchor (take = delete)
  commits/<entry>                   the commit object (JSON): the version is visible
  parts/<entry>/part-<k>-<run>-<size>-<blake2b>.bin
                                    part k, put by whichever trainer process made it
  removed/<entry>@<unix ms>         a tombstone: its parts go after the grace period

The client is `obstore <https://developmentseed.org/obstore>`_, the Python binding of the Rust
``object_store`` crate (the one Arrow, DataFusion and Delta use): one small dependency and one
API for all these stores (boto3, google-cloud-storage and azure-storage-blob are one store
each), with the conditional (create-only) put needed for the commit, multipart uploads for
large parts, bounded retries with backoff (5xx, throttling, dropped connections) and
per-request timeouts, and credentials from each store's usual configuration (environment,
instance metadata, or options passed through).

>>> feed = ObjectStoreFeed("memory://", grace_seconds=0)
>>> run = feed.claim_run(bytes(16))
>>> delta = Entry(version=1, kind="delta", base=0, parts=2)
>>> feed.put(delta, 1, b"second")  # committed once the last of its parts is in
>>> [feed.entries(), feed.pending() == [delta]]
[[], True]
>>> feed.put(delta, 0, b"first")
>>> [bytes(p) for p in feed.parts(delta)], feed.remove(delta), feed.entries()
([b'first', b'second'], None, [])
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import re
import threading
import time
from typing import Any, Callable

import obstore
from obstore.exceptions import AlreadyExistsError, NotSupportedError
from obstore.exceptions import BaseError as StoreError

from jsparse._src.engine.feed import (_NAME, _RUN_BYTES, DirectoryFeed, Entry, PartsLostError,
                                      _run_of, _sort_key)
from jsparse._src.errors import ConfigError
from jsparse._src.options import float_option, int_option

_FORMAT = "jsparse-object-feed/1"
_RUN, _ANCHOR_REQUESTED = "RUN", "ANCHOR_REQUESTED"
_COMMITS, _PARTS, _REMOVED = "commits", "parts", "removed"
_PART = re.compile(r"^part-(\d{5})-([0-9a-f]{32}|none)-(\d{1,15})-([0-9a-f]{32})\.bin$")
_TOMBSTONE = re.compile(r"^(.+)@(\d{1,15})$")
_NO_RUN = "none"  # the writer token of parts put into a feed no publisher claimed
_COMMIT_BYTES = 4096  # a commit object's size is at most this plus 256 per part
_LOCAL = ("file", "memory")


def _digest(data) -> str:
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _brief(error: BaseException) -> str:
  """The first line of a store error (obstore appends a long debug dump)."""
  text = str(error).strip().splitlines()
  return (text[0] if text else type(error).__name__)[:400]


class ObjectStoreFeed:
  """A feed in an object store (see the module docstring for the layout and the protocol).

  A version is committed by whichever writer sees the last of its parts arrive: every
  :meth:`put` uploads its part, then lists the version's part objects, and the writer that
  finds all of them writes the commit object create-only. Two processes that both see the last
  part write the same commit; the loser's put finds it there and is done. A second publisher
  on the same prefix is refused by :meth:`claim_run` (the :class:`Publisher` raises
  ``ConfigError``); one that bypasses it gets ``ConfigError`` from :meth:`put` when it tries
  to commit a version already committed with other parts. Part names carry the writer's run
  id, so parts of two runs are never committed together.

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
    self._run: str | None = None  # this writer's run, hex (read from RUN at the first put)
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

  def _get(self, key: str):
    """The object's bytes (an ``obstore.Bytes``, sliceable, a buffer); FileNotFoundError if
    absent."""
    def get(store, key):
      return obstore.get(store, key).bytes()
    return self._call(f"reading {key}", get, key)

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

  def _writer(self) -> str:
    """This writer's run id (hex) as part names carry it: the feed's run, read once."""
    if self._run is None:
      run = self.run_id()
      if run is None:
        return _NO_RUN
      self._run = run.hex()
    return self._run

  def put(self, entry: Entry, part: int, data) -> None:
    """Uploads part ``part`` of ``entry`` (a multipart upload when large); commits the entry
    when all its parts are there (see the class docstring).

    Raises:
      PartsLostError: the store failed (after the retries).
      ConfigError: another publisher writes into this feed: the version is already committed
        with other parts, or two different objects of one part are there.
    """
    if not 0 <= part < entry.parts:
      raise ValueError(f"part {part} of an entry of {entry.parts} parts")
    name, view = DirectoryFeed._name(entry), memoryview(data).cast("B")
    run = self._writer()
    key = f"{_PARTS}/{name}/part-{part:05d}-{run}-{len(view)}-{_digest(view)}.bin"
    self._call(f"writing {key}", obstore.put, key, view)
    found: dict[int, list[str]] = {}
    for path in self._list(f"{_PARTS}/{name}"):
      match = _PART.match(path.rsplit("/", 1)[-1])
      if match and match.group(2) == run and int(match.group(1)) < entry.parts:
        found.setdefault(int(match.group(1)), []).append(path.rsplit("/", 1)[-1])
    if len(found) < entry.parts:
      return  # another writer's put will see the last part
    doubled = sorted(k for k, names in found.items() if len(names) > 1)
    if doubled:
      raise ConfigError(
          f"{self.url}: version {entry.version} ({entry.kind}) has two different objects for "
          f"part {doubled[0]} from run {run}: another publisher writes into this feed (a feed "
          "has one publisher); remove the entry or use a new prefix")
    commit = json.dumps({"format": _FORMAT, "version": entry.version, "kind": entry.kind,
                         "base": entry.base, "run": run,
                         "parts": [found[k][0] for k in range(entry.parts)]},
                        indent=0).encode()
    commit_key = f"{_COMMITS}/{name}"
    try:
      self._call(f"committing {commit_key}", obstore.put, commit_key, commit, mode="create")
    except AlreadyExistsError:
      try:
        held = bytes(self._get(commit_key))
      except FileNotFoundError:
        held = None  # removed since: committed, then retired
      if held is not None and held != commit:
        raise ConfigError(
            f"{self.url}: version {entry.version} ({entry.kind}) is already committed with "
            "other parts: another publisher writes into this feed (a feed has one "
            "publisher)") from None

  # -- reading -------------------------------------------------------------------------------

  def entries(self) -> list[Entry]:
    """The committed entries (their commit objects), by version."""
    return sorted(self._named(self._list(_COMMITS)), key=_sort_key)

  def pending(self) -> list[Entry]:
    """The entries with part objects but neither a commit nor a tombstone (e.g. a publish
    that failed), by version."""
    done = {DirectoryFeed._name(e) for e in self.entries()} | set(self._tombstones())
    return sorted(self._named(n for n in self._dirs(_PARTS) if n not in done), key=_sort_key)

  @staticmethod
  def _named(names) -> list[Entry]:
    found = []
    for name in names:
      match = _NAME.match(name.rsplit("/", 1)[-1])
      if match:
        version, kind, base, parts = match.groups()
        found.append(Entry(int(version), kind, int(base), int(parts)))
    return found

  def parts(self, entry: Entry) -> list:
    """The parts of a committed entry, each checked against its commit object (size and
    BLAKE2b), as ``obstore.Bytes`` (bytes-like: ``len``, slicing, the buffer protocol).

    Raises:
      PartsLostError: the entry is not committed (or was removed), its commit object is not
        one this feed wrote for it, a part is missing or its bytes are not those committed,
        or the store failed (after the retries).
    """
    name = DirectoryFeed._name(entry)
    try:
      raw = self._get(f"{_COMMITS}/{name}")
    except FileNotFoundError as e:
      raise PartsLostError(f"version {entry.version} ({entry.kind}) is no longer in the feed "
                           f"({self.url}/{_COMMITS}/{name} is gone)") from e
    named = self._commit_parts(bytes(raw), entry, name)
    if len(named) == 1:
      return [self._part(name, *named[0])]
    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency,
                                                           thread_name_prefix="jsparse-feed")
    futures = [self._pool.submit(self._part, name, *p) for p in named]
    return [f.result() for f in futures]

  def _commit_parts(self, raw: bytes, entry: Entry, name: str) -> list[tuple[int, str, int, str]]:
    """The parts a commit object names: (index, object name, size, digest) each; a commit
    that is not this entry's, well formed, is a :class:`PartsLostError`."""
    where = f"{self.url}/{_COMMITS}/{name}"
    try:
      if len(raw) > _COMMIT_BYTES + 256 * entry.parts:
        raise ValueError(f"{len(raw)} bytes")
      commit = json.loads(raw)
      fields = (commit["format"], commit["version"], commit["kind"], commit["base"])
      if fields != (_FORMAT, entry.version, entry.kind, entry.base):
        raise ValueError(f"it is {fields[1:]}")
      names = commit["parts"]
      if not isinstance(names, list) or len(names) != entry.parts:
        raise ValueError(f"it names {len(names)} parts, not {entry.parts}")
      named = []
      for k, part in enumerate(names):
        match = _PART.match(part) if isinstance(part, str) else None
        if not match or int(match.group(1)) != k or match.group(2) != commit["run"]:
          raise ValueError(f"part {k} is named {part!r}")
        named.append((k, part, int(match.group(3)), match.group(4)))
      return named
    except (ValueError, KeyError, TypeError) as e:
      raise PartsLostError(f"{where}: not a commit of version {entry.version} "
                           f"({entry.kind}) as this feed writes them ({e})") from e

  def _part(self, name: str, k: int, part: str, size: int, digest: str):
    key = f"{_PARTS}/{name}/{part}"
    try:
      data = self._get(key)
    except FileNotFoundError as e:
      raise PartsLostError(f"{self.url}/{key}: part {k} is gone") from e
    if len(data) != size:
      raise PartsLostError(f"{self.url}/{key}: part {k} has {len(data)} bytes, its commit "
                           f"says {size}")
    if _digest(data) != digest:
      raise PartsLostError(f"{self.url}/{key}: part {k}'s bytes are not those committed "
                           "(checksum)")
    return data

  # -- retention -----------------------------------------------------------------------------

  def remove(self, entry: Entry) -> None:
    """Removes an entry: a committed one's commit object at once (a tombstone is written
    first) and its parts after ``grace_seconds``; a pending one's parts at once. Then deletes
    the parts of entries removed longer ago than the grace period (:meth:`collect`)."""
    name = DirectoryFeed._name(entry)
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
      if match and _NAME.match(match.group(1)):
        found.setdefault(match.group(1), []).append((key, int(match.group(2))))
    return found

  def collect(self, now: float | None = None) -> int:
    """Deletes the parts of the entries removed ``grace_seconds`` ago or more (then their
    tombstones); returns how many entries it cleared.

    >>> feed = ObjectStoreFeed("memory://", grace_seconds=60)
    >>> feed.put(Entry(1, "delta", 0, 1), 0, b"part")
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
      data = bytes(self._get(_RUN))
    except FileNotFoundError:
      return None
    return _run_of(data[:2 * _RUN_BYTES + 2], f"{self.url}/{_RUN}")

  def claim_run(self, run_id: bytes) -> bytes:
    """Makes ``run_id`` (16 bytes) this feed's run unless it has one (a create-only put: of
    two publishers racing, one wins); returns the feed's run.

    >>> feed = ObjectStoreFeed("memory://")
    >>> feed.claim_run(bytes(range(16))) == feed.claim_run(bytes(16)) == feed.run_id()
    True
    """
    if len(run_id) != _RUN_BYTES:
      raise ValueError(f"a run id is {_RUN_BYTES} bytes, got {len(run_id)}")
    try:
      self._call(f"writing {_RUN}", obstore.put, _RUN, bytes(run_id).hex().encode() + b"\n",
                 mode="create")
    except AlreadyExistsError:
      pass
    run = self.run_id()
    if run is None:
      raise PartsLostError(f"{self.url}/{_RUN}: gone right after it was claimed")
    self._run = run.hex()
    return run

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
