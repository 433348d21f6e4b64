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


def test_readme_multihost_lines_are_the_example_programs():
  """The ```py block of the multi-host section quotes jsparse/examples/multihost.py, which
  tests/multihost runs as multi-process jobs."""
  source = (README.parents[0] / "jsparse" / "examples" / "multihost.py").read_text()
  lines = {line.strip() for line in source.splitlines()}
  (block,) = re.findall(r"^```py\n(.*?)^```", README.read_text(), re.S | re.M)
  quoted = [line.strip() for line in block.splitlines() if not line.strip().startswith("#")]
  assert quoted and all(line in lines for line in quoted), [l for l in quoted if l not in lines]
