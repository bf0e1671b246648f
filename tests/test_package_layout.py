"""The package's layout holds: each room (a subpackage of vaswani/) imports only the rooms below it, no two modules
import each other (imports inside functions included), and no module outgrows one sitting. docs/architecture.md
draws the same floors; a change that needs an import upwards belongs in a lower room, or the page and this test
change with it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vaswani"

# Floors, lowest first: a room may import its own modules and those of lower floors (the package's root,
# `vaswani/__init__.py`, registers the models with transformers and may be imported from anywhere).
FLOORS = {
    "modeling": 0,
    "folders": 0,
    "data": 1,
    "constraints": 1,
    "conversion": 2,
    "training": 2,
    "runtime": 3,
    "quantization": 4,
    "export": 5,
    "evaluation": 6,
    "serving": 6,
    "cli": 7,
    "vllm_plugin": 8,
    "vllm_models": 8,
    "__main__": 8,
}
MAX_LINES = 600
# Old import paths kept for users: they hand names on from the rooms that now hold them, by name, on first use.
SHIMS = {"vaswani.conversion", "vaswani.conversion.onnx"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every vaswani module `path` imports, at the top or inside a function, resolved to its full name."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "vaswani":
                continue
            # `from . import x` may name submodules: then those are what it imports, not the package's face.
            submodules = [
                f"{target}.{alias.name}"
                for alias in node.names
                if (PACKAGE.parent / (target + "." + alias.name).replace(".", "/")).with_suffix(".py").exists()
            ]
            found |= set(submodules) if len(submodules) == len(node.names) else {target, *submodules}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "vaswani"}
    found.discard(name)
    return found


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
IMPORTS = {name: imported_modules(path) for name, path in MODULES.items() if name not in SHIMS}


def upward_imports(name: str, targets: set[str]) -> list[str]:
    """The modules of `targets` that `name` may not import: another room's, on its own floor or above."""
    own = room(name)
    return sorted(
        target
        for target in targets
        if room(target) is not None and room(target) != own and FLOORS[room(target)] >= FLOORS.get(own, 99)
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other in a loop (the first repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def test_every_room_has_a_floor():
    rooms = {room(name) for name in MODULES} - {None}
    assert rooms <= set(FLOORS), f"rooms without a floor in this test and docs/architecture.md: {rooms - set(FLOORS)}"


@pytest.mark.parametrize("name", sorted(IMPORTS))
def test_imports_go_down(name):
    assert not upward_imports(name, IMPORTS[name]), f"{name} imports these from its own floor or above"


def test_no_module_imports_another_that_imports_it_back():
    graph = {name: {target for target in targets if target in IMPORTS} for name, targets in IMPORTS.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"modules that import each other: {' -> '.join(cycle)}"


def test_the_checks_see_an_upward_import_and_a_circle():
    # What the checks above exist to catch: the runtime importing the exporter, which imports the runtime.
    graph = {"vaswani.runtime.models": {"vaswani.export.exporter"}, "vaswani.export.exporter": {"vaswani.runtime.models"}}
    assert upward_imports("vaswani.runtime.models", graph["vaswani.runtime.models"]) == ["vaswani.export.exporter"]
    assert upward_imports("vaswani.export.exporter", graph["vaswani.export.exporter"]) == []
    assert find_cycle(graph) == ["vaswani.export.exporter", "vaswani.runtime.models", "vaswani.export.exporter"]
    # and imports inside functions count: one of the package's own is found
    assert "vaswani.conversion.checkpoints" in IMPORTS["vaswani.cli.convert"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_outgrows_one_sitting(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines; split it by concern (at most {MAX_LINES})"
