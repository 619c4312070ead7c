"""The package's shape, read from its source: which parts may import which, and no function so long
that a reader cannot take it in (design.md's layout; issue 13)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_pipeline"

# part -> parts it must not import. extract/ and train/ are the two stages and know nothing of each
# other (what both need lives in method.py, launch.py, schemas/ or store/); eval/ may use both.
# generate/ comes before extraction: it uses extract's readers and eval's target helpers, and nothing
# but the CLI imports it (extract reads its output through schemas/generate.py). The shared modules
# below them import none of the stages. decoding/ builds on train/'s drafter model and serves eval/,
# generate/ and train/'s held-out tree estimate, so it must not reach up into eval/ or generate/.
FORBIDDEN = {
    "decoding": {"eval", "generate"},
    "extract": {"train", "eval", "generate"},
    "train": {"extract", "eval", "generate"},
    "eval": {"generate"},
    "generate": {"train", "store"},
    "store": {"extract", "train", "eval", "generate"},
    "schemas": {"extract", "train", "eval", "store", "generate"},
    "method": {"extract", "train", "eval", "store", "generate"},
    "launch": {"extract", "train", "eval", "store", "generate"},
    "progress": {"extract", "train", "eval", "store", "generate"},
    "errors": {"extract", "train", "eval", "store", "generate"},
}

MAX_FUNCTION_LINES = 90
# Functions allowed over the limit, by "path:qualified name". Only for code that truly cannot be split;
# an entry whose function is back under the limit (or gone) fails the test, so the list only shrinks.
LONG_FUNCTIONS_ALLOWED: set[str] = set()


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE), ast.parse(path.read_text(), filename=str(path))


def _part(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py")


def _imported_parts(tree: ast.Module) -> set[tuple[str, int]]:
    """(part of dflash_pipeline, line) of every import of the package, at any depth of the module."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "dflash_pipeline" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def test_no_import_runs_against_the_layering():
    bad = []
    for rel, tree in _modules():
        forbidden = FORBIDDEN.get(_part(rel), set())
        for part, line in sorted(_imported_parts(tree)):
            if part in forbidden:
                bad.append(f"{rel}:{line} imports dflash_pipeline.{part}")
    assert not bad, "imports against the layering (see FORBIDDEN):\n  " + "\n  ".join(bad)


def _functions(tree: ast.Module):
    """(qualified name, first line, length in lines) of every function and method, nested ones too."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def test_no_function_is_too_long_to_read():
    long, seen = [], set()
    for rel, tree in _modules():
        for name, line, length in _functions(tree):
            key = f"{rel.as_posix()}:{name}"
            if length > MAX_FUNCTION_LINES:
                seen.add(key)
                if key not in LONG_FUNCTIONS_ALLOWED:
                    long.append(f"{rel.as_posix()}:{line} {name}: {length} lines")
    stale = sorted(LONG_FUNCTIONS_ALLOWED - seen)
    assert not long and not stale, (
        (f"functions over {MAX_FUNCTION_LINES} lines (split them):\n  " + "\n  ".join(long) + "\n" if long else "")
        + (f"allow-list entries no longer needed (remove them): {stale}" if stale else ""))


def test_the_checks_see_what_they_should():
    """The walkers find a nested import and a method; a forbidden arrow would be caught."""
    tree = ast.parse("def f():\n    from dflash_pipeline.train.model import X\n"
                     "class C:\n    def m(self):\n        import dflash_pipeline.extract.target\n")
    assert _imported_parts(tree) == {("train", 2), ("extract", 5)}
    assert [n for n, _, _ in _functions(tree)] == ["f", "C.m"]
    assert "extract" in FORBIDDEN["train"] and "train" in FORBIDDEN["extract"]
