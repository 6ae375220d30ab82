"""The package layout's import rules, read from the source with ``ast`` (nothing is imported).

* No import cycle among ``valle`` modules: at module level (where a cycle breaks imports),
  nor through imports inside functions (where one hid drifted copies of a class).
* ``valle.codec`` owns audio <-> codes and imports nothing from ``valle.data`` (not even
  inside a function): the data package stores codes, the codec package makes them.
* ``valle.models`` and ``valle.train`` import with torch alone: no module of theirs reaches
  lhotse, phonemizer or encodec through module-level imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "valle"
HEAVY = ("lhotse", "phonemizer", "encodec")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _resolve_relative(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    base = importer.split(".")
    # In a package's __init__, level 1 is the package itself; in a plain module, its parent.
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
                   modules: dict[str, Path]) -> Iterator[str]:
    """Absolute names of the modules an import statement loads (``from pkg import sub``
    loads ``pkg.sub`` when that is a module)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    target = _resolve_relative(node, importer, is_package) if node.level else node.module or ""
    yield target
    for alias in node.names:
        if f"{target}.{alias.name}" in modules:
            yield f"{target}.{alias.name}"


def import_nodes(tree: ast.Module, module_level: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported (``module_level``: top level,
    including under ``if``/``try``, not in functions or classes), or all of them."""
    if not module_level:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack.extend(ast.iter_child_nodes(node))
        elif hasattr(ast, "TryStar") and isinstance(node, ast.TryStar):
            stack.extend(ast.iter_child_nodes(node))


def _with_parents(name: str, importer: str) -> Iterator[str]:
    """``a.b.c`` runs ``a`` and ``a.b`` first: those are imported too (except the importer's
    own packages, which are already running when it is)."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if not (importer == prefix or importer.startswith(prefix + ".")):
            yield prefix


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    """module -> the modules it imports (valle modules and top-level third-party names)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges: set[str] = set()
        for node in import_nodes(tree, module_level):
            for target in imported_names(node, name, path.name == "__init__.py", modules):
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    edges.update(t for t in _with_parents(target, name) if t in modules and t != name)
                elif target and target != "__future__":
                    edges.add(target.split(".")[0])
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every name ``start`` loads transitively -> the module that imports it (for messages)."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt not in seen:
                seen[nxt] = node
                todo.append(nxt)
    return seen


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# ------------------------------------------------------------------------------------ tests
def test_graph_sees_the_package():
    graph = import_graph()
    # Sanity: a broken walker would make every rule below pass vacuously.
    assert "valle.codec" in graph and "valle.data.datamodule" in graph and "valle.train.loop" in graph
    assert "torch" in graph["valle.models.valle"]
    assert "valle.codec.mel" in graph["valle.codec.mel_rvq"]
    assert "lhotse" in reachable(graph, "valle.data.sampling")  # the heavy-import rule can fire
    assert "valle.data.audio" not in graph  # the EnCodec tokenizer lives in valle.codec


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle)


def test_no_import_cycle_through_lazy_imports():
    """A circle closed by an import inside a function still ties two modules together (each
    needs the other), and such circles hid drifted copies of one class before: none either."""
    cycle = find_cycle(import_graph(module_level=False))
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle)


def test_codec_does_not_import_data():
    """Arrows go one way: valle.data may use valle.codec, never the reverse (function-level
    imports included: a lazy import is still a dependency)."""
    graph = import_graph(module_level=False)
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() if in_package(m, "valle.codec")
                   for t in targets if in_package(t, "valle.data"))
    assert not wrong, "valle.codec imports valle.data: " + ", ".join(wrong)


def test_models_and_train_import_with_torch_alone():
    graph = import_graph()
    wrong = []
    for module in sorted(graph):
        if not (in_package(module, "valle.models") or in_package(module, "valle.train")):
            continue
        loaded = reachable(graph, module)
        for heavy in HEAVY:
            if heavy in loaded:
                chain, node = [heavy], heavy
                while node != module:
                    node = loaded[node]
                    chain.append(node)
                wrong.append(" -> ".join(reversed(chain)))
    assert not wrong, "module-level imports of heavy packages:\n" + "\n".join(wrong)


def argparse_calls(path: Path) -> list[str]:
    """``file:line`` of each ``.add_argument(...)``/``.add_argument_group(...)`` call in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("add_argument", "add_argument_group")]


