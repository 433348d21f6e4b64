"""The public ``jsparse.errors`` module: every error is there, named there, and still at the top
level."""

import pickle
import traceback

import jax.numpy as jnp
import pytest

import jsparse
from jsparse import errors


def test_every_error_is_public_and_named_under_jsparse_errors():
  for name in errors.__all__:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.JsparseError)
    assert cls.__module__ == "jsparse.errors"
    assert pickle.loads(pickle.dumps(cls("m"))).args == ("m",)  # Ray ships errors pickled
  from jsparse import engine, tunix
  assert engine.PartsLostError is errors.PartsLostError
  assert tunix.TunixVersionError is errors.TunixVersionError


def test_top_level_names_still_work():
  for name in ("PlanMismatchError", "VersionError", "PayloadError", "ConfigError"):
    assert getattr(jsparse, name) is getattr(errors, name)


def test_a_traceback_names_the_public_module():
  plan = jsparse.make_plan({'w': jnp.zeros(3)})
  with pytest.raises(errors.PlanMismatchError) as caught:
    jsparse.diff(plan, {'w': jnp.zeros(3)}, {'w': jnp.zeros(4)})
  last = traceback.format_exception_only(caught.type, caught.value)[-1]
  assert last.startswith("jsparse.errors.PlanMismatchError: ")
