"""Everything jsparse takes from Tunix, in one place, with the version it is tested with.

Tunix's API moves quickly. The adapter depends on exactly these names; a missing module, class or
attribute raises :class:`TunixVersionError` naming the tested version, instead of an
``AttributeError`` deep inside a training loop.

* ``tunix.rl.rollout.base_rollout.BaseRollout``: the rollout interface (``generate``,
  ``get_per_token_logps``, ``update_params(params, filter_types)``, ``pad_id``, ``eos_id``,
  ``model``), which :class:`~jsparse.tunix.SparseRollout` implements by delegation.
* ``tunix.rl.rl_cluster.RLCluster``: ``actor_trainer.model``, ``rollout`` and the private
  ``_rollout`` slot that :func:`~jsparse.tunix.use_sparse_sync` replaces.
* ``tunix.sft.utils.is_lora_enabled``: how Tunix picks ``nnx.LoRAParam`` over ``nnx.Param``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from jsparse._src.errors import TunixVersionError

TESTED_TUNIX_VERSION = "0.1.7"


def installed_version() -> str | None:
  """The installed ``google-tunix`` version, or None."""
  try:
    return importlib.metadata.version("google-tunix")
  except importlib.metadata.PackageNotFoundError:
    return None


def _problem(what: str) -> TunixVersionError:
  return TunixVersionError(
      f"jsparse.tunix: {what}. The adapter is tested with google-tunix=={TESTED_TUNIX_VERSION} "
      f"(installed: {installed_version() or 'none'}); install it with "
      f"`pip install 'jsparse[tunix]'`.")


def tunix_attr(module: str, name: str) -> Any:
  """``module.name`` from Tunix, else :class:`TunixVersionError` naming both.

  >>> tunix_attr("tunix.rl.rollout.base_rollout", "BaseRollout").__name__
  'BaseRollout'
  """
  try:
    return getattr(importlib.import_module(module), name)
  except ImportError as e:
    raise _problem(f"cannot import {module} ({e})") from e
  except AttributeError:
    raise _problem(f"{module} has no {name}") from None


def require(obj: Any, attribute: str, what: str) -> Any:
  """``obj.attribute``, else :class:`TunixVersionError` (``what`` names ``obj``)."""
  if not hasattr(obj, attribute):
    raise _problem(f"{what} has no attribute {attribute!r}")
  return getattr(obj, attribute)
