"""The architecture rules of docs/design.md, checked on the source: every ``dcp_plus`` module is
parsed with ``ast`` and every import counts (module level, in functions, under
``TYPE_CHECKING``, and the names a package exports lazily through ``lazy_exports``)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dcp_plus"

# The floors, lowest first: a module imports its own package, lower floors, or an allowed
# sibling on its floor. errors.py, _lazy.py and _gc.py sit below everything, then _compat/ (the
# private torch names); dcp_plus/__init__.py (the lazy public names) is exempt.
FLOORS: list[set[str]] = [
    {"errors", "_lazy", "_gc", "shm"},
    {"_compat"},
    {"format"},
    {"storage", "memory"},
    {"stagers", "planners", "writers", "readers"},
    {"tiers"},
    {"manager", "schedule"},
    {"integrations"},
    {"cli", "__main__"},  # ``python -m dcp_plus`` is the command too
]
# Imports between packages of one floor that exist and are meant: the manager drives the
# adaptive checkpoint interval of schedule/.
SIBLINGS = {("manager", "schedule"), ("__main__", "cli")}
# names of torch's own threads: code that matches them is telling executors apart by name
TORCH_THREAD_NAMES = ("AsyncCheckpointExecutor",)
IO_LIBRARIES = {"fsspec", "s3fs", "botocore", "aiobotocore", "aiohttp", "nfs_rs"}
MAX_LINES = 400
# private torch names read outside _compat/, for now: stagers/ (worked on in parallel) is to
# take them from _compat.torch_dcp too (torch._foreach_copy_ is also what torch.optim calls)
PRIVATE_TORCH_ALLOWED = {("dcp_plus.stagers.copy_engine", "torch._foreach_copy_"),
                         ("dcp_plus.stagers.tree", "dt._spec")}


@dataclass
class Module:
    name: str  # dotted, e.g. dcp_plus.writers.local ("dcp_plus.writers" for its __init__)
    path: Path
    tree: ast.Module
    imports: set[str] = field(default_factory=set)  # every module named by an import
    internal: set[str] = field(default_factory=set)  # the dcp_plus modules among them


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([node.module] if node.module else []))
    # ``from pkg import name``: the module pkg.name when there is one, else pkg
    return [f"{base}.{a.name}" for a in node.names]


def _lazy_exports(tree: ast.Module, module: str) -> list[str]:
    """The modules named by a package's ``_EXPORTS = {name: module}`` (``lazy_exports``)."""
    out = []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)):
            for v in node.value.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    out.append(module + v.value if v.value.startswith(".") else v.value)
    return out


