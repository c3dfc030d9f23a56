"""The layering rules of DESIGN.md, read from the source (no imports run):

- no module imports another module's private names (`from multihead.x import _y`, or
  `x._y` through an imported module): what two modules share gets a module of its own;
- no circle between files (lazy imports inside functions count: they are circles too);
- tools (plan, inspect, lab, heads) never import the CLI or each other; lab may use plan's
  and inspect's public API;
- the lower floors (kernels, masks, score mods, rope, caches, modules) never import interop,
  distributed or the tools: conversions live in interop;
- reference.py imports no torch, and plan's arithmetic needs none.

`DEBT` lists the violations known when this test was written (issue 20 removes them). A
new violation fails; so does a listed one that is gone (remove it from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
TOOLS = ("plan", "inspect", "lab", "heads")
# DESIGN: lab may use plan's and inspect's public API; heads (the library, not its CLI) is a floor below lab
TOOL_USES = {("lab", "plan"), ("lab", "inspect"), ("lab", "heads")}
LOWER = {"attention", "latent", "functional", "blocksparse", "flex", "kernels", "masks", "score_mods", "rope",
         "cache", "reference", "_checks", "_files", "_layer", "_lazy", "errors", "corpus"}
HIGHER = {"interop", "distributed", "heads", "inspect", "plan", "lab", "cli", "convert", "tour"}

# Known when this test was written (issue 20, "The house"); each goes as the refactor lands.
DEBT = {
    "private": set(),
    "cycles": set(),
    "tools": set(),
    "floors": set(),
}


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted((SRC / "multihead").rglob("*.py"))}


def _analyse():
    """module -> set of multihead modules it imports; and the private names it reaches."""
    edges: dict[str, set[str]] = {}
    private: set[tuple[str, str]] = set()
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        aliases: dict[str, str] = {}  # local name -> the multihead module it is bound to
        mine = edges.setdefault(mod, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                if base.split(".")[0] != "multihead":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in MODULES:  # `from multihead import masks`: the submodule
                        mine.add(sub)
                        aliases[alias.asname or alias.name] = sub
                    else:
                        mine.add(base)
                        if alias.name.startswith("_") and not alias.name.startswith("__") and base != mod:
                            private.add((mod, f"{base}.{alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "multihead":
                        mine.add(alias.name)
                        if alias.asname:
                            aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.add((mod, f"{aliases[node.value.id]}.{node.attr}"))
        mine.discard(mod)
    return edges, private


EDGES, PRIVATE = _analyse()


def _inside(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".")


def _cycles() -> set[tuple[str, ...]]:
    """Strongly connected components of more than one file. A package's __init__ importing
    its own submodules (its public face) is not an edge of a circle."""
    graph = {m: {t for t in ts if t in MODULES and not (MODULES[m].name == "__init__.py" and _inside(t, m))}
             for m, ts in EDGES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:  # Tarjan; the import graph is shallow, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _tool(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in TOOLS else None


def _floor(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def _check(kind: str, found: set) -> None:
    known = DEBT[kind]
    new, gone = sorted(found - known), sorted(known - found)
    assert not new, f"new {kind} violation(s) of DESIGN.md's layering: {new}"
    assert not gone, f"fixed, so remove from DEBT[{kind!r}] in tests/test_layering.py: {gone}"


def test_the_analysis_sees_the_imports():
    # the reader is not vacuous: known edges of the package are found
    assert "multihead.functional" in EDGES["multihead.attention"]
    assert "multihead.masks" in EDGES["multihead.functional"]
    assert len(MODULES) > 50


def test_no_private_names_across_modules():
    _check("private", PRIVATE)


def test_no_circles_between_files():
    _check("cycles", _cycles())


def test_tools_do_not_import_each_other_or_the_cli():
    found = set()
    for mod, targets in EDGES.items():
        a = _tool(mod)
        if a is None:
            continue
        for t in targets:
            b = _tool(t)
            if t == "multihead.cli" or (b is not None and b != a and ((a, b) not in TOOL_USES or t.endswith(".cli"))):
                found.add((mod, t))
    lab_reaches = {(m, t) for m, ts in EDGES.items() if _tool(m) == "lab" for t in ts if _tool(t) == "inspect"}
    found |= {pair for pair in lab_reaches if pair[0] == "multihead.lab.checkpoint"}  # a format, not a use
    _check("tools", found)


def test_lower_floors_do_not_import_interop_or_tools():
    found = {(m, t) for m, ts in EDGES.items() if _floor(m) in LOWER for t in ts if _floor(t) in HIGHER}
    _check("floors", found)


def test_reference_and_plan_need_no_torch():
    offenders = []
    for mod, path in MODULES.items():
        if mod == "multihead.reference" or _tool(mod) == "plan":
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [(mod, n) for n in names if n.split(".")[0] == "torch"]
    assert not offenders, f"torch imported where DESIGN.md says none is needed: {offenders}"
