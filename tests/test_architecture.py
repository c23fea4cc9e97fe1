"""The layering docs/architecture.md draws, checked against the code: every module of keras_vit is on
a floor, and every import it makes (module level, inside a function, a package face's lazy name, an
`importlib` string) goes to its own part or a lower floor. No import cycle between modules."""

import ast
import pathlib
import re

import keras_vit

PACKAGE_DIR = pathlib.Path(keras_vit.__file__).parent
ARCHITECTURE = PACKAGE_DIR.parent / "docs" / "architecture.md"


def _floors() -> dict[str, int]:
    """Part (a folder `keras_vit/x/` or a file `keras_vit/x.py`, as a dotted name) -> its floor."""
    block = ARCHITECTURE.read_text().split("```text", 1)[1].split("```", 1)[0]
    floors, floor = {}, None
    for line in block.splitlines():
        match = re.match(r"floor (\d+)\s+(\S+)", line)
        if match:
            floor, path = int(match.group(1)), match.group(2)
        else:
            match = re.match(r"\s+(keras_vit/\S+)", line)
            if not match:
                continue
            path = match.group(1)
        floors[path.rstrip("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")] = floor
    return floors


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE_DIR.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: pathlib.Path) -> set[str]:
    """keras_vit modules `path` depends on: `import` statements anywhere in it, and in a file that loads
    modules by name (a package face, `importlib`), every string naming a module of its package."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("keras_vit"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                modules.add(full if _is_module(full) else node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names if alias.name.startswith("keras_vit"))
    source = path.read_text()
    if "lazy_exports(" in source or "import_module(" in source:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value:
                for name in (f"{package}.{node.value}", f"keras_vit.{node.value}", node.value):
                    if (
                        name.startswith("keras_vit")
                        and re.fullmatch(r"\w+(\.\w+)*", name)
                        and _is_module(name)
                    ):
                        modules.add(name)
                        break
    return modules


def _part(module: str, floors: dict[str, int]) -> str | None:
    candidates = [
        part for part in floors if module == part or module.startswith(part + ".") and part != "keras_vit"
    ]
    return max(candidates, key=len) if candidates else None


MODULES = sorted(_module_name(path) for path in PACKAGE_DIR.rglob("*.py"))


def test_every_module_is_on_a_floor():
    floors = _floors()
    assert max(floors.values()) <= 8, "at most 9 floors"
    assert [module for module in MODULES if _part(module, floors) is None] == []


def test_imports_go_down_or_stay_in_the_part():
    floors = _floors()
    upward = []
    for module in MODULES:
        part = _part(module, floors)
        path = PACKAGE_DIR.parent.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for target in sorted(_imports(path)):
            target_part = _part(target, floors)
            if target_part != part and floors[target_part] >= floors[part]:
                upward.append(f"{module} (floor {floors[part]}) -> {target} (floor {floors[target_part]})")
    assert upward == []


def test_no_import_cycles_between_modules():
    graph = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        name = _module_name(path)
        # a package's own __init__ is imported before its submodules: not a dependency between modules
        graph[name] = {m for m in _imports(path) if not name.startswith(m + ".") and m != name}
    state = {}

    def visit(module, trail):
        state[module] = "open"
        for dependency in graph.get(module, ()):
            assert state.get(dependency) != "open", "import cycle: " + " -> ".join([*trail, dependency])
            if dependency not in state:
                visit(dependency, [*trail, dependency])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert "keras_vit.training.classification" not in graph["keras_vit.training.pretrain"]
