"""bench/import_graph.py: who imports whom among the repository's top-level modules, read from the AST.

    python bench/import_graph.py          # one line per module: lines, then the modules it imports

An import made only inside a function is marked `(local)`: the header of a file should show its real dependencies.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
mods = {p.stem: p for p in sorted(ROOT.glob("*.py"))}
for name, path in mods.items():
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    deps = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module.split(".")[0]]
        else:
            continue
        for m in found:
            if m in mods and m != name:
                deps[m] = deps.get(m, False) or id(node) not in local  # True once imported outside a function
    lines = len(path.read_text().splitlines())
    shown = ", ".join(m + ("" if top_level else " (local)") for m, top_level in sorted(deps.items()))
    print(f"{name + '.py':<16}{lines:>6}  -> {shown or '-'}")
