"""The checkpoint reader stands alone: no import circle with torch_bq.nn, no private names across packages."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "torch_bq"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """``(module imported, names)`` for every import in ``path``, function-level ones included."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names]


def _graph():
    graph = {}
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        graph[name] = {(m, tuple(n)) for m, n in _imports(path) if m.startswith("torch_bq")}
    return graph


def test_checkpoint_package_never_imports_nn():
    for path in (PKG / "checkpoint").rglob("*.py"):
        for mod, _ in _imports(path):
            assert not mod.startswith("torch_bq.nn"), f"{path.name} imports {mod}"


def test_no_import_circle_between_the_loader_and_the_modules():
    # nn.linear builds modules from the reader's records; nothing it imports may lead back to it.
    graph = _graph()
    start = "torch_bq.nn.linear"
    seen, stack = set(), [m for m, _ in graph[start]]
    while stack:
        mod = stack.pop()
        for candidate in (mod, mod.rpartition(".")[0]):
            if candidate in graph and candidate not in seen:
                seen.add(candidate)
                stack += [m for m, _ in graph[candidate]]
    assert start not in seen and "torch_bq.nn.checkpoint" not in seen, sorted(seen)


def test_loader_imports_no_private_name_of_another_package():
    for path in [*(PKG / "checkpoint").rglob("*.py"), PKG / "nn" / "checkpoint.py", PKG / "nn" / "save.py",
                 PKG / "nn" / "linear.py", PKG / "cli.py"]:
        here = _module_name(path).split(".")[:2]
        for mod, names in _imports(path):
            if mod.split(".")[:2] == here:
                continue
            private = [n for n in names if n.startswith("_") and n != "__future__"]
            assert not private, f"{path.relative_to(PKG)} imports {private} from {mod}"
