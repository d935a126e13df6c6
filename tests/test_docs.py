"""The docs say what the repository holds: every link and every named file or module resolves, and the
exit-code table (docs/reliability.md) is the one `eagle31.errors` and its kin define."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import string
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the prose: README, docs/ and every folder's README; not the results tables the studies and benchmarks write
DOCS = sorted(
    p
    for p in {
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("experiments/**/README.md"),
        *ROOT.glob("benchmarks/**/README.md"),
    }
    if p.parent == ROOT or p.relative_to(ROOT).parts[0] == "docs" or "results" not in p.relative_to(ROOT).parts
)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
# the repository's top-level folders: an inline `path` starting with one names a file that must exist
TOP = (
    "eagle31/",
    "experiments/",
    "benchmarks/",
    "docs/",
    "scripts/",
    "tests/",
    "recipes/",
    "data_prep/",
    "train/",
    ".ci/",
)
# what a command writes, named in the docs before it exists (git-ignored)
WRITTEN = ("benchmarks/wheels/",)
PLACEHOLDER = re.compile(r"[<>*{}$\[\]|]")
DOTTED = re.compile(r"^(?:eagle31|experiments|benchmarks)(?:\.[A-Za-z_]\w*)+$")


def prose(path: Path) -> str:
    """The markdown of `path` without its fenced code blocks (commands and their output)."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = CODE.sub(lambda m: m.group(1), heading).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading anchors on its text
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_docs_are_found():
    names = {rel(p) for p in DOCS}
    assert {
        "README.md",
        "CONTRIBUTING.md",
        "docs/architecture.md",
        "docs/export.md",
        "docs/results/README.md",
        "experiments/README.md",
    } <= names
    assert not any("/results/" in n and not n.startswith("docs/results/") for n in names), names


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_resolves_inside_the_repository(doc):
    bad = []
    for target in LINK.findall(CODE.sub("code", prose(doc))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(f"{target}: no such file in the repository")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{target}: {rel(path)} has no heading #{anchor}")
    assert not bad, f"{rel(doc)}: " + "; ".join(bad)


def defined_names(module: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def unresolved_dotted(name: str) -> str | None:
    """Why `eagle31.x.y` (a module, or a name a module defines) names nothing, or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = module_file(parts[:i])
        if module is not None:
            if i == len(parts) or parts[i] in defined_names(module) or module_file(parts[: i + 1]):
                return None
            return f"{'.'.join(parts[:i])} defines no {parts[i]}"
    return "no such module"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_file_and_module_the_prose_names_exists(doc):
    """An inline `eagle31/...` path or `eagle31.x.name` in the prose (commands are not checked) is in the tree."""
    bad = []
    for code in CODE.findall(prose(doc)):
        token = code.strip()
        if token.startswith("train/") and "." not in token:  # a metric's name (train/wait_s), not a file of train/
            continue
        if (
            token.startswith(TOP)
            and " " not in token
            and not PLACEHOLDER.search(token)
            and not token.startswith(WRITTEN)
        ):
            path = token.split("::")[0].rstrip(".,:;")
            if not (ROOT / path).exists():
                bad.append(f"{token}: no such file")
        elif DOTTED.match(token) and (why := unresolved_dotted(token)):
            bad.append(f"{token}: {why}")
    assert not bad, f"{rel(doc)}: " + "; ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_test_the_prose_names_is_a_test_of_that_file(doc):
    """`tests/<file>.py::<name>` in the prose (CONTRIBUTING.md's "held by" column) names a function of that file."""
    bad = []
    for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", prose(doc)):
        tree = ast.parse((ROOT / path).read_text()) if (ROOT / path).exists() else None
        if tree is None or name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            bad.append(f"{path}::{name}")
    assert not bad, f"{rel(doc)}: " + "; ".join(bad)


# ------------------------------------------------------------------ the exit codes

RELIABILITY = ROOT / "docs" / "reliability.md"


def documented_exit_codes() -> dict[int, str]:
    """code -> the class named in the `kind` column of docs/reliability.md's exit-code table."""
    section = prose(RELIABILITY).split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ([^|]*) \|", section, re.M)
    assert rows, "docs/reliability.md has no exit-code table under '## Exit codes'"
    return {int(code): (CODE.findall(kind) or ["-"])[0] for code, kind in rows}


def eagle31_error_classes() -> dict[str, type]:
    """Every `Eagle31Error` subclass of the library, by name (the modules defining them found by their source)."""
    from eagle31.errors import Eagle31Error

    derived, classes = {"Eagle31Error"}, {}
    for path in ROOT.glob("eagle31/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                classes[node.name] = (bases, path)
    changed = True
    while changed:  # the names deriving from Eagle31Error, through any chain of bases
        grown = {name for name, (bases, _) in classes.items() if derived & set(bases)}
        changed = not grown <= derived
        derived |= grown
    for name in derived - {"Eagle31Error"}:
        module = ".".join(classes[name][1].relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        importlib.import_module(module)

    found, todo = {}, [Eagle31Error]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return {n: c for n, c in found.items() if c.__module__.startswith("eagle31")}


def test_the_exit_code_table_is_the_one_the_error_classes_define():
    documented = documented_exit_codes()
    classes = eagle31_error_classes()
    assert documented.pop(0) == "-", "code 0 (success) names no failure kind"
    for code, name in documented.items():
        assert name in classes, f"docs/reliability.md: exit code {code} names {name}, which is no Eagle31Error"
        assert classes[name].exit_code == code, (
            f"docs/reliability.md: {name} exits {classes[name].exit_code}, not {code}"
        )
    defined = {c.exit_code for c in classes.values() if c.__name__ != "Eagle31Error"}
    assert defined == set(documented), (
        f"codes the classes use but the table lacks: {defined - set(documented)}; "
        f"codes the table has but no class uses: {set(documented) - defined}"
    )


# ------------------------------------------------------------------ the documented commands

# the command lines of a recipe: what a reader copies from a page, a recipe's comment or a script's docstring
RECIPE_CLIS = ("train/main.py", "data_prep/prepare.py", "data_prep/capture.py", "data_prep/import_speculators.py")
COMMAND_SOURCES = [
    *DOCS,
    *sorted((ROOT / "recipes" / "recipe").glob("*.yaml")),
    *sorted((ROOT / "data_prep").glob("*.py")),
    ROOT / "train" / "main.py",
]


def recipe_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(processes per node, arguments) of each recipe command line in `path`: the fenced blocks of a page, every
    line of a recipe or a script (comment marks dropped); continuations joined, trailing comments cut, the
    variables the page `export`s expanded."""
    text = path.read_text()
    blocks = FENCE.findall(text) if path.suffix == ".md" else [re.sub(r"(?m)^\s*# ?", "", text)]
    commands = []
    variables: dict[str, str] = {}
    for block in blocks:
        for line in re.sub(r"\\\n\s*(#\s*)?", " ", block).splitlines():
            for part in re.split(r"&&|;", line):
                try:
                    words = [string.Template(w).safe_substitute(variables) for w in shlex.split(part, comments=True)]
                except ValueError:  # not a shell line (output, a table)
                    continue
                if words[:1] == ["export"]:
                    variables.update(w.split("=", 1) for w in words[1:] if "=" in w)
                cli = next((i for i, w in enumerate(words) if w in RECIPE_CLIS), None)
                if cli is not None:
                    launcher = " ".join(words[:cli])
                    nproc = re.search(r"--nproc[-_]per[-_]node[ =](\d+)", launcher)
                    commands.append((int(nproc.group(1)) if nproc else 1, words[cli:]))
    return commands


@pytest.mark.parametrize("source", COMMAND_SOURCES, ids=rel)
def test_every_documented_recipe_command_composes_and_can_run(source):
    """A command a reader copies composes; one that loads the target names it (a recipe for a Hub model carries
    its config for dry runs, never its weights, so `target.path=` is the reader's to give); and a target spread
    over a node's GPUs is never launched once per GPU to capture or train online."""
    from eagle31.errors import ConfigError
    from eagle31.recipe import load_recipe

    bad = []
    for nproc, words in recipe_commands(source):
        overrides = [w for w in words[1:] if "=" in w and not w.startswith("-")]
        if "..." in words or {"--help", "-h", "--cfg"} & set(words) or "dry_run=true" in overrides:
            continue
        command = " ".join(words)
        try:
            cfg = load_recipe(ROOT / "recipes", overrides)
        except ConfigError as e:
            bad.append(f"{command}: {e}")
            continue
        if cfg.target.builtin is None and cfg.target.path is None:
            bad.append(f"{command}: no target.path (the command stops with 'target.path is not set')")
        spread = cfg.target.device_map and nproc > 1 and cfg.features.engine.worker != "vllm"
        if spread and (words[0] == "data_prep/capture.py" or cfg.features.mode == "online"):
            bad.append(f"{command}: {nproc} processes per node each load a target spread over the node")
    assert not bad, "\n".join(bad)


def vllm_serve_commands(path: Path) -> list[list[str]]:
    """The arguments after `vllm serve` of each command in the fenced blocks of `path`."""
    commands = []
    for block in FENCE.findall(path.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            at = next((i for i in range(len(words) - 1) if words[i : i + 2] == ["vllm", "serve"]), None)
            if at is not None:
                commands.append(words[at + 2 :])
    return commands


def test_a_target_spread_over_a_node_is_served_over_the_node():
    """The Hub id of a recipe whose target is spread over a node's GPUs (`target.device_map`) is never served by
    `vllm serve` on one GPU: its command names the tensor-parallel size."""
    from eagle31.recipe import load_recipe

    spread = set()
    for recipe in sorted((ROOT / "recipes" / "recipe").glob("*.yaml")):
        cfg = load_recipe(ROOT / "recipes", [f"recipe={recipe.stem}"])
        if cfg.target.device_map and cfg.target.name:
            spread.add(cfg.target.name)
    assert "moonshotai/Kimi-K2.6" in spread
    bad = [
        f"{rel(page)}: vllm serve {' '.join(words)}"
        for page in DOCS
        for words in vllm_serve_commands(page)
        if words
        and words[0] in spread
        and not any(w.startswith(("--tensor-parallel-size", "-tp", "--pipeline-parallel-size")) for w in words)
    ]
    assert not bad, "\n".join(bad)


def test_the_vllm_releases_the_export_page_names_are_the_ones_the_layouts_and_kinds_declare():
    """docs/export.md's opening sentence and its layouts table name the release each layout (`min_vllm`) and each
    drafter kind's fc_norm (`min_vllm_fc_norm`) needs, as the model cards do."""
    from eagle31.attention import KINDS
    from eagle31.layouts import LAYOUTS

    text = (ROOT / "docs" / "export.md").read_text()
    opening = text.split("## Supported vLLM releases and how they are tested", 1)[1].split("\n\n", 2)[1]
    for name, layout in LAYOUTS.items():
        assert f"| `{name}` (vLLM >= {layout.min_vllm}) |" in text or f"`{name}` (vLLM >= {layout.min_vllm})" in text
        assert f"**{layout.min_vllm}.0 to" in opening, (name, opening)
    for name, kind in KINDS.items():
        if kind.min_vllm_fc_norm:
            assert f"{name.upper()} EAGLE 3.1 drafter" in opening and f"needs **{kind.min_vllm_fc_norm}.0**" in opening
