"""A Griffe extension for the API reference: jsparse's docstrings are Google style with
reStructuredText touches (``:class:`~x.Y``` roles, ``double backticks``, bare ``>>>`` doctests).
This renders them as Markdown: each doctest becomes a ``pycon`` code block (else Markdown reads
``>>>`` as nested quotes and ``[0]`` as a link), roles and double backticks become code spans.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj|py:\w+):`(~?)([^`]+)`")
_DOUBLE = re.compile(r"``([^`]+)``")


def _role(match: re.Match) -> str:
  name = match.group(2)
  return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


def markdown(text: str) -> str:
  """The docstring text with doctests fenced and reST inline markup as code spans."""
  out: list[str] = []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    if line.lstrip().startswith(">>>"):
      indent = line[:len(line) - len(line.lstrip())]
      out.append(f"{indent}```pycon")
      while i < len(lines) and lines[i].strip():
        out.append(lines[i])
        i += 1
      out.append(f"{indent}```")
      continue
    line = _DOUBLE.sub(r"`\1`", _ROLE.sub(_role, line))
    if line.endswith("::") and not line.strip() == "::":
      line = line[:-1]  # a reST literal block follows; Markdown's indented block renders it
    out.append(line)
    i += 1
  return "\n".join(out)


class DoctestBlocks(griffe.Extension):
  """Rewrites every docstring once, as Griffe loads the object."""

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is not None:
      obj.docstring.value = markdown(obj.docstring.value)
