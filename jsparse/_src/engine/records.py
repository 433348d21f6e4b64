"""The two small records a feed holds besides parts: a version's *commit* (its run, generation,
version, kind, base, and every part's size and BLAKE2b checksum) and a publisher's
*generation* claim. Both are JSON, bounded in size, parsed strictly, and signed when the
publisher has a key (``signing.py``); every feed kind stores them as opaque bytes, so the
rules that decide what a rollout may trust live here, once.

>>> entry = Entry(3, "delta", 2, 1, generation=1, run="ab" * 16)
>>> raw = commit_record(entry, [part_meta(b"part")], key=None)
>>> commit = read_commit(raw, entry, key=None)
>>> commit.parts[0].size, commit.signed
(4, False)
>>> read_commit(raw, Entry(3, "delta", 2, 1, generation=2, run="ab" * 16), key=None)
Traceback (most recent call last):
...
jsparse.errors.PartsLostError: commit of version 3 (delta): not a commit of this entry (it names generation 1, not 2)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Sequence

from jsparse._src.engine.feed import MAX_VERSION, ROLLOUT_ID, STATUS_BYTES, Entry
from jsparse._src.engine.signing import SigningKey
from jsparse._src.errors import ConfigError, PartsLostError

COMMIT_FORMAT = "jsparse-commit/1"
GENERATION_FORMAT = "jsparse-generation/1"
GENERATION_BYTES = 512  # a generation record is at most this long
_COMMIT_FIXED, _COMMIT_PER_PART = 1024, 64  # a commit is at most fixed + per part * parts


@dataclasses.dataclass(frozen=True)
class PartMeta:
  """One part as its commit names it: its size in bytes and its BLAKE2b-128 checksum (hex)."""

  size: int
  digest: str


@dataclasses.dataclass(frozen=True)
class Commit:
  """A verified commit: the entry it commits, its parts, and whether it was signed."""

  entry: Entry
  parts: tuple[PartMeta, ...]
  signed: bool


def part_digest(data) -> str:
  """The BLAKE2b-128 checksum (hex) of a part's bytes."""
  return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


def part_meta(data) -> PartMeta:
  """The size and checksum of a part's bytes."""
  return PartMeta(len(memoryview(data).cast("B")), part_digest(data))


def commit_bytes_cap(parts: int) -> int:
  """The most bytes a commit of ``parts`` parts can take (reads stop past it)."""
  return _COMMIT_FIXED + _COMMIT_PER_PART * parts


def _canonical(body: dict) -> bytes:
  return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _envelope(kind: str, body: dict, key: SigningKey | None) -> bytes:
  signed = None
  if key is not None:
    signature = key.sign(kind.encode() + b"\n" + _canonical(body))
    signed = {"algorithm": key.algorithm, "key_id": key.key_id, "signature": signature.hex()}
  return json.dumps({"record": body, "signed": signed}, sort_keys=True,
                    separators=(",", ":")).encode()


def _open_envelope(raw, cap: int, kind: str, key: SigningKey | None) -> tuple[dict, bool]:
  """The body of a record and whether it is signed; ValueError saying why it is not one."""
  raw = bytes(raw)
  if len(raw) > cap:
    raise ValueError(f"{len(raw)} bytes, more than a record of its kind takes ({cap})")
  try:
    found = json.loads(raw)
  except (ValueError, RecursionError, UnicodeDecodeError) as e:
    raise ValueError(f"not JSON ({type(e).__name__})") from None
  if not isinstance(found, dict) or set(found) != {"record", "signed"} \
      or not isinstance(found["record"], dict):
    raise ValueError("not a record")
  body, signed = found["record"], found["signed"]
  if signed is not None and not (isinstance(signed, dict) and all(
      isinstance(signed.get(k), str) for k in ("algorithm", "key_id", "signature"))):
    raise ValueError("a malformed signature")
  if key is not None:
    if signed is None:
      raise ValueError("unsigned, and this feed's versions must be signed")
    if (signed["algorithm"], signed["key_id"]) != (key.algorithm, key.key_id):
      raise ValueError(f"signed by another key ({signed['algorithm']} {signed['key_id']}, not "
                       f"{key.algorithm} {key.key_id})")
    try:
      signature = bytes.fromhex(signed["signature"])
    except ValueError:
      raise ValueError("a malformed signature") from None
    if not key.verify(kind.encode() + b"\n" + _canonical(body), signature):
      raise ValueError("its signature does not verify")
  return body, signed is not None


def _int(body: dict, name: str, top: int) -> int:
  value = body.get(name)
  if type(value) is not int or not 0 <= value < top:
    raise ValueError(f"its {name} is {value!r}")
  return value


def commit_record(entry: Entry, parts: Sequence[PartMeta], key: SigningKey | None) -> bytes:
  """The commit of ``entry`` with its ``parts``, signed with ``key`` (if given)."""
  if len(parts) != entry.parts:
    raise ValueError(f"a commit of {entry.parts} parts given {len(parts)}")
  body = {"format": COMMIT_FORMAT, "run": entry.run, "generation": entry.generation,
          "version": entry.version, "kind": entry.kind, "base": entry.base,
          "parts": [[p.size, p.digest] for p in parts]}
  return _envelope(COMMIT_FORMAT, body, key)


