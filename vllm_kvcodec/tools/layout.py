"""The package's layout, read from its source: rooms, their sizes, the imports between them, and any circle.

A room is a subpackage of ``vllm_kvcodec`` (``keys``, ``format``, ``codecs``,
``connector``, ...), the top-level ``storage`` package, or a module at the
package root. Every import counts, at module level or inside a function,
under ``TYPE_CHECKING`` or not: a circle a reader must untangle is a circle
whether or not Python trips on it. ``kvcodec layout`` prints the rooms in
layers (each imports only rooms in layers below it), the largest files, and
any circle between modules or rooms; ``tests/tools/test_layout.py`` holds the
package to it.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGES = ("vllm_kvcodec", "storage")


@dataclasses.dataclass
class Layout:
    modules: dict[str, Path]  # dotted name -> file
    lines: dict[str, int]  # dotted name -> lines of source
    imports: dict[str, set[str]]  # dotted name -> modules of these packages it imports

    def room(self, module: str) -> str:
        """``vllm_kvcodec.keys.chain`` -> ``keys``; ``storage.testing.faults`` -> ``storage``; a root module -> its
        name (``stats``); the package's own ``__init__`` -> ``__init__``."""
        parts = module.split(".")
        if parts[0] != "vllm_kvcodec":
            return parts[0]
        return parts[1] if len(parts) > 1 else "__init__"

    def root_modules(self) -> list[str]:
        """The modules at the package root besides ``__init__``."""
        return sorted(m.split(".")[1] for m in self.modules if m.count(".") == 1 and m.startswith("vllm_kvcodec.")
                      and not self.modules[m].name == "__init__.py")

    def room_imports(self) -> dict[str, set[str]]:
        edges: dict[str, set[str]] = {self.room(m): set() for m in self.modules}
        for module, targets in self.imports.items():
            for target in targets:
                if self.room(target) != self.room(module):
                    edges[self.room(module)].add(self.room(target))
        return edges

    def module_circles(self) -> list[list[str]]:
        return circles(self.imports)

    def room_circles(self) -> list[list[str]]:
        return circles(self.room_imports())

    def layers(self) -> list[list[str]]:
        """Rooms in layers, lowest first: each room imports only rooms of lower layers (rooms in a circle are left
        out: there is no such order for them)."""
        edges = self.room_imports()
        placed: dict[str, int] = {}
        while True:
            ready = [r for r, deps in edges.items() if r not in placed and deps <= placed.keys()]
            if not ready:
                break
            for r in ready:
                placed[r] = 1 + max((placed[d] for d in edges[r]), default=-1)
        out: list[list[str]] = []
        for room, level in placed.items():
            while len(out) <= level:
                out.append([])
            out[level].append(room)
        return [sorted(level) for level in out]

    def room_lines(self) -> dict[str, tuple[int, int]]:
        """Per room: (modules, lines)."""
        sizes: dict[str, tuple[int, int]] = {}
        for module, n in self.lines.items():
            count, total = sizes.get(self.room(module), (0, 0))
            sizes[self.room(module)] = (count + 1, total + n)
        return sizes

    def largest(self, n: int = 10, under: str = "") -> list[tuple[str, int]]:
        files = [(str(p), self.lines[m]) for m, p in self.modules.items() if str(p).startswith(under)]
        return sorted(files, key=lambda f: -f[1])[:n]


def read_layout(root: Path) -> Layout:
    """The layout of the packages under ``root`` (a checkout, or site-packages)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            modules[".".join(parts)] = path.relative_to(root)
    lines, imports = {}, {}
    for module, path in modules.items():
        source = (root / path).read_text()
        lines[module] = source.count("\n")
        imports[module] = {t for t in _imported(module, path, ast.parse(source), modules) if t != module}
    return Layout(modules, lines, imports)


def _imported(module: str, path: Path, tree: ast.AST, modules: dict[str, Path]) -> Iterable[str]:
    """The modules of these packages ``module`` imports (``from p import m`` counts as ``p.m`` when it is one)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                yield name


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan): every import circle, each once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for node in sorted(edges):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def report(layout: Layout) -> str:
    """What ``kvcodec layout`` prints."""
    sizes = layout.room_lines()
    out = ["rooms in layers, lowest first (each imports only rooms of lower layers):"]
    for level, rooms in enumerate(layout.layers()):
        out.append(f"  {level}: " + ", ".join(f"{r} ({sizes[r][0]} modules, {sizes[r][1]} lines)" for r in rooms))
    out.append(f"modules at the package root: {', '.join(layout.root_modules())}")
    out.append("largest files:")
    out += [f"  {n:5d}  {path}" for path, n in layout.largest()]
    module_circles, room_circles = layout.module_circles(), layout.room_circles()
    out.append(f"import circles between modules: {len(module_circles)}")
    out += [f"  {' <-> '.join(c)}" for c in module_circles]
    out.append(f"import circles between rooms: {len(room_circles)}")
    out += [f"  {' <-> '.join(c)}" for c in room_circles]
    total = sum(layout.lines[m] for m in layout.modules)
    out.append(f"{len(layout.modules)} modules, {total} lines")
    return "\n".join(out)
