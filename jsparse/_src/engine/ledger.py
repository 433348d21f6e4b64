"""What a publisher or a subscriber may trust of a feed: the verified commits of one run, the
newest verified generation, and claiming the next one. Every feed kind stores commits and
claims as opaque bytes; the rules are here, once.

A commit or claim that does not parse, names another run or generation than its name says,
is unsigned or wrongly signed where a key is given, or is larger than its kind, is *ignored*:
not listed, never applied, never counted for retention or version numbers (logged once per
name). A forged name costs a reader one bounded read every ``recheck_seconds`` (it is read
again then, in case the publisher replaced a forged commit squatting its name), and nothing
else.

>>> import tempfile
>>> from jsparse._src.engine.feed import DirectoryFeed, Entry
>>> feed = DirectoryFeed(tempfile.mkdtemp())
>>> ledger, run = Ledger(feed, key=None), "ab" * 16
>>> generation = ledger.claim_generation(run)
>>> entry = Entry(1, "anchor", 0, 1, generation, run)
>>> feed.put(entry, 0, b"part")
>>> ledger.commit(entry, [part_meta(b"part")])
>>> [c.entry.version for c in ledger.commits(run)], ledger.newest_generation(run)
([1], 1)
>>> forged = Entry(50, "anchor", 0, 1, generation, run)
>>> feed.put(forged, 0, b"x"); _ = feed.commit(forged, b"not a commit")
>>> [c.entry.version for c in ledger.commits(run)]  # the forged name is ignored (logged)
[1]
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

from jsparse._src.engine.feed import MAX_VERSION, Entry, Feed
from jsparse._src.engine.records import (Commit, PartMeta, commit_record, generation_record,
                                         part_meta, read_commit, read_generation)
from jsparse._src.engine.signing import SigningKey
from jsparse._src.errors import ConfigError, PartsLostError

__all__ = ["Ledger", "part_meta"]

_CLAIM_ATTEMPTS = 64
_CACHE_LIMIT = 4096


class Ledger:
  """A feed's commits and generations as far as they verify (see the module docstring).

  Args:
    feed: the feed.
    key: the feed's key (``signing.py``): commits and claims are signed with it (publisher)
      and must verify with it (both sides); None: unsigned, nothing is required.
  """

  def __init__(self, feed: Feed, key: SigningKey | None, recheck_seconds: float = 10.0):
    self.feed, self.key, self.recheck_seconds = feed, key, recheck_seconds
    self._commits: dict[Entry, Commit | None] = {}  # verified (None: refused), by entry
    self._refused: dict[Entry, float] = {}  # when each refused commit was read
    self._claims: dict[tuple[str, int], bool] = {}  # (run, generation) -> verified
    self._warned: set = set()

  def _ignore(self, what, error: Exception) -> None:
    if what not in self._warned:
      self._warned.add(what)
      logging.getLogger("jsparse").warning("jsparse: ignoring %s in the feed: %s", what, error)

  def commits(self, run: str, max_parts: int | None = None) -> list[Commit]:
    """The committed entries of run ``run`` (hex) whose commits verify, by version (those
    naming more than ``max_parts`` parts are ignored unread). Commits are immutable
    (create-only), so each is read once; one that failed to read (a store error) is read
    again at the next call."""
    listed = self.feed.entries()
    verified = []
    for entry in listed:
      if entry.run != run:
        continue
      if max_parts is not None and entry.parts > max_parts:
        self._ignore(entry.name, PartsLostError(f"it names {entry.parts} parts, more than "
                                                f"{max_parts}"))
        continue
      if self._commits.get(entry, 0) is None and \
          time.monotonic() - self._refused[entry] >= self.recheck_seconds:
        del self._commits[entry]
      if entry not in self._commits:
        try:
          raw = self.feed.read_commit(entry)
        except PartsLostError as e:
          if "no longer" not in str(e) and "not committed" not in str(e):
            self._ignore(entry.name, e)
          continue
        try:
          self._commits[entry] = read_commit(raw, entry, self.key)
        except PartsLostError as e:
          self._commits[entry], self._refused[entry] = None, time.monotonic()
          self._ignore(entry.name, e)
      if self._commits[entry] is not None:
        verified.append(self._commits[entry])
    if len(self._commits) > _CACHE_LIMIT:  # forget what is no longer listed
      still = set(listed)
      self._commits = {e: c for e, c in self._commits.items() if e in still}
      self._refused = {e: t for e, t in self._refused.items() if e in still}
    return verified

  def commit_of(self, entry: Entry) -> Commit:
    """The verified commit of ``entry``.

    Raises:
      PartsLostError: it is gone, or does not verify.
    """
    if self._commits.get(entry) is None:
      self._commits.pop(entry, None)
      self._commits[entry] = read_commit(self.feed.read_commit(entry), entry, self.key)
    return self._commits[entry]

  def _claimed(self, run: str, generation: int) -> bool:
    """Whether ``generation`` is claimed for ``run`` by a record that verifies."""
    known = self._claims.get((run, generation))
    if known is None:
      try:
        read_generation(self.feed.read_generation(generation), run, generation, self.key)
        known = True
      except PartsLostError as e:
        known = False
        self._ignore(f"generation {generation}", e)
      self._claims[(run, generation)] = known
    return known

  def newest_generation(self, run: str) -> int:
    """The newest generation claimed for ``run`` that verifies (0: none)."""
    for generation in sorted(self.feed.generations(), reverse=True):
      if self._claimed(run, generation):
        return generation
    return 0

  def claim_generation(self, run: str) -> int:
    """Claims a generation for ``run`` larger than every one claimed in the feed (verified or
    not, of any run): atomically, so that no two publishers hold one number."""
    for _ in range(_CLAIM_ATTEMPTS):
      claimed = self.feed.generations()
      generation = max(claimed, default=0) + 1
      if generation >= MAX_VERSION:
        raise ConfigError(f"{self.feed!r}: the feed's generations are used up (a claim of "
                          f"{generation - 1} is there): use a new feed")
      record = generation_record(run, generation, self.key)
      if self.feed.claim_generation(generation, record):
        self._claims[(run, generation)] = True
        return generation
    raise PartsLostError(f"{self.feed!r}: {_CLAIM_ATTEMPTS} attempts to claim a generation lost "
                         "races (are many publishers starting on this feed?)")

  def commit(self, entry: Entry, parts: Sequence[PartMeta]) -> None:
    """Commits ``entry`` with its ``parts`` (signed with the key, if any).

    Raises:
      PartsLostError: a part is missing, or the store failed.
      ConfigError: the entry was committed before with another record (another writer with
        this entry's run and generation: never the case for one publisher).
    """
    record = commit_record(entry, parts, self.key)
    for _ in range(_CLAIM_ATTEMPTS):
      held = bytes(self.feed.commit(entry, record))
      if held == record:
        self._commits[entry] = read_commit(record, entry, self.key)
        return
      try:
        read_commit(held, entry, self.key)
      except PartsLostError as e:  # a forged or garbled commit squats the name: not ours
        self._ignore(f"{entry.name} (replaced by this publisher's commit)", e)
        self.feed.remove_commit(entry)
        continue
      raise ConfigError(f"version {entry.version} ({entry.kind}) of generation "
                        f"{entry.generation} was committed before with other parts: another "
                        "writer uses this publisher's generation")
    raise PartsLostError(f"version {entry.version} ({entry.kind}): its name is squatted by "
                         f"commits that do not verify, {_CLAIM_ATTEMPTS} times in a row")
