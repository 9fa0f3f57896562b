"""The package's shape, checked: no import cycle inside ampfx, no function body over 60 lines,
passes that name no op, a unit test file for every pass, a wheel that installs passes/ as ampfx.passes.

``python tests/test_architecture.py`` prints the figures (cycles, longest functions, imports
inside functions) instead of asserting them.
"""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ampfx": ROOT / "ampfx", "ampfx.passes": ROOT / "passes"}
MAX_BODY = 60
FX_KINDS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed package."""
    found = {}
    for package, folder in PACKAGES.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = f
    return found


def _imports(name: str, path: Path, known: dict[str, Path], inner_too: bool = False) -> tuple[set[str], int]:
    """Modules of ``known`` that ``name`` imports when it is imported (module level; with ``inner_too``,
    inside functions as well), and the number of import statements inside functions. Imports under
    ``if TYPE_CHECKING:`` never run and are left out."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    inner = 0

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = name.split(".") if is_package else name.split(".")[:-1]
        if node.level:
            base = base[:len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
        subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
        return subs if len(subs) == len(node.names) else [module, *subs]

    def visit(node: ast.AST, in_function: bool) -> None:
        nonlocal inner
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                inner += in_function
                if inner_too or not in_function:
                    edges.update(t for t in targets(child) if t in known and t != name)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return edges, inner


def package_of(name: str) -> str:
    """The package a module belongs to, for the cycle check between packages: its folder (``ampfx.runtime`` for
    ``ampfx.runtime.view``), the installed passes (``ampfx.passes``), or the module itself for a module at the
    top of ampfx (``ampfx.api``); ``ampfx`` for the package's ``__init__``."""
    parts = name.split(".")
    if name.startswith("ampfx.passes"):
        return "ampfx.passes"
    if len(parts) >= 2 and (PACKAGES["ampfx"] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return name


def import_cycles(inner_too: bool = False, packages: bool = False) -> list[list[str]]:
    """Strongly connected groups of more than one module in the module-level import graph (with
    ``inner_too``, the imports inside functions as well; with ``packages``, of the packages those modules are in
    (:func:`package_of`): a module of one importing a module of the other is an edge between the two)."""
    known = modules()
    graph = {name: _imports(name, path, known, inner_too)[0] for name, path in known.items()}
    if packages:
        merged: dict[str, set[str]] = {}
        for name, edges in graph.items():
            merged.setdefault(package_of(name), set()).update(package_of(e) for e in edges)
        graph = {name: edges - {name} for name, edges in merged.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            connect(v)
    return groups


def function_bodies() -> list[tuple[int, str]]:
    """(lines, qualified name) of every function, docstring excluded, longest first."""
    out = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    body = body[1:]
                if body:
                    out.append((body[-1].end_lineno - body[0].lineno + 1, f"{name}.{node.name}"))
    return sorted(out, reverse=True)


def string_comparisons(source: str, filename: str = "<source>") -> list[str]:
    """Comparisons (==, !=, in, not in) of anything with a string literal that is not an fx
    node kind; comparisons of padding modes, dict keys and devices are allowed."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for op, right in zip(node.ops, node.comparators):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            consts = [right] if isinstance(right, ast.Constant) else list(getattr(right, "elts", []))
            words = [c.value for c in consts if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            left = ast.unparse(node.left)
            if any(w not in FX_KINDS for w in words) and not re.fullmatch(r"mode|k|key|[\w.]*device(\.type)?", left):
                hits.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return hits


def op_name_comparisons() -> list[str]:
    """:func:`string_comparisons` over every pass."""
    return [hit for path in sorted(PACKAGES["ampfx.passes"].glob("*.py"))
            for hit in string_comparisons(path.read_text(), path.name)]


def test_no_import_cycle_inside_ampfx():
    """Module-level imports of ampfx and ampfx.passes form no cycle."""
    assert import_cycles() == []


def test_no_import_cycle_even_through_imports_inside_functions():
    """An import inside a function is not a way around a cycle: with them, the graph has none either."""
    assert import_cycles(inner_too=True) == []


def test_no_import_cycle_between_packages():
    """Between packages (runtime, passes, ops, policy, capture, report, tools, ui, integrations, and each module at
    the top of ampfx on its own), imports run one way, also through imports inside functions."""
    assert import_cycles(inner_too=True, packages=True) == []


def test_the_package_cycle_check_sees_one(tmp_path, monkeypatch):
    """Two folders whose modules import each other's (no module cycle) are a cycle between packages."""
    root = tmp_path / "ampfx"
    for folder in ("low", "high"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("from ..high import b\n")
    (root / "high" / "b.py").write_text("")
    (root / "high" / "c.py").write_text("def f():\n    from ..low import d\n")
    (root / "low" / "d.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", {"ampfx": root})
    assert import_cycles(inner_too=True) == []
    assert import_cycles(inner_too=True, packages=True) == [["ampfx.high", "ampfx.low"]]


def test_the_cycle_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    """Two modules importing each other, one of them inside a function, are a cycle for the check with
    ``inner_too`` and none without it."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setitem(PACKAGES, "pkg", tmp_path / "pkg")
    assert ["pkg.a", "pkg.b"] in import_cycles(inner_too=True)
    assert ["pkg.a", "pkg.b"] not in import_cycles()


def error_classes_elsewhere() -> list[str]:
    """Exception classes (``Exception`` subclasses) defined in a module other than ``ampfx.errors``."""
    found = []
    for name, path in modules().items():
        if name == "ampfx.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(  # BaseException: a control-flow signal, not an error
                    re.search(r"(Error|Exception|Untraceable|Unfaithful|Failed)$", ast.unparse(b))
                    and ast.unparse(b) != "BaseException" for b in node.bases):
                found.append(f"{name}.{node.name}")
    return found


def test_every_error_class_is_in_errors_py():
    """Every exception class of ampfx is defined in ampfx/errors.py (control-flow signals deriving from
    BaseException, which no user sees, aside); errors.py imports nothing of ampfx."""
    assert error_classes_elsewhere() == []
    import ampfx.errors

    raised = [v for v in vars(ampfx.errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(raised) >= 10 and all(c.__module__ == "ampfx.errors" for c in raised)
    assert _imports("ampfx.errors", modules()["ampfx.errors"], modules(), inner_too=True)[0] == set()


def unplaced_modules() -> list[str]:
    """Modules of the package that docs/architecture.md does not name (as ``ampfx/x.py``, ``passes/x.py``,
    or a folder ``ampfx/x/`` that names each of its modules)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for name, path in modules().items():
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and (rel in text or rel.rsplit("/", 1)[0] + "/" in text):
            continue
        if rel not in text and f"`{rel.rsplit('/', 1)[-1]}`" not in text:
            missing.append(rel)
    return missing




FORBIDDEN = {  # importer prefix -> imported prefixes it must not import (docs/architecture.md; "ampfx.runtime." bans
# the run-time modules but not ampfx.runtime itself, the helpers the tables and generated code name)
    "ampfx.passes": ("ampfx.capture", "ampfx.tree", "ampfx.rewrite", "ampfx.api", "ampfx.ui"),
    "ampfx.libraries": ("ampfx.passes", "ampfx.capture", "ampfx.tree", "ampfx.rewrite", "ampfx.api", "ampfx.ui",
                        "ampfx.integrations"),
    "ampfx.ops": ("ampfx.libraries", "ampfx.integrations", "ampfx.passes", "ampfx.capture", "ampfx.runtime",
                  "ampfx.tree", "ampfx.rewrite", "ampfx.api", "ampfx.tools", "ampfx.ui"),
    "ampfx.policy": ("ampfx.passes", "ampfx.capture", "ampfx.runtime.", "ampfx.tree", "ampfx.rewrite", "ampfx.api",
                     "ampfx.tools", "ampfx.ui"),
    "ampfx.report": ("ampfx.passes", "ampfx.capture", "ampfx.tree", "ampfx.rewrite", "ampfx.api", "ampfx.tools",
                     "ampfx.ui"),
    "ampfx.capture": ("ampfx.passes", "ampfx.tree", "ampfx.rewrite", "ampfx.api", "ampfx.ui"),
    "ampfx.runtime": ("ampfx.tree", "ampfx.rewrite", "ampfx.api", "ampfx.tools", "ampfx.ui"),
    "ampfx.integrations.fsdp": ("ampfx.passes", "ampfx.capture", "ampfx.tree", "ampfx.rewrite", "ampfx.api",
                                "ampfx.tools", "ampfx.ui"),
}


def layer_violations() -> list[str]:
    """Module-level imports that cross the layers of docs/architecture.md, and any import of the UI
    from outside it (``python -m ampfx`` aside)."""
    known = modules()
    bad = []
    for name, path in known.items():
        edges = _imports(name, path, known)[0]
        for importer, banned in FORBIDDEN.items():
            if name == importer or name.startswith(importer + "."):
                bad += [f"{name} imports {e}" for e in edges if e.startswith(banned)]
        if not name.startswith(("ampfx.ui", "ampfx.__main__")):
            bad += [f"{name} imports {e}" for e in edges if e.startswith("ampfx.ui")]
    return sorted(bad)


TRAINERS = ("ampfx.integrations.lazy", "ampfx.integrations.lightning", "ampfx.integrations.accelerate",
            "ampfx.integrations.hf")
"""The trainer integrations: above the public API (they call ampfx.convert), imported only by one another."""
TRAINER_LIBRARIES = ("pytorch_lightning", "lightning", "lightning_fabric", "accelerate", "transformers")


def trainer_violations() -> list[str]:
    """Imports of a trainer integration from the rest of ampfx, of a trainer library from the rest of ampfx,
    and of pass or capture internals from a trainer integration."""
    known = modules()
    bad = []
    for name, path in known.items():
        edges = _imports(name, path, known)[0]
        libraries = {a.name.split(".")[0] for n in ast.walk(ast.parse(path.read_text()))
                     if isinstance(n, ast.Import) for a in n.names}
        libraries |= {n.module.split(".")[0] for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        if name in TRAINERS:
            bad += [f"{name} imports {e}" for e in edges if e.startswith(("ampfx.passes", "ampfx.capture", "ampfx.tree",
                                                                         "ampfx.rewrite", "ampfx.ui"))]
        else:
            bad += [f"{name} imports {e}" for e in edges if e in TRAINERS]
            bad += [f"{name} imports {lib}" for lib in sorted(libraries & set(TRAINER_LIBRARIES))]
    return sorted(bad)


def test_trainer_integrations_sit_above_the_core():
    """No core module imports a trainer integration or a trainer library (even inside a function); the
    integrations use the public API, no pass or capture internals."""
    assert trainer_violations() == []


def test_every_module_is_placed_in_the_architecture_page():
    """docs/architecture.md names every module of ampfx and ampfx.passes."""
    assert unplaced_modules() == []


def test_layers_import_only_what_they_may():
    """Passes import no capture or stage module, other libraries' plugins no pass (nor a trainer integration), the
    vocabulary (ops, policy, report) no stage, tool or run-time module (the op tables not even the runtime's
    helpers), the run time no stage or tool, nothing the UI."""
    assert layer_violations() == []


MAX_PARAMS = 8
PUBLIC_OPTIONS = {("ampfx/api.py", "convert"), ("ampfx/ops/registration.py", "register_op"),
                  ("ampfx/tools/compare.py", "compare"), ("ampfx/tools/tune.py", "tune")}
"""Public entry points whose keyword options are the user's spelling (``convert(model, dtype, tracer=...,
**options)``): their options stay keywords of their own."""


def long_signatures() -> list[str]:
    """Functions of ampfx and ampfx.passes with more than :data:`MAX_PARAMS` parameters (``self``/``cls`` not
    counted, ``*args`` and ``**kwargs`` one each), the public entry points aside."""
    hits = []
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) not in PUBLIC_OPTIONS:
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
                count = len(names) + bool(a.vararg) + bool(a.kwarg)
                if count > MAX_PARAMS:
                    hits.append(f"{rel}:{node.lineno} {node.name}: {count} parameters")
    return hits


def test_no_function_takes_more_than_eight_parameters():
    """What belongs together travels as one record (where a graph sits: ``Place``; what a caller asked:
    ``Asked``; what a capture keeps whole: ``Bounds``), not as a row of arguments unpacked and packed again."""
    assert long_signatures() == []


def test_no_function_body_over_60_lines():
    """Every function body (docstring aside) is at most 60 lines."""
    long = [(n, f) for n, f in function_bodies() if n > MAX_BODY]
    assert long == []


def test_passes_compare_no_op_names():
    """Passes test properties of the op tables, never an op's name."""
    assert op_name_comparisons() == []


def test_the_op_name_check_sees_names_and_rules_written_as_strings():
    """The check above finds the comparisons it forbids, and lets fx node kinds and modes pass."""
    source = ("d.op == 'linear'\nname in ('setitem', 'iadd')\nd.rule != 'select'\n"
              "node.op == 'call_function'\nmode == 'never'\nd.kind in ('placeholder', 'get_attr')\n")
    assert [h.split(": ", 1)[1] for h in string_comparisons(source)] == [
        "d.op == 'linear'", "name in ('setitem', 'iadd')", "d.rule != 'select'"]


def pass_order_violations() -> list[str]:
    """Imports (also inside functions) of a pass module by a module that runs before it, or by a module that runs no
    step at all (the shared helpers: ``nodes``, ``cast_model``, ``context``, ``fidelity``), in the order of
    ``ANALYSES``, ``PIPELINE``, ``COUNTS``, ``LOWERING``: a step reads what earlier steps decided, never a later
    step's code."""
    from ampfx.passes import ANALYSES, COUNTS, LOWERING, PIPELINE

    steps = [fn for _, fn in ANALYSES] + list(PIPELINE) + [fn for _, fn in COUNTS] + [fn for _, fn in LOWERING]
    position: dict[str, int] = {}
    for i, fn in enumerate(steps):
        position.setdefault(fn.__module__, i)
    known = modules()
    bad = []
    for name, path in known.items():
        if not name.startswith("ampfx.passes.") or name == "ampfx.passes":
            continue
        mine = position.get(name, -1)  # a helper runs no step: it may import no step's module
        for edge in _imports(name, path, known, inner_too=True)[0]:
            theirs = position.get(edge)
            if theirs is not None and theirs > mine:
                bad.append(f"{name} imports {edge}, a later step" if mine >= 0 else
                           f"{name} (a helper) imports {edge}, a step")
    return sorted(bad)


def test_no_pass_imports_a_later_pass():
    """Passes import the passes before them, the node facts (``passes/nodes.py``) and the cast model
    (``passes/cast_model.py``), never a later pass; the helpers import no pass."""
    assert pass_order_violations() == []


def test_the_pass_order_check_sees_a_pass_importing_a_later_one(monkeypatch):
    """The check is not vacuous: ``unpack`` (step 2) importing ``classify`` (step 4) is reported."""
    real = _imports

    def with_one_more(name, path, known, inner_too=False):
        edges, inner = real(name, path, known, inner_too)
        return (edges | {"ampfx.passes.classify"} if name == "ampfx.passes.unpack" else edges), inner

    monkeypatch.setitem(globals(), "_imports", with_one_more)
    assert pass_order_violations() == ["ampfx.passes.unpack imports ampfx.passes.classify, a later step"]


def test_every_pass_has_a_unit_test_file():
    """Each pass in PIPELINE (and shape propagation) has tests/passes/test_<pass>.py whose code names
    the pass function itself (``paint.paint``, ``casts.insert_casts``, ...), not only through convert."""
    from ampfx.passes import PIPELINE, shapes

    for fn in [*PIPELINE, shapes.propagate]:
        module = fn.__module__.rsplit(".", 1)[1]
        test = ROOT / "tests" / "passes" / f"test_{module}.py"
        assert test.exists(), f"no unit tests for the {module} pass"
        used = {ast.unparse(n) for n in ast.walk(ast.parse(test.read_text())) if isinstance(n, ast.Attribute)}
        assert f"{module}.{fn.__name__}" in used, f"{test.name} never names {module}.{fn.__name__}"


def test_the_core_imports_no_user_interface_or_integration_library():
    """``import ampfx`` loads no UI module (rich is imported only when a table is printed), no DGL, and no trainer
    integration or library."""
    code = ("import sys, ampfx; bad = [m for m in sys.modules if m.startswith('ampfx.ui') or m.split('.')[0] in "
            f"{('dgl', *TRAINER_LIBRARIES)!r} or m in {TRAINERS!r}]; sys.exit(', '.join(bad) or None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_wheel_installs_passes_as_ampfx_passes(tmp_path):
    """A built wheel holds ampfx/passes/*.py (from the top-level passes/ folder) and no top-level passes package."""
    source = tmp_path / "src"  # a copy: building in place would leave build/ and *.egg-info in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "dist", "*.egg-info",
                                                                "__pycache__", ".pytest_cache"))
    offline = ["--no-build-isolation"] if _setuptools_at_least(77) else []  # else pip fetches setuptools>=77
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *offline, "-w", str(tmp_path),
                           str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("ampfx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ampfx/passes/paint.py" in names and "ampfx/passes/__init__.py" in names
    assert "ampfx/ui/cli.py" in names and "ampfx/capture/ladder.py" in names
    assert not any(n.startswith("passes/") for n in names)


def _setuptools_at_least(major: int) -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= major


def test_pyproject_lists_every_package():
    """pyproject.toml names its packages one by one (passes/ is mapped in): a new subpackage must be added there."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == listed


if __name__ == "__main__":
    cycles = import_cycles()
    bodies = function_bodies()
    inner = sum(_imports(n, p, modules())[1] for n, p in modules().items())
    print(f"modules: {len(modules())}")
    print(f"import cycles: {len(cycles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in cycles))
    inner_cycles = import_cycles(inner_too=True)
    print(f"import cycles through imports inside functions: {len(inner_cycles)}"
          + "".join(f"\n  {' <-> '.join(c)}" for c in inner_cycles))
    print(f"modules docs/architecture.md does not place: {unplaced_modules()}")
    print(f"error classes outside errors.py: {error_classes_elsewhere()}")
    print(f"imports inside functions: {inner}")
    print(f"functions over {MAX_BODY} lines: {sum(n > MAX_BODY for n, _ in bodies)}; longest:")
    for n, f in bodies[:8]:
        print(f"  {n:4d}  {f}")
    hits = op_name_comparisons()
    print(f"op-name comparisons in passes: {len(hits)}" + "".join(f"\n  {h}" for h in hits))


def test_the_dgl_plugins_old_name_is_the_same_module():
    """ampfx.integrations.dgl, the DGL plugin's name before it moved to ampfx.libraries (saved converted modules
    name its runner there), is the same module object: nothing computes twice, nothing differs."""
    import ampfx.integrations.dgl
    import ampfx.libraries.dgl

    assert ampfx.integrations.dgl is ampfx.libraries.dgl
    assert ampfx.integrations.dgl.call_dgl_low is ampfx.libraries.dgl.call_dgl_low


PARAMETER_READS = "ampfx.runtime.reads"
"""The one module that scans a converted graph for the dtypes its parameters are read in."""


def parameter_scanners(found: dict[str, Path] | None = None) -> list[str]:
    """Functions of the runtime and the integrations, :data:`PARAMETER_READS` aside, that scan a graph's ``get_attr``
    nodes for the casts or low module calls that read them (a second answer to "which parameters does this graph
    read low")."""
    bad = []
    for name, path in (found or modules()).items():
        if not name.startswith(("ampfx.runtime", "ampfx.integrations")) or name == PARAMETER_READS:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            strings = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant)}
            names = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)} | \
                {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
            if "get_attr" in strings and names & {"cast", "cast_pad", "call_module_low"} and \
                    any(isinstance(n, ast.Attribute) and n.attr == "users" for n in ast.walk(fn)):
                bad.append(f"{name}.{fn.name}")
    return bad


def test_no_module_but_one_scans_a_graph_for_the_dtypes_its_parameters_are_read_in():
    """Rule: the weight cache, inference copies and FSDP2's gather dtype ask ampfx.runtime.reads, which scans the
    graph once per question; none scans it itself."""
    assert parameter_scanners() == []


def test_the_parameter_scan_check_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def low(gm, runtime):\n    return [n for n in gm.graph.nodes if n.op == 'get_attr'\n"
                   "            and any(u.target is runtime.cast for u in n.users)]\n")
    assert parameter_scanners({"ampfx.runtime.bad": bad}) == ["ampfx.runtime.bad.low"]


WEIGHT_COPIES = "ampfx.runtime.weight_cache"
"""The one store of weight copies kept across calls (training mode's cache, ``mode="inference"``'s copies): the one
module that stamps a weight to know when its copy must be made again."""

STAMPS_NO_COPY = {"ampfx.runtime.fixed"}
"""Modules that stamp a tensor to see it written without keeping a copy of it (the check of what a graph fixed)."""


def copy_keepers(found: dict[str, Path] | None = None) -> list[str]:
    """Functions outside :data:`WEIGHT_COPIES` (and :data:`STAMPS_NO_COPY`) that stamp a tensor with
    :func:`ampfx.runtime.written.stamp`: a second place keeping weight copies across calls."""
    bad = []
    for name, path in (found or modules()).items():
        if name == WEIGHT_COPIES or name in STAMPS_NO_COPY or name == "ampfx.runtime.written":
            continue
        tree = ast.parse(path.read_text())
        bare = any(isinstance(n, ast.ImportFrom) and (n.module or "").endswith("written")
                   and any(a.name == "stamp" for a in n.names) for n in ast.walk(tree))

        def stamps(n: ast.AST) -> bool:
            f = getattr(n, "func", None)
            return isinstance(n, ast.Call) and (
                (isinstance(f, ast.Attribute) and f.attr == "stamp" and getattr(f.value, "id", None) == "written")
                or (bare and isinstance(f, ast.Name) and f.id == "stamp"))

        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(stamps, ast.walk(fn))):
                bad.append(f"{name}.{fn.name}")
    return bad


