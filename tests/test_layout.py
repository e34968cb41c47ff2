"""The code stays easy to follow: layers, module and function sizes, and citations that point at files we ship.

Layers (docs/design.md "Layers"): spec_rl/ is a stack of subpackages; a module imports only from its own
layer or the layers below (an AST walk over every import, also those inside functions), no module is
part of an import cycle, and nothing imports the root package (it holds the public names only).
Limits (docs/design.md "Conventions"): a module in spec_rl/ or kernels/ is at most 800 lines (a loose sanity
bound; the guideline is 450), a function at most 80 lines without its docstring, and no comment or docstring
cites a file the repository does not contain (a path of ours that does not exist, DESIGN-style notes outside
the repo) or an issue number of a tracker the user does not have.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spec_rl", "kernels")
MAX_MODULE_LINES = 800  # a sanity bound: modules aim at 450 lines
MAX_FUNCTION_LINES = 100  # the formatter writes a long call one argument per line
CODE_DIRS = ("spec_rl", "kernels", "csrc", "benchmarks", "tests")
CODE_SUFFIXES = {".py", ".cpp", ".cu", ".cuh", ".h", ".sh"}
# Built from pieces so this file does not match itself.
FORBIDDEN = re.compile("|".join([r"\bDESIGN" + r"\.md\b", r"\bHOPPER" + r"\.md\b", r"\b[Ii]ssue" + r" #?\d+\b"]))


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    body = body[1:]  # the docstring does not count
            if not body:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            doc_lines = 0
            if body is not node.body:
                doc = node.body[0]
                doc_lines = doc.end_lineno - doc.lineno + 1
            out.append((node.name, node.end_lineno - first + 1 - doc_lines))
    return out


LAYERS_LINE = re.compile(r"^Layers, lowest first: (.+)$", re.M)


def layer_order() -> list[str]:
    """The layer order, written once in docs/design.md ("Layers, lowest first: util < ops < ...")."""
    found = LAYERS_LINE.findall((ROOT / "docs" / "design.md").read_text())
    assert len(found) == 1, "docs/design.md must state the layer order once, as 'Layers, lowest first: a < b < ...'"
    return [name.strip().strip("`") for name in found[0].split("<")]


#: Submodules of spec_rl built from other folders: kernels/ (installed as spec_rl.kernels) and csrc/ (spec_rl._C).
BUILT_ELSEWHERE = ("kernels", "_C")


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (anywhere in the file; names imported from a
    module count as importing it, a submodule imported by name as importing the submodule; the submodules
    in BUILT_ELSEWHERE are outside the layers)."""
    name = package.name
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = (
                    ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module
                )
                targets.update(
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules or a.name in BUILT_ELSEWHERE else base
                    for a in node.names
                )
        # the nearest module of ours for each target (spec_rl.kernels and spec_rl._C are not in the folder)
        graph[mod] = {t for t in targets if t in modules and t != mod and (t.startswith(name + ".") or t == name)}
    return graph


