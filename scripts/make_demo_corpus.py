"""Extract the demo corpus's functions from a Python standard library into the file the package ships.

    python scripts/make_demo_corpus.py                       # the running interpreter's standard library
    python scripts/make_demo_corpus.py --stdlib DIR --out FILE

The shipped `eagle31/targets/corpus/stdlib_functions.jsonl` was made by this script from CPython 3.11.7's
standard library (PSF license, `eagle31/targets/corpus/LICENSE`); the demo target reads that file and never the
running interpreter's, so the corpus, the tokenizer and the target are the same under every Python
(docs/demo_target.md). Public, documented, ASCII functions and methods of modest size, in sorted order.
"""

import argparse
import ast
import dataclasses
import json
import sysconfig
from pathlib import Path

from eagle31.io import atomic_write_text
from eagle31.targets.demo_corpus import CORPUS_FILE, Function

# Parts of the standard library that are tests, demos, GUIs or vendored code.
SKIP_DIRS = {
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "lib-dynload",
    "__phello__",
    "venv",
}
MAX_CODE_CHARS = 800  # keeps a conversation under ~384 tokens of the demo tokenizer
MIN_CODE_CHARS = 80


def stdlib_functions(root: Path) -> list[Function]:
    """Public, documented, ASCII functions and methods of modest size under `root`, in sorted order."""
    found: dict[tuple[str, str], Function] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        # ast numbers lines at \n, \r\n and \r only; str.splitlines also splits at form feeds and would shift them
        lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for prefix, node in definitions(tree):
            fn = function(module, prefix, node, lines)
            if fn is not None:
                found.setdefault((fn.module, fn.name), fn)
    return list(found.values())


def definitions(tree: ast.Module):
    """(name prefix, def node) for top-level functions and the methods of top-level classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield "", node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    yield node.name + ".", sub


def function(module: str, prefix: str, node: ast.FunctionDef, lines: list[str]) -> Function | None:
    """The corpus entry of one definition, or None when it is private, undocumented, too long or not ASCII."""
    end = node.end_lineno or node.lineno  # always set by ast.parse
    if node.name.startswith("_") or end - node.lineno > 40:
        return None
    doc = ast.get_docstring(node)
    if not doc:
        return None
    summary = doc.strip().splitlines()[0].strip()
    # the definition's lines (decorators excluded), dedented to column 0
    body = lines[node.lineno - 1 : end]
    indent = " " * node.col_offset
    if not all(line.startswith(indent) or not line.strip() for line in body):
        return None
    code = "\n".join(line[node.col_offset :].rstrip() for line in body)
    if not (MIN_CODE_CHARS <= len(code) <= MAX_CODE_CHARS) or "\t" in code or not code.isascii():
        return None
    if not summary or len(summary) > 120 or not summary.isascii():
        return None
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    signature = f"({ast.unparse(node.args)}){returns}"
    return Function(module, prefix + node.name, signature, summary, code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out", type=Path, default=CORPUS_FILE)
    args = parser.parse_args()
    functions = stdlib_functions(args.stdlib)
    atomic_write_text(args.out, "".join(json.dumps(dataclasses.asdict(f)) + "\n" for f in functions))
    print(f"{len(functions)} functions from {args.stdlib} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
