"""The house rules of ../shared/STYLE.md that a reader can check by counting, on every
package of the layer table: no source file over 400 lines, no function over 60 outside the
kernels (a Triton kernel is one launch; splitting it would cost registers, not clarity)."""
from __future__ import annotations

import ast

from tests.unit.test_layering import PACKAGES, ROOT

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _sources():
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if not f.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")):
                yield f


def test_no_file_over_the_limit():
    long = [f"{f.relative_to(ROOT)}: {n} lines" for f in _sources()
            if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, long


def test_no_function_over_the_limit_outside_the_kernels():
    long = []
    for f in _sources():
        if f.relative_to(ROOT).parts[:2] == ("engine", "kernels"):
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, long


def test_the_counts_see_the_code():
    files = list(_sources())
    assert len(files) > 100 and any(f.name == "llm_engine.py" for f in files)
