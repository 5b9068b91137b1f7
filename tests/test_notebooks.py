"""The notebooks in notebooks/ install rljax from one `RLJAX_SOURCE`, run top to bottom in their small
CPU setting from a wheel of this checkout, and are committed clean; no notebook or doc tells anyone to
install PyPI's `rljax`, which is an unrelated project."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import venv
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_ENV = {
    "RLJAX_NOTEBOOK_SMALL": "1",        # the CPU-sized setting
    "JAX_PLATFORMS": "cpu",
    # -O0 as the suite (tests/conftest.py): LLVM optimises less, the programs are the same.
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": "",                   # imports come from the kernel's venv only
    # The wheel's dependencies must already be there (the test venv, through a .pth): a missing one
    # fails the install cell instead of being downloaded.
    "PIP_NO_INDEX": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    # Skip pip's conflict scan of every installed distribution (~1 s an install; the resolver has
    # already checked the wheel's own dependencies). pip reads a --no-* flag's variable as the
    # option's value, so 0 turns the check off.
    "PIP_NO_WARN_CONFLICTS": "0",
}
# Appended to each notebook: the file of every rljax module the run imported (its name if it has none).
RLJAX_MODULE_FILES = """import json, sys
print(json.dumps(sorted({getattr(module, "__file__", None) or name
                         for name, module in list(sys.modules.items()) if name.split(".")[0] == "rljax"})))"""


def setup_cell(path: Path) -> str:
    """The notebook's first code cell: the one that installs rljax."""
    return next(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")


def test_the_three_notebooks_exist():
    """notebooks/ holds the quickstart, functional-API and bring-your-own-checkpoint notebooks.
    Catches: a notebook renamed or removed, which the parametrized runs below would silently drop."""
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_functional_api.ipynb",
                                          "03_bring_your_own_checkpoint.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    """No stored outputs or execution counts, so the repository stays small and diffs stay readable.
    Catches: a notebook committed after a local run."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs"


def test_every_notebook_opens_with_the_same_rljax_source_cell():
    """The first code cell of every notebook is one shared text whose first line is the Colab form
    field `RLJAX_SOURCE = ""`, and the markdown above it explains the variable. Catches: a notebook
    whose install cell drifted from the others (the resolution tests below read only the first), or
    that buries the variable below other code."""
    cells = {p.name: setup_cell(p) for p in NOTEBOOKS}
    assert len(set(cells.values())) == 1, "the notebooks' setup cells differ"
    assert next(iter(cells.values())).splitlines()[0] == 'RLJAX_SOURCE = ""  # @param {type:"string"}'
    for path in NOTEBOOKS:
        intro = nbformat.read(path, as_version=4).cells[0]
        assert intro.cell_type == "markdown" and "`RLJAX_SOURCE`" in intro.source, path.name


def _resolve_install(cwd: Path, monkeypatch, *, source: str | None = None, edited: str = "",
                     uploaded: tuple[str, ...] = (), constraints: str | None = None) -> list[str]:
    """Executes the shared setup cell in this process, in `cwd`, with `%pip` recorded instead of run,
    `RLJAX_SOURCE` from the environment (`source`) or typed into the cell (`edited`), `uploaded`
    as what the `/content` wheel glob finds and `constraints` as RLJAX_CONSTRAINTS; returns the pip
    command lines."""
    text = setup_cell(NOTEBOOKS[0]).replace('RLJAX_SOURCE = ""', f"RLJAX_SOURCE = {edited!r}", 1)
    code = TransformerManager().transform_cell(text)   # `%pip ...` -> get_ipython().run_line_magic(...)
    pip_lines: list[str] = []

    class Shell:
        def run_line_magic(self, name: str, line: str) -> None:
            assert name == "pip"
            pip_lines.append(line.format_map(namespace))   # IPython expands {names} the same way

    namespace = {"get_ipython": Shell}
    if constraints is None:
        monkeypatch.delenv("RLJAX_CONSTRAINTS", raising=False)
    else:
        monkeypatch.setenv("RLJAX_CONSTRAINTS", constraints)
    if source is None:
        monkeypatch.delenv("RLJAX_SOURCE", raising=False)
    else:
        monkeypatch.setenv("RLJAX_SOURCE", source)
    monkeypatch.setattr("glob.glob", lambda pattern: list(uploaded) if pattern.startswith("/content/")
                        else [])
    monkeypatch.chdir(cwd)
    exec(compile(code, "setup_cell", "exec"), namespace)
    return pip_lines


def test_setup_cell_installs_exactly_the_source_it_is_given(tmp_path, monkeypatch):
    """A git URL becomes a PEP 508 direct reference with the [gcs] extra, a wheel path gets the extra
    appended, the environment variable wins over an empty cell and a value typed into the cell works
    without it. Catches: `pip install rljax` (PyPI's unrelated project) in place of the source, a git
    URL passed with `[gcs]` glued to it (pip rejects that), the environment variable ignored."""
    git = "git+https://example.invalid/you/rljax@main"
    assert _resolve_install(tmp_path, monkeypatch, source=git) == [f'install -q "rljax[gcs] @ {git}"']
    wheel = "/tmp/dist/rljax-0.1.0-py3-none-any.whl"
    assert _resolve_install(tmp_path, monkeypatch, source=wheel) == [f'install -q "{wheel}[gcs]"']
    assert _resolve_install(tmp_path, monkeypatch, edited=wheel) == [f'install -q "{wheel}[gcs]"']


def test_setup_cell_defaults_to_the_checkout_or_an_uploaded_wheel(tmp_path, monkeypatch):
    """With no source: in this checkout, where rljax already imports from it, nothing is installed;
    in another checkout (rljax imports from elsewhere) that checkout's directory is installed; outside
    any checkout, a wheel uploaded to Colab's /content is. Catches: reinstalling over a developer's
    editable install, keeping an rljax that is not this checkout's, missing the uploaded wheel."""
    assert _resolve_install(NOTEBOOK_DIR, monkeypatch) == []
    other = tmp_path / "other-checkout"
    (other / "rljax").mkdir(parents=True)
    (other / "rljax" / "__init__.py").write_text("")
    (other / "notebooks").mkdir()
    assert _resolve_install(other / "notebooks", monkeypatch) == [f'install -q "{other}[gcs]"']
    wheel = "/content/rljax-0.1.0-py3-none-any.whl"
    assert _resolve_install(tmp_path, monkeypatch, uploaded=(wheel,)) == [f'install -q "{wheel}[gcs]"']


def test_setup_cell_installs_with_the_projects_constraints(tmp_path, monkeypatch):
    """The install pins the versions CI tested with `-c constraints.txt`: the file in a checkout
    source, the one beside a wheel, a GitHub repository's own at the git URL's revision (HEAD
    without one), or RLJAX_CONSTRAINTS, which wins; a source with none installs unpinned.
    Catches: the notebooks installing without the project's constraints (the issue-39 report), a
    GitHub URL's revision ignored (pins of another commit), and the environment variable ignored."""
    checkout = tmp_path / "checkout"
    (checkout / "rljax").mkdir(parents=True)
    (checkout / "rljax" / "__init__.py").write_text("")
    (checkout / "constraints.txt").write_text("jax==0.10.2\n")
    assert _resolve_install(tmp_path, monkeypatch, source=str(checkout)) == [
        f'install -q "{checkout}[gcs]" -c "{checkout}/constraints.txt"']
    wheel = checkout / "rljax-0.1.0-py3-none-any.whl"
    assert _resolve_install(tmp_path, monkeypatch, source=str(wheel)) == [
        f'install -q "{wheel}[gcs]" -c "{checkout}/constraints.txt"']
    raw = "https://raw.githubusercontent.com/you/rljax"
    for url, pinned in (("git+https://github.com/you/rljax.git@v0.2", f"{raw}/v0.2/constraints.txt"),
                        ("git+https://github.com/you/rljax", f"{raw}/HEAD/constraints.txt")):
        assert _resolve_install(tmp_path, monkeypatch, source=url) == [
            f'install -q "rljax[gcs] @ {url}" -c "{pinned}"']
    assert _resolve_install(tmp_path, monkeypatch, source=str(wheel), constraints="/pins.txt") == [
        f'install -q "{wheel}[gcs]" -c "/pins.txt"']
    bare = tmp_path / "dist" / "rljax-0.1.0-py3-none-any.whl"
    assert _resolve_install(tmp_path, monkeypatch, source=str(bare)) == [f'install -q "{bare}[gcs]"']


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_with_a_colab_badge_for_its_own_path(path):
    """The first cell carries an "Open in Colab" badge whose link opens this very file from GitHub
    (`.../blob/<rev>/notebooks/<name>`). Catches: a missing badge, and a copied badge that opens
    another notebook."""
    intro = nbformat.read(path, as_version=4).cells[0].source
    links = re.findall(r"\[!\[Open In Colab\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
                       r"\((https://colab\.research\.google\.com/github/[^)\s]+)\)", intro)
    assert len(links) == 1, path.name
    assert re.fullmatch(r"https://colab\.research\.google\.com/github/[^/]+/rljax/blob/[^/]+/notebooks/"
                        + re.escape(path.name), links[0]), links[0]


def test_setup_cell_without_any_source_names_both_fixes(tmp_path, monkeypatch):
    """Outside a checkout with no source and no uploaded wheel, the cell stops with one line that
    names RLJAX_SOURCE and the wheel build command. Catches: a silent fallback to PyPI's `rljax`, or a
    bare ImportError further down."""
    with pytest.raises(RuntimeError) as raised:
        _resolve_install(tmp_path, monkeypatch)
    message = str(raised.value)
    assert "\n" not in message and "RLJAX_SOURCE" in message
    assert "python3 -m pip wheel --no-deps . -w dist" in message


@pytest.fixture(scope="session")
def rljax_wheel(tmp_path_factory) -> Path:
    """A wheel of this checkout's working tree (tracked and untracked, not ignored), built once per
    test process. It is built from a copy so that it never races another test's in-tree build for
    `build/` (setuptools also packs stale files left there), and without build isolation because the
    build backend, setuptools, is already in the test venv (torch requires it) and CI may be offline."""
    tree = tmp_path_factory.mktemp("checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        source = ROOT / rel
        if source.exists() or source.is_symlink():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / rel, follow_symlinks=False)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(tree)], check=True)
    (wheel,) = dist.glob("rljax-*.whl")
    return wheel


