"""The package's layering, read from its source with ``ast`` (no module is imported): no import
cycle among behemoth's modules, and no import from a lower layer into a higher one.

Data flows one way: plan -> mesh -> comm -> parallel -> parallelize -> engine -> train -> cli.
Models are plain serial PyTorch (no collectives, no mesh), the planner is pure (it never touches
a process group), and the collectives never know about the parallel layers built on them.
Imports inside functions count as much as those at the top of a file: a deferred import hides a
dependency from the reader, not from the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "behemoth"

# (importing package or module, packages or modules it must never import, why)
RULES = [
    (
        "behemoth.models",
        ("behemoth.parallel", "behemoth.comm", "behemoth.mesh", "behemoth.engine"),
        "models are serial",
    ),
    ("behemoth.parallel", ("behemoth.engine", "behemoth.train", "behemoth.cli"), "layers know no engine or app"),
    ("behemoth.comm", ("behemoth.parallel",), "collectives sit below the parallel layers"),
    ("behemoth.planner", ("behemoth.mesh", "behemoth.comm", "behemoth.engine"), "the planner is pure"),
    ("behemoth.parallelize", ("behemoth.engine", "behemoth.train", "behemoth.cli"), "parallelize needs no engine"),
    ("behemoth.checkpoint", ("behemoth.engine", "behemoth.train", "behemoth.cli"), "checkpoints know components"),
    (
        "behemoth.checkpoint_shards",
        ("behemoth.engine", "behemoth.train", "behemoth.cli"),
        "checkpoints know components",
    ),
    ("behemoth.async_checkpoint", ("behemoth.engine", "behemoth.train", "behemoth.cli"), "checkpoints know components"),
    ("behemoth.engine", ("behemoth.train", "behemoth.cli"), "the core never imports the application"),
    ("behemoth.executor", ("behemoth.engine", "behemoth.train", "behemoth.cli"), "executors know no engine"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, mod: str, known: set[str]) -> set[str]:
    """The behemoth modules ``mod`` imports (a package's ``__init__`` is its own module; ``from
    pkg import sub`` imports ``pkg.sub``; a name imported from a module resolves to the module)."""
    out = set()
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            names = [x for x in subs if x in known] or [base]
            names += [base] if len(names) < len(subs) else []
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.add(n)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: imports_of(p, m, set(files)) for m, p in files.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (the import cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def within(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def test_the_graph_is_read():
    graph = import_graph()
    assert "behemoth.engine" in graph and "behemoth.comm" in graph["behemoth.engine"]
    assert "behemoth.models.gpt" in graph


def test_no_import_cycle():
    cycles = strongly_connected(import_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_layers_import_downward_only():
    graph = import_graph()
    broken = [
        f"{mod} imports {dep} ({why})"
        for src, banned, why in RULES
        for mod, deps in sorted(graph.items())
        if within(mod, src)
        for dep in sorted(deps)
        if any(within(dep, b) for b in banned)
    ]
    assert broken == [], "\n".join(broken)


def test_the_checks_can_fail():
    """The cycle finder and the rules catch what they are meant to, on a made-up graph."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert within("behemoth.parallel.tensor.tp1d", "behemoth.parallel")
    assert not within("behemoth.parallelize", "behemoth.parallel")


def test_test_modules_have_unique_basenames():
    # tests/ has no packages: pytest imports each test file by its basename, so two files of one
    # name in unit/, dist/ or e2e/ stop the whole run at collection
    root = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    for f in sorted(root.rglob("test_*.py")):
        assert f.name not in seen, f"{f.relative_to(root)} and {seen[f.name].relative_to(root)} share a basename"
        seen[f.name] = f
