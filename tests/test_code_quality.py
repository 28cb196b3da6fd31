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


def test_every_public_error_has_a_row_in_the_readme_error_table():
    """The README's error table (When things go wrong) names every exception class zcollective
    exports: a new error, or one left out, shows here."""
    import zcollective

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("\n## When things go wrong")
    section = text[start:text.index("\n## ", start + 1)]
    table = section[section.index("| error | raised when | what to do |"):]
    named = set(re.findall(r"^\| `(\w+)`", table, re.M))
    exported = {name for name, obj in ((n, getattr(zcollective, n)) for n in zcollective.__all__)
                if isinstance(obj, type) and issubclass(obj, Exception)}
    assert len(exported) > 10, exported
    assert not exported - named, f"errors with no row in the README's error table: {sorted(exported - named)}"


LAYERS = [  # lowest first: a module imports only from its own layer or lower ones, and no circle
    {"errors", "_limits", "_hostlist", "_future", "_announce"},
    {"config"},
    {"_format"},
    {"_protocol"},
    {"_io", "_forming"},
    {"_lifecycle"},
    {"_calls", "_elastic", "_subgroups", "_point", "_matched", "_waiting"},
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


def _section(text, title):
    """The body of the ``## title`` section of protocol.md (its heading starting with ``title``)."""
    start = next(m.end() for m in re.finditer(r"^## (.*)$", text, re.M) if m.group(1).startswith(title))
    following = re.search(r"^## ", text[start:], re.M)
    return text[start:start + following.start()] if following else text[start:]


def _rules(text, title):
    """The rule numbers of a numbered rules section, checked to run 1, 2, ... n."""
    numbers = [int(n) for n in re.findall(r"^(\d+)\. \*[^*]+\*", _section(text, title), re.M)]
    assert numbers == list(range(1, len(numbers) + 1)), (title, numbers)
    return set(numbers)


def _cited_rules():
    """(file, line, whose, number) for every "rule N" the package's code cites: the member's
    ("rule N of the member", "the member's rule N", or bare in _member.py) or the coordinator's
    (any other); _future's own rules (the concurrency rule, in its docstring) are left out."""
    cited = []
    for root, _, files in os.walk(os.path.join(ROOT, "zcollective")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.relpath(os.path.join(root, f), ROOT)
            with open(os.path.join(ROOT, path), encoding="utf-8") as source:
                lines = source.read().splitlines()
            for i, line in enumerate(lines):
                after_line = " " + (lines[i + 1].strip() if i + 1 < len(lines) else "")
                for m in re.finditer(r"\b[Rr]ules? (\d+)\b(?! ?-)", line):
                    of = re.match(r"\s*of\s+(?:the\s+)?(?::mod:`~?)?([\w.]+)", line[m.end():] + after_line)
                    owner = re.search(r"(\w+)'s\s*$", line[:m.start()])
                    whose = of.group(1) if of else owner.group(1) if owner else f[:-3]
                    if "_future" in whose:
                        continue
                    cited.append((path, i + 1, "member" if whose.endswith(("member", "_member")) else
                                  "coordinator", int(m.group(1))))
    return cited


def test_every_rule_the_code_cites_is_in_protocol_md():
    text = _protocol_md()
    rules = {"coordinator": _rules(text, "Coordinator rules"), "member": _rules(text, "Member rules")}
    cited = _cited_rules()
    assert len(cited) > 40, "the scan of the code's rule citations found too few: is it broken?"
    missing = [c for c in cited if c[3] not in rules[c[2]]]
    assert not missing, f"rules the code cites that protocol.md's rules lists lack: {missing}"
    for module, whose in [("_coordinator", "coordinator"), ("_member", "member")]:
        with open(os.path.join(ROOT, "zcollective", "_protocol", module + ".py"), encoding="utf-8") as f:
            doc = f.read().split('"""')[1]
        title = "Coordinator rules" if whose == "coordinator" else "Member rules"
        assert f"Rules 1-{max(rules[whose])} " in doc and f"*{title}*" in doc, (module, "points elsewhere")


def test_every_section_the_docstrings_and_protocol_md_point_to_exists():
    text = _protocol_md()
    titles = re.findall(r"^## (.*)$", text, re.M)
    pointers = [("docs/protocol.md", m) for m in re.findall(r"\bSee ((?:\*[^*]+\*(?:, | and )?)+)", text)]
    for root, _, files in os.walk(os.path.join(ROOT, "zcollective")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f), encoding="utf-8") as source:
                    flat = " ".join(source.read().split())
                pointers += [(f, m) for m in re.findall(
                    r"docs/protocol\.md, ((?:\*[^*]+\*(?:, | and )?)+)", flat)]
    assert len(pointers) > 10, "the scan of pointers found too few: is it broken?"
    dangling = [(where, name) for where, names in pointers for name in re.findall(r"\*([^*]+)\*", names)
                if not any(t.startswith(name) for t in titles)]
    assert not dangling, f"pointers to sections protocol.md does not have: {dangling}"


def test_protocol_md_opens_with_its_words_and_names_only_code_that_exists():
    """The glossary is the first section; each word is defined once; every class, function or
    attribute it names (to say which word the docs use instead) is still in the code, so a
    rename that ends a clash shows here, and the glossary is brought up to date with it."""
    import importlib
    import inspect
    import pkgutil

    import zcollective

    text = _protocol_md()
    assert re.findall(r"^## (.*)$", text, re.M)[0] == "Words"
    words = _section(text, "Words")
    rows = re.findall(r"^\| (\*\*.*?) \|", words, re.M)
    defined = [w for row in rows for w in re.findall(r"\*\*([^*]+)\*\*", row)]
    assert len(defined) > 30 and len(defined) == len(set(defined)), sorted(defined)
    modules = {"zcollective": zcollective}
    for info in pkgutil.walk_packages(zcollective.__path__, "zcollective."):
        modules[info.name] = importlib.import_module(info.name)

    def found(name):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest leading run that names a module
            module = [m for n, m in modules.items() if n.endswith("." + ".".join(parts[:i]))]
            if module:
                return any(_has(m, parts[i:]) for m in module)
        return any(_has(m, parts) for m in modules.values())

    def _has(obj, rest):
        for k, attr in enumerate(rest):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
                continue
            if k == len(rest) - 1 and inspect.isclass(obj):  # set in __init__: self.<attr> =
                assigned = rf"self\.{re.escape(attr)}\b\s*(:[^=\n]*)?="
                return re.search(assigned, inspect.getsource(obj)) is not None
            return False
        return True

    names = {re.sub(r"\(.*", "", n) for n in re.findall(r"`([^`\s]+)`", words)}
    names = {n for n in names if re.fullmatch(r"[A-Za-z_][\w.]*", n) and ("." in n or n[0].isupper())}
    assert len(names) > 20, names
    gone = sorted(n for n in names if not found(n))
    assert not gone, f"protocol.md's Words name code that is not there (renamed? update the glossary): {gone}"


SURFACE_MODULES = {os.path.join("zcollective", "_io", "_interrupts.py")}  # where a wait may be written
NOT_LIBRARY = {"run.py", "testing.py", "_child.py", "__main__.py"}  # the launcher's and test helpers'
WAITABLES = {"Event", "Condition", "Barrier", "Semaphore", "BoundedSemaphore", "Queue", "SimpleQueue"}


def _blocking_waits(source):
    """The blocking waits written in ``source`` (line, what): a sleep, a poll
    or select with a timeout, a thread's join, any ``.wait(``, an acquire
    that may block, a waitable of ``threading``/``queue`` made, a process or
    signal waited for. Not a wait: a call of ``_interrupts`` (the surfaces),
    a group's turn's or a ``Waiter``'s ``wait`` (they wait through them), a poll with timeout 0,
    an acquire with ``blocking=False``, a ``with`` on a lock (held for a few
    statements by its holder, never across a wait)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        if receiver.split(".")[-1] == "_interrupts":
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        first = node.args[0] if node.args else None
        timeout = node.args[1] if len(node.args) > 1 else keywords.get("timeout")
        if receiver == "select" and not node.args and not node.keywords:
            continue  # (a poll object made: no wait)
        if (
            name == "sleep"
            or name in ("zmq_poll", "poll", "select", "epoll", "kqueue") and not (
                isinstance(timeout, ast.Constant) and timeout.value == 0)
            or name == "join" and "thread" in receiver.split(".")[-1].lower()
            or name == "wait" and not receiver.endswith(("turns", "waiter"))
            or name == "acquire" and not any(isinstance(v, ast.Constant) and v.value is False
                                             for v in [first, keywords.get("blocking")])
            or name in WAITABLES and receiver in ("threading", "queue")
            or name in ("waitpid", "wait3", "wait4", "pause", "sigwait", "sigtimedwait")
        ):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def _library_sources():
    package = os.path.join(ROOT, "zcollective")
    for root, _, files in os.walk(package):
        for f in sorted(files):
            path = os.path.join(root, f)
            rel = os.path.relpath(path, ROOT)
            if f.endswith(".py") and rel not in SURFACE_MODULES and not (
                    root == package and f in NOT_LIBRARY):
                with open(path, encoding="utf-8") as source:
                    yield rel, source.read()


def test_every_blocking_wait_of_the_library_is_an_interrupt_surface():
    """A wait anywhere in the library goes through ``_io/_interrupts`` (where a
    signal's handler may run at once: see docs/protocol.md, Concurrency)."""
    found = [(rel, *wait) for rel, source in _library_sources() for wait in _blocking_waits(source)]
    assert not found, f"blocking waits outside the interrupt surfaces: {found}"
    group = dict(_library_sources())[os.path.join("zcollective", "_group.py")]
    for broken in ("time.sleep(1)", "self._thread.join(5)", "lock.acquire()", "done = threading.Event()",
                   "cond.wait(1)", "zmq_poll(items, 10)", "select.select([fd], [], [], 2)"):
        assert _blocking_waits(group + "\n" + broken + "\n"), f"{broken} was not found"


def _rules_breaches(source, coordinator=False):
    """What the rules must not do, found in ``source``: resolve a future (its callbacks are the
    program's code), or read the clock or the entropy themselves (they are passed in: a
    default argument may name them); the ``coordinator``'s, nor unpickle a value (``loads``) or
    call a reduce function (``user_code``): it asks for a reduction (``_ops.Combine``), which
    its driver runs."""
    import ast

    tree = ast.parse(source)
    defaults = {id(d) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                for d in node.args.defaults + node.args.kw_defaults if d is not None}
    found = []
    for node in ast.walk(tree):
        if coordinator and isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("loads", "user_code"):
                found.append((node.lineno, ast.unparse(node.func)))
        if not isinstance(node, ast.Attribute):
            continue
        resolves = node.attr in ("_set_result", "_set_exception", "_done")
        reads = id(node) not in defaults and ast.unparse(node) in (
            "time.monotonic", "time.perf_counter", "time.time", "os.urandom")
        if resolves or reads:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_rules_only_decide():
    """Issue 33: the coordinator's and the member's rules return what to send and what calls
    came to (the call runner applies it), and the reductions to run (the driver runs them); the
    clock and entropy are passed in."""
    assert _rules_breaches("def f(clock=time.monotonic):\n    return clock()\n") == []
    assert _rules_breaches("def f(fut):\n    fut._set_result(1)\n") == [(2, "fut._set_result")]
    assert _rules_breaches("def f():\n    return time.monotonic()\n") == [(2, "time.monotonic")]
    unpickles = "v = _serialize.loads(seg)\nr = self.user_code(fn)(v, v)\nw = loads(seg)\n"
    assert _rules_breaches(unpickles) == []  # (a member's finisher unpickles)
    assert sorted(_rules_breaches(unpickles, coordinator=True)) == [
        (1, "_serialize.loads"), (2, "self.user_code"), (3, "loads")]
    found = []
    folder = os.path.join(ROOT, "zcollective", "_protocol")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                found += [(name, *hit) for hit in _rules_breaches(f.read(), name == "_coordinator.py")]
    assert not found, f"rules that act instead of deciding: {found}"


TRANSPORTS = {"_local.py": 550}  # _io/'s transports added since issue 33's bound, each bounded on its own:
# a second transport behind the seam moves bytes and decides nothing (its packets: _format/_packets.py)


def test_the_drivers_stay_smaller_than_the_rules_and_the_format_they_drive():
    """Issue 33's bound: _io/ (sockets, threads, signals) at most 0.6 of _protocol/ and _format/
    together: a decision written in a driver belongs in the rules (with a test without sockets).
    A transport added since (:data:`TRANSPORTS`) has a bound of its own."""
    def lines(folder, but=()):
        path = os.path.join(ROOT, "zcollective", folder)
        return sum(sum(1 for _ in open(os.path.join(path, f), encoding="utf-8"))
                   for f in os.listdir(path) if f.endswith(".py") and f not in but)
    drivers, rules = lines("_io", TRANSPORTS), lines("_protocol") + lines("_format")
    assert drivers <= 0.6 * rules, f"_io/ has {drivers} lines, more than 0.6 x {rules}: move the rules out"
    for name, most in TRANSPORTS.items():
        with open(os.path.join(ROOT, "zcollective", "_io", name), encoding="utf-8") as f:
            assert sum(1 for _ in f) <= most, f"_io/{name} has more than {most} lines"


# Names of other modules' objects a module may read although they begin with "_", each with why.
PUBLIC_BY_CONVENTION = {
    "_current_frames": "sys._current_frames: the stdlib's only way to every thread's stack (a stall report)",
    "_getframe": "sys._getframe: the stdlib's way to the caller's frame",
    "_exit": "os._exit: the stdlib's exit without unwinding (a forked child, the launcher)",
    "_replace": "namedtuple's public API", "_asdict": "namedtuple's public API",
    "_fields": "namedtuple's public API", "_make": "namedtuple's public API",
}


def _private_reaches(source):
    """``obj._name`` in ``source`` where ``_name`` is not the module's own (defined or assigned in
    it) and is not read through ``self``, ``cls`` or ``super()``: another module's private."""
    import ast

    tree = ast.parse(source)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.alias):
            own.add(node.asname or node.name.split(".")[-1])
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        if node.attr in own or node.attr in PUBLIC_BY_CONVENTION:
            continue
        found.append((node.lineno, node.attr))
    return found


def test_no_module_reads_another_modules_private_names():
    """Modules meet through interfaces: what one module needs of another has a public name."""
    package = os.path.join(ROOT, "zcollective")
    found = []
    for root, _, files in os.walk(package):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path, encoding="utf-8") as source:
                    found += [(os.path.relpath(path, ROOT), *hit) for hit in _private_reaches(source.read())]
    assert not found, f"private names of other modules read (give them a public name): {found}"
    with open(os.path.join(package, "_group.py"), encoding="utf-8") as source:
        group = source.read()
    for broken in ("calls._progress", "self._calls._drive()", "future._value", "driver._tracked[seq]"):
        assert _private_reaches(group + "\n" + broken + "\n"), f"{broken} was not found"


