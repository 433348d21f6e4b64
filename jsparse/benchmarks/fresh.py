"""Runs one benchmark point in a fresh Python process (no compilation cached, JAX's persistent
cache off, its own memory and device count) and returns what it printed last, as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jsparse.testing import host_device_flags


def in_fresh_process(module: str, call: str, devices: int | None = None) -> dict:
  """``module.call`` evaluated in a new interpreter; ``devices``: simulated CPU devices there.

  >>> in_fresh_process("math", "floor(2.5)")
  2
  """
  env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
  if devices is not None:
    env["XLA_FLAGS"] = host_device_flags(devices)
  code = f"import json, {module} as m; print(json.dumps(m.{call}))"
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env=env)
  return json.loads(out.stdout.strip().splitlines()[-1])