def test_weight_copies_are_kept_in_one_place():
    """Rule: training mode's weight cache and mode="inference"'s copies are one store
    (:class:`ampfx.runtime.weight_cache.WeightCache`, read through casts or from attributes): no other module
    stamps a weight to keep a copy of it."""
    import torch

    import ampfx
    from ampfx.runtime.weight_cache import WeightCache

    assert copy_keepers() == []
    m, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    for mode, reads_copies in (("train", False), ("inference", True)):
        rt = ampfx.convert(m, "bf16", example_inputs=(x,), gemm_min_flops=0, weight_cache=True, mode=mode)._rt
        assert type(rt.weights) is WeightCache and rt.weights.reads_copies is reads_copies


def test_the_copy_keeper_check_sees_a_second_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ampfx.runtime.written import stamp\n\ndef keep(p, copies):\n"
                   "    copies[id(p)] = (p.to(dtype=copies.low), stamp(p))\n")
    assert copy_keepers({"ampfx.runtime.bad": bad}) == ["ampfx.runtime.bad.keep"]


ARMING = "ampfx.runtime.arming"
"""The one module that writes a converted graph module's runtime state at conversion (its function ``arm``)."""

RUNTIME_OWN = ("ampfx.runtime.entries", "Runtime")
"""The runtime's own methods, which change its state as calls ask (an entry made, a structure change heard)."""


