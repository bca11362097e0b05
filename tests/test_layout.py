"""The package layout is the architecture: each layer imports only the layers below it, the engine knows
nothing of Lightning or Hydra, and the configs ship inside the package."""

from __future__ import annotations

import ast
import configparser
import fnmatch
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_shard"
COMMANDS = {"__init__", "train", "estimate", "bench", "consolidate", "export"}  # `python -m lightning_shard.X`
# each layer and the layers it may import (besides itself)
BELOW = {
    "engine": set(),
    "checkpoint": {"engine"},
    "memory": {"engine"},
    "lightning": {"engine", "checkpoint", "memory"},
    "app": {"engine", "checkpoint", "memory", "lightning", ""},
    "tools": {"engine", "checkpoint", "memory", "lightning", "app", ""},
    # the simulator runs the engine and FSDP2 on a simulated world, with the benchmarks' models and process spawning
    "simulate": {"engine", "checkpoint", "memory", "lightning", "app", "tools", ""},
}
FRAMEWORKS = ("lightning", "lightning_utilities", "hydra", "omegaconf")  # not below the Lightning face
# the engine's rooms, each importing only the rooms before it; shard_module.py, the entry point, all of them
ROOMS = ("comm", "plan", "storage", "optim", "runtime")


def imports_of(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def layer_of(module: str) -> str:
    """``lightning_shard.engine.runtime.hooks`` -> ``engine``; the top-level package or a command -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in BELOW else ""


def test_only_commands_lie_loose_in_the_package():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == COMMANDS
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(BELOW)


def test_each_layer_imports_only_layers_below_it():
    wrong = []
    for layer, allowed in BELOW.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            for name in imports_of(path):
                if name.split(".")[0] == "lightning_shard" and layer_of(name) not in allowed | {layer}:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_engines_rooms_import_only_the_rooms_below_them():
    engine = PACKAGE / "engine"
    assert {p.name for p in engine.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ROOMS)
    assert {p.stem for p in engine.glob("*.py")} == {"__init__", "shard_module"}  # the rest in rooms
    wrong = []
    for rank, room in enumerate(ROOMS):
        for path in (engine / room).glob("*.py"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[:2] == ["lightning_shard", "engine"] and (len(parts) < 3 or parts[2] not in ROOMS[: rank + 1]):
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_engine_checkpoint_and_memory_know_no_framework():
    wrong = [f"{path.relative_to(PACKAGE)} imports {name}"
             for layer in ("engine", "checkpoint", "memory") for path in (PACKAGE / layer).rglob("*.py")
             for name in imports_of(path) if name.split(".")[0] in FRAMEWORKS]
    assert not wrong, "\n".join(wrong)


def test_commands_are_thin():
    for name in COMMANDS - {"__init__"}:
        path = PACKAGE / f"{name}.py"
        assert len(path.read_text().splitlines()) <= 12, f"{name}.py should only forward to its layer"


def test_every_config_is_shipped_as_package_data():
    setup = configparser.ConfigParser()
    setup.read(PACKAGE.parent / "setup.cfg")
    patterns = setup["options.package_data"]["lightning_shard.app"].replace(",", " ").split()
    app = PACKAGE / "app"
    configs = [str(p.relative_to(app)) for p in (app / "conf").rglob("*.yaml")]
    assert configs and not (PACKAGE.parent / "conf").exists()
    unshipped = [c for c in configs if not any(fnmatch.fnmatch(c, pattern) and c.count("/") == pattern.count("/")
                                               for pattern in patterns)]
    assert not unshipped


def test_no_module_imports_itself_round_a_circle():
    """Imports inside functions count: a circle closed by a deferred import is still a circle (module A must be
    read to understand module B and the other way round)."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    imports = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    circles, done = [], set()

    def visit(name: str, path: list[str]) -> None:  # depth first; a name met again on the path closes a circle
        if name in path:
            circles.append(" -> ".join(path[path.index(name):] + [name]))
            return
        if name in done:
            return
        for imported in sorted(imports[name]):
            visit(imported, path + [name])
        done.add(name)

    for name in sorted(modules):
        visit(name, [])
    assert not circles, "\n".join(circles)
