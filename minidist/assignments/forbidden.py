"""What a student's region may not use: the library's own answer to the same assignment (its
all-reduces for the ring, its fast AdamW for AdamW, its schedule builders for 1F1B, ...), and
the doors around any rule (eval, getattr by name, imports by string, the file system).

The check reads the region's code with `ast`, without running it: every name, attribute and
imported module is compared with the assignment's list (registry.py) and with DYNAMIC. It is a
guard against the obvious shortcut, not a proof; the hidden tests and the wrong-solution tests
do the rest (docs/instructors.md)."""
from __future__ import annotations

import ast

# Ways to reach anything at all by a string or a file: never needed by an assignment.
DYNAMIC = ("eval", "exec", "compile", "__import__", "importlib", "getattr", "setattr", "globals", "locals",
           "vars", "open", "os", "sys", "subprocess", "inspect", "builtins", "__builtins__", "ctypes", "torch")


def names_used(body: str) -> list[tuple[int, str]]:
    """(line, name) for every name, attribute and imported module in a region's `body` (the lines
    between its markers, at any indentation). A SyntaxError if the body is not Python."""
    lines = body.splitlines() or ["pass"]
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    source = "def _region():\n" + "".join(f"    {line[indent:]}\n" for line in lines) + "    pass\n"
    used = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            used.append((node.lineno - 1, node.id))
        elif isinstance(node, ast.Attribute):
            used.append((node.lineno - 1, node.attr))
        elif isinstance(node, ast.alias):
            used += [(node.lineno - 1, part) for part in node.name.split(".")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            used += [(node.lineno - 1, part) for part in node.module.split(".")]
    return sorted(set(used))


def forbidden_uses(body: str, forbidden: tuple[str, ...], where: str, why: str) -> list[str]:
    """One line per forbidden name the region uses (`where`: the file and region, for the
    message; `why`: what the assignment asks the student to write instead)."""
    try:
        used = names_used(body)
    except SyntaxError as error:
        return [f"{where}: not valid Python (line {max(1, (error.lineno or 2) - 1)} of the region: {error.msg})"]
    lines = []
    for line, name in used:
        if name in DYNAMIC:
            lines.append(f"{where}, line {line}: uses {name}, which no assignment needs (graded code may not "
                         "reach other code by a string, a file or the system)")
        elif name in forbidden:
            lines.append(f"{where}, line {line}: uses {name}, the library's own answer: {why}")
    return lines
