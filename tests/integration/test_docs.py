"""The docs site builds with warnings as errors (broken links and anchors included), and every
```python block of its pages runs as it is; ```py blocks quote the package's programs line for
line (see doc_blocks)."""

import os
import subprocess
import sys

import jax
import pytest

from tests.integration.doc_blocks import (ROOT, check_quoted, indented_blocks, python_blocks,
                                          quoted_blocks, run_block)

PAGES = sorted((ROOT / "docs").rglob("*.md"))
BLOCKS = [(page, index, block) for page in PAGES
          for index, block in enumerate(python_blocks(page))]


def _name(page, index):
  return f"{page.relative_to(ROOT)} block {index}"


def test_docs_build_strictly(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
       str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  assert (tmp_path / "site" / "api" / "jsparse" / "index.html").exists()


def test_docs_pages_have_examples_and_no_hidden_ones():
  assert len(BLOCKS) >= 8
  assert not [str(p) for p in PAGES if indented_blocks(p)]


@pytest.fixture
def restored_jax_config():
  """A block may set JAX options (the compilation cache): they are undone after it, and a first
  compilation before it settles this process's cache use, so no block turns the cache on here."""
  jax.jit(lambda x: x + 1)(1)
  before = dict(jax.config.values)
  yield
  for name, value in before.items():
    if jax.config.values.get(name) != value:
      jax.config.update(name, value)


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[_name(p, i) for p, i, _ in BLOCKS])
def test_docs_example_runs(page, index, block, restored_jax_config, capsys):
  run_block(block, _name(page, index))


def test_docs_quoted_lines_are_the_example_programs():
  quoted = [(page, index, block) for page in PAGES
            for index, block in enumerate(quoted_blocks(page))]
  assert quoted
  for page, index, block in quoted:
    check_quoted(block, f"{page.relative_to(ROOT)} py block {index}")
