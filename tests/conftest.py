"""Test set-up: 8 simulated CPU devices (before JAX initializes), quick compilations and
hypothesis profiles."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The suite compiles thousands of small programs and runs each a few times: XLA's CPU backend
# compiles them up to about 2x faster with LLVM's optimizations off. XLA's own HLO passes, which
# decide what is computed, run as always; only the machine code is less tuned. Processes the
# tests start inherit it. At the default level instead:
#   XLA_FLAGS=--xla_backend_optimization_level=2 bash run.sh test
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# Slot levels compile when a sync first needs them, not ahead in the background
# (``jsparse._src.sync.programs.SlotLevels``): most tests run a few syncs of plans of their own,
# and levels compiled ahead for syncs that never come took about a third of a module's compile
# time. The tests of compiling ahead turn it on (the ``compile_ahead`` marker); processes the
# tests start inherit the setting.
os.environ.setdefault("JSPARSE_COMPILE_AHEAD", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from tests.helpers import drop_queued_compilations, release_compiled_programs_if_many  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

settings.register_profile(
    "default", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser):
  parser.addoption("--fuzz-examples", type=int, default=6,
                   help="cases of the whole-stack fuzz (tests/sync/test_fuzz.py)")


def pytest_configure(config):
  os.environ["JSPARSE_FUZZ_EXAMPLES"] = str(config.getoption("--fuzz-examples"))
  config.addinivalue_line("markers", "compile_ahead: slot levels compile ahead, in the "
                          "background, as they do by default outside the suite")


@pytest.fixture(autouse=True)
def _bounded_compiled_programs(request):
  """Slot levels compiled ahead for tests marked ``compile_ahead`` only; drops the background
  compilations a test left queued, and keeps the session below the kernel's limit of memory
  maps (see the helpers)."""
  from jsparse._src.sync import programs
  ahead = request.node.get_closest_marker("compile_ahead") is not None
  previous = programs.compile_ahead(ahead or os.environ["JSPARSE_COMPILE_AHEAD"] != "0")
  yield
  drop_queued_compilations()
  programs.compile_ahead(previous)
  release_compiled_programs_if_many()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_auto_num_workers(config):
  """``-n auto`` (``bash run.sh test``): one worker per core, at most 4 (each worker is a JAX
  process with 8 simulated devices; some tests start jobs of several processes)."""
  del config
  return max(1, min(4, len(os.sched_getaffinity(0))))
