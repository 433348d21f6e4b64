"""The README's Layout section names every module of the package, and nothing that is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> set[str]:
  """Every module under jsparse/; of the package markers, the top-level one (the others hold
  no code)."""
  return {str(p.relative_to(ROOT)) for p in (ROOT / "jsparse").rglob("*.py")
          if p.name != "__init__.py" or p.parent == ROOT / "jsparse"}


def _listed() -> set[str]:
  layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
  return set(re.findall(r"^(jsparse/\S+\.py)", layout, re.M))


def test_layout_lists_every_module_and_only_existing_ones():
  modules, listed = _modules(), _listed()
  assert not modules - listed, f"modules missing from README's Layout: {sorted(modules - listed)}"
  assert not listed - modules, f"README's Layout lists modules that are gone: " \
      f"{sorted(listed - modules)}"
