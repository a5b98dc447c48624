"""docs/architecture.md stays true: the files and tests it names exist, it names every source file, config class,
command and core message (and core_process.py handles each message), tensors stay where it says, the layers import
downwards only, and nothing in the repository points outside it (a clone has nothing beside it)."""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
DOCS = [REPO / "docs" / "architecture.md", REPO / "README.md"]
# Lower layers first: a module may import its own layer and the ones below, never one above.
# benchmark/ sits beside the CLI: `serval bench throughput` and `bench quality` drive the engine (`bench serve` is an
# HTTP client).
# cluster/ (the router over replicas) talks to servers over HTTP and sits beside the CLI too.
LAYER_RANK = {"layers": 0, "model": 1, "engine": 2, "server": 3, "cli": 4, "benchmark": 4, "cluster": 4}
# The package root re-exports the engine (LLM, LLMEngine), so it ranks as the engine.
ROOT_RANK = LAYER_RANK["engine"]
SKIPPED_DIRS = {"__pycache__", "build", "dist", "results", "node_modules"}
SOURCE_SUFFIXES = {".py", ".cpp", ".h"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".html", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".json"}


def _rank(module: str) -> float | None:
    """serval.engine.scheduler → 2; a shared top-level module (serval.config, ...) → None."""
    parts = module.split(".")
    if parts == ["serval"]:
        return ROOT_RANK
    return LAYER_RANK.get(parts[1]) if len(parts) > 1 else None


def _all_imports(path: Path) -> list[str]:
    """The modules a file imports, at top level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def _imports(path: Path) -> list[str]:
    """The serval modules a file imports, at top level or inside functions."""
    return [m for m in _all_imports(path) if m == "serval" or m.startswith("serval.")]


def _source_files() -> list[Path]:
    """The package's Python modules and C++ sources (``__init__.py`` files aside)."""
    return sorted(p for p in (REPO / "serval").rglob("*") if p.suffix in SOURCE_SUFFIXES
                  and p.name != "__init__.py" and not SKIPPED_DIRS & set(p.parts))


def _named_source_files(text: str) -> set[str]:
    """Source files a text names in backticks: ``serval/engine/core.py``, ``engine/core.py`` or ``core.py``."""
    return set(re.findall(r"`([\w./-]+\.(?:py|cpp|h))`", text))


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
    text = ARCHITECTURE.read_text()
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
    # A short name (`runner.py`, `layers/csrc/panel_linear.cpp`) is the end of a path in the package.
    sources = [p.relative_to(REPO).as_posix() for p in _source_files()]
    for name in _named_source_files(text):
        assert any(s == name or s.endswith("/" + name) for s in sources) or (REPO / name).exists(), (
            f"docs/architecture.md names {name}, which is no file of the package")


def test_the_architecture_document_names_every_source_file_of_the_package():
    named = _named_source_files(ARCHITECTURE.read_text())
    unnamed = [p.relative_to(REPO).as_posix() for p in _source_files()]
    unnamed = [s for s in unnamed if not any(s == n or s.endswith("/" + n) for n in named)]
    assert unnamed == []


def test_the_architecture_document_lists_every_config_class():
    tree = ast.parse((REPO / "serval" / "config.py").read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)
               and any(getattr(d, "id", None) == "dataclass" for d in node.decorator_list)}
    listed = re.search(r"`config\.py` \(([^)]*)\)", ARCHITECTURE.read_text())
    assert listed is not None, "docs/architecture.md lists config.py's classes as `config.py` (`...`, ...)"
    assert "EngineConfig" in classes and classes <= set(re.findall(r"`(\w+)`", listed.group(1)))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_the_architecture_document_lists_every_command():
    from serval.cli import build_parser

    text = ARCHITECTURE.read_text()
    commands = _subcommands(build_parser())
    listed = re.search(r"`serval ([\w-]+(?: \| [\w-]+)+)`", text)
    assert listed is not None, "docs/architecture.md lists the commands as `serval serve | router | ...`"
    assert sorted(listed.group(1).split(" | ")) == sorted(commands)
    bench_commands = sorted(_subcommands(commands["bench"]))
    assert [c for c in bench_commands if f"`serval bench {c}`" not in text] == []


