"""The layering rules of docs/development.md, read from the source (no imports run):

- no module imports another module's private names (`from multihead.x import _y`, or
  `x._y` through an imported module): what two modules share gets a module of its own;
- no module reads or sets a private attribute of another module's objects (`mask._op` where
  masks.py makes `_op`; self, cls and super() are the class's own), and the private
  attributes of other libraries it touches are listed in `THIRD_PARTY` with the reason;
- no circle between files (lazy imports inside functions count: they are circles too);
- tools (plan, inspect, lab, heads) never import the CLI or each other; lab may use plan's
  and inspect's public API;
- the lower floors (kernels, masks, score mods, rope, caches, modules) never import interop,
  distributed or the tools: conversions live in interop;
- reference.py imports no torch, and plan's arithmetic needs none.

`DEBT` lists known violations (none at present). A new violation fails; so does a listed
one that is gone (remove it from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
TOOLS = ("plan", "inspect", "lab", "heads")
# DESIGN: lab may use plan's and inspect's public API; heads (the library, not its CLI) is a floor below lab
TOOL_USES = {("lab", "plan"), ("lab", "inspect"), ("lab", "heads")}
LOWER = {"attention", "latent", "functional", "kernels", "masks", "score_mods", "rope",
         "cache", "reference", "checks", "files", "layer_parts", "conversion_parts", "_lazy", "errors", "corpus"}
HIGHER = {"interop", "distributed", "heads", "inspect", "plan", "lab", "cli", "convert", "tour"}

# Known violations, each removed when it is fixed.
DEBT = {
    "private": set(),
    "private_attrs": set(),
    "cycles": set(),
    "tools": set(),
    "floors": set(),
}


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted((SRC / "multihead").rglob("*.py"))}


def _analyse():
    """module -> set of multihead modules it imports; the private names it reaches; and each
    module's syntax tree and names bound to multihead modules (for `_private_attributes`)."""
    edges: dict[str, set[str]] = {}
    private: set[tuple[str, str]] = set()
    trees: dict[str, ast.Module] = {}
    bound: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        tree = trees[mod] = ast.parse(path.read_text(), filename=str(path))
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
        bound[mod] = set(aliases)
    return edges, private, trees, bound


EDGES, PRIVATE, TREES, MODULE_NAMES = _analyse()

