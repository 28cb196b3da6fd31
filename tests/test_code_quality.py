"""The code stays ruff-clean and mypy-clean (both are test dependencies); the docs agree with
the code where a test can tell."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tool, args", [
    ("ruff", ["check", "."]),
    ("mypy", ["zcollective"]),
])
def test_tool_is_clean(tool, args):
    if shutil.which(tool) is None and not _has_module(tool):
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _has_module(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_api_reference_is_what_the_docstrings_say():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "make_api.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _protocol_md():
    with open(os.path.join(ROOT, "docs", "protocol.md"), encoding="utf-8") as f:
        return f.read()


def test_protocol_md_names_the_protocol_version_the_wire_speaks():
    from zcollective._format._wire import PROTOCOL_VERSION

    text = _protocol_md()
    assert text.splitlines()[0] == f"# zcollective protocol (version {PROTOCOL_VERSION}) and its drivers"
    assert f"`PROTOCOL_VERSION` = {PROTOCOL_VERSION};" in text


def test_protocol_md_lists_every_operation_code_and_what_each_rank_receives():
    from zcollective._protocol._ops import Op

    text = _protocol_md()
    header_row = next(line for line in text.splitlines() if line.startswith("| 4 | 1 | op |"))
    assert header_row == "| 4 | 1 | op | " + ", ".join(f"{int(o)} {o.label}" for o in Op) + " |"
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    named = {name.strip() for row in rows for name in row.split(",")}
    assert {o.label for o in Op if o is not Op.NONE} <= named, "an operation has no row"


def test_the_docs_cite_no_file_outside_the_repository():
    pattern = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|LAYOUT\.md")
    places = ["README.md", "CHANGELOG.md", "benchmarks/README.md", *(
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))]
    for root, _, files in os.walk(os.path.join(ROOT, "zcollective")):
        places += [os.path.relpath(os.path.join(root, f), ROOT) for f in files if f.endswith(".py")]
    cited = []
    for place in places:
        with open(os.path.join(ROOT, place), encoding="utf-8") as f:
            if pattern.search(f.read()):
                cited.append(place)
    assert not cited, cited


LAYERS = [  # lowest first: a module imports only from its own layer or lower ones, and no circle
    {"errors", "_limits", "_hostlist", "_future"},
    {"config"},
    {"_format"},
    {"_protocol"},
    {"_io", "_forming"},
    {"_elastic"},
    {"_group"},
    {"__init__", "testing", "run", "_child"},
]


def _imports():
    """Each module of the package (dotted, under ``zcollective``) and the
    package's modules it imports, anywhere in it (a function's import too)."""
    import ast

    package = os.path.join(ROOT, "zcollective")
    found = {}
    for root, _, files in os.walk(package):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            parts = os.path.relpath(path, package)[:-3].split(os.sep)
            name = ".".join(p for p in parts if p != "__init__") or "__init__"
            here = parts[:-1]
            targets = set()
            with open(path, encoding="utf-8") as source:
                tree = ast.parse(source.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                    module = [*base, *(node.module.split(".") if node.module else [])]
                    for alias in node.names:
                        whole = ".".join([*module, alias.name])
                        targets.add(whole if os.path.exists(os.path.join(package, *whole.split(".")) + ".py")
                                    else ".".join(module) or "__init__")
            found[name] = targets - {name}
    return found


def _layer(module):
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_imports_point_down_the_layers_and_make_no_circle():
    imports = _imports()
    upward = [(m, t) for m, targets in imports.items() for t in targets if _layer(t) > _layer(m)]
    assert not upward, f"imports that reach up a layer: {upward}"
    seen, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError(f"a circle of imports: {' -> '.join(path[path.index(module):] + [module])}")
        if module in seen:
            return
        path.append(module)
        for target in sorted(imports.get(module, ())):
            visit(target)
        path.pop()
        seen.add(module)
    for module in sorted(imports):
        visit(module)
