"""The folders import one way: the language imports nothing built on it, kernels and the runtime
know nothing of tuning or models, tuning nothing of models, and only the commands at the top
(the CLI, build, bench-kernels) reach everything. Read from the sources' import statements, so a
cycle fails here before it fails an import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"zdsl": "zdsl", "kernels": "zdsl.kernels", "runtime": "zdsl.runtime", "autotune": "zdsl.autotune",
           "models": "zdsl.models"}
# Each layer and the layers it may import (itself included). `zdsl` is the package's own modules.
LAYERS = {
    "base": {"base"},                                   # errors, caches, the shader tools, tables, defaults
    "lang": {"lang", "base"},                           # zdsl.lang, and `import zdsl` (the language's API)
    "kernels": {"kernels", "lang", "base"},
    "runtime": {"runtime", "base"},
    "autotune": {"autotune", "kernels", "runtime", "lang", "base"},
    "models": {"models", "autotune", "kernels", "runtime", "lang", "base"},
    "app": {"app", "models", "autotune", "kernels", "runtime", "lang", "base"},
}
BASE = {"zdsl.errors", "zdsl.cache", "zdsl.toolchain", "zdsl.console", "zdsl.device_defaults"}
APP = {"zdsl.cli", "zdsl.build", "zdsl.bench_kernels"}


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    if module in APP:
        return "app"
    if module == "zdsl" or module.startswith("zdsl.lang"):
        return "lang"
    return module.split(".")[1]


def modules():
    """(module name, its source file) of every module the package ships."""
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([package, *parts]), path


def imports(path: Path) -> set[str]:
    """The zdsl modules a source file imports (relative imports resolved)."""
    package = path.parent
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "zdsl"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(package, node.level)
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name.split(".")[0] == "zdsl":
                # `from zdsl import errors` imports the module zdsl.errors, not the language's API
                modules = {f"{name}.{a.name}" for a in node.names if _is_module(f"{name}.{a.name}")}
                out |= modules if len(modules) == len(node.names) else {name, *modules}
    return out


def _is_module(name: str) -> bool:
    return any(name.startswith(package + ".") and (ROOT / folder / (name[len(package) + 1:].replace(".", "/") + ".py")).exists()
               for folder, package in FOLDERS.items())


def _package_of(folder: Path, level: int) -> str:
    for name, package in FOLDERS.items():
        top = ROOT / name
        if folder == top or top in folder.parents:
            rel = folder.relative_to(top).parts
            parts = [*package.split("."), *rel]
            return ".".join(parts[:len(parts) - (level - 1)])
    raise AssertionError(folder)


def test_every_import_points_down():
    wrong = []
    for module, path in modules():
        mine = layer(module)
        for target in imports(path):
            if layer(target) not in LAYERS[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_no_cycles_between_folders():
    edges = {}
    for module, path in modules():
        for target in imports(path):
            a, b = layer(module), layer(target)
            if a != b:
                edges.setdefault(a, set()).add(b)

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in edges.get(start, ()))

    assert not [a for a in edges if reaches(a, a)]


def test_the_language_imports_nothing_above_it():
    for module, path in modules():
        if layer(module) == "lang":
            assert all(layer(t) in ("lang", "base") for t in imports(path)), module