@cache
def modules() -> dict[str, Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        found[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    for m in found.values():
        is_package = m.path.name == "__init__.py"
        names = [n for node in ast.walk(m.tree) for n in _imported(node, m.name, is_package)]
        names += _lazy_exports(m.tree, m.name)
        m.imports = set(names)
        for n in names:
            while n and n not in found:  # dcp_plus.writers.local.LocalWriter -> the module
                n = n.rpartition(".")[0]
            if n.startswith("dcp_plus") and n != m.name:
                m.internal.add(n)
    return found


def _package(module: str) -> str:
    """The top-level part of ``dcp_plus`` a module belongs to (``""`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(package: str) -> int:
    for i, names in enumerate(FLOORS):
        if package in names:
            return i
    raise AssertionError(f"dcp_plus/{package} has no floor in FLOORS: add it where "
                         "docs/design.md puts it")


def _graph() -> dict[str, list[str]]:
    return {name: sorted(m.internal) for name, m in modules().items()}


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Every import cycle in ``graph``: one path that closes it per group of modules that
    import each other (strongly connected component)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while not group or w != v:
                w = stack.pop()
                group.add(w)
            if len(group) > 1:
                groups.append(group)

    for v in graph:
        if v not in index:
            connect(v)
    return [_path_in(sorted(g)[0], g, graph) for g in groups]


def _path_in(start: str, group: set[str], graph: dict[str, list[str]]) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``group``."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in group and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a cycle group but no path returns to it")


def test_every_module_parses_and_the_graph_is_not_empty() -> None:
    mods = modules()
    assert "dcp_plus.writers.local" in mods and "dcp_plus.cli.main" in mods
    assert "dcp_plus.writers.base" in mods["dcp_plus.writers.local"].internal
    assert "dcp_plus.writers.local" in mods["dcp_plus.writers"].internal  # a lazy export


def test_no_import_cycle_between_dcp_plus_modules() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_inside_the_cli() -> None:
    # the cli part of the rule above, not marked: bench/runner <-> bench/world is gone
    cycles = [c for c in _cycles(_graph()) if any(_package(m) == "cli" for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_the_cycle_bench_had() -> None:
    graph = _graph()
    graph["dcp_plus.cli.bench.world"].append("dcp_plus.cli.bench.runner")
    assert ["dcp_plus.cli.bench.runner", "dcp_plus.cli.bench.world",
            "dcp_plus.cli.bench.runner"] in _cycles(graph)


def test_each_layer_imports_only_its_own_floor_or_lower_ones() -> None:
    violations = []
    for name, m in modules().items():
        if name == "dcp_plus":
            continue
        src = _package(name)
        for target in sorted(m.internal):
            dst = _package(target)
            if not dst or dst == src or (src, dst) in SIBLINGS:
                continue
            if _floor(dst) >= _floor(src):
                violations.append(f"{name} -> {target}")
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_no_library_module_imports_the_cli() -> None:
    offenders = [f"{n} -> {t}" for n, m in modules().items()
                 if _floor(_package(n) or "errors") != _floor("cli")
                 for t in sorted(m.internal) if _package(t) == "cli"]
    assert not offenders, offenders


def test_format_imports_no_io_library() -> None:
    offenders = [f"{n} imports {i}" for n, m in modules().items() if _package(n) == "format"
                 for i in sorted(m.imports) if i.split(".")[0] in IO_LIBRARIES]
    assert not offenders, offenders


def _frame_or_thread_probes(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            text = ast.unparse(node)
            if (node.attr in ("_getframe", "currentframe", "f_back", "f_locals")
                    or text == "inspect.stack"
                    or (node.attr in ("name", "getName") and "current_thread()" in text)):
                found.append((node.lineno, text))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and any(n in node.value for n in TORCH_THREAD_NAMES)):
            found.append((node.lineno, repr(node.value)))
    return found


def test_no_frame_or_thread_name_probing() -> None:
    offenders = [f"{m.path.relative_to(PACKAGE.parent)}:{line}: {text}"
                 for m in modules().values() for line, text in _frame_or_thread_probes(m.tree)]
    assert not offenders, "\n".join(offenders)


def test_the_probe_check_finds_what_it_looks_for() -> None:
    probes = _frame_or_thread_probes(ast.parse(
        "import sys, inspect, threading\n"
        "f = sys._getframe(2).f_locals\n"
        "g = inspect.currentframe().f_back\n"
        "ok = threading.current_thread().name == 'x'\n"
        "PREFIX = 'AsyncCheckpointExecutor'\n"))
    assert {text for _, text in probes} >= {"sys._getframe", "inspect.currentframe",
                                            "threading.current_thread().name",
                                            "'AsyncCheckpointExecutor'"}


def test_no_module_over_400_lines() -> None:
    long = {str(m.path.relative_to(PACKAGE.parent)): n for m in modules().values()
            if (n := len(m.path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _private_torch_uses(m: Module) -> list[str]:
    """Private torch names ``m`` imports (``torch.distributed.checkpoint._nested_dict``,
    ``default_planner._EmptyStateDictLoadPlanner``) or reads (``torch._x``, a DTensor's
    ``._local_tensor`` / ``._spec``)."""
    found = [i for i in m.imports
             if i.split(".")[0] == "torch" and any(p.startswith("_") for p in i.split(".")[1:])]
    for node in ast.walk(m.tree):
        if not isinstance(node, ast.Attribute):
            continue
        text = ast.unparse(node)
        if (m.name, text) in PRIVATE_TORCH_ALLOWED or text.startswith("torch.__"):
            continue
        if text.startswith("torch._") or node.attr in ("_local_tensor", "_spec",
                                                       "_CHECKPOINT_PROCESS"):
            found.append(f"{node.lineno}: {text}")
    return found


def test_private_torch_names_are_used_only_in_compat() -> None:
    offenders = [f"{m.path.relative_to(PACKAGE.parent)}: {use}" for m in modules().values()
                 if _package(m.name) != "_compat" for use in _private_torch_uses(m)]
    assert not offenders, ("private torch names outside dcp_plus/_compat/torch_dcp.py:\n"
                           + "\n".join(offenders))


def test_the_private_torch_check_finds_what_it_looks_for() -> None:
    tree = ast.parse("from torch.distributed.checkpoint._nested_dict import flatten_state_dict\n"
                     "from torch.distributed.checkpoint.default_planner import _Empty\n"
                     "x = dt._local_tensor\n"
                     "torch._foreach_copy_(a, b)\n"
                     "v = torch.__version__\n")
    m = Module("dcp_plus.planners.x", PACKAGE / "planners" / "x.py", tree,
               imports={"torch.distributed.checkpoint._nested_dict.flatten_state_dict",
                        "torch.distributed.checkpoint.default_planner._Empty",
                        "torch.distributed.checkpoint.metadata.Metadata"})
    uses = _private_torch_uses(m)
    assert sorted(uses) == ["3: dt._local_tensor", "4: torch._foreach_copy_",
                            "torch.distributed.checkpoint._nested_dict.flatten_state_dict",
                            "torch.distributed.checkpoint.default_planner._Empty"], uses
