"""te_seq/core sits under fusion/, run/ and ops/: it imports none of them at module level. The
one deliberate upward import is function-level, in BasicOperation.forward (the standalone
`op(x)` runs through te_seq.run.sequential)."""

from __future__ import annotations

import ast
from pathlib import Path

import te_seq

CORE = Path(te_seq.__file__).parent / "core"
ABOVE_CORE = ("te_seq.run", "te_seq.ops", "te_seq.fusion")


def _imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(module imported, node) for every import statement under `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, node))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node) for alias in node.names)
    return found


def _is_above(module: str) -> bool:
    return any(module == top or module.startswith(top + ".") for top in ABOVE_CORE)


def _function_of(tree: ast.Module, target: ast.AST) -> str | None:
    """Qualified name of the function that contains `target` (None at module level)."""
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)] + [tree]:
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and target in ast.walk(fn):
                return f"{cls.name}.{fn.name}" if isinstance(cls, ast.ClassDef) else fn.name
    return None


def test_core_imports_nothing_above_it_except_the_standalone_call() -> None:
    upward = []
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for module, node in _imports(tree):
            if _is_above(module):
                upward.append((path.name, _function_of(tree, node), module))
    assert upward == [("operation.py", "BasicOperation.forward", "te_seq.run.sequential")]
