"""The import graph of torch_bq: the checkpoint reader stands alone, no import circle anywhere, no private
names imported across packages."""

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


def _module_graph():
    """``module -> modules it imports`` over torch_bq, ``from pkg import submodule`` resolved to the submodule."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for mod, names in _imports(path):
            if not mod.startswith("torch_bq"):
                continue
            for n in names or [None]:
                target = f"{mod}.{n}" if n and f"{mod}.{n}" in modules else mod
                # importing a submodule runs its parents' __init__ anyway; the root package is no edge
                if target in modules and target not in (name, "torch_bq"):
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan), iteratively."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_anywhere_in_the_package():
    # function-level imports count: hiding a circle inside a function is still a circle
    assert _cycles(_module_graph()) == []


def test_no_private_name_imported_across_packages():
    for path in PKG.rglob("*.py"):
        here = _module_name(path).split(".")[:2]
        for mod, names in _imports(path):
            if not mod.startswith("torch_bq.") or mod.split(".")[:2] == here:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not private, f"{path.relative_to(PKG)} imports {private} from {mod}"


def test_no_private_attribute_of_another_package_is_used():
    # ``from ..reference import attention as ref`` then ``ref._check(...)`` is the same private
    # dependency as importing ``_check`` by name.
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    for path in PKG.rglob("*.py"):
        here = _module_name(path).split(".")[:2]
        aliases = {}
        tree = ast.parse(path.read_text())
        for (mod, names), node in zip(_imports(path), (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))):
            for alias in node.names:
                target = f"{mod}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
                if target in modules and target.split(".")[:2] != here:
                    aliases[alias.asname or alias.name.split(".")[-1]] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                raise AssertionError(f"{path.relative_to(PKG)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
