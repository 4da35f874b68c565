"""The house rules on code layout, as tests, checked by parsing the source with `ast` (nothing is imported).

- Imports only go one way, kernels <- engine <- app (ARCHITECTURE.md): kernels/ never imports engine or app,
  engine/ never imports app, not even inside a function or under TYPE_CHECKING, so each layer can be used,
  tested and reasoned about without the ones above it.
- Inside engine/ the tiers are layers too (ENGINE_TIERS, lowest first): a module imports only modules of its
  own tier or of the tiers below it, at import time, inside a function or under TYPE_CHECKING alike (a type
  hint is an import too, STYLE.md). Every module of engine/ has its tier.
- No import cycles between the modules of kernels/, engine/ and app/ at import time: a cycle makes the
  import order matter and half-initialised modules show up as confusing AttributeErrors. Nor any cycle through
  imports of any kind (inside a function, under TYPE_CHECKING): such a cycle is two modules that each need the
  other, whatever the import order.
- The stateless routes (openai_api, tokenize_api) import nothing of app/sessions.
- No module over ~400 lines and no function over ~40 lines without a reason (STYLE.md). Modules are held to
  MAX_MODULE_LINES; functions on the hot path (the scheduler/runner/model step) to MAX_FUNCTION_LINES, since
  those are the ones read most often when chasing latency or correctness bugs.
- Every Python file is as `ruff format` writes it at 100 columns (pyproject.toml).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "engine", "app")  # lowest first: a layer may import only the layers before it
# the rule is "~400 lines"; 420 leaves a little slack before a split is forced
MAX_MODULE_LINES = 420
# STYLE.md says ~40 "without a reason"; 50 is where no reason is good enough
MAX_FUNCTION_LINES = 50
SIZE_CHECKED = ("engine", "app")
HOT_PATH = (
    "engine/core/scheduler.py",
    "engine/core/block_manager.py",
    "engine/core/block_pool.py",
    "engine/worker/model_runner.py",
    "engine/worker/step_inputs.py",
    "engine/runtime/engine_core.py",
    "engine/output/output_processor.py",
    "engine/output/detokenizer.py",
    "engine/layers/*.py",
    "engine/sample/*.py",
    "engine/core/run_queues.py",
    "engine/models/*.py",
    "engine/kv_backend/*.py",
    "engine/worker/cuda_graphs.py",
    "engine/runtime/core_process.py",
)

# engine/'s tiers, lowest first: (what it is, the packages and modules in it). A package stands for every module in
# it; ``engine`` alone is the package's own __init__ (its public names), at the top with the front-facing modules.
ENGINE_TIERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "shared types",
        (
            "engine.config",
            "engine.sampling_params",
            "engine.sequence",
            "engine.forward_context",
            "engine.log_format",
            "engine.child_process",
            "engine.free_heap",
            "engine.cache_dir",
            "engine.device_defaults",
        ),
    ),
    (
        "weights",
        ("engine.weights",),
    ),  # GGUF files and weight formats: torch, numpy, gguf, kernels only
    # the KV tiers below the host: block files, the disk and Redis stores, their I/O thread (torch, no core)
    ("kv_tiers", ("engine.kv_tiers",)),
    ("core", ("engine.core",)),  # what runs in each step: scheduler, block books, pins, stats
    ("distributed", ("engine.distributed",)),  # tensor parallelism's group and collectives
    ("kv_backend", ("engine.kv_backend",)),
    ("layers", ("engine.layers",)),
    ("models", ("engine.models",)),
    ("sample", ("engine.sample",)),
    ("output", ("engine.output",)),  # output types, detokenizing, beam search, structured output
    ("worker", ("engine.worker",)),  # how a step runs: model runner, loader, CUDA graphs, TP ranks
    ("speculative", ("engine.speculative",)),  # drafts for a step and their verification
    ("runtime", ("engine.runtime",)),  # the loop that drives core and worker, and its process
    (
        "front",
        (
            "engine",
            "engine.async_engine",
            "engine.llm_engine",
            "engine.llm",
            "engine.core_connection",
            "engine.request_stream",
            "engine.engine_client",
            "engine.chat_template",
            "engine.grammar_worker",
            "engine.grammar_zygote",
            "engine.grammar_side",
            "engine.prefix_cache_calls",
        ),
    ),
)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the layers (a package's __init__ is the package)."""
    found: dict[str, Path] = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def base_of(module: str, node: ast.ImportFrom) -> str:
    """The absolute module named by `from <base> import ...` in `module` (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = (
        module.split(".") if modules()[module].name == "__init__.py" else module.split(".")[:-1]
    )
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names an import statement brings in: `from a import b` gives a.b (maybe not a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = base_of(module, node)
    return [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]


def most_specific(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None: not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules():
            return ".".join(parts[:end])
    return None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


# where an import statement runs
AT_IMPORT = "at import time"
IN_FUNCTION = "inside a function"
TYPE_ONLY = "under TYPE_CHECKING"


def imports_in(
    node: ast.AST, kind: str = AT_IMPORT
) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under ``node``, with where it runs: when the module is imported (top level, class
    bodies, if/try/with blocks), inside a function (when it is called), or never (``if TYPE_CHECKING:``; its
    else branch does run)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, kind
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == AT_IMPORT:
        kind = IN_FUNCTION
    if isinstance(node, ast.If) and is_type_checking(node.test):
        for stmt in node.body:
            yield from imports_in(stmt, TYPE_ONLY if kind == AT_IMPORT else kind)
        for stmt in node.orelse:
            yield from imports_in(stmt, kind)
        return
    for child in ast.iter_child_nodes(node):
        yield from imports_in(child, kind)


def test_no_upward_imports() -> None:
    offenders = []
    for module, path in modules().items():
        rank = LAYERS.index(module.split(".")[0])
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported(module, node):
                    top = name.split(".")[0]
                    if top in LAYERS and LAYERS.index(top) > rank:
                        offenders.append(
                            f"{rel(path)}:{node.lineno} -> {most_specific(name) or name}"
                        )
    assert not offenders, "imports must go kernels <- engine <- app only:\n" + "\n".join(offenders)


STATELESS_ROUTES = ("app.openai_api", "app.tokenize_api")  # they serve without the session store


def test_the_stateless_routes_import_nothing_of_the_session_routes() -> None:
    """The stateless routes reach sessions only through Serving's typed services (a chat with a session id is
    handed to ``Serving.session_chat``), so they import no module of app/sessions themselves."""
    offenders = []
    for module in STATELESS_ROUTES:
        path = modules()[module]
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                offenders += [
                    f"{rel(path)}:{node.lineno} -> {name}"
                    for name in imported(module, node)
                    if name.startswith("app.sessions")
                ]
    assert not offenders, "\n".join(offenders)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the graph's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            at = stack.index(node)
            components.append(sorted(stack[at:]))
            del stack[at:]

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete cycle through the component's first module (a shortest one, by breadth-first search)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    next_frontier.append(succ)
        frontier = next_frontier
    return component


def import_graph(
    kinds: tuple[str, ...],
) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Module -> the modules it imports by imports of ``kinds``; and for each edge, where its first import is
    (file:line, and its kind)."""
    graph: dict[str, set[str]] = {module: set() for module in modules()}
    where: dict[tuple[str, str], str] = {}
    for module, path in modules().items():
        for node, kind in imports_in(parse(path)):
            if kind not in kinds:
                continue
            for name in imported(module, node):
                target = most_specific(name)
                if target is not None and target != module:
                    graph[module].add(target)
                    where.setdefault((module, target), f"{rel(path)}:{node.lineno} {kind}")
    return graph, where