def test_tensors_stay_where_the_architecture_document_says():
    # The scheduler, the block pool and Request deal in ints (their modules import no torch themselves); every engine
    # module that does import torch is named in the document's paragraph on where tensors live (it says so).
    engine = REPO / "serval" / "engine"
    for name in ("scheduler.py", "kv_cache.py", "request.py"):
        assert "torch" not in {m.split(".")[0] for m in _all_imports(engine / name)}, f"{name} imports torch"
    paragraph = next(p for p in ARCHITECTURE.read_text().split("\n\n") if "import no torch" in p)
    with_torch = [p.name for p in sorted(engine.glob("*.py"))
                  if "torch" in {m.split(".")[0] for m in _all_imports(p)}]
    assert "runner.py" in with_torch
    assert [name for name in with_torch if f"`{name}`" not in paragraph] == []


def _message_classes(direction: str) -> list[str]:
    """The class names engine/messages.py lists in COMMANDS, REPLIES or PAYLOADS."""
    tree = ast.parse((REPO / "serval" / "engine" / "messages.py").read_text())
    value = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == direction)
    return [element.id for element in value.elts]


def _match_cases(path: Path, functions: set[str]) -> set[str]:
    """The classes named by the `case X(...)` patterns in these functions of a file."""
    tree = ast.parse(path.read_text())
    return {node.cls.id for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef) and function.name in functions
            for node in ast.walk(function) if isinstance(node, ast.MatchClass)}