def _runtime_like(node: ast.AST, aliases: set[str] = frozenset()) -> bool:
    """Does ``node`` name a runtime state: ``rt`` (or a local name bound to one), ``<x>._rt``, ``runtime_of(<x>)``,
    ``<x>.__dict__["_ampfx_runtime"]``, ``vars(<one of those>)``, ``<one of those>.__dict__``?"""
    if isinstance(node, ast.Name):
        return node.id == "rt" or node.id in aliases
    if isinstance(node, ast.Attribute):
        return node.attr == "_rt" or node.attr == "__dict__" and _runtime_like(node.value, aliases)
    if isinstance(node, ast.Call):
        called = getattr(node.func, "id", getattr(node.func, "attr", None))
        return called == "runtime_of" or called == "vars" and bool(node.args) and _runtime_like(node.args[0], aliases)
    return isinstance(node, ast.Subscript) and (
        isinstance(node.slice, ast.Constant) and node.slice.value == "_ampfx_runtime" or _runtime_like(node.value, aliases))


def _aliases(fn: ast.AST) -> set[str]:
    """Local names ``fn`` binds to a runtime state (``state = gm._rt``), to a fixed point."""
    found: set[str] = set()
    while True:
        more = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and _runtime_like(node.value, found)
                for t in node.targets if isinstance(t, ast.Name)} - found
        if not more:
            return found
        found |= more