# Private attributes of torch, transformers and the standard library that multihead reads
# (no public spelling exists); any other `obj._x` on an object multihead did not make is new.
THIRD_PARTY = {
    "_orig_mod": "torch.compile(model)'s OptimizedModule: the heads tools refuse a compiled model by name",
    "_compiled_call_impl": "nn.Module.compile() sets it: the heads tools refuse a compiled model by name",
    "_torchdynamo_orig_callable": "marks a torch.compile'd function put on model.forward: refused as above",
    "_dynamo": "torch._dynamo.config.patch(recompile_limit=) and its exception: flex's compile limit",
    "_ops": "torch._ops.OpOverload(Packet): the type of a torch.ops entry, keyed by identity in flex's cache",
    "_C": "torch._C._current_graph_task_id: whether autograd is running a backward; torch._C._storage_Use_Count: "
          "whether anything but the fused engine's kept alias refers to an output's memory (as torch's own "
          "cudagraph trees read liveness)",
    "_storage_Use_Count": "torch._C._storage_Use_Count: fused_tiles.output reuses a dropped output's memory only "
                          "when nothing else refers to it",
    "_cdata": "UntypedStorage._cdata: the handle _storage_Use_Count reads",
    "_current_graph_task_id": "see _C",
    "_version": "Tensor._version: the in-place version counter, so an edited tensor misses flex's cache",
    "_scaled_dot_product_flash_attention_for_cpu": "torch's CPU flash kernel: returns the log-sum-exp",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "its backward from a given log-sum-exp",
    "_qkv_same_embed_dim": "nn.MultiheadAttention's packed-projection flag (in_proj_weight or q/k/v_proj_weight)",
    "_name_or_path": "transformers' PretrainedConfig: where a model was loaded from",
    "_attn_implementation": "transformers' PretrainedConfig: the attention backend a model runs",
    "_model_mapping": "transformers' auto classes: whether a head class has a model for a config",
    "_tqdm_active": "transformers' logging: its progress bars without the hub's",
    "_fields": "namedtuple's field names (public API with an underscore against field clashes)",
    "_forward_hooks": "nn.Module's registered forward hooks (no public reader): the edge tools refuse a hook on a "
                      "module whose weights they read without calling it",
    "_forward_pre_hooks": "see _forward_hooks",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object's own class hierarchy."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module makes: its functions and classes, the names it assigns,
    the attributes it sets on self/cls, and keywords it passes (argparse's set_defaults(_x=))."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return {n for n in names if _private(n)}


def _private_reads(tree: ast.Module, modules: set[str]):
    """(line, name) of every `obj._x` (read or write) and `getattr(obj, "_x")` on an object
    that is not the class's own (self, cls, super()) nor a multihead module (the import
    check's business)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            base, name = node.args[0], node.args[1].value
        else:
            continue
        if _own(base) or (isinstance(base, ast.Name) and base.id in modules):
            continue
        yield node.lineno, name


def _private_attributes(trees: dict[str, ast.Module], bound: dict[str, set[str]]):
    """(across, foreign): `obj._x` whose `_x` this module does not make but another multihead
    module does, as (module, name, the modules that make it); and `_x` that no multihead
    module makes (torch's, transformers'), as (module, name). A name made here as well as
    elsewhere counts as this module's own."""
    made = {mod: _defined(tree) for mod, tree in trees.items()}
    across, foreign = set(), set()
    for mod, tree in trees.items():
        for _, name in _private_reads(tree, bound.get(mod, set())):
            if name in made[mod]:
                continue
            makers = tuple(sorted(m for m, names in made.items() if name in names))
            if makers:
                across.add((mod, name, makers))
            else:
                foreign.add((mod, name))
    return across, foreign


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
    assert not new, f"new {kind} violation(s) of the layering in docs/development.md: {new}"
    assert not gone, f"fixed, so remove from DEBT[{kind!r}] in tests/test_layering.py: {gone}"


def test_the_analysis_sees_the_imports():
    # the reader is not vacuous: known edges of the package are found
    assert "multihead.functional" in EDGES["multihead.attention"]
    assert "multihead.masks" in EDGES["multihead.functional"]
    assert len(MODULES) > 50


def test_no_private_names_across_modules():
    _check("private", PRIVATE)


def test_no_private_attributes_across_modules():
    """No module reads or sets a private attribute another multihead module gives its objects
    (`mask._op` where masks.py makes `_op`): what the kernels need is a public property."""
    across, _ = _private_attributes(TREES, MODULE_NAMES)
    _check("private_attrs", across)


def test_private_attributes_of_other_libraries_are_listed():
    """Every private attribute of torch, transformers or the standard library that multihead
    touches is in THIRD_PARTY with the reason no public spelling does; a listed one no
    longer used is removed."""
    _, foreign = _private_attributes(TREES, MODULE_NAMES)
    used = {name for _, name in foreign}
    new = sorted((m, n) for m, n in foreign if n not in THIRD_PARTY)
    assert not new, f"private attributes of another library, not in THIRD_PARTY (say why, or use a public one): {new}"
    assert used >= set(THIRD_PARTY), f"no longer used, remove from THIRD_PARTY: {sorted(set(THIRD_PARTY) - used)}"


def test_the_private_attribute_check_can_fail():
    """The reader flags a kernel reading a MaskMod's private field, and nothing of its own."""
    masks = ast.parse("class MaskMod:\n    def __init__(self, op):\n        self._op = op\n")
    kernel = ast.parse("def key(x, self):\n    self._mine = 1\n    return x._op, self._mine, getattr(x, '_op')\n")
    across, foreign = _private_attributes({"m.masks": masks, "m.kernel": kernel}, {})
    assert across == {("m.kernel", "_op", ("m.masks",))} and not foreign


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
    assert not offenders, f"torch imported where docs/development.md says none is needed: {offenders}"
