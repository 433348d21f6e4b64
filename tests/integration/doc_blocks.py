"""The code blocks of the user-facing pages (README.md, docs/**/*.md), for the tests that run them.

Two kinds of fenced block are checked:

- ```` ```python ````: a complete program. It runs as it is, each block in a fresh namespace
  (tests/conftest.py gives the process 8 simulated CPU devices).
- ```` ```py ````: lines quoted from a program of the package that cannot run inside the test
  process (a multi-process ``jax.distributed`` job, a Ray cluster). Its first line is a comment
  naming the file, ``# jsparse/examples/<name>.py ...``; every other line that is not a comment
  must be a line of that file (indentation aside), and the block must parse as Python. The
  tests that run that program (e.g. tests/multihost) cover its behaviour.

Any other block (```` ```bash ````, ```` ```text ````) is not run. Blocks must start at the left
margin: an indented ```` ```python ```` block would be silently skipped, so it fails the check.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_RUN = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_QUOTED = re.compile(r"^```py\n(.*?)^```", re.S | re.M)
_INDENTED = re.compile(r"^[ \t]+```py(thon)?\s*$", re.M)


def python_blocks(path: Path) -> list[str]:
  """The ```python blocks of a page, in order."""
  return _RUN.findall(path.read_text())


def quoted_blocks(path: Path) -> list[str]:
  """The ```py blocks of a page, in order."""
  return _QUOTED.findall(path.read_text())


def indented_blocks(path: Path) -> list[str]:
  """Python fences that do not start at the left margin (never run: the pages must have none)."""
  return [m.group(0) for m in _INDENTED.finditer(path.read_text())]


def run_block(source: str, name: str) -> None:
  """Runs one ```python block as a program of its own."""
  exec(compile(source, name, "exec"), {"__name__": "docs_example"})


def check_quoted(block: str, name: str) -> None:
  """A ```py block parses and every line of it is a line of the file its first line names."""
  first, _, rest = block.partition("\n")
  match = re.match(r"#\s*(jsparse/\S+\.py)\b", first)
  assert match, f"{name}: a ```py block starts with '# jsparse/<file>.py', not {first!r}"
  ast.parse(block, filename=name)  # valid Python, even though it is not run here
  source = {line.strip() for line in (ROOT / match.group(1)).read_text().splitlines()}
  quoted = [line.strip() for line in rest.splitlines()
            if line.strip() and not line.strip().startswith("#")]
  missing = [line for line in quoted if line not in source]
  assert quoted and not missing, f"{name}: lines not in {match.group(1)}: {missing}"
