"""The package's shape: every import arrow points down, through the layers below (LAYERS) and with no
cycle (counting imports inside functions and under TYPE_CHECKING, and the package `__init__` that
importing a module of another package runs first), and each module imports on its own."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rdlm"
OPTIONAL = {"rdlm.integrations.lm_eval": "lm_eval", "rdlm.integrations.hf": "transformers",
            **{f"rdlm.integrations.vllm.{m}": "vllm" for m in ("adaptive", "engine_config", "layers", "model")},
            **{f"rdlm.integrations.hf.{m}": "transformers"
               for m in ("cache", "config", "generation", "loading", "model", "sequences", "tokenizer")}}


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The rdlm modules `name` imports anywhere in its source (top level, functions, TYPE_CHECKING):
    `from a.b import c` counts as a.b.c when that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:   # `import rdlm.a.b.Class` style: the module part
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # Importing rdlm.a.b from outside rdlm.a runs rdlm/a/__init__.py first: an arrow to it too.
    for target in list(found):
        parent = target.rpartition(".")[0]
        while parent.count(".") >= 1 and not (name == parent or name.startswith(parent + ".")):
            found.add(parent)
            parent = parent.rpartition(".")[0]
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None (depth-first search)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_package_import_graph_has_no_cycle():
    modules = module_names()
    # The package root re-exports the public API; a submodule importing `rdlm` itself would be a cycle
    # through it, so the root is a node like any other.
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["rdlm.inference.generate"], "the graph should see the package"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The layers, bottom up: a module imports only from its own package and from packages of a lower layer.
# The root re-exports the public API (rdlm.model's); the command line and the demo are imported by nobody
# below them.
LAYERS = {"rdlm.fileio": 0, "rdlm.checks": 0, "rdlm.data": 1, "rdlm.model": 2, "rdlm": 3, "rdlm.resources": 3,
          "rdlm.inference": 4, "rdlm.train": 5, "rdlm.analysis": 5, "rdlm.integrations": 5, "rdlm.demo": 6,
          "rdlm.cli": 7, "rdlm.__main__": 8}


def layer_of(name: str) -> str:
    return name if name in LAYERS else ".".join(name.split(".")[:2])


def test_every_import_points_to_a_lower_layer():
    modules = module_names()
    assert {layer_of(name) for name in modules} <= set(LAYERS), "a new package needs its place in LAYERS"
    upward = [f"{name} imports {target}" for name, path in modules.items()
              for target in sorted(imported_modules(name, path, modules))
              if layer_of(target) != layer_of(name) and LAYERS[layer_of(target)] >= LAYERS[layer_of(name)]]
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


# rdlm.inference's rooms, bottom up (rdlm/inference/__init__.py says what each holds): a module imports from its
# own room and from rooms below it, never up; a room's `__init__` imports nothing, so importing one module never
# loads its neighbours.
INFERENCE_ROOMS = {"exits": 0, "params": 1, "events": 2, "execution": 2, "scheduling": 3, "runner": 4,
                   "batching": 5, "generate": 6, "evaluate": 6, "server": 7}


def room_of(name: str) -> str:
    return name.split(".")[2]


def test_the_inference_rooms_import_downward():
    modules = module_names()
    inside = {name: path for name, path in modules.items() if name.startswith("rdlm.inference.")}
    assert {room_of(name) for name in inside} == set(INFERENCE_ROOMS), "every room (and only these) in its place"
    upward = [f"{name} imports {target}" for name, path in inside.items()
              for target in sorted(imported_modules(name, path, modules))
              if target.startswith("rdlm.inference.") and room_of(target) != room_of(name)
              and INFERENCE_ROOMS[room_of(target)] >= INFERENCE_ROOMS[room_of(name)]]
    assert not upward, "imports that run up a room:\n" + "\n".join(upward)
    rooms = [path for name, path in inside.items() if path.name == "__init__.py"]
    assert len(rooms) == 5
    importing = [str(path) for path in rooms
                 if any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.parse(path.read_text()).body)]
    assert not importing, f"room __init__ modules that import: {importing}"


def test_the_inference_package_has_no_flat_room():
    """The engine's parts live in rooms: the package's top holds only what callers use and the engine itself."""
    top = sorted(p.stem for p in (PACKAGE / "inference").glob("*.py") if p.stem != "__init__")
    assert top == ["batching", "evaluate", "events", "generate", "params"]


@pytest.mark.slow  # one interpreter per module (a minute)
def test_every_module_imports_on_its_own():
    """Each module imported first, in a process where no other rdlm module has been imported."""
    names = [n for n in module_names() if not n.endswith("__main__")]
    script = (
        "import importlib, sys\n"
        f"names, optional = {names!r}, {OPTIONAL!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'rdlm' or m.startswith('rdlm.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as err:\n"
        "        if err.name != optional.get(name, '') and not (err.name or '').startswith(optional.get(name, '?')):\n"
        "            failed.append(f'{name}: {err!r}')\n"
        "    except Exception as err:\n"
        "        failed.append(f'{name}: {err!r}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stdout + done.stderr


LONGEST_MODULE = 550


def test_no_module_is_longer_than_the_limit():
    """A module over ~550 lines is several modules: split it along its seams, each reading top to bottom."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in module_names().items()}
    assert max(lengths.values()) > LONGEST_MODULE // 2   # the count sees real modules
    long = {name: n for name, n in lengths.items() if n > LONGEST_MODULE}
    assert not long, f"modules over {LONGEST_MODULE} lines: {long}"



