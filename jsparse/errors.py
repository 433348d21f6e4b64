"""The exceptions jsparse raises, in one public place.

Every error derives from :class:`JsparseError`, so ``except jsparse.errors.JsparseError`` catches
the whole family, and from the matching builtin (``ValueError``, ``TypeError``,
``RuntimeError``), so generic handlers work too. Tracebacks name them here
(``jsparse.errors.PlanMismatchError``); the most common are also at the top level
(``jsparse.PlanMismatchError``).

>>> import jsparse
>>> from jsparse import errors
>>> errors.PlanMismatchError is jsparse.PlanMismatchError
True
>>> issubclass(errors.PartsLostError, errors.JsparseError)
True
>>> raise errors.VersionError("a message")
Traceback (most recent call last):
...
jsparse.errors.VersionError: a message
"""

from jsparse._src.errors import (ArgumentError, CheckpointError, ConfigError, FencedError,
                                 ForeignPlanError, IntegrityError, JsparseError,
                                 OverflowedDeltaError, PartsLostError, PayloadError, PlanError,
                                 PlanMismatchError, StalenessError, TunixVersionError, VersionError)

__all__ = [
    "ArgumentError", "CheckpointError", "ConfigError", "FencedError", "ForeignPlanError",
    "IntegrityError",
    "JsparseError", "OverflowedDeltaError", "PartsLostError", "PayloadError", "PlanError",
    "PlanMismatchError", "StalenessError", "TunixVersionError", "VersionError",
]

for _name in __all__:  # tracebacks and reprs name the public module, not where each is defined
  globals()[_name].__module__ = __name__
del _name
