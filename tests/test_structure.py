"""The package's shape: folders by side and role (none over 12 modules, no two module names that
share a stem), one module that talks to Ray Train's reporting, and no import cycle, counting every
import that runs: at module level and inside functions, absolute and relative, and ``from raytpu
import x`` of a submodule (imports under ``if TYPE_CHECKING:``, which never run, are for type
checkers only). Importing the loop or the runtime package loads neither torch_xla nor ray."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raytpu"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The raytpu modules that importing ``name`` may import (each with its parent packages)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        found.update(target for target in targets if target in known and target != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_folders_by_role_hold_at_most_12_modules_and_no_two_names_share_a_stem():
    folders = {path.parent for path in PACKAGE.rglob("*.py")}
    roles = {"config", "driver", "cluster", "records", "worker", "runtime", "storage", "corpus", "parallel"}
    assert {folder.name for folder in folders} == {"raytpu", *roles}
    for folder in folders:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        assert count <= 12, f"{folder} holds {count} modules"
    stems = sorted({path.stem for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"})
    shared = [(a, b) for a in stems for b in stems if a != b and b.startswith(a)]
    assert not shared, shared  # launch / launcher / launched: one name, three roles


def calls_of(path: Path, dotted: str) -> int:
    """How many calls of ``dotted`` (``ray.train.report``) the module's code makes."""
    return sum(
        1
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == dotted
    )


def test_one_module_reports_to_ray_train_and_reads_its_checkpoints():
    """Every worker, whatever started it (train, test, tune, --local, launch), reports through the
    reporter interface; only Ray's reporter calls Ray Train."""
    for name in ("ray.train.report", "ray.train.get_checkpoint"):
        callers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if calls_of(p, name))
        assert callers == ["worker/reporting.py"], (name, callers)


def test_one_function_makes_every_plan_and_nothing_rewrites_one():
    """A plan (``config/plan.py``'s ``Plan``) is made by ``make_plan`` alone; no module replaces a
    field of a plan or of its config afterwards (a changed plan is ``plan.remade``, by make_plan)."""
    makers, rewrites = [], []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = ast.unparse(node.func)
            if called in ("Plan", "plan.Plan"):
                makers.append(str(path.relative_to(PACKAGE)))
            if called.endswith("replace") and node.args and "plan" in ast.unparse(node.args[0]).lower():
                rewrites.append(f"{path.relative_to(PACKAGE)}: {ast.unparse(node)}")
    assert makers == ["config/plan.py"] and calls_of(PACKAGE / "config/plan.py", "Plan") == 1, makers
    assert not rewrites, rewrites


def side(module: str) -> str:
    """``raytpu.worker.loop`` -> ``worker``; a top-level module (``raytpu.job``) -> ``raytpu``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "raytpu"


def test_imports_run_one_way():
    """The worker, the runtimes, the config, the records and storage never import the driver's side
    (``driver/``, ``cluster/``); the driver imports of the worker side only the entry it starts
    (the records both read are in ``records/``); nothing but the worker side imports it."""
    known = modules()
    wrong = []
    for name, path in known.items():
        for target in imports_of(name, path, set(known)):
            source, reached = side(name), side(target)
            if source in ("worker", "runtime", "config", "records", "storage", "parallel") and reached in (
                "driver",
                "cluster",
            ):
                wrong.append(f"{name} -> {target}")
            if (
                source in ("driver", "cluster")
                and reached == "worker"
                and target not in ("raytpu.worker", "raytpu.worker.entry")
            ):
                wrong.append(f"{name} -> {target}")
            if source in ("runtime", "config", "records", "storage", "parallel") and reached == "worker":
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


def test_no_import_cycle_in_the_package():
    known = modules()
    graph = {name: imports_of(name, path, set(known)) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_detector_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_loop_and_the_runtimes_load_neither_ray_nor_torch_xla():
    import subprocess
    import sys

    code = "import sys, raytpu.worker.loop, raytpu.runtime; print(sorted({'ray', 'torch_xla'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_local_path_loads_no_ray():
    import subprocess
    import sys

    code = "import sys, raytpu.driver.local, raytpu.cli; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_driver_s_own_actors_load_no_torch():
    """raytpu's small actors (a launch's state, the stop flag, the progress board) each take a Ray
    worker process of their own, which imports only the actor's module: torch there cost 3 s of CPU."""
    import subprocess
    import sys

    modules = "raytpu.records.relay, raytpu.driver.signals, raytpu.records.progress"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