def cycles_of(graph: dict[str, set[str]], where: dict[tuple[str, str], str]) -> list[str]:
    """One cycle of each strongly connected component, each import named by its file:line and kind."""
    cycles = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            path = cycle_in(component, graph)
            steps = [f"{a} ({where[a, b]})" for a, b in zip(path, path[1:])]
            cycles.append(
                " -> ".join([*steps, path[-1]]) + f"   (component: {', '.join(component)})"
            )
    return cycles


def test_no_import_cycles_among_modules() -> None:
    cycles = cycles_of(*import_graph((AT_IMPORT,)))
    assert not cycles, "import cycles at import time:\n" + "\n".join(cycles)


def test_no_import_cycles_through_function_level_or_type_checking_imports() -> None:
    """A cycle that closes only through an import inside a function or under TYPE_CHECKING imports fine, but it
    is two modules that each need the other: one of them is in the wrong place (or is one class split in two)."""
    cycles = cycles_of(*import_graph((AT_IMPORT, IN_FUNCTION, TYPE_ONLY)))
    assert not cycles, "import cycles (any kind of import):\n" + "\n".join(cycles)


def engine_tier(module: str) -> int | None:
    """The index in ENGINE_TIERS of an engine module's tier: the tier naming it, else the one naming the closest
    package above it (``engine`` names the package's own __init__ only); None when none does."""
    for index, (_, names) in enumerate(ENGINE_TIERS):
        if module in names:
            return index
    owners = [
        (len(name), index)
        for index, (_, names) in enumerate(ENGINE_TIERS)
        for name in names
        if name != "engine" and module.startswith(name + ".")
    ]
    return max(owners)[1] if owners else None


