"""Exception types raised by jsparse.

Every error jsparse raises derives from :class:`JsparseError`, so callers can catch the whole
family at once, and from the matching builtin (``ValueError`` ...), so generic handlers work too.

>>> import jsparse
>>> issubclass(jsparse.ConfigError, (jsparse.JsparseError, ValueError))
True
"""

from __future__ import annotations


class JsparseError(Exception):
  """Base class of every error raised by jsparse."""


class ConfigError(JsparseError, ValueError):
  """An option has a bad type or value (e.g. ``capacity=2.0``, ``anchor_every=True``)."""


class ArgumentError(JsparseError, TypeError):
  """A public function got an argument of the wrong type (the message says what it expects)."""


class PlanError(JsparseError, ValueError):
  """A plan cannot be built from the given tree (an unsupported dtype, a leaf too large)."""


class PlanMismatchError(JsparseError, ValueError):
  """A tree, delta or payload does not match the plan (structure, leaf shape or dtype)."""


class OverflowedDeltaError(JsparseError, ValueError):
  """A pure :func:`~jsparse.apply` was given a :class:`~jsparse.Delta` with overflowed segments:
  it holds only their first ``capacity`` changes, so the result would not be exact."""


class PayloadError(JsparseError, ValueError):
  """Bytes cannot be decoded: not a jsparse payload, corrupted, truncated or for another plan."""


class VersionError(JsparseError, ValueError):
  """A payload applies to another version than the receiver holds (missed, replayed, reordered)."""


class IntegrityError(JsparseError, RuntimeError):
  """The state reconstructed by a receiver does not match the digest the sender computed."""


class CheckpointError(JsparseError, RuntimeError):
  """A checkpoint step is missing, unreadable, corrupted or from another plan (named)."""


class FencedError(JsparseError, RuntimeError):
  """A publisher was replaced in its feed (a restored trainer claimed a newer generation, or the
  feed now belongs to another run): it must stop publishing; nothing of it is applied after."""


class StalenessError(JsparseError, TimeoutError):
  """A version was not reached in time: a rollout waiting for a version (``wait_for``), or a
  publisher waiting for its rollouts to be within ``max_lag`` versions (the message names who
  lags, and why, as they reported it)."""


class ForeignPlanError(CheckpointError):
  """The step was saved with another plan (its fingerprint differs)."""


class PartsLostError(JsparseError):
  """A committed version's parts can no longer be read (deleted, truncated, their owner died),
  or the feed holds something unexpected where a part, entry or marker belongs."""


class TunixVersionError(ConfigError):
  """Tunix is missing, or its API is not the one the adapter was tested with."""

