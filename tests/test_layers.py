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
CLI = 7
# Low to high. Top-level names under rljax/: a package or a module (errors, config_io, optim).
# Evaluation and the loop are the orchestration layers; evaluation sits below the loop, which
# runs it (evaluation importing the loop's setup would be a cycle in waiting).
LAYERS = {
    "models": 0, "lora": 0, "tokenizers": 0, "rewards": 0, "objectives": 0,
    "errors": 0, "config_io": 0, "optim": 0, "storage": 0,
    "sampling": 1, "update": 1, "data": 1, "checkpoint": 1, "sharding": 1, "envs": 1,
    "evaluation": 2,
    "stages": 3, "warmstart": 3,
    "drivers": 4,
    "plan": 5,
    "train": 6,
    "cli": CLI, "__main__": CLI, "quiet": CLI,
}
LAYER_NAMES = ("foundations", "components", "evaluation", "programs", "drivers", "planning", "training run",
               "command line")


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
        ("rljax/models/core.py:4", "rljax.train (training run)"),
        ("rljax/models/rel.py:1", "rljax.sampling (components)"),
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


@pytest.mark.parametrize("module, layer", [("rljax.sampling.command", CLI), ("rljax.train.loop", 6),
                                           ("rljax.errors", 0), ("rljax", CLI), ("rljax.extras.x", None)])
def test_layer_of(module, layer):
    """`command` modules and the package root are CLI; others follow their top-level name."""
    assert layer_of(module) == layer


# ----------------------------------------------------------------------------- structure


def import_graph(package_root: Path) -> dict[str, set[str]]:
    """Module -> the rljax modules it imports (lazy imports included). Package `__init__`s are
    facades that re-export their modules, so an import of a package counts as none: a cycle
    must run through real modules."""
    paths = sorted(package_root.rglob("*.py"))
    known = {module_name(path, package_root) for path in paths}
    packages = {module_name(p, package_root) for p in paths if p.name == "__init__.py"}
    graph = {}
    for path in paths:
        module = module_name(path, package_root)
        if module in packages:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = {name for _, name in imported_modules(tree, module, False, known)
                         if name in known and name not in packages and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules():
    """No two modules of rljax/ import each other, directly or through others. Catches the old
    `sampling/continuous.py` <-> `sampling/paged.py` pair."""
    assert cycles(import_graph(ROOT / "rljax")) == []


def test_cycles_are_found(tmp_path):
    """The cycle finder itself: a three-module ring is reported, a chain is not."""
    pkg = tmp_path / "rljax"
    _write(pkg, "__init__.py")
    _write(pkg, "a/__init__.py", "from rljax.a.x import f\n")  # a facade: not an edge
    _write(pkg, "a/x.py", "from rljax.a.y import g\n")
    _write(pkg, "a/y.py", "def g():\n    from rljax.a.z import h\n")  # lazy counts
    _write(pkg, "a/z.py", "from rljax.a import x\n")
    _write(pkg, "b/p.py", "from rljax.b.q import f\n")
    _write(pkg, "b/q.py", "")
    assert cycles(import_graph(pkg)) == [["rljax.a.x", "rljax.a.y", "rljax.a.z"]]


def test_plan_does_not_import_the_training_run():
    """`rljax.plan` sizes a run from its config and the stage programs; it never imports `train/`
    (the loop, its setup or its config), so planning cannot depend on how a run is driven."""
    graph = import_graph(ROOT / "rljax")
    plan = {m: deps for m, deps in graph.items() if m.startswith("rljax.plan.") and not m.endswith(".command")}
    assert plan and not [(m, d) for m, deps in plan.items() for d in deps if d.startswith("rljax.train")]


def test_files_are_short_and_train_is_the_outline():
    """No module of rljax/ over 450 lines, and `train/` (the run's outline, setup, config and CLI)
    under 2,000 lines in all."""
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in (ROOT / "rljax").rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > 450} == {}
    train = sum(n for p, n in sizes.items() if p.parts[1] == "train")
    assert train < 2000, train


def test_the_loop_does_not_branch_on_the_mode():
    """`train()` runs `DRIVERS[cfg.driver]` and knows no mode: its module reads none of the settings
    that pick a driver (rl.mode, [env], a mixture, the sampler's layout or processes)."""
    text = (ROOT / "rljax" / "train" / "loop.py").read_text()
    code = "\n".join(line.split("#")[0] for line in text.split('"""')[-1].splitlines())
    for setting in ("rl.mode", ".env", "host_batching", "sampler_layout", "run.sampler", "sampler_processes",
                    "is_mixture", "dynamic_sampling"):
        assert setting not in code, setting


def test_test_files_have_unique_basenames():
    """tests/ has no __init__.py files, so pytest imports each test file by its basename: two files
    of one name in different folders fail collection ("import file mismatch") and the second one's
    tests never run (tests/plan/test_vision.py beside tests/sampling/test_vision.py did, in CI).
    Catches: a new test file named like an existing one in another folder."""
    names = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: p for n, p in names.items() if len(p) > 1}