def layering_problems(package: Path, order: list[str]) -> list[str]:
    """Every upward import, import of the root package, unknown layer and import cycle in ``package``."""
    graph, name = import_graph(package), package.name
    rank = {layer: i for i, layer in enumerate(order)}

    def layer(mod: str) -> str:  # cli_*.py modules (the command line's helpers) belong to the cli layer
        top = mod.split(".")[1] if "." in mod else "(root)"
        return "cli" if top.startswith("cli_") else top

    problems = [f"{m}: not in any layer of {order}" for m in graph if m != name and layer(m) not in rank]
    for mod, targets in sorted(graph.items()):
        for t in sorted(targets):
            if t == name and mod != name:
                problems.append(f"{mod} imports the root package {name} (import from the defining module)")
            elif mod != name and layer(t) in rank and layer(mod) in rank and rank[layer(t)] > rank[layer(mod)]:
                problems.append(f"{mod} ({layer(mod)}) imports {t} from a layer above ({layer(t)})")
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component with more than one module (iterative DFS)."""
    state, cycles = {}, []
    for start in sorted(graph):
        if start in state:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path, state[start] = [start], "open"
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = "done"
            elif state.get(child) == "open":
                cycles.append(path[path.index(child) :] + [child])
            elif child not in state:
                state[child] = "open"
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return cycles


def test_layers_hold():
    problems = layering_problems(ROOT / "spec_rl", layer_order())
    assert not problems, "\n".join(problems)


def test_every_subpackage_is_a_layer_and_says_what_it_may_import():
    order = layer_order()
    subpackages = sorted(p.parent.name for p in (ROOT / "spec_rl").glob("*/__init__.py"))
    assert set(subpackages) | {"cli"} == set(order) | {"cli"}, (subpackages, order)
    for sub in subpackages:
        doc = ast.get_docstring(ast.parse((ROOT / "spec_rl" / sub / "__init__.py").read_text())) or ""
        assert f"Layer {order.index(sub)}:" in doc and "may import" in doc, f"spec_rl/{sub}/__init__.py docstring"


def test_the_layering_check_catches_an_upward_import_and_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    for layer in ("low", "high"):
        (pkg / layer).mkdir(parents=True)
        (pkg / layer / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from ..low import b\n")
    (pkg / "low" / "b.py").write_text("x = 1\n")
    assert layering_problems(pkg, ["low", "high"]) == []
    (pkg / "low" / "b.py").write_text("def f():\n    from ..high.a import b\n")  # upward, and a cycle a -> b -> a
    problems = layering_problems(pkg, ["low", "high"])
    assert any("imports pkg.high.a from a layer above" in p for p in problems), problems
    assert any(p.startswith("import cycle:") and "pkg.high.a" in p and "pkg.low.b" in p for p in problems), problems
    (pkg / "low" / "c.py").write_text("import pkg\n")
    assert any("imports the root package" in p for p in layering_problems(pkg, ["low", "high"]))


def test_modules_exist():
    assert len(_modules()) > 20


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines (limit {MAX_MODULE_LINES}): split it"
    long = [(name, n) for name, n in _function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_citation_of_files_or_trackers_we_do_not_ship():
    bad = []
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in CODE_SUFFIXES and path.is_file():
                for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if FORBIDDEN.search(line):
                        bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not bad, "cite docs/design.md or the paper instead:\n" + "\n".join(bad)


OUR_PATH = re.compile(
    r"(?<![\w/.-])((?:spec_rl|kernels|csrc|benchmarks|tests|docs|examples)/[\w/.-]*\w\.(?:py|md|sh|cpp|cu|cuh))\b"
)


def test_cited_paths_of_ours_exist():
    """Every path into our own folders that code, docs or the README cites names a file we ship."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts += [
        p for folder in CODE_DIRS + ("examples",) for p in (ROOT / folder).rglob("*") if p.suffix in CODE_SUFFIXES
    ]
    missing = []
    for path in texts:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for cited in OUR_PATH.findall(line):
                if not (ROOT / cited).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: {cited}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_design_doc_is_shipped_and_linked():
    assert (ROOT / "docs" / "design.md").is_file()
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_repository_kernels_folder_is_not_mistaken_for_the_hub_kernels_package():
    """From the repository root, `import kernels` finds our folder: it must import nothing and look unusable."""
    import subprocess
    import sys

    code = "import kernels, sys; print(kernels.__version__, len(kernels.__all__), 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0", "False"]


def test_the_kernels_stand_alone():
    # kernels/ (spec_rl.kernels) is the layer under everything: it imports nothing of spec_rl, and spec_rl imports it
    # only lazily where Triton runs (spec_rl/util/triton.py, the verify dispatch), so nothing cycles between them.
    upward = []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level > 1 or (node.module or "").startswith("spec_rl")):
                upward.append(f"{path.name}: from {'.' * node.level}{node.module or ''}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("spec_rl") for a in node.names):
                upward.append(f"{path.name}: import {', '.join(a.name for a in node.names)}")
    assert upward == []
