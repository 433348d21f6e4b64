"""Every colab/ notebook runs top to bottom unchanged (nbclient, a real Jupyter kernel)."""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "colab").glob("*.ipynb"))


def test_the_seven_notebooks_are_there():
  assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07"]


# An import of a private module (jsparse's or a dependency's ``_src``) or of the benchmarks.
PRIVATE = re.compile(r"^\s*(?:from|import)\s+[\w.]*(?:\._src\b|jsparse\.benchmarks\b)", re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_show_the_public_api_only(path):
  notebook = nbformat.read(path, as_version=4)
  private = [line.strip() for cell in notebook.cells if cell.cell_type == "code"
             for line in cell.source.splitlines() if PRIVATE.match(line)]
  assert not private, f"{path.name} imports private modules: {private}"


def test_the_private_import_check_can_fail():
  assert PRIVATE.search("import jax\nfrom qwix._src.core import qarray")
  assert PRIVATE.search("  from jsparse.benchmarks import quantized")
  assert not PRIVATE.search('subprocess.run([sys.executable, "-m", "jsparse.benchmarks"])')


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
  notebook = nbformat.read(path, as_version=4)
  client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
  errors = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
