"""Installing labkit: the Makefile's torch step, the conda route, the wheel, the install cell.

* ``make setup`` on a bare environment installs torch from PyTorch's CPU wheel index when it
  answers, else from pip's default index with a message saying so (fast: no long hang), and
  never replaces an importable torch. The Makefile runs for real here, on a fake ``.venv``
  whose ``python`` records the pip commands instead of running them;
* environment.yml takes conda-forge's CPU build of PyTorch;
* ``make lab`` uses an active conda environment ``labkit`` instead of building ``.venv``;
* ``make dist`` builds a wheel holding every subpackage (``labkit.kernels`` from ``kernels/``),
  which pip accepts in the install cell's form (``labkit[lab,serve] @ file://...``);
* the notebooks' install cell installs from ``$LABKIT_SOURCE`` (a wheel path, a wheel URL, a
  Git URL) or the course default, only where labkit is missing, then, on a machine without an
  NVIDIA GPU, compiles the C++ CPU kernels (``python -m labkit kernels``) so that no later cell
  waits on a compiler.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.metadata
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
import zipfile
from pathlib import Path

import pytest

from labkit.notebooks import LABKIT_SOURCE, install_cell

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

FAKE_PYTHON = """#!/bin/sh
# A venv's python for the Makefile's setup step: pip commands are recorded, not run;
# `import torch` succeeds only when FAKE_TORCH=1; any other -c code runs on the real python.
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; echo "$*" >> "$PIP_LOG"; exit 0; fi
if [ "$1" = "-c" ]; then
  case "$2" in
    *"import torch"*) [ "$FAKE_TORCH" = 1 ] || exit 1; echo 2.99.0+fake; exit 0;;
  esac
fi
exec "$REAL_PYTHON" "$@"
"""


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return venv


def _make_setup(tmp_path: Path, torch_index: str, has_torch: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    venv = _fake_venv(tmp_path)
    log = tmp_path / "pip.log"
    env = dict(os.environ, PIP_LOG=str(log), REAL_PYTHON=sys.executable, FAKE_TORCH="1" if has_torch else "0")
    env.pop("CONDA_DEFAULT_ENV", None)
    run = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "setup", f"VENV={venv}",
                          f"TORCH_INDEX={torch_index}"],
                         env=env, capture_output=True, text=True, timeout=120)
    return run, log.read_text().splitlines() if log.exists() else []


@contextlib.contextmanager
def _package_index(tmp_path: Path):
    """A PEP 503 index on loopback with a page for torch (what the Makefile probes)."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html><body></body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the torch step -------------------------------------------------------------------------
def test_makefile_names_pytorchs_cpu_index():
    text = (ROOT / "Makefile").read_text()
    default = re.search(r"^TORCH_INDEX\s*\?=\s*(\S+)\s*$", text, re.M)
    assert default and default.group(1) == CPU_INDEX, "the Makefile's torch must come from PyTorch's CPU index"
    assert '--index-url "$(TORCH_INDEX)"' in text


@needs_make
@pytest.mark.slow
def test_setup_installs_torch_from_the_cpu_index_when_it_answers(tmp_path):
    with _package_index(tmp_path) as index:
        run, pip = _make_setup(tmp_path, index, has_torch=False)
    assert run.returncode == 0, run.stdout + run.stderr
    torch_installs = [c for c in pip if "torch==" in c]
    assert len(torch_installs) == 1, pip
    assert f"--index-url {index} torch==" in torch_installs[0], torch_installs
    assert pip[-1].startswith("install -e .["), pip          # then labkit itself, from the default index
    assert "cannot reach" not in run.stdout