def engine_modules() -> dict[str, Path]:
    return {module: path for module, path in modules().items() if module.split(".")[0] == "engine"}


def test_every_engine_module_has_its_tier() -> None:
    named = [name for _, names in ENGINE_TIERS for name in names]
    unknown = [name for name in named if name not in modules()]
    assert not unknown, f"ENGINE_TIERS names what is no module or package of engine/: {unknown}"
    assert len(named) == len(set(named)), "ENGINE_TIERS names a module twice"
    unplaced = [
        rel(path) for module, path in engine_modules().items() if engine_tier(module) is None
    ]
    assert not unplaced, "modules in no tier of ENGINE_TIERS (give each its tier):\n" + "\n".join(
        unplaced
    )


def test_no_upward_imports_between_engine_tiers() -> None:
    """Every import of every kind: at import time, inside a function, under TYPE_CHECKING."""
    offenders = []
    for module, path in engine_modules().items():
        rank = engine_tier(module)
        if rank is None:
            continue  # (test_every_engine_module_has_its_tier)
        for node, kind in imports_in(parse(path)):
            for name in imported(module, node):
                target = most_specific(name)
                above = engine_tier(target) if target is not None else None
                if above is not None and above > rank:
                    offenders.append(
                        f"{rel(path)}:{node.lineno}: {module} (tier {ENGINE_TIERS[rank][0]!r}) imports "
                        f"{target} (tier {ENGINE_TIERS[above][0]!r}) {kind}"
                    )
    assert not offenders, (
        "engine/'s tiers import only their own and those below them:\n" + "\n".join(offenders)
    )


def test_no_module_over_400_lines_in_engine_and_app() -> None:
    counts = {
        rel(p): len(p.read_text(encoding="utf-8").splitlines())
        for layer in SIZE_CHECKED
        for p in sorted((ROOT / layer).rglob("*.py"))
    }
    offenders = [f"{name}: {n} lines" for name, n in counts.items() if n > MAX_MODULE_LINES]
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(offenders)


def functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, nested ones included, with a qualified name (Class.method, f.inner)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def test_no_function_over_50_lines_on_the_hot_path() -> None:
    paths = sorted({p for pattern in HOT_PATH for p in ROOT.glob(pattern)})
    assert paths, f"no hot-path module found: {HOT_PATH}"
    offenders = []
    for path in paths:
        for name, node in functions(parse(path)):
            # from the `def` line: decorators are not counted
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                offenders.append(f"{rel(path)}:{name}: {length} lines")
    assert not offenders, f"hot-path functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
        offenders
    )


FORMATTED = ("engine", "app", "kernels", "tests", "benchmarks", "scripts")


def test_the_code_is_as_ruff_format_writes_it() -> None:
    """Every Python file is as `ruff format` writes it at pyproject.toml's line length (100): one style, and no
    review spent on it. Run `ruff format` to fix a failure."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff is not None, "ruff (a dev dependency) is not installed beside this Python"
    result = subprocess.run(
        [ruff, "format", "--check", *FORMATTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readmes_python_is_as_ruff_format_writes_it() -> None:
    """The README's Python examples too: readers copy them."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff is not None, "ruff (a dev dependency) is not installed beside this Python"
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README shows Python"
    for block in blocks:
        result = subprocess.run(
            [ruff, "format", "--check", "--stdin-filename", "README.py", "-"],
            cwd=ROOT,
            input=block,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, f"not as ruff format writes it:\n{block}"