def test_argparse_calls_finds_them():
    assert argparse_calls(ROOT / "valle" / "config_flags.py")  # the one place that makes flags
    assert argparse_calls(ROOT / "valle" / "infer.py")  # its non-decoding flags


def test_trainer_options_are_declared_once_in_the_config_tree():
    """A training, model or data option is a field of TrainConfig, ModelConfig or DataConfig
    (docs/architecture.md, "The config tree"); their flags are generated by valle/config_flags.py,
    so no module of valle.train or valle.models, nor the data module, declares a flag by hand."""
    paths = [*sorted((ROOT / "valle" / "train").rglob("*.py")), *sorted((ROOT / "valle" / "models").rglob("*.py")),
             ROOT / "valle" / "data" / "datamodule.py"]
    wrong = [call for path in paths for call in argparse_calls(path)]
    assert not wrong, "flags declared by hand (declare a config field with flag() instead): " + ", ".join(wrong)


# ------------------------------------------------------------------------ the step's shape
MAX_CLASS_LINES = 350
RESILIENCE = ROOT / PACKAGE / "train" / "resilience"


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def test_no_class_has_too_many_jobs():
    """A class past a few hundred lines holds several jobs (the resilient step once held
    seven in 622 lines): split it by job instead of letting it grow."""
    long = sorted(f"{module}.{name}: {node.end_lineno - node.lineno + 1} lines"
                  for module, path in package_modules().items()
                  for name, node in _classes(path).items()
                  if node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES)
    assert not long, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(long)


def test_forward_backward_is_a_plain_function():
    tree = ast.parse((RESILIENCE / "forward_backward.py").read_text(encoding="utf-8"))
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"forward_backward", "forward_loss", "backward_loss"} <= functions
    assert not any(isinstance(n, ast.ClassDef) and n.name != "PassSettings" for n in tree.body)


def test_the_fault_injector_listens_to_the_phase_tracker_and_owns_no_phase_state():
    """Where the trainer is (phase, step, attempt, host work) has one home, the
    PhaseTracker; the injector only reads it, so normal runs do not depend on it."""
    injector = _classes(RESILIENCE / "faults.py")["FaultInjector"]
    methods = {n.name for n in injector.body if isinstance(n, ast.FunctionDef)}
    assert not methods & {"phase_scope", "host_work", "begin_attempt", "take_error_phase"}
    written = {t.attr for n in ast.walk(injector) if isinstance(n, (ast.Assign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
               if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
               and t.value.id == "self"}
    assert not written & {"phase", "step", "attempt", "_host_depth", "_error_phase"}
    tracker = _classes(RESILIENCE / "phases.py")["PhaseTracker"]
    assert {"phase_scope", "host_work", "begin_attempt", "subscribe"} <= {
        n.name for n in tracker.body if isinstance(n, ast.FunctionDef)}


def test_the_step_has_one_attempt_whatever_the_grad_sync():
    """The DDP/bucketed difference lives in the grad syncs (votes_before_backward), not in
    a second copy of the attempt chosen by a mode string."""
    step = _classes(RESILIENCE / "step.py")["ResilientStep"]
    methods = [n.name for n in step.body if isinstance(n, ast.FunctionDef)]
    assert methods.count("_attempt") == 1 and not any("ddp" in m for m in methods)
    assert "mode" not in {n.attr for n in ast.walk(step) if isinstance(n, ast.Attribute)}
