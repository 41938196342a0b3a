"""No function in hpcddp/ is longer than 80 lines (CONTRIBUTING: a function a reader can hold
in mind; long ones are split by phase or become a class, as the staging ring did)."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hpcddp"
LIMIT = 80


def test_no_function_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} "
                                f"{node.name} ({lines} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)