def read_commit(raw, entry: Entry, key: SigningKey | None) -> Commit:
  """The commit of ``entry`` in ``raw``, checked: its size, its form, that it names this very
  entry (run, generation, version, kind, base, part count) and, given a ``key``, that the key
  signed it.

  Raises:
    PartsLostError: ``raw`` is not such a commit (the message says why).
  """
  try:
    body, signed = _open_envelope(raw, commit_bytes_cap(entry.parts), COMMIT_FORMAT, key)
    if body.get("format") != COMMIT_FORMAT:
      raise ValueError(f"its format is {str(body.get('format'))[:40]!r}")
    named = (body.get("run"), _int(body, "generation", MAX_VERSION),
             _int(body, "version", MAX_VERSION), body.get("kind"),
             _int(body, "base", MAX_VERSION))
    for field, found, wanted in zip(("run", "generation", "version", "kind", "base"), named,
                                    (entry.run, entry.generation, entry.version, entry.kind,
                                     entry.base)):
      if found != wanted:
        raise ValueError(f"it names {field} {str(found)[:40]}, not {wanted}")
    listed = body.get("parts")
    if not isinstance(listed, list) or len(listed) != entry.parts:
      raise ValueError(f"it does not name {entry.parts} parts")
    parts = []
    for k, item in enumerate(listed):
      if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
              and 0 <= item[0] < 1 << 48 and isinstance(item[1], str) and len(item[1]) == 32
              and all(c in "0123456789abcdef" for c in item[1])):
        raise ValueError(f"part {k} is named {str(item)[:60]}")
      parts.append(PartMeta(item[0], item[1]))
  except ValueError as e:
    raise PartsLostError(f"commit of version {entry.version} ({entry.kind}): not a commit of "
                         f"this entry ({e})") from None
  return Commit(entry, tuple(parts), signed)


def generation_record(run: str, generation: int, key: SigningKey | None) -> bytes:
  """A publisher's claim of ``generation`` in run ``run`` (hex), signed with ``key``."""
  body = {"format": GENERATION_FORMAT, "run": run, "generation": generation}
  return _envelope(GENERATION_FORMAT, body, key)


def read_generation(raw, run: str, generation: int, key: SigningKey | None) -> None:
  """Checks that ``raw`` claims ``generation`` of run ``run`` (signed by ``key``, if given).

  Raises:
    PartsLostError: it does not (the message says why).
  """
  try:
    body, _ = _open_envelope(raw, GENERATION_BYTES, GENERATION_FORMAT, key)
    if body.get("format") != GENERATION_FORMAT or body.get("run") != run \
        or _int(body, "generation", MAX_VERSION) != generation:
      raise ValueError(f"it claims {str(body)[:120]}")
  except ValueError as e:
    raise PartsLostError(f"generation {generation}: not a claim of this run ({e})") from None



STATUS_FORMAT = "jsparse-status/1"


@dataclasses.dataclass(frozen=True)
class Status:
  """What a rollout reported of itself (see :func:`status_record`).

  Attributes:
    rollout: the rollout's id.
    version: the version it holds (None: no version of the run).
    generation: the newest generation of the run it knows.
    digest: the digest of the state it holds (hex), verified against the sender's.
    time: when it wrote this (its clock, seconds since the epoch).
    stalled: why it cannot follow the feed now, or None.
    refused: why it did not apply the last version it tried, or None (since it applied one).
    applied: how many versions it applied so far.
  """

  rollout: str
  version: int | None
  generation: int
  digest: str
  time: float
  stalled: str | None
  refused: str | None
  applied: int


def check_rollout_id(rollout: str) -> str:
  """``rollout`` if it is a valid rollout id (1-64 of ``A-Za-z0-9._-``, not starting with a
  dot or dash), else ConfigError."""
  if not isinstance(rollout, str) or not ROLLOUT_ID.match(rollout):
    raise ConfigError(f"a rollout id is 1 to 64 letters, digits, '.', '_' or '-' (not first), "
                      f"got {rollout!r:.80}")
  return rollout


def status_record(run: str, status: Status, key: SigningKey | None) -> bytes:
  """A rollout's status in run ``run``, signed with ``key`` where the key can sign."""
  body = {"format": STATUS_FORMAT, "run": run, **dataclasses.asdict(status)}
  for field in ("stalled", "refused"):
    if body[field] is not None:
      body[field] = body[field][:1000]
  return _envelope(STATUS_FORMAT, body, key if key is not None and key.can_sign else None)


def read_status(raw, run: str, rollout: str, key: SigningKey | None) -> Status:
  """The status in ``raw`` of rollout ``rollout`` in run ``run``, checked (its size, its form,
  and, given a ``key`` that can sign, its signature).

  Raises:
    PartsLostError: it is not such a status (the message says why).
  """
  try:
    signing = key if key is not None and key.can_sign else None
    body, _ = _open_envelope(raw, STATUS_BYTES, STATUS_FORMAT, signing)
    if body.get("format") != STATUS_FORMAT or body.get("run") != run \
        or body.get("rollout") != rollout:
      raise ValueError("it is of another run or rollout")
    version = body.get("version")
    if version is not None:
      version = _int(body, "version", MAX_VERSION)
    when, digest = body.get("time"), body.get("digest")
    stalled, refused = body.get("stalled"), body.get("refused")
    if type(when) not in (int, float) or not 0 <= when < 1e11:
      raise ValueError(f"its time is {str(when)[:40]}")
    if not all(x is None or isinstance(x, str) for x in (stalled, refused)):
      raise ValueError("its stall or refusal reason is not text")
    if not (isinstance(digest, str) and len(digest) <= 64
            and all(c in "0123456789abcdef" for c in digest)):
      raise ValueError("its digest is not hex")
    return Status(rollout, version, _int(body, "generation", MAX_VERSION), digest, float(when),
                  stalled, refused, _int(body, "applied", MAX_VERSION))
  except ValueError as e:
    raise PartsLostError(f"status of rollout {rollout}: not a status of this run ({e})") from None