@needs_make
@pytest.mark.slow
def test_setup_falls_back_to_the_default_index_quickly_and_says_so(tmp_path):
    start = time.monotonic()
    run, pip = _make_setup(tmp_path, f"http://127.0.0.1:{_closed_port()}/whl/cpu", has_torch=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert time.monotonic() - start < 60
    assert "cannot reach" in run.stdout and "default index" in run.stdout, run.stdout
    torch_installs = [c for c in pip if "torch==" in c]
    assert len(torch_installs) == 1 and "--index-url" not in torch_installs[0], pip


@needs_make
@pytest.mark.slow
def test_setup_never_replaces_an_importable_torch(tmp_path):
    run, pip = _make_setup(tmp_path, CPU_INDEX, has_torch=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "keeping the installed torch 2.99.0+fake" in run.stdout
    assert not [c for c in pip if "torch==" in c], pip
    assert len(pip) == 1 and pip[0].startswith("install -e ."), pip


@needs_make
def test_setup_refuses_a_python_older_than_310(tmp_path):
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\nexit 1\n")             # sys.version_info < (3, 10)
    old.chmod(0o755)
    run = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "setup", f"PYTHON={old}",
                          f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "needs Python 3.10 or newer" in run.stderr and "PYTHON=python3.11" in run.stderr, run.stderr
    assert not (tmp_path / "venv").exists()


# ---- conda ----------------------------------------------------------------------------------
def test_environment_yml_takes_conda_forges_cpu_pytorch():
    yaml = pytest.importorskip("yaml")
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["name"] == "labkit"
    assert env["channels"] == ["conda-forge"], "conda-forge only: its CPU build of PyTorch, no 'defaults'"
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any(d.split(">")[0].split("=")[0] == "pytorch-cpu" for d in conda), conda
    assert not any(d.split(">")[0].split("=")[0] in ("pytorch", "pytorch-gpu", "cuda-version") for d in conda)
    assert not any(p.startswith("torch") for p in pip), "pip must not install a second torch (PyPI's is CUDA)"
    assert any(p.startswith("-e .[") for p in pip), "labkit and its extras come from pyproject.toml"


@needs_make
def test_make_lab_uses_the_active_conda_environment(tmp_path):
    prefix = tmp_path / "envs" / "labkit"
    env = dict(os.environ, CONDA_DEFAULT_ENV="labkit", CONDA_PREFIX=str(prefix))
    env.pop("VENV", None)
    run = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "-n", "lab"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"{prefix}/bin/jupyter lab" in run.stdout and ".venv" not in run.stdout, run.stdout
    assert "using the active conda environment labkit" in run.stdout
    other = dict(env, CONDA_DEFAULT_ENV="someone-elses")    # another environment is left alone
    run = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "-n", "lab"],
                         env=other, capture_output=True, text=True, timeout=60)
    assert ".venv/bin/jupyter lab" in run.stdout, run.stdout


# ---- the wheel ------------------------------------------------------------------------------
@needs_make
@pytest.mark.slow
def test_make_dist_builds_a_wheel_with_every_subpackage(tmp_path):
    run = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "dist", f"DIST={tmp_path}",
                          f"VENV={Path(sys.executable).parent.parent}"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    wheels = list(tmp_path.glob("labkit-*-py3-none-any.whl"))
    assert len(wheels) == 1, run.stdout
    names = zipfile.ZipFile(wheels[0]).namelist()
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "labkit").rglob("__init__.py")
                if "__pycache__" not in p.parts}
    for package in sorted(packages):
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel (pyproject's packages)"
    kernels = {p.name for p in (ROOT / "kernels").glob("*.py")}
    assert kernels <= {Path(n).name for n in names if n.startswith("labkit/kernels/")}
    csrc = {p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
    assert csrc <= {Path(n).name for n in names if n.startswith("labkit/kernels/csrc/")}, "a C++ source is missing"
    assert not any(n.startswith("kernels/") for n in names), "a top-level 'kernels' would shadow HF's package"

    # Installed alone, the wheel is the whole package: labkit and labkit.kernels import from it.
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                          str(target), str(wheels[0])], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    probe = ("import labkit, labkit.kernels, labkit.bench.__main__, sys; "
             "print(labkit.__file__); print(labkit.kernels.__file__)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(target)), timeout=300)
    assert run.returncode == 0, run.stderr
    assert all(line.startswith(str(target)) for line in run.stdout.split()), run.stdout

    # The install cell's requirement, with this wheel as $LABKIT_SOURCE, is one pip accepts.
    requirement = f"labkit[lab,serve] @ {wheels[0].resolve().as_uri()}"
    dry = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index",
                          requirement], capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0 and "Would install labkit-" in dry.stdout, dry.stdout + dry.stderr


# ---- the install cell -----------------------------------------------------------------------
#: The device files of NVIDIA GPUs, which the install cell looks for (it must not import torch).
NVIDIA_DEVICES = "/dev/nvidia[0-9]*"


def _fake_gpus(monkeypatch, devices: list[str]) -> None:
    """The install cell's GPU probe finds ``devices``, whatever this machine has."""
    import glob
    real = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pattern, *a, **k: list(devices) if pattern == NVIDIA_DEVICES
                        else real(pattern, *a, **k))