# The model's parts that the inference engine runs (the prelude, a core iteration, the coda) and the calls that
# run several core iterations; in rdlm/inference only the runner calls them on the model itself.
MODEL_CALLS = {"embed", "step", "readout", "forward", "exit_probability"}
# Teacher-forced scoring runs the model's own forward over whole sequences, as training does, with no cache
# and nothing decoded: perplexity, lm-eval scores and the learned gate's logits (evaluate.py).
SCORES_WITHOUT_A_RUNNER = {"rdlm.inference.evaluate"}


def model_calls(path: Path) -> list[str]:
    """Calls of the model's parts in a module's source: `model.step(...)`, `self.model.readout(...)`, or the
    model itself, `model(...)` (whatever the receiver holds, a name or attribute `model` is a model here)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        target = func.value if isinstance(func, ast.Attribute) and func.attr in MODEL_CALLS else func
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "model":
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(func)}")
    return found


def test_decoding_calls_the_model_only_through_the_runner():
    """Every core iteration (and prelude and coda) the engine runs goes through `ModelCalls`
    (rdlm/inference/execution/model_calls.py): no other module of rdlm/inference calls the model's parts itself, so the
    scheduler, the step calls, lockstep tokens, prompt chunks, speculative rounds and parallel waves all
    run the model one way."""
    names = module_names()
    inference = {n: p for n, p in names.items() if n.startswith("rdlm.inference.")}
    calls = {n: model_calls(p) for n, p in inference.items()}
    assert calls["rdlm.inference.execution.model_calls"], "the check sees the runner's own calls"
    assert calls["rdlm.inference.evaluate"], "and teacher-forced scoring's"
    allowed = {"rdlm.inference.execution.model_calls", *SCORES_WITHOUT_A_RUNNER}
    outside = {n: c for n, c in calls.items() if c and n not in allowed}
    assert not outside, f"modules that call the model itself instead of through ModelCalls: {outside}"


def cap_comparisons(path: Path) -> list[str]:
    """Ordering comparisons of a token's iterations with its cap (`iteration >= cap`, `iterations < num_steps`)."""
    def ident(node: ast.AST) -> str:
        return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops):
            names = [ident(operand) for operand in (node.left, *node.comparators)]
            if any(n in ("cap", "num_steps") for n in names) and any("iteration" in n for n in names):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_cap_is_compared_in_one_place():
    """Whether a token reached its cap is one rule (rdlm.inference.exits.track.at_cap, inside done_iterating):
    no other module of the engine or the vLLM plugin compares a token's iterations with its cap itself."""
    names = module_names()
    track = names["rdlm.inference.exits.track"]
    assert cap_comparisons(track), "the check sees the rule's own comparison"
    outside = {n: c for n, p in names.items()
               if (n.startswith("rdlm.inference.") or n.startswith("rdlm.integrations.vllm")) and p != track
               for c in [cap_comparisons(p)] if c}
    assert not outside, f"cap comparisons outside at_cap: {outside}"
