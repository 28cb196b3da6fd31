"""Write docs/api.md, the API reference, from the docstrings of what
``zcollective`` exports (``__all__``) and of ``zcollective.testing``.

    python docs/make_api.py          # rewrite docs/api.md
    python docs/make_api.py --check  # exit 1 if docs/api.md is not what the code says

``tests/test_code_quality.py`` runs the check, so the page never drifts from the code.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
PAGE = HERE / "api.md"
MADE_BY_THE_LIBRARY = {"CollectiveFuture"}  # classes whose constructor is not for users
HEADER = """# API reference

Generated from the docstrings by `python docs/make_api.py`; the README's API table is the short
version. Every function of the module works on the default group (`initialize`); a `Group` has
the same operations as methods.
"""


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", text)  # no addresses: the page is stable


def _entry(name: str, obj: Any, level: str = "##") -> list[str]:
    doc = inspect.getdoc(obj) or "(no docstring)"
    if inspect.isclass(obj):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        head = f"{level} class `{name}`" + (f"({', '.join(bases)})" if bases else "")
        lines = [head, "", doc, ""]
        if not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__",):
                    continue
                if callable(member) or isinstance(member, property):
                    target = member.fget if isinstance(member, property) else member
                    if attr == "__init__" and (name in MADE_BY_THE_LIBRARY or not inspect.getdoc(target)):
                        continue
                    if isinstance(member, property):
                        lines += [f"### `{name}.{attr}` (a property)", "", inspect.getdoc(target) or "", ""]
                    else:
                        lines += _entry(f"{name}.{attr}", target, "###")
        return lines
    if callable(obj):
        return [f"{level} `{name}{_signature(obj)}`", "", doc, ""]
    return [f"{level} `{name}`", "", f"`{obj!r}`", ""]


def render() -> str:
    sys.path.insert(0, str(HERE.parent))
    import zcollective
    import zcollective.testing

    lines = [HEADER]
    for name in zcollective.__all__:
        lines += _entry(name, getattr(zcollective, name))
    lines += ["## `zcollective.testing`", "", inspect.getdoc(zcollective.testing) or "", ""]
    for name in ("run_replicas", "Replicas", "ReplicasFailed", "free_port"):
        lines += _entry(f"testing.{name}", getattr(zcollective.testing, name), "###")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
