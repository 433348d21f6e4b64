"""The package's layers hold: no import cycle, no import from a lower layer to a higher one, every
error class in one module. Read from the source (every import, lazy ones included), so it runs in
milliseconds and names the offending file and line."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jsparse"

# Lowest first. A module belongs to the first layer with a prefix of its name; an import may go
# to its own layer or a lower one. Everything not named (jsparse/*.py, the examples, benchmarks
# and testing helpers) is the public layer on top.
LAYERS = (
    ("foundation", ("jsparse._src.errors", "jsparse._src.options", "jsparse._src.pytree",
                    "jsparse._src.threads")),
    ("core", ("jsparse._src.core",)),  # the pure plan, diff and apply
    ("device", ("jsparse._src.device",)),  # jitted programs: ranks, ulp codes, packing
    ("quant", ("jsparse._src.quant", "jsparse._src.planning")),  # views above the plan
    ("wire", ("jsparse._src.wire",)),  # host byte formats
    ("sync", ("jsparse._src.sync",)),  # the protocol: Sender, Receiver
    ("persistence", ("jsparse._src.chain_meta", "jsparse._src.checkpoint")),
    ("engine", ("jsparse._src.engine",)),  # feeds, publishers, subscribers
    ("tunix", ("jsparse._src.tunix",)),
    ("public", ("jsparse",)),
)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
  for rank, (_, prefixes) in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return rank
  raise AssertionError(f"{module} is in no layer")


def imports_in(source: str, module: str, package: str, known) -> list[tuple[str, int]]:
  """The modules of ``known`` that ``source`` (module ``module`` of package ``package``) imports
  anywhere in it, lazy imports included, with the line of each import."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
      submodules = [f"{base}.{alias.name}" for alias in node.names
                    if f"{base}.{alias.name}" in known]
      targets = submodules or [base]
    else:
      continue
    found += [(t, node.lineno) for t in targets if t in known and t != module]
  return found


def imports_of(module: str) -> list[tuple[str, int]]:
  path = MODULES[module]
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  return imports_in(path.read_text(), module, package, MODULES)


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_is_in_a_layer():
  assert {m: layer_of(m) for m in MODULES}


def test_no_import_goes_up_a_layer():
  upward = [f"{MODULES[m].relative_to(ROOT)}:{line}: {LAYERS[layer_of(m)][0]} module {m} imports "
            f"{target} ({LAYERS[layer_of(target)][0]}, a higher layer)"
            for m, targets in GRAPH.items() for target, line in targets
            if layer_of(target) > layer_of(m)]
  assert not upward, "\n".join(upward)


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  found = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_no_import_cycle():
  found = cycles({m: [t for t, _ in targets] for m, targets in GRAPH.items()})
  assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
  assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
  assert cycles({"a": ["b"], "b": []}) == []


def test_the_import_reader_sees_lazy_and_relative_imports():
  known = {"jsparse._src.core.plan", "jsparse._src.quant.view", "jsparse._src.core.bits"}
  source = ("from . import bits\n"
            "def make():\n"
            "  from jsparse._src.quant import view  # lazy: still an import\n")
  found = imports_in(source, "jsparse._src.core.plan", "jsparse._src.core", known)
  assert found == [("jsparse._src.core.bits", 1), ("jsparse._src.quant.view", 3)]
  assert layer_of("jsparse._src.quant.view") > layer_of("jsparse._src.core.plan")


def _error_classes(path: pathlib.Path) -> list[str]:
  tree = ast.parse(path.read_text())
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
      bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
      if any(b.endswith(("Error", "Exception", "Warning")) for b in bases):
        names.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}")
  return names


def test_every_error_class_is_defined_in_the_errors_module():
  elsewhere = [name for m, path in MODULES.items() if m != "jsparse._src.errors"
               for name in _error_classes(path)]
  assert not elsewhere, "error classes outside jsparse/_src/errors.py:\n" + "\n".join(elsewhere)
  assert len(_error_classes(MODULES["jsparse._src.errors"])) >= 10


@pytest.mark.parametrize("public", ["jsparse.errors"])
def test_the_public_errors_module_reexports_every_error(public):
  import jsparse.errors
  defined = {n.split(": ")[1] for n in _error_classes(MODULES["jsparse._src.errors"])}
  assert defined <= set(jsparse.errors.__all__) | {"JsparseError"}
