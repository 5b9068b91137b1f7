"""Import layers: no module under rljax/ imports from a higher layer (docs/architecture.md).

Every import counts, the lazy ones inside functions included: a CLI that imports the loop inside
a function still depends on it. Same-layer imports are allowed; a package that is in no layer is
reported too, so a new package has to take its place in the order (here and in the docs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI = 4
# Low to high. Top-level names under rljax/: a package or a module (errors, config_io, optim).
# Evaluation and the loop are the orchestration layers; evaluation sits below the loop, which
# runs it (evaluation importing the loop's setup would be a cycle in waiting).
LAYERS = {
    "models": 0, "lora": 0, "tokenizers": 0, "rewards": 0, "objectives": 0,
    "errors": 0, "config_io": 0, "optim": 0, "storage": 0,
    "sampling": 1, "update": 1, "data": 1, "checkpoint": 1, "sharding": 1, "envs": 1,
    "evaluation": 2,
    "train": 3, "plan": 3,
    "cli": CLI, "__main__": CLI, "quiet": CLI,
}
LAYER_NAMES = ("foundations", "stages", "evaluation", "training loop", "command line")


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name under rljax (None: in no layer).

    `command` modules belong to the CLI layer wherever they live, and so does the package root
    `rljax` itself (its `__getattr__` re-exports the update step for notebooks: a facade)."""
    parts = module.split(".")
    if parts[-1] in ("command", "__main__") or parts == ["rljax"]:
        return CLI
    return LAYERS.get(parts[1])


def module_name(path: Path, package_root: Path) -> str:
    rel = path.relative_to(package_root.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, dotted name) of every rljax module `tree` imports, relative imports resolved.

    `from X import y` names `X.y` when that is a module in `known` (`from rljax import
    tokenizers`), else `X` (`from rljax.models import forward`, `from rljax import update_step`)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return [(line, name) for line, name in found if name == "rljax" or name.startswith("rljax.")]


def upward_imports(package_root: Path) -> list[str]:
    """One line per import from a higher layer, or by or of a module in no layer."""
    paths = sorted(package_root.rglob("*.py"))
    known = {module_name(path, package_root) for path in paths}
    problems = []
    for path in paths:
        module = module_name(path, package_root)
        mine = layer_of(module)
        rel = path.relative_to(package_root.parent)
        if mine is None:
            problems.append(f"{rel}: {module} is in no layer; add its package to LAYERS and the docs")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        seen = set()
        for line, name in imported_modules(tree, module, path.name == "__init__.py", known):
            theirs = layer_of(name)
            if (line, name) in seen or (theirs is not None and theirs <= mine):
                continue
            seen.add((line, name))
            if theirs is None:
                problems.append(f"{rel}:{line} imports {name}, which is in no layer")
            else:
                problems.append(f"{rel}:{line} ({LAYER_NAMES[mine]}) imports {name} ({LAYER_NAMES[theirs]})")
    return problems


def test_no_module_imports_from_a_higher_layer():
    """Walks every module under rljax/: each import points to its own layer or a lower one.

    Catches, for example, `from rljax.train.setup import verifier_metadata` inside
    rljax/evaluation/runner.py (what that module did before the contract moved to rljax.data)."""
    problems = upward_imports(ROOT / "rljax")
    assert not problems, "upward imports:\n" + "\n".join(problems)


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_upward_imports_are_reported(tmp_path):
    """A synthetic tree: absolute, lazy, relative and `from rljax import x` imports that run
    upward are each reported; same-layer and downward ones, and root-level names that are not
    modules, are judged by where they point."""
    pkg = tmp_path / "rljax"
    _write(pkg, "__init__.py")
    _write(pkg, "models/__init__.py", "from rljax.models.core import f\n")  # same package
    _write(pkg, "models/core.py", "from rljax.errors import E\n\n"  # downward
                                  "def f():\n    from rljax.train import loop\n")  # lazy, upward
    _write(pkg, "models/rel.py", "from ..sampling import sample\nfrom . import core\n")  # upward
    _write(pkg, "models/command.py", "from rljax.train import loop\n")  # the CLI layer may
    _write(pkg, "evaluation/__init__.py")
    _write(pkg, "tokenizers/x.py", "from rljax import evaluation, models\n")  # one upward
    _write(pkg, "data/y.py", "import rljax.sampling\nfrom rljax import update_step\n")  # facade
    _write(pkg, "extras/z.py", "")  # in no layer
    problems = upward_imports(pkg)
    expected = [
        ("rljax/data/y.py:2", "rljax (command line)"),
        ("rljax/extras/z.py", "in no layer"),
        ("rljax/models/core.py:4", "rljax.train (training loop)"),
        ("rljax/models/rel.py:1", "rljax.sampling (stages)"),
        ("rljax/tokenizers/x.py:1", "rljax.evaluation (evaluation)"),
    ]
    assert len(problems) == len(expected), problems
    for problem, (where, what) in zip(problems, expected):
        assert problem.startswith(where) and what in problem, problem


def test_docs_list_the_same_layers():
    """docs/architecture.md's layer table names every package of LAYERS in the same layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\|\s*(\d)\s*\|\s*`([\w.]+)`", text, flags=re.M)
    documented = {name.removeprefix("rljax."): int(layer) for layer, name in rows}
    expected = {name: layer for name, layer in LAYERS.items() if name != "__main__"}
    assert documented == expected


@pytest.mark.parametrize("module, layer", [("rljax.sampling.command", CLI), ("rljax.train.loop", 3),
                                           ("rljax.errors", 0), ("rljax", CLI), ("rljax.extras.x", None)])
def test_layer_of(module, layer):
    """`command` modules and the package root are CLI; others follow their top-level name."""
    assert layer_of(module) == layer