def test_the_architecture_document_names_every_message_between_front_end_and_core():
    commands, replies = _message_classes("COMMANDS"), _message_classes("REPLIES")
    assert {"AddRequests", "FinishRequests", "EngineCoreOutputs"} <= set(commands + replies)
    # Every dataclass messages.py defines is a message of one of the two directions, or what they carry.
    tree = ast.parse((REPO / "serval" / "engine" / "messages.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, ast.ClassDef)
               and any(getattr(d, "id", None) == "dataclass" for d in n.decorator_list)]
    assert [name for name in defined if name not in commands + replies + _message_classes("PAYLOADS")] == []
    text = ARCHITECTURE.read_text()
    assert [name for name in commands + replies if f"`{name}" not in text] == []
    # The core's loop has a case for every command; the front end's start and output thread one for every reply.
    engine = REPO / "serval" / "engine"
    assert sorted(set(commands) - _match_cases(engine / "core_process.py", {"_core_loop"})) == []
    assert sorted(set(replies) - _match_cases(engine / "core_client.py", {"_wait_ready", "_read_outputs"})) == []


def test_the_server_and_front_end_modules_import_neither_torch_nor_the_engine_core():
    """What `serval serve` imports for its default engine (a core process), with its config built from the flags
    and the model's tokenizer loaded: no torch, no engine core, no xgrammar (which imports torch); the core process
    has them (it settles the config: EngineConfig.settled). Through a real server: tests/server/
    test_responsiveness.py::test_the_server_process_has_no_torch_nor_grammar_library_and_its_core_loads_them."""
    script = ("import sys\n"
              "import serval.cli, serval.server.app, serval.engine.core_client\n"
              "from serval.cli import _engine_config, build_parser\n"
              "from serval.model.registry import resolve_model_path\n"
              "from serval.tokenizer import Tokenizer\n"
              "config = _engine_config(build_parser().parse_args(['serve']))\n"
              "Tokenizer.load(resolve_model_path(config.model))\n"
              "heavy = ('torch', 'xgrammar', 'serval.engine.core', 'serval.layers', 'serval.model.loader')\n"
              "print(sorted(m for m in heavy if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


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


# The server's functions stay short enough to read on a screen; create_app only wires the routes to OpenAIServing.
MAX_SERVER_FUNCTION_LINES = 80
MAX_CREATE_APP_LINES = 120


def _functions(path: Path) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, int]]:
    """Every function in a file, nested ones included, with its length in lines."""
    return [(node, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_server_functions_stay_short():
    server = REPO / "serval" / "server"
    app_functions = _functions(server / "app.py")
    create_app, create_app_lines = next((n, lines) for n, lines in app_functions if n.name == "create_app")
    routes = [(n, lines) for n, lines in app_functions if n is not create_app and n in set(ast.walk(create_app))]
    too_long = [f"{path.name}::{node.name} ({lines} lines)" for path in sorted(server.glob("*.py"))
                for node, lines in (app_functions if path.name == "app.py" else _functions(path))
                if node is not create_app and lines > MAX_SERVER_FUNCTION_LINES]
    assert too_long == []
    assert create_app_lines <= MAX_CREATE_APP_LINES
    assert len(routes) >= 10 and [n.name for n, lines in routes if lines > 12] == []  # the routes stay thin


def test_router_functions_stay_short():
    # The router's app holds thin routes; the work lives in cluster/proxy.py's ReplicaProxy (create_router_app was
    # one 297-line function of closures).
    cluster = REPO / "serval" / "cluster"
    functions = {path.name: _functions(path) for path in (cluster / "router.py", cluster / "proxy.py")}
    create, create_lines = next((n, lines) for n, lines in functions["router.py"] if n.name == "create_router_app")
    routes = [(n, lines) for n, lines in functions["router.py"] if n is not create and n in set(ast.walk(create))]
    too_long = [f"{name}::{node.name} ({lines} lines)" for name, found in functions.items() for node, lines in found
                if node is not create and lines > MAX_SERVER_FUNCTION_LINES]
    assert too_long == []
    assert create_lines <= 60
    assert len(routes) >= 5 and [n.name for n, lines in routes if lines > 12] == []


MAX_TOKENS_NAMES = {"max_tokens", "max_completion_tokens", "max_output_tokens"}


def _max_tokens_defaults() -> list[str]:
    """Every default given to a max_tokens field or argument in the server, the engine and SamplingParams, as
    ``file:line value``."""
    found = []
    package = REPO / "serval"
    paths = [*(package / "server").glob("*.py"), *(package / "engine").glob("*.py"), package / "sampling_params.py"]
    for path in sorted(paths):
        where = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in MAX_TOKENS_NAMES and node.value:
                found.append(f"{where}:{node.lineno} {ast.unparse(node.value)}")
            elif isinstance(node, ast.arguments):
                args = node.posonlyargs + node.args
                pairs = list(zip(args[len(args) - len(node.defaults):], node.defaults))
                pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
                found += [f"{where}:{d.lineno} {ast.unparse(d)}" for a, d in pairs if a.arg in MAX_TOKENS_NAMES]
    return found


def test_max_tokens_has_one_default_literal_and_one_bound():
    # The literal default lives once (sampling_params.DEFAULT_MAX_TOKENS: OpenAI's completions default, vLLM's);
    # every other default of a max_tokens is that name or None (chat's: up to the context).
    defaults = _max_tokens_defaults()
    assert defaults and all(d.endswith((" DEFAULT_MAX_TOKENS", " None")) for d in defaults), defaults
    assert re.search(r"^DEFAULT_MAX_TOKENS = 16\b", (REPO / "serval" / "sampling_params.py").read_text(), re.M)
    # The HTTP bound of max_tokens and its other names is the one MaxTokens type (completions alone also take 0).
    for name in ("protocol.py", "responses.py"):
        for node in ast.walk(ast.parse((REPO / "serval" / "server" / name).read_text())):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in MAX_TOKENS_NAMES:
                annotation = ast.unparse(node.annotation)
                assert "MaxTokens" in annotation or "ge=0" in annotation, f"{name}:{node.lineno} {annotation}"


def test_temperature_and_top_p_have_one_http_bound():
    # As MaxTokens: the chat, completions and Responses schemas take OpenAI's ranges from one type each.
    types = {"temperature": "Temperature", "top_p": "TopP"}
    found = []
    for name in ("protocol.py", "responses.py"):
        for node in ast.walk(ast.parse((REPO / "serval" / "server" / name).read_text())):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in types:
                found.append(f"{name}:{node.lineno} {ast.unparse(node.annotation)} = {ast.unparse(node.value)}")
                assert ast.unparse(node.annotation) == f"{types[node.target.id]} | None", found[-1]
                assert ast.unparse(node.value) == "None", found[-1]  # no Field(ge=...) beside the type
    assert len(found) == 4, found


def _reads_the_message(expr: ast.AST, exc: str, derived: set[str]) -> bool:
    """Whether ``expr`` uses the text of the exception named ``exc`` (``str(exc)``, ``exc.args``, ``exc.message``)
    or a name computed from it."""
    return any(ast.unparse(node) in (f"str({exc})", f"{exc}.args", f"{exc}.message")
               or (isinstance(node, ast.Name) and node.id in derived) for node in ast.walk(expr))


def test_an_error_is_named_by_its_type_never_by_its_text():
    """Errors are typed (serval/errors.py: a RequestError is raised where its check is, with the field and the code):
    where the server turns a caught exception into an error, what it names comes from the exception's type and fields,
    never from its message (a message that mentions max_tokens or the context names neither)."""
    offenders = []
    for path in sorted((REPO / "serval" / "server").glob("*.py")):
        for handler in ast.walk(ast.parse(path.read_text())):
            if not isinstance(handler, ast.ExceptHandler) or handler.name is None:
                continue
            assigns = [n for n in ast.walk(handler) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value]
            derived: set[str] = set()
            for _ in assigns:  # to a fixed point: a name computed from one computed from the message
                for node in assigns:
                    if _reads_the_message(node.value, handler.name, derived):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        derived |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            for call in ast.walk(handler):
                if not (isinstance(call, ast.Call) and ast.unparse(call.func) in ("OpenAIError", "RequestError")):
                    continue
                message_at = 0 if ast.unparse(call.func) == "OpenAIError" else 1
                naming = [a for i, a in enumerate(call.args) if i != message_at]
                naming += [k.value for k in call.keywords if k.arg != "message"]
                if any(_reads_the_message(a, handler.name, derived) for a in naming):
                    offenders.append(f"{path.name}:{call.lineno} {ast.unparse(call)[:100]}")
    assert offenders == []


def test_a_prompts_room_is_computed_in_one_function():
    # prompt_room (sampling_params.py) is the one place that subtracts max_tokens from the context; whatever builds a
    # chat prompt or checks a prompt against max_tokens calls it.
    subtractions, callers = [], []
    for path in sorted((REPO / "serval").rglob("*.py")):
        for function, _ in _functions(path):
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(function)
                     if isinstance(n, (ast.Name, ast.Attribute))}
            if function.name != "prompt_room":
                subtractions += [f"{path.name}:{n.lineno}" for n in ast.walk(function)
                                 if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)
                                 and "max_model_len" in ast.unparse(n.left) and "max_tokens" in ast.unparse(n.right)]
            if "build_chat_prompt" in names and function.name != "build_chat_prompt":
                callers.append((f"{path.name}::{function.name}", "prompt_room" in names))
    assert subtractions == []
    assert len(callers) >= 3 and [name for name, uses in callers if not uses] == []


