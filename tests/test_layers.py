"""The package's floors (docs/layers.md): every import, those inside functions included, goes
to a module on its own floor or below, and no modules import each other around a circle."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pagedattn"


def floors() -> dict[str, int]:
    """docs/layers.md's table: module prefix (relative to the package) -> floor."""
    table = {}
    for line in (ROOT / "docs" / "layers.md").read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for name in re.findall(r"`([\w.]+)`", m.group(2)):
                table[name] = int(m.group(1))
    return table


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the package's modules, wherever in the module they are."""
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in mods:
                        found.add(target)
                    elif base in mods:
                        found.add(base)
        graph[name] = found - {name}
    return graph


def floor_of(name: str, table: dict[str, int]) -> int | None:
    rel = name.removeprefix("pagedattn").removeprefix(".") or "pagedattn"
    best = None
    for prefix, floor in table.items():
        if (rel == prefix or rel.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, floor)
    return None if best is None else best[1]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_floor_and_imports_go_down():
    table = floors()
    mods = modules()
    graph = imports(mods)
    missing = sorted(m for m in mods if floor_of(m, table) is None)
    assert not missing, f"modules docs/layers.md gives no floor: {missing}"
    climbs = [
        f"{a} (floor {floor_of(a, table)}) -> {b} (floor {floor_of(b, table)})"
        for a, targets in graph.items()
        for b in targets
        if floor_of(b, table) > floor_of(a, table)
    ]
    assert not climbs, "imports that climb a floor:\n" + "\n".join(sorted(climbs))


def test_no_import_circles():
    assert circles(imports(modules())) == []


def test_the_walk_sees_imports_inside_functions_and_circles(tmp_path):
    """The checks above can fail: an import inside a function is an edge, and the circle it
    closes is found."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from . import high\n    return high\n")
    (package / "high.py").write_text("from .low import f\n")
    graph = imports(modules(package))
    assert graph["pkg.low"] == {"pkg.high"} and graph["pkg.high"] == {"pkg.low"}
    assert circles(graph) == [["pkg.high", "pkg.low"]]
    assert floor_of("pagedattn.families.hopper", {"families": 2, "families.hopper": 9}) == 9
