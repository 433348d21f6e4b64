"""The package as documented: CONTRIBUTING.md's Code layout names every module (and nothing
gone), every public name has a runnable example, and `import jsparse` stays light."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> set[str]:
  """Every module under jsparse/; of the package markers, the top-level one (the others hold
  no code)."""
  return {str(p.relative_to(ROOT)) for p in (ROOT / "jsparse").rglob("*.py")
          if p.name != "__init__.py" or p.parent == ROOT / "jsparse"}


def _listed() -> set[str]:
  layout = (ROOT / "CONTRIBUTING.md").read_text().split("## Code layout", 1)[1]
  return set(re.findall(r"^(jsparse/\S+\.py)", layout, re.M))


def test_layout_lists_every_module_and_only_existing_ones():
  modules, listed = _modules(), _listed()
  assert not modules - listed, \
      f"modules missing from CONTRIBUTING.md's Code layout: {sorted(modules - listed)}"
  assert not listed - modules, f"CONTRIBUTING.md's Code layout lists modules that are gone: " \
      f"{sorted(listed - modules)}"


def test_every_public_entry_point_has_a_runnable_example():
  import jsparse
  from jsparse import engine, quantized, tunix
  missing = []
  for module in (jsparse, engine, quantized, tunix):
    names = [name for name in module.__all__ if callable(getattr(module, name)) and (
        not isinstance(getattr(module, name), type)
        or not issubclass(getattr(module, name), Exception))]
    missing += [f"{module.__name__}.{name}" for name in names
                if ">>>" not in (getattr(module, name).__doc__ or "")]
  assert not missing, f"public names without a >>> example: {missing}"


def test_import_jsparse_loads_neither_orbax_nor_flax_nor_optax_nor_tunix():
  import subprocess
  import sys
  code = ("import sys, jsparse, jsparse.engine; "
          "print(sorted({m.split('.')[0] for m in sys.modules} & "
          "{'orbax', 'flax', 'optax', 'matplotlib', 'ray', 'tunix'}))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"