def _writes(node: ast.AST, fields: set[str], aliases: set[str]) -> list[str]:
    """What ``node`` writes of a runtime state (or of a mirror's armed check), in words."""
    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    out = []
    for t in targets:
        for one in (t.elts if isinstance(t, ast.Tuple) else [t]):
            if isinstance(one, ast.Attribute) and (one.attr in fields and _runtime_like(one.value, aliases)
                                                   or one.attr == "_ampfx_check"):
                out.append(f"{ast.unparse(one)} {'deleted' if isinstance(node, ast.Delete) else '='}")
            elif isinstance(one, ast.Subscript) and _runtime_like(one.value, aliases) and not (
                    isinstance(one.slice, ast.Constant) and one.slice.value == "_ampfx_runtime"):
                out.append(f"{ast.unparse(one)} =")
    if isinstance(node, ast.Call):
        called = getattr(node.func, "id", getattr(node.func, "attr", ""))
        first = node.args[0] if node.args else None
        if called == "setattr" and first is not None and _runtime_like(first, aliases) or \
                called == "__setattr__" and (first is not None and _runtime_like(first, aliases) or len(node.args) > 1
                                             and isinstance(node.args[1], ast.Constant)
                                             and node.args[1].value == "_ampfx_check") or \
                called == "update" and isinstance(node.func, ast.Attribute) and _runtime_like(node.func.value, aliases) \
                or called.startswith("set_") and called[4:] in {*fields, "step", "mode_graph"}:
            out.append(ast.unparse(node))
    return out


