"""The house rules of docs/architecture.md, checked on the source: imports flow one way (no circle), the
plain-torch rooms import nothing of Lightning, Hydra, OmegaConf or the rooms above them, and no module
is over 300 lines."""

import ast
from pathlib import Path

from helpers import REPO

SRC = REPO / "src"
PURE = ("ddpm.diffusion", "ddpm.models")  # plain torch
FRAMEWORKS = ("lightning", "pytorch_lightning", "hydra", "omegaconf")
MAX_LINES = 300


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (`from a.b import c` -> a.b.c or a.b)."""
    names, known = set(), modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                      for a in node.names}  # fmt: skip
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_no_import_circle() -> None:
    graph = {name: {i for i in imports(path) if i in modules()} - {name} for name, path in modules().items()}
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != "open", f"import circle: {' -> '.join([*trail, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_plain_torch_rooms_import_no_framework_and_nothing_above_them() -> None:
    for name, path in modules().items():
        if not name.startswith(PURE):
            continue
        for imported in imports(path):
            assert imported.split(".")[0] not in FRAMEWORKS, f"{name} imports {imported}"
            if imported.startswith("ddpm."):
                assert imported.startswith(PURE), f"{name} imports {imported}, a room above the plain-torch ones"


def test_no_module_over_300_lines() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_architecture_doc_names_every_room_and_file() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    for path in modules().values():
        if path.name == "__init__.py":
            continue
        assert path.name in text, f"docs/architecture.md does not say where {path.relative_to(REPO)} lives"
