"""Checks of user options, shared by every entry point: one message style, one error type.

>>> int_option("anchor_every", 3, minimum=1, optional=True)
3
>>> int_option("anchor_every", True, minimum=1)
Traceback (most recent call last):
...
jsparse.errors.ConfigError: anchor_every must be an int >= 1, got True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jsparse._src.errors import ArgumentError, ConfigError


def int_option(name: str, value: Any, *, minimum: int, optional: bool = False) -> Any:
  """``value`` as an ``int`` (numpy integers accepted) of at least ``minimum``; None passes if
  ``optional``. Bools are refused: ``True`` is not a count.

  Raises:
    ConfigError: naming the option and what was expected.
  """
  if value is None and optional:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
      or value < minimum:
    allowed = " or None" if optional else ""
    raise ConfigError(f"{name} must be an int >= {minimum}{allowed}, got {value!r}")
  return int(value)


def float_option(name: str, value: Any, *, minimum: float = 0.0) -> float:
  """``value`` as a finite ``float`` (ints accepted) of at least ``minimum``.

  >>> float_option("stall_seconds", 30)
  30.0

  Raises:
    ConfigError: naming the option and what was expected.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)) \
      or not np.isfinite(value) or value < minimum:
    raise ConfigError(f"{name} must be a finite number >= {minimum}, got {value!r}")
  return float(value)


def typed_argument(name: str, value: Any, kind: type | tuple[type, ...], expected: str) -> Any:
  """``value`` if it is a ``kind``, else :class:`ArgumentError` saying what was expected.

  >>> typed_argument("plan", "p", int, "a jsparse.Plan (from make_plan)")
  Traceback (most recent call last):
  ...
  jsparse.errors.ArgumentError: jsparse: plan must be a jsparse.Plan (from make_plan), got str
  """
  if not isinstance(value, kind):
    raise ArgumentError(f"jsparse: {name} must be {expected}, got {type(value).__name__}")
  return value


def feed_argument(feed: Any) -> Any:
  """``feed`` if it has the methods of a feed (``jsparse.engine.Feed``), else
  :class:`ArgumentError`."""
  missing = [m for m in ("put", "commit", "remove_commit", "entries", "read_commit", "pending",
                         "parts", "remove", "request_anchor", "take_anchor_request", "run_id",
                         "claim_run", "generations", "read_generation", "claim_generation",
                         "put_status", "statuses", "remove_status")
             if not callable(getattr(feed, m, None))]
  if missing:
    raise ArgumentError(f"jsparse: feed must be a jsparse.engine feed (DirectoryFeed, RayFeed, "
                        f"...), got {type(feed).__name__} (no {', '.join(missing)})")
  return feed