USER_FUNCTIONS = ("fn", "reduce_fn", "reduce_function", "func", "user_fn")  # what the rules call the
# program's reduce function (or an elementwise one) where they hold it


def _user_code_in_rules(source):
    """What in ``source`` unpickles: ``loads`` named at all (called, or passed on as a function:
    ``partial(_serialize.loads, ...)``, or imported), or calls the program's function by one of the
    names it goes by (:data:`USER_FUNCTIONS`): (line, what), in line order."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in USER_FUNCTIONS:
                found.append((node.lineno, ast.unparse(node.func)))
        elif (isinstance(node, ast.Attribute) and node.attr == "loads") or (
                isinstance(node, ast.Name) and node.id == "loads"):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and any(a.name == "loads" for a in node.names):
            found.append((node.lineno, "import loads"))
    return sorted(found)


def test_no_rule_unpickles_or_runs_the_programs_functions():
    """Issue 45: no ``loads(`` nor user reduce function call under _protocol/. The rows say what a
    call's value is made of and the call runner (_calls.py) unpickles it; the star's reductions
    run in _io/_combine.py, the data plane's and shared memory's in _io/_reducing.py."""
    assert _user_code_in_rules("a = _serialize.loads(seg)\nb = loads(seg)\nc = fn(a, b)\n"
                               "reduce_fn(a, b)\nd = self.reducer(a, b)\ne = dumps(a)\n"
                               "f = partial(_serialize.loads, seg)\ng = [pickle.loads]\n"
                               "from ._serialize import loads as unpickle\nh = self.decode(seg)\n") == [
        (1, "_serialize.loads"), (2, "loads"), (3, "fn"), (4, "reduce_fn"), (7, "_serialize.loads"),
        (8, "pickle.loads"), (9, "import loads")]
    folder = os.path.join(ROOT, "zcollective", "_protocol")
    found = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                found += [(name, *hit) for hit in _user_code_in_rules(f.read())]
    assert not found, f"rules that unpickle or run the program's code: {found}"
