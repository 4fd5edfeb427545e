"""The package's shape: every folder of modules is a package, imports flow one way (cli -> stages / runtime ->
specs, checkpoint, backends, files), there is no import cycle (module level or inside functions), and the CLI
imports no heavy library until a command runs."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fluxtrt"

# Lower layers never import higher ones. A module not listed fails the test (place it when adding it).
LAYERS = {
    0: ["fluxtrt", "fluxtrt.errors", "fluxtrt.fileio", "fluxtrt.dtypes"],
    1: ["fluxtrt.precisions", "fluxtrt.nvfp4", "fluxtrt.fp8", "fluxtrt.fp8_layers", "fluxtrt.attention",
        "fluxtrt.kernels", "fluxtrt.wrappers",
        "fluxtrt.stepcache", "fluxtrt.flux_math", "fluxtrt.components",
        "fluxtrt.checkpoint", "fluxtrt.onnxio", "fluxtrt.records", "fluxtrt.gpus", "fluxtrt.data"],
    # what the build and the runtime both stand on: backends, refit, ONNX Runtime sessions, weight maps, workflows
    2: ["fluxtrt.core"],
    3: ["fluxtrt.models", "fluxtrt.compare"],
    4: ["fluxtrt.export", "fluxtrt.optimize", "fluxtrt.quantize", "fluxtrt.engine"],
    5: ["fluxtrt.stages"],
    6: ["fluxtrt.runtime"],
    7: ["fluxtrt.bench", "fluxtrt.validate", "fluxtrt.artifacts", "fluxtrt.api", "fluxtrt.render", "fluxtrt.serving",
        "fluxtrt.dropin"],
    8: ["fluxtrt.cli"],
}
# The runtime runs engines and ONNX; it never reaches into the tools that make them (it shares fluxtrt.core with
# them). The build stages never reach into the runtime.
BUILD_TOOLS = ("fluxtrt.export", "fluxtrt.optimize", "fluxtrt.quantize", "fluxtrt.engine", "fluxtrt.compare",
               "fluxtrt.stages")
FORBIDDEN = [("fluxtrt.runtime", p) for p in BUILD_TOOLS] + [(p, "fluxtrt.runtime") for p in BUILD_TOOLS]
# The server is a front end beside the CLI's facade: request limits come from core.limits, defaults from the
# workflow registry, not from api.
FORBIDDEN += [("fluxtrt.serving", "fluxtrt.api")]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """fluxtrt modules that `name` imports, anywhere in the file (functions included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t.startswith("fluxtrt") and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = all_modules()
    return {n: imports_of(n, p, mods) for n, p in mods.items()}


def layer_of(name: str) -> int:
    best = None
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (layer, p)
    assert best is not None, f"{name} is in no layer of tests/test_imports.py: place it"
    return best[0]


def test_every_module_folder_is_a_package():
    for folder in {p.parent for p in ROOT.rglob("*.py")}:
        assert (folder / "__init__.py").exists(), f"{folder} has modules but no __init__.py"


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    assert len(g) > 40  # the walk saw the whole package


def test_imports_flow_down_the_layers():
    bad = []
    for n, deps in graph().items():
        for d in deps:
            if layer_of(d) > layer_of(n):
                bad.append(f"{n} (layer {layer_of(n)}) imports {d} (layer {layer_of(d)})")
            for a, b in FORBIDDEN:
                if (n == a or n.startswith(a + ".")) and (d == b or d.startswith(b + ".")):
                    bad.append(f"{n} imports {d}")
    assert not bad, "\n".join(sorted(bad))


def test_build_and_runtime_stand_on_the_shared_layer():
    """Backends, refit, ONNX Runtime sessions, weight maps and the workflow registry live in fluxtrt.core, and
    both sides use it from there (none of them is reached among the build's stages)."""
    g = graph()

    def uses(prefix):
        return {d for n, deps in g.items() if n == prefix or n.startswith(prefix + ".") for d in deps}

    shared = {"fluxtrt.core.backends", "fluxtrt.core.refit", "fluxtrt.core.sessions", "fluxtrt.core.weightmap",
              "fluxtrt.core.workflows"}
    assert shared <= set(g)
    assert {"fluxtrt.core.backends", "fluxtrt.core.refit", "fluxtrt.core.sessions", "fluxtrt.core.weightmap",
            "fluxtrt.core.workflows"} <= uses("fluxtrt.runtime")
    assert {"fluxtrt.core.backends", "fluxtrt.core.weightmap", "fluxtrt.core.workflows"} <= uses("fluxtrt.stages")
    assert not any(d.startswith(("fluxtrt.runtime", "fluxtrt.stages")) for d in uses("fluxtrt.core"))


def test_the_walk_sees_function_level_imports(tmp_path):
    """The checker itself: an import inside a function body counts as an edge."""
    mods = all_modules()
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from .records import read_manifest\n    from .. import fluxtrt\n")
    assert "fluxtrt.records" in imports_of("fluxtrt.x", f, mods)


def test_cli_import_is_light():
    code = ("import sys, fluxtrt.cli; heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt_rtx', 'numpy',"
            " 'diffusers', 'transformers') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import fluxtrt.cli pulled in {out}"


def test_cli_functions_are_short():
    """The CLI parses options, calls the library once and renders: no function there reaches 45 lines."""
    tree = ast.parse((ROOT / "cli.py").read_text())
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert max(lengths.values()) < 45, sorted(lengths.items(), key=lambda kv: -kv[1])[:3]


def test_long_signatures_are_keyword_only():
    """A function with more than five parameters makes the rest keyword-only (adjacent flags cannot be swapped
    by position); torch modules' forward (called with the spec's inputs in order), the CLI's typer commands and
    Triton kernels (`@triton.jit`: launched with their arguments in order) are the exceptions."""
    bad = []
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "forward" \
                    and name != "fluxtrt.cli" and "triton.jit" not in map(ast.unparse, node.decorator_list):
                args = node.args.posonlyargs + node.args.args
                n = len(args) - (1 if args and args[0].arg in ("self", "cls") else 0)
                if n > 5 and not node.args.vararg:
                    bad.append(f"{name}.{node.name} ({n} positional)")
    assert not bad, bad


def _fluxtrt_callables() -> set:
    """Names of fluxtrt's functions and classes, records (dataclasses, named tuples) included."""
    return {node.name for path in all_modules().values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_no_call_passes_more_than_five_positional_arguments_to_fluxtrt():
    """A record is built with keywords and a call passes at most five arguments by position: a field added or
    reordered cannot shift the others silently."""
    defs = _fluxtrt_callables()
    bad = []
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and len(node.args) > 5:
                fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if fn in defs and fn != "forward" and not any(isinstance(a, ast.Starred) for a in node.args):
                    bad.append(f"{name}:{node.lineno} {fn}(... {len(node.args)} positional)")
    assert not bad, bad


def test_every_error_class_lives_in_errors_py():
    bad = []
    for name, path in all_modules().items():
        if name == "fluxtrt.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "BadRequest"))
                    or getattr(b, "id", "") in ("QueueFull", "ShuttingDown") for b in node.bases):
                bad.append(f"{name}.{node.name}")
    assert not bad, bad


def test_api_functions_say_what_they_take_return_and_raise():
    import fluxtrt.api as api_module

    tree = ast.parse(Path(api_module.__file__).read_text())
    missing = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
               and not all(w in (ast.get_docstring(n) or "") for w in ("Args", "Returns", "Raises"))]
    assert not missing, missing


# Suites that cross modules by design; every other test file is named after the module or package it tests.
CROSS_CUTTING = {
    "test_imports": "the package's shape (this file)",
    "test_untrusted": "every kind of untrusted input, fuzzed",
    "test_bad_input": "one-line errors and exit code 2 across commands",
    "test_reliability": "faults: concurrent and killed builds, full disks",
    "test_gpu": "the runtime's GPU discipline (skipped without a GPU)",
    "test_readme": "the README's commands and examples as written",
    "test_docs": "the docs' citations, folders and troubleshooting table against the tree",
}


def _tested_module(path: Path) -> str | None:
    """The module a test file mirrors: tests/<pkg>/test_<name>.py -> fluxtrt.<pkg>.<name> (test_<pkg>.py in
    tests/<pkg>/: the package's __init__), tests/test_<name>.py -> fluxtrt.<name>; None if there is none."""
    rel = path.relative_to(ROOT.parent / "tests").with_suffix("")
    *folders, stem = rel.parts
    name = stem.removeprefix("test_")
    if folders and name == folders[-1]:
        return ".".join(["fluxtrt", *folders])
    return ".".join(["fluxtrt", *folders, name])


# Modules with no code of their own to test (a version string, re-exports, an empty package marker).
UNTESTED = {"fluxtrt", "fluxtrt.runtime", "fluxtrt.core", "fluxtrt.models", "fluxtrt.optimize", "fluxtrt.quantize",
            "fluxtrt.engine", "fluxtrt.stages", "fluxtrt.data", "fluxtrt.kernels"}


def test_the_tests_tree_mirrors_the_package():
    """A reader finds a module's tests where the module is: tests/<package>/test_<module>.py tests
    fluxtrt/<package>/<module>.py (Polygraphy's layout); every module with code has its file; the cross-cutting
    suites above are the only other test files, and every test folder is a package (test basenames repeat)."""
    modules = set(all_modules())
    tests_root = ROOT.parent / "tests"
    files = sorted(tests_root.rglob("test_*.py"))
    unplaced = [str(f.relative_to(tests_root)) for f in files
                if f.stem not in CROSS_CUTTING and _tested_module(f) not in modules]
    assert not unplaced, f"name these after the module they mirror, or list them in CROSS_CUTTING: {unplaced}"
    assert all(tests_root.joinpath(f"{s}.py").exists() for s in CROSS_CUTTING)
    mirrored = {_tested_module(f) for f in files}
    without = sorted(m for m in modules - mirrored - UNTESTED)
    assert not without, f"modules without a test file of their own: {without}"
    assert all((d / "__init__.py").exists() for d in tests_root.rglob("*") if d.is_dir() and d.name != "__pycache__")


def test_one_opener_of_pipelines_and_a_pipeline_that_keeps_the_loop():
    """runtime/assembly.open_pipeline is the one place a Pipeline is made (api, CLI, dropin and serving go through
    it), and Pipeline keeps the loop only: under 250 lines (executor assembly lives in runtime/assembly.py)."""
    import ast
    import re

    made = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if re.search(r"[^\w.]Pipeline\(", p.read_text())]
    assert made == ["runtime/assembly.py"], made
    tree = ast.parse((ROOT / "runtime" / "pipeline.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")
    assert cls.end_lineno - cls.lineno + 1 < 250, cls.end_lineno - cls.lineno + 1
