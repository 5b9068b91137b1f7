"""The notebooks in notebooks/ run top to bottom in their small CPU setting, and are committed clean."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_ENV = {
    "RLJAX_NOTEBOOK_CI": "1",           # skip the install cell: rljax is importable from the venv
    "RLJAX_NOTEBOOK_SMALL": "1",        # the CPU-sized setting
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    "TOKENIZERS_PARALLELISM": "false",
}


def test_the_three_notebooks_exist():
    """notebooks/ holds the quickstart, functional-API and bring-your-own-checkpoint notebooks."""
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_functional_api.ipynb",
                                          "03_bring_your_own_checkpoint.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    """No stored outputs or execution counts, so the repository stays small and diffs stay readable."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    """Every cell executes without error in the small setting (nbclient raises on the first failing
    cell), and every plotting cell displays a PNG figure."""
    for key, value in KERNEL_ENV.items():
        monkeypatch.setenv(key, value)
    # The kernel is this interpreter (jupyter_client maps the spec's `python` to sys.executable).
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    for cell in nb.cells:
        if cell.cell_type == "code" and "plt.show()" in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"no figure shown:\n{cell.source}"
    print(f"{path.name}: {elapsed:.1f} s")