@pytest.fixture
def shell(monkeypatch):
    """IPython running the install cell on "Colab" without labkit and without a GPU (unless a test
    says otherwise with ``_fake_gpus``): %pip and ``!`` commands are recorded, not run."""
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    pio = pytest.importorskip("plotly.io")
    monkeypatch.setattr(pio.renderers, "default", pio.renderers.default)       # restored after
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "labkit" else real(name, *a, **k))
    ip = interactiveshell.InteractiveShell.instance()
    calls: list[str] = []
    ip.register_magic_function(lambda line: calls.append(line), "line", "pip")
    # `!cmd` is ip.system(cmd): recorded with its {variables} expanded in the cell's namespace, as IPython does
    monkeypatch.setattr(ip, "system", lambda cmd: calls.append("! " + ip.var_expand(cmd, depth=1)))
    _fake_gpus(monkeypatch, [])
    # the cell first checks that its source answers (and fails at once if not): recorded, not sent
    import urllib.request
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None:
                        calls.append(f"probe {url}") or types.SimpleNamespace(close=lambda: None))
    yield ip, calls
    ip.register_magic_function(lambda line: None, "line", "pip")


def _requirement(line: str):
    from packaging.requirements import Requirement
    assert line.startswith("install -q "), line
    return Requirement(line.removeprefix("install -q ").strip('"'))


@pytest.mark.parametrize("source, expected", [
    (None, LABKIT_SOURCE),
    ("dist/labkit-0.1.0-py3-none-any.whl", "LOCAL"),
    ("https://course.example.edu/labkit-0.1.0-py3-none-any.whl", "https://course.example.edu/labkit-0.1.0-py3-none-any.whl"),
    ("git+https://git.example.edu/ta/labkit@fall", "git+https://git.example.edu/ta/labkit@fall"),
])
def test_install_cell_installs_from_labkit_source(shell, monkeypatch, tmp_path, source, expected):
    ip, calls = shell
    monkeypatch.chdir(tmp_path)
    if source is None:
        monkeypatch.delenv("LABKIT_SOURCE", raising=False)
    else:
        monkeypatch.setenv("LABKIT_SOURCE", source)
    result = ip.run_cell(install_cell())
    assert result.success, result.error_in_exec or result.error_before_exec
    assert len(calls) == 3 and calls[0].startswith("probe "), calls
    req = _requirement(calls[1])
    assert req.name == "labkit" and req.extras == {"lab", "serve"}
    if expected == "LOCAL":
        expected = (tmp_path / source).resolve().as_uri()
    assert req.url == expected
    assert calls[2] == f'! "{sys.executable}" -m labkit kernels', calls     # no GPU here: see below
    import plotly.io as pio
    assert pio.renderers.default == "colab"