def runtime_writers(found: dict[str, Path] | None = None) -> list[str]:
    """Code of ``ampfx`` but :data:`ARMING`'s and the runtime's own methods (:data:`RUNTIME_OWN`) that writes a
    field of a graph module's runtime state (``rt.guard = ...``, ``state = gm._rt; state.alt = ...``, ``del rt.fixed``,
    ``setattr(rt, ...)``, ``object.__setattr__(rt, ...)``, ``vars(rt).update(...)``, ``rt.__dict__[...] = ...``),
    arms a mirror's check (``_ampfx_check``) or calls a setter of one (``gm.set_step(...)``): a second place that
    arms a graph module. Module-level code counts as a function named ``<module>``."""
    from ampfx.runtime.entries import Runtime

    fields = {f for f in Runtime.__dataclass_fields__}
    bad = []
    for name, path in (found or modules()).items():
        if name == ARMING:
            continue
        tree = ast.parse(path.read_text())
        own = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and (name, c.name) == RUNTIME_OWN
               for n in ast.walk(c)}
        scopes = [fn for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                  and id(fn) not in own]
        inner = {id(n) for fn in scopes for n in ast.walk(fn)}
        module_level = ast.Module(body=[n for n in tree.body if id(n) not in inner and id(n) not in own
                                        and not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))],
                                  type_ignores=[])
        for fn in [*scopes, module_level]:
            label = getattr(fn, "name", "<lambda>" if isinstance(fn, ast.Lambda) else "<module>")
            aliases = _aliases(fn)
            for node in ast.walk(fn):
                if fn is not module_level or id(node) not in inner:
                    bad += [f"{name}.{label}: {w}" for w in _writes(node, fields, aliases)]
    return sorted(set(bad))


