"""docs/architecture.md stays true: the files and tests it names exist, the layers import downwards only, and
nothing in the repository points outside it (a clone has nothing beside it)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "docs" / "architecture.md", REPO / "README.md"]
# Lower layers first: a module may import its own layer and the ones below, never one above.
# benchmark/ sits beside the CLI: `serval bench throughput` drives the engine (`bench serve` is an HTTP client).
# cluster/ (the router over replicas) talks to servers over HTTP and sits beside the CLI too.
LAYER_RANK = {"layers": 0, "model": 1, "engine": 2, "server": 3, "cli": 4, "benchmark": 4, "cluster": 4}
# The package root re-exports the engine (LLM, LLMEngine), so it ranks as the engine.
ROOT_RANK = LAYER_RANK["engine"]
SKIPPED_DIRS = {"__pycache__", "build", "dist", "results", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".html", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".json"}


def _rank(module: str) -> float | None:
    """serval.engine.scheduler → 2; a shared top-level module (serval.config, ...) → None."""
    parts = module.split(".")
    if parts == ["serval"]:
        return ROOT_RANK
    return LAYER_RANK.get(parts[1]) if len(parts) > 1 else None


def _imports(path: Path) -> list[str]:
    """The serval modules a file imports, at top level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [m for m in found if m == "serval" or m.startswith("serval.")]


def test_layers_import_downwards_only():
    violations = []
    for path in sorted((REPO / "serval").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if module == "serval.__init__":
            continue
        own = _rank(module)
        for imported in _imports(path):
            rank = _rank(imported)
            if rank is None:
                continue  # shared top-level modules may be imported from anywhere
            # Shared modules sit beside the layers: they may use layers/ but nothing above it.
            limit = LAYER_RANK["layers"] if own is None else own
            if rank > limit:
                violations.append(f"{module} imports {imported}")
    assert violations == []


def test_the_architecture_document_names_only_files_and_tests_that_exist():
    text = (REPO / "docs" / "architecture.md").read_text()
    current_file = None
    num_tests = 0
    for match in re.finditer(r"`((?:serval|tests|scripts|docs)/[\w./-]+)`|`(test_\w+)`", text):
        path, test_name = match.groups()
        if path:
            assert (REPO / path).exists(), f"docs/architecture.md names {path}, which does not exist"
            current_file = REPO / path if path.endswith(".py") else current_file
        else:
            assert current_file is not None, f"{test_name} is named before any test file"
            assert re.search(rf"^def {test_name}\(", current_file.read_text(), re.MULTILINE), (
                f"docs/architecture.md says {current_file.relative_to(REPO)} has {test_name}")
            num_tests += 1
    assert num_tests >= 15


def test_readme_and_docs_link_only_inside_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        links = re.findall(r"\]\(([^)\s]+)\)", text)
        for link in links:
            if not re.match(r"[a-z]+://", link):
                target = (doc.parent / link.split("#")[0]).resolve()
                assert target.is_relative_to(REPO) and target.exists(), f"{doc.name} links to {link}"
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text()  # the README leads to the document


def _text_files():
    for directory, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
                   and (not d.startswith(".") or d == ".ci")]
        for name in files:
            path = Path(directory) / name
            if path.suffix in TEXT_SUFFIXES or path.parent.name == ".ci":
                yield path


def test_nothing_points_outside_the_repository():
    this_file = Path(__file__).resolve()
    offenders = []
    for path in _text_files():
        if path == this_file:
            continue
        text = path.read_text(errors="replace")
        for needle in ("../shared", "/work/"):
            if needle in text:
                offenders.append(f"{path.relative_to(REPO)}: {needle}")
    assert offenders == []
