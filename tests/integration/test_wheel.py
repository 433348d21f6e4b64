"""jsparse as a user installs it: the wheel `python -m build` makes from a clean copy of the
tree, installed into a fresh venv, ships every module and `py.typed`, reports its version, and
runs the README's quick start from outside the repository.

Nothing is downloaded: the wheel is built without an isolated build env (the test extra has
setuptools and build), installed with `--no-deps`, and the fresh venv sees this venv's
site-packages for jsparse's dependencies through a .pth file. A .pth line only adds a path, so
this venv's editable jsparse is not activated there: the fresh venv imports the wheel's copy,
and the test checks that it does.
"""

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.integration.doc_blocks import ROOT, python_blocks


def _run(args, timeout, **kwargs):
  out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
  assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
  return out


def _source_files():
  """What a clone holds: the tracked files and the untracked ones git does not ignore."""
  out = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], 60,
             cwd=ROOT)
  return [name for name in out.stdout.split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """(the wheel's path, a fresh venv's python with the wheel installed, a directory outside the
  repository)."""
  tmp = tmp_path_factory.mktemp("wheel")
  source = tmp / "source"
  for name in _source_files():
    (source / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / name, source / name)
  _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
        str(tmp / "dist"), str(source)], 600)
  (path,) = (tmp / "dist").glob("jsparse-*.whl")

  venv = tmp / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 120)
  python = venv / "bin" / "python"
  _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
        "--no-index", str(path)], 300)
  site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
              60).stdout.strip()
  ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  with open(f"{site}/_jsparse_test_deps.pth", "w") as f:
    f.write("\n".join(sorted(ours)) + "\n")
  outside = tmp / "user"
  outside.mkdir()
  return path, python, outside


def test_wheel_ships_every_module_and_py_typed(wheel):
  path, _, _ = wheel
  names = set(zipfile.ZipFile(path).namelist())
  modules = {str(p.relative_to(ROOT)) for p in (ROOT / "jsparse").rglob("*.py")}
  assert modules, "no modules found under jsparse/"
  assert not modules - names, f"modules missing from the wheel: {sorted(modules - names)}"
  assert "jsparse/py.typed" in names
  assert not [n for n in names if n.startswith("tests/")]


def test_wheel_version_is_the_package_version(wheel):
  path, python, outside = wheel
  version = path.name.split("-")[1]
  code = ("import importlib.metadata, json, jsparse; print(json.dumps([jsparse.__version__, "
          "importlib.metadata.version('jsparse'), jsparse.__file__]))")
  out = _run([str(python), "-c", code], 120, cwd=outside)
  package_version, metadata_version, file = json.loads(out.stdout)
  assert package_version == metadata_version == version
  assert str(ROOT) not in file, f"the fresh venv imported the repository's jsparse: {file}"


def test_wheel_runs_the_readme_quick_start(wheel):
  _, python, outside = wheel
  quick_start = python_blocks(ROOT / "README.md")[0]
  (outside / "quick_start.py").write_text(quick_start)
  out = _run([str(python), "quick_start.py"], 600, cwd=outside)
  assert "bytes instead of" in out.stdout


def test_wheel_imports_every_public_module(wheel):
  _, python, outside = wheel
  code = ("import jsparse, jsparse.engine, jsparse.errors, jsparse.testing, jsparse.tunix, "
          "jsparse.examples.rl_model, jsparse.benchmarks; print('ok')")
  assert _run([str(python), "-c", code], 300, cwd=outside).stdout.strip() == "ok"
