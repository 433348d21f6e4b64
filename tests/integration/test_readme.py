"""Every ```python block of the README runs as it is (each in a fresh namespace); its ```py
blocks quote the package's programs line for line (see doc_blocks)."""

import pytest

from tests.integration.doc_blocks import (ROOT, check_quoted, indented_blocks, python_blocks,
                                          quoted_blocks, run_block)

README = ROOT / "README.md"
BLOCKS = python_blocks(README)


def test_readme_has_examples():
  assert len(BLOCKS) >= 1
  assert not indented_blocks(README)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
  run_block(BLOCKS[index], f"README.md block {index}")


def test_readme_quoted_lines_are_the_example_programs():
  for index, block in enumerate(quoted_blocks(README)):
    check_quoted(block, f"README.md py block {index}")
