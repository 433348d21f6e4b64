"""The trainer's view of its rollouts, from the status each one writes into the feed: which
version it holds, whether its digest is the trainer's digest of that version, how far it lags,
when it was last seen, and why it stalls or refused a version.

A status is a claim, not a proof: one that does not parse, names another run or rollout, is
larger than a status, or (with a key that can sign) is not signed by it, is ignored with a
warning; and statuses are only ever used to *keep* more (retention by need) or to *wait*
(bounded staleness), never to delete what the fixed retention rule keeps.

>>> import time
>>> from jsparse._src.engine.records import Status, status_record
>>> status = Status("r1", 2, 1, "00" * 8, time.time(), None, None, 2)
>>> [(r.rollout, r.lag_versions, r.digest_ok) for r in fleet_view(
...     {"r1": status_record("ab" * 16, status, None)}, run="ab" * 16, key=None,
...     published={2: ("00" * 8, 0.0)}, latest=3, now=time.time(), gone_seconds=60.0)]
[('r1', 1, True)]
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Mapping

from jsparse._src.errors import PartsLostError
from jsparse._src.engine.records import read_status
from jsparse._src.engine.signing import SigningKey


@dataclasses.dataclass(frozen=True)
class RolloutInfo:
  """One rollout as the trainer sees it (from :meth:`~jsparse.engine.Publisher.fleet`).

  Attributes:
    rollout: its id.
    version: the version it holds (None: none of this run).
    digest_ok: whether its digest is the trainer's digest of that version (None: a version
      this publisher did not publish, e.g. of an earlier generation).
    lag_versions: how many versions behind the newest it is (None: it holds none).
    lag_seconds: how long ago the first version it does not hold was published (0: current).
    last_seen: seconds since it last reported (on its clock against the trainer's).
    stalled: why it cannot follow the feed, as it said (None: it can).
    refused: why it did not apply the last version it tried (None: it applied it).
    generation: the newest trainer generation it knows.
    applied: how many versions it applied so far.
    gone: not seen for ``gone_seconds``: it holds nothing back.

  >>> row = RolloutInfo("r1", 7, True, 1, 0.2, 0.05, None, None, 1, 7, gone=False)
  >>> row.live, row.lag_versions
  (True, 1)
  """

  rollout: str
  version: int | None
  digest_ok: bool | None
  lag_versions: int | None
  lag_seconds: float
  last_seen: float
  stalled: str | None
  refused: str | None
  generation: int
  applied: int
  gone: bool

  @property
  def live(self) -> bool:
    return not self.gone


def fleet_view(statuses: Mapping[str, bytes], *, run: str, key: SigningKey | None,
               published: Mapping[int, tuple[str, float]], latest: int, now: float,
               gone_seconds: float, warned: set | None = None) -> list[RolloutInfo]:
  """The rollouts of run ``run`` from their status records, by id.

  Args:
    statuses: rollout id -> status record (``Feed.statuses``).
    run: the run (hex).
    key: the feed's key (statuses are checked against it where it can sign).
    published: version -> (digest hex, publish time) of what the trainer published.
    latest: the newest version the trainer published.
    now: the trainer's time (seconds since the epoch).
    gone_seconds: a rollout not seen this long is gone.
    warned: what was warned about already (each ignored status is warned about once).
  """
  warned = set() if warned is None else warned
  rows = []
  for rollout in sorted(statuses):
    try:
      status = read_status(statuses[rollout], run, rollout, key)
    except PartsLostError as e:
      if (rollout, str(e)) not in warned:
        warned.add((rollout, str(e)))
        logging.getLogger("jsparse").warning("jsparse: ignoring a status in the feed: %s", e)
      continue
    known = published.get(status.version) if status.version is not None else None
    lag = None if status.version is None else max(0, latest - status.version)
    first_missing = published.get((status.version or 0) + 1)
    lag_seconds = 0.0 if lag == 0 else (now - first_missing[1] if first_missing else 0.0)
    seen = max(0.0, now - status.time)
    rows.append(RolloutInfo(rollout, status.version, None if known is None else
                            known[0] == status.digest, lag, max(0.0, lag_seconds), seen,
                            status.stalled, status.refused, status.generation, status.applied,
                            seen > gone_seconds))
  return rows


def encode_rows(rows: list[RolloutInfo]) -> bytes:
  """The rows as bytes (to agree on them across a trainer's processes)."""
  return json.dumps([dataclasses.asdict(r) for r in rows]).encode()


def decode_rows(data: bytes) -> list[RolloutInfo]:
  return [RolloutInfo(**row) for row in json.loads(data)]
