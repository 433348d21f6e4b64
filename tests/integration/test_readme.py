"""Every ```python block of the README runs as it is (each in a fresh namespace)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_examples():
  assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
  exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme"})