@pytest.mark.parametrize("gpus", [[], ["/dev/nvidia0"]], ids=["cpu-runtime", "gpu-runtime"])
def test_install_cell_compiles_the_cpu_kernels_after_pip_where_there_is_no_gpu(shell, monkeypatch, gpus):
    """On a CPU runtime (Colab's default) the cell compiles the C++ CPU kernels right after pip,
    with the interpreter pip installed into, so that no later cell (the first LLM()) waits on a
    compiler; on a GPU runtime Triton's kernels run, and it compiles nothing. It finds a GPU
    without importing torch (which must load after labkit)."""
    ip, calls = shell
    _fake_gpus(monkeypatch, gpus)
    monkeypatch.setenv("LABKIT_SOURCE", "https://example.edu/labkit-0.1.0-py3-none-any.whl")
    result = ip.run_cell(install_cell())
    assert result.success, result.error_in_exec or result.error_before_exec
    kinds = [c.split()[0] for c in calls]                       # probe, install (pip), ! (a command)
    assert kinds == (["probe", "install"] if gpus else ["probe", "install", "!"]), calls
    if not gpus:
        assert calls[2] == f'! "{sys.executable}" -m labkit kernels', calls
    assert not re.search(r"^\s*(?:import|from)\s+torch\b", install_cell(), re.MULTILINE)