@pytest.fixture
def wheel_kernel(rljax_wheel, tmp_path, monkeypatch) -> tuple[str, Path]:
    """A Jupyter kernel in a fresh, empty venv with `RLJAX_SOURCE` pointing at the wheel: the
    notebook's own setup cell installs it there. A .pth line puts the test venv's site-packages after
    the venv's own, so jax, ipykernel and pip are importable and pip counts the wheel's dependencies
    as installed (nothing is downloaded), while the editable rljax there stays out of reach (its
    finder is a .pth hook, which a plain path line does not run) and pip refuses to uninstall it
    (it lies outside the venv). A venv per notebook costs ~0.1 s and proves each notebook's install."""
    env_dir = tmp_path / "kernel-venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site_packages = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    (site_packages / "test-venv-site-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    spec_dir = tmp_path / "jupyter" / "kernels" / "rljax-wheel"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rljax from a wheel", "language": "python",
        "env": {**KERNEL_ENV, "RLJAX_SOURCE": str(rljax_wheel)}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "rljax-wheel", site_packages


def _seconds(cell) -> float:
    """How long an executed cell ran, from the timing nbclient records in its metadata."""
    timing = cell.metadata["execution"]
    start, end = (datetime.fromisoformat(timing[k].replace("Z", "+00:00"))
                  for k in ("iopub.execute_input", "shell.execute_reply"))
    return (end - start).total_seconds()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_from_the_wheel(path, wheel_kernel):
    """In a kernel whose venv has no rljax, the setup cell installs the wheel named by
    `RLJAX_SOURCE`, every cell executes without error in the small setting (nbclient raises on the
    first failing cell), every plotting cell displays a PNG figure, and every rljax module the run
    imported came from the wheel in the kernel's venv. Catches: an install cell that skips the
    install or installs something else, a notebook that imports the checkout instead (a sys.path
    insert or chdir), a dependency the wheel lacks, a broken cell."""
    kernel_name, site_packages = wheel_kernel
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(RLJAX_MODULE_FILES))
    client = NotebookClient(nb, timeout=300, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    for cell in nb.cells:
        if cell.cell_type == "code" and "plt.show()" in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"no figure shown:\n{cell.source}"
    files = json.loads(nb.cells[-1].outputs[0]["text"])
    installed = os.path.realpath(site_packages / "rljax") + os.sep
    assert files and all(os.path.realpath(f).startswith(installed) for f in files), files
    setup = next(c for c in nb.cells if c.cell_type == "code")
    print(f"{path.name}: {elapsed:.1f} s, of which the setup cell {_seconds(setup):.1f} s")


# `pip install` (any options) of the bare index name `rljax`, with or without extras or a version;
# `rljax[gcs] @ <url>`, paths, wheels and `-e .` do not match.
PYPI_RLJAX = re.compile(r"pip3?\s+install(?:\s+[^\s;&|]+)*?\s+[\"'`]?rljax(?![\w./-]|\[[\w,]+\]\s*@|\s*@)")
NEGATION = re.compile(r"\b(?:never|not|don't|do not)\b", re.IGNORECASE)


def test_no_file_tells_anyone_to_install_rljax_from_the_index():
    """No tracked notebook, Markdown page, shell script or TOML file holds the `OWNER/rljax`
    placeholder or a `pip install rljax` from the package index, except in a line that warns against
    it. Catches: the old placeholder and the PyPI name (an unrelated project) coming back."""
    assert PYPI_RLJAX.search("pip install -q rljax[gcs]") and PYPI_RLJAX.search("pip3 install rljax==0.1.0")
    assert not PYPI_RLJAX.search('pip install -q "rljax[gcs] @ git+https://x/rljax"')
    assert not PYPI_RLJAX.search("pip install dist/rljax-0.1.0-py3-none-any.whl")
    listed = subprocess.run(["git", "ls-files", "*.ipynb", "*.md", "*.sh", "*.toml"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    assert any(name.endswith(".ipynb") for name in listed) and any(name.endswith(".md") for name in listed)
    found = []
    for name in listed:
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            pypi = PYPI_RLJAX.search(line)
            if "OWNER/rljax" in line or (pypi and not NEGATION.search(line[:pypi.start()])):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