def test_runtime_state_is_written_only_by_the_arming_function():
    """Rule: conversion leaves each graph module its frozen plan and writes nothing a call reads; ``arm`` (in
    ampfx.runtime.arming) arms it, and afterwards only the runtime's own methods change its state."""
    assert runtime_writers() == []


def test_the_runtime_writer_check_sees_a_second_writer(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def guard(gm, g):\n    gm._rt.guard = g\n\n"
                   "def step(gm, rt, c):\n    rt.weights, x = c, 1\n    setattr(rt, 'low', c)\n    gm.set_step('low', c)\n\n"
                   "def alias(gm, c):\n    state = gm._rt\n    other = state\n    other.alt = c\n    del state.fixed\n"
                   "    object.__setattr__(state, 'check', c)\n    vars(gm._rt).update(low=c)\n"
                   "    gm._rt.__dict__['guard'] = c\n\n"
                   "def mirror(m, c):\n    object.__setattr__(m, '_ampfx_check', c)\n\n"
                   "fn = lambda gm: setattr(gm._rt, 'low', None)\n"
                   "class Runtime:\n    def mine(self, gm):\n        gm._rt.alt = None\n")
    assert runtime_writers({"ampfx.runtime.bad": bad}) == sorted([
        "ampfx.runtime.bad.<lambda>: setattr(gm._rt, 'low', None)",
        "ampfx.runtime.bad.alias: state.fixed deleted",
        "ampfx.runtime.bad.alias: gm._rt.__dict__['guard'] =",
        "ampfx.runtime.bad.alias: object.__setattr__(state, 'check', c)",
        "ampfx.runtime.bad.alias: other.alt =",
        "ampfx.runtime.bad.alias: vars(gm._rt).update(low=c)",
        "ampfx.runtime.bad.guard: gm._rt.guard =", "ampfx.runtime.bad.mine: gm._rt.alt =",
        "ampfx.runtime.bad.mirror: object.__setattr__(m, '_ampfx_check', c)",
        "ampfx.runtime.bad.step: gm.set_step('low', c)", "ampfx.runtime.bad.step: rt.weights =",
        "ampfx.runtime.bad.step: setattr(rt, 'low', c)"])


def callers(function: str, found: dict[str, Path] | None = None) -> list[str]:
    """Modules of ``ampfx`` whose code calls a function named ``function`` (``f(...)`` or ``<x>.f(...)``)."""
    out = []
    for name, path in (found or modules()).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == function:
                out.append(name)
                break
    return sorted(out)


def test_only_the_planner_scans_a_graph_for_its_parameter_reads():
    """Rule: the planner (ampfx.rewrite) scans each finished graph once, into its plan's table; everything else
    reads the table (ampfx.runtime.reads.reads scans only a graph module pickled before plans held one)."""
    assert callers("scan") == ["ampfx.rewrite", "ampfx.runtime.reads"]


def test_the_compile_backend_plans_and_does_not_convert():
    """Rule: the torch.compile backend takes the compiler half (ampfx.plan): it arms nothing it would discard."""
    assert "ampfx.integrations.dynamo" not in callers("convert") + callers("convert_request")
    assert "ampfx.integrations.dynamo" in callers("plan") + callers("_plan")


def test_the_caller_check_sees_a_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(api, gm):\n    return api.convert(gm)\n")
    assert callers("convert", {"ampfx.integrations.dynamo": bad}) == ["ampfx.integrations.dynamo"]