# vLLM v1's EngineCore.step is about 25 lines: schedule, execute, update. Serval's was 107 (issue 50).
MAX_CORE_STEP_LINES = 25


def test_the_engine_core_step_stays_short_and_reads_as_schedule_execute_update():
    """EngineCore.step calls its phases and nothing else of its own; the model, its loading and the KV cache's size
    are the Worker's (engine/worker.py), so the core imports no loader."""
    core = REPO / "serval" / "engine" / "core.py"
    step, lines = next((node, lines) for node, lines in _functions(core) if node.name == "step")
    assert lines <= MAX_CORE_STEP_LINES
    calls = sorted((node.lineno, node.func.attr) for node in ast.walk(step)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr.startswith("_"))
    assert [name for _, name in calls] == ["_outputs_between_steps", "_schedule_step", "_execute", "_update"]
    assert not {"serval.model.loader", "serval.engine.memory_profile", "serval.engine.workers"} & set(_imports(core))


def test_one_place_decides_multi_step_runs():
    """The worker states once what it runs in a row (Worker.max_decode_steps); the scheduler alone makes each step's
    plan of forwards in a row (SchedulerOutput.num_decode_steps); the runner only executes it. (It was decided in
    five places, with an override from the core.)"""
    deciders, limiters = set(), set()
    for path in sorted((REPO / "serval").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            attributes = {t.attr for t in targets if isinstance(t, ast.Attribute)}
            if isinstance(node, ast.Call):
                attributes |= {k.arg for k in node.keywords}
            if "num_decode_steps" in attributes:
                deciders.add(path.name)
            if "max_decode_steps" in attributes:
                limiters.add(path.name)
    assert deciders == {"scheduler.py"}
    assert limiters == {"scheduler.py", "worker.py"}  # the worker states it, the scheduler keeps it


def test_one_front_end_adds_requests_over_either_core_client():
    """LLMEngine (an in-process core) and CoreProcessClient (a core process) add a request through one FrontEnd:
    prepare, register, then their core client's send. The request's processing and registration are written once
    (they were written in both, issue 50)."""
    calls: dict[str, set[str]] = {}
    for path in sorted((REPO / "serval").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # called, or handed to a thread to call
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                pair = f"{node.value.attr.lstrip('_')}.{node.attr}"
                if pair in ("inputs.process", "outputs.add", "front.prepare", "front.register"):
                    calls.setdefault(pair, set()).add(path.name)
    both = {"engine.py", "core_client.py"}
    assert calls == {"inputs.process": {"frontend.py"}, "outputs.add": {"frontend.py"},
                     "front.prepare": both, "front.register": both}