def test_the_kernels_command_the_install_cell_runs_says_what_it_built(monkeypatch, capsys):
    """``python -m labkit kernels`` (the install cell's step) prints one line saying what the CPU
    backend runs, and exits 0 even where nothing can be built (it then runs its Numba kernel).
    Mocked: the compile itself is ``tests/test_cpu_extension.py``'s to test."""
    from labkit import __main__ as cli
    from labkit.kernels import cpu_extension
    for ok, sentence in ((True, "C++ kernels compiled for this CPU (avx2 build)"),
                         (False, "C++ kernels unavailable: no C++ compiler")):
        monkeypatch.setattr(cpu_extension, "status", lambda isa=None: (ok, sentence))
        monkeypatch.setattr(cpu_extension, "build_directory", lambda name=None: Path("/cache/labkit_cpu_avx2"))
        assert cli.main(["kernels"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"labkit: {sentence}") and out.count("\n") == 1, out
        assert ("/cache/labkit_cpu_avx2" in out) == ok and ("Numba" in out) == (not ok), out


def test_install_cell_does_nothing_where_labkit_is_installed(monkeypatch):
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    ip = interactiveshell.InteractiveShell.instance()
    calls: list[str] = []
    ip.register_magic_function(lambda line: calls.append(line), "line", "pip")
    monkeypatch.setattr(ip, "system", lambda cmd: calls.append("! " + cmd))
    try:
        monkeypatch.setenv("LABKIT_SOURCE", "https://example.edu/x.whl")
        result = ip.run_cell(install_cell())
        assert result.success and calls == []                  # neither pip nor the kernels' compile
    finally:
        ip.register_magic_function(lambda line: None, "line", "pip")


# ---- one install cell in every notebook, written by `python -m labkit.notebooks colab` ------------
def _solutions(tmp_path: Path, first_cells: dict[str, str]):
    nbformat = pytest.importorskip("nbformat")
    from labkit.notebooks import Paths
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labkit").mkdir()
    for name, first in first_cells.items():
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
        cells = [nbformat.v4.new_code_cell(first)] if first else []
        cells += [nbformat.v4.new_markdown_cell("# A chapter"),
                  nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"),
                  nbformat.v4.new_code_cell("# CHECK exercise 1\nassert x == 1")]
        for i, cell in enumerate(cells):
            cell.id = f"{name[:2]}-{i}"
        nb.cells = cells
        (tmp_path / "solutions" / name).write_text(nbformat.writes(nb))
    return Paths(tmp_path)


def test_colab_command_writes_one_install_cell_everywhere(tmp_path):
    from labkit.notebooks import check, colab, generate, main, read, strip
    old = ('import sys\nif "google.colab" in sys.modules:\n'
           '    %pip install -q "labkit[lab] @ git+https://github.com/someone/labkit"')
    paths = _solutions(tmp_path, {"00_a.ipynb": old, "01_b.ipynb": "", "02_c.ipynb": install_cell()})
    strip(paths)
    generate(paths)
    problems = check(paths)
    assert any("00_a.ipynb: it does not open on its title" in p for p in problems), problems
    assert any("01_b.ipynb: its first code cell is not the install cell" in p for p in problems), problems

    assert main(["colab", "--root", str(tmp_path)]) == 0
    for name in ("00_a.ipynb", "01_b.ipynb", "02_c.ipynb"):
        nb = read(paths.solutions / name)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert nb.cells[0].source == "# A chapter", name                         # the title first
        assert nb.cells[1] is code[0] and code[0].source == install_cell(), name
        assert sum("%pip install" in c.source for c in code) == 1, name          # replaced, not added twice
        assert [c.source for c in code[1:]] == ["### BEGIN SOLUTION\nx = 1\n### END SOLUTION",
                                               "# CHECK exercise 1\nassert x == 1"], name
    assert colab(paths) == []                                                    # idempotent
    generate(paths)
    assert check(paths) == []
    student = read(paths.notebooks / "01_b.ipynb")
    assert student.cells[1].source == install_cell()
    # A hand edit of one notebook's install cell is caught.
    nb = read(paths.solutions / "02_c.ipynb")
    nb.cells[1].source = nb.cells[1].source.replace(LABKIT_SOURCE, "git+https://example.edu/fork")
    from labkit.notebooks import dumps
    (paths.solutions / "02_c.ipynb").write_text(dumps(nb))
    assert any("02_c.ipynb: its install cell differs" in p for p in check(paths))


def test_install_cell_names_its_source_once_and_installs_the_extras_the_notebooks_need():
    cell = install_cell("https://example.edu/labkit-0.1.0-py3-none-any.whl")
    assert cell.count("https://example.edu/labkit-0.1.0-py3-none-any.whl") == 1
    assert 'os.environ.get("LABKIT_SOURCE"' in cell and "labkit[lab,serve] @ {src}" in cell
    assert LABKIT_SOURCE.startswith("git+https://") or LABKIT_SOURCE.endswith(".whl")


def test_stripped_notebooks_carry_the_kernelspec_jupyter_writes():
    """What JupyterLab writes on save (ipykernel's display name) is what strip and generate
    write, so saving a solution from JupyterLab and stripping it again changes nothing."""
    nbformat = pytest.importorskip("nbformat")
    from labkit.notebooks import DEFAULT_KERNELSPEC, clean
    from jupyter_client.kernelspec import KernelSpecManager
    installed = KernelSpecManager().get_kernel_spec("python3")
    assert DEFAULT_KERNELSPEC == {"display_name": installed.display_name, "language": installed.language,
                                  "name": "python3"}
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    assert clean(nb).metadata["kernelspec"] == DEFAULT_KERNELSPEC
    nb.metadata["kernelspec"] = {"display_name": "R", "language": "R", "name": "ir"}
    assert clean(nb).metadata["kernelspec"]["name"] == "ir"                      # another kernel: kept


# ---- make lab's JupyterLab settings (.jupyter/) -----------------------------------------------------
def test_lab_config_reads_notebooks_with_the_running_kernels_metadata(tmp_path):
    """The contents manager of ``.jupyter/jupyter_server_config.py`` hands JupyterLab a python3
    notebook whose kernelspec and language_info already equal what the kernel will report,
    so opening it changes nothing (tests/test_browser.py checks the same in a browser)."""
    pytest.importorskip("jupyter_server")
    nbformat = pytest.importorskip("nbformat")
    import asyncio

    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager
    from traitlets.config import Configurable

    from traitlets.config import Config

    namespace = {"c": Config()}          # what Jupyter hands a config file: any section may be set
    exec(compile((ROOT / ".jupyter" / "jupyter_server_config.py").read_text(), "jupyter_server_config.py", "exec"),
         namespace)
    manager_class = namespace["c"].ServerApp.contents_manager_class

    class Server(Configurable):
        kernel_spec_manager = KernelSpecManager()

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nb.metadata.update(kernelspec={"display_name": "Python 3", "language": "python", "name": "python3"},
                       language_info={"name": "python"})
    (tmp_path / "a.ipynb").write_text(nbformat.writes(nb))
    other = nbformat.v4.new_notebook()
    other.metadata["kernelspec"] = {"display_name": "R", "language": "R", "name": "ir"}
    (tmp_path / "r.ipynb").write_text(nbformat.writes(other))
    stored = (tmp_path / "a.ipynb").read_bytes()

    manager = manager_class(root_dir=str(tmp_path), parent=Server())
    model = asyncio.run(manager.get("a.ipynb"))
    meta = model["content"]["metadata"]
    assert meta["language_info"] == IPythonKernel.language_info
    assert meta["kernelspec"]["display_name"] == KernelSpecManager().get_kernel_spec("python3").display_name
    assert (tmp_path / "a.ipynb").read_bytes() == stored                   # the file itself is untouched
    r = asyncio.run(manager.get("r.ipynb"))["content"]["metadata"]
    assert r["kernelspec"]["name"] == "ir" and "language_info" not in r    # another kernel's notebook: as stored
    assert asyncio.run(manager.get("a.ipynb", content=False))["content"] is None


def test_lab_config_turns_the_news_pop_up_off():
    import json
    page = json.loads((ROOT / ".jupyter" / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"] == {"@jupyterlab/apputils-extension:announcements": True}
    text = (ROOT / "Makefile").read_text()
    assert 'JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter' in text
    assert "--LabApp.default_url=/lab/tree/00_setup_and_tour.ipynb" in text


# The repository's kernels/ folder is labkit.kernels (pyproject's package-dir). From the
# repository's root (pytest, `python -m labkit ...` as the README runs it) Python also finds it
# as a top-level `kernels`: the name of Hugging Face's kernel-hub package, which Transformers 5
# depends on and imports. CI failed on exactly that the day Transformers began to.

def _hub_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _hub_kernels_init() -> Path:
    """The ``__init__.py`` Hugging Face's installed kernels distribution ships."""
    return Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")).resolve()


def test_transformers_imports_from_the_repository_root_beside_the_kernels_folder():
    probe = ("import transformers\nfrom transformers import LlamaConfig\nimport labkit.kernels, sys\n"
             "print(labkit.kernels.paged_decode_attention.__module__)\n"
             "print(getattr(sys.modules.get('kernels'), '__file__', None))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    module, top_level = run.stdout.split()
    assert module == "labkit.kernels.paged_decode_attention"
    if _hub_kernels_installed():        # Transformers imported it: the hub's package, not this folder
        assert Path(top_level).resolve() == _hub_kernels_init()
    else:
        assert top_level == "None"


@pytest.mark.skipif(not _hub_kernels_installed(), reason="Hugging Face's kernels package is not installed here")
def test_a_top_level_kernels_import_from_the_root_gets_hugging_faces_package():
    run = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip()).resolve() == _hub_kernels_init()


def test_the_kernels_folder_under_any_other_name_is_refused():
    # The checkout's folder as a namespace package, e.g. `import main.kernels` beside a clone in main/.
    if not ROOT.name.isidentifier() or ROOT.name == "labkit":
        pytest.skip(f"the checkout's folder name {ROOT.name!r} does not make another package name")
    probe = f"import sys; sys.path.insert(0, {str(ROOT.parent)!r}); import {ROOT.name}.kernels"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and f"imported here as {ROOT.name}.kernels" in run.stderr, run.stderr[-2000:]


def test_a_top_level_kernels_import_without_the_hub_package_names_labkit_kernels():
    # -S: no site-packages, so no Hugging Face kernels; only the repository's root on the path.
    probe = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import kernels"
    run = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "is the package labkit.kernels: import it by that name" in run.stderr
    assert "ModuleNotFoundError" not in run.stderr and "ImportError" in run.stderr
