"""The user's documentation holds together: README stays short and links every page of docs/; every relative link
(and its anchor) in README, CHANGELOG and docs/ resolves; every command they show parses (Hydra overrides compose and
pass the app's checks, other commands' flags are in their --help, paths exist); CI runs README's two set-up commands;
every row of the setup report is explained; no issue numbers in the user's pages."""

from __future__ import annotations

import ast
import configparser
import contextlib
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
USER_PAGES = [README, *DOCS]  # what a user reads: the current state, no project history
ALL_PAGES = [*USER_PAGES, ROOT / "CHANGELOG.md"]
HYDRA_COMMANDS = {"lightning_shard.train", "lightning_shard.estimate"}  # their arguments are Hydra overrides

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *$", re.M)
STARTERS = ("python ", "pip ", "bash ", "lightning-shard-")


def without_code(text: str) -> str:
    return INLINE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``_`` and ``-`` kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def test_readme_is_short_and_links_every_page_of_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    linked = {(README.parent / target.split("#")[0]).resolve() for target in LINK.findall(without_code(text))}
    assert DOCS and [p.name for p in DOCS if p.resolve() not in linked] == []


def test_every_relative_link_resolves_anchors_too():
    broken = []
    for page in ALL_PAGES:
        for target in LINK.findall(without_code(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_each_page_starts_with_a_title_and_ends_with_its_limits():
    wrong = []
    for page in DOCS:
        headings = HEADING.findall(FENCE.sub("", page.read_text()))
        if not page.read_text().startswith("# "):
            wrong.append(f"{page.name}: no title first")
        sections = [title for level, title in headings if level == "##"]
        if page.name not in ("README.md", "limits.md") and (not sections or not sections[-1].startswith("Limits")):
            wrong.append(f"{page.name}: last section is {sections[-1:]}, not Limits")
    assert not wrong, "\n".join(wrong)


def test_no_issue_numbers_in_the_users_pages():
    found = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in USER_PAGES
             for m in re.finditer(r"\bissues? #?\d+", page.read_text(), re.I)]
    assert not found, "project history belongs in CHANGELOG.md:\n" + "\n".join(found)


def test_every_row_of_the_setup_report_is_explained():
    from lightning_shard.memory.estimate import MemoryEstimate

    offloaded = MemoryEstimate(*[0] * 8, host_resident=1).table()  # offload adds the host row
    rows = [line.split()[0] for line in offloaded.splitlines()]
    text = (ROOT / "docs" / "memory.md").read_text()
    assert "host" in rows and [name for name in rows if f"| `{name}` |" not in text] == []


# -- commands ----------------------------------------------------------------------------------------------------
def shown_commands(page: Path) -> list[list[str]]:
    """Each command a page shows, as argv: its bash blocks (continuations joined, comments dropped, ``&&`` split) and
    its inline code that starts like a command."""
    text = page.read_text()
    lines = [line for lang, body in FENCE.findall(text) if lang in ("bash", "sh")
             for line in body.replace("\\\n", " ").splitlines()]
    lines += [" ".join(span.split()) for span in INLINE.findall(FENCE.sub("", text))
              if " ".join(span.split()).startswith(STARTERS)]
    commands = []
    for line in lines:
        tokens = shlex.split(line, comments=True)
        commands += [list(group) for is_and, group in itertools.groupby(tokens, lambda t: t == "&&") if not is_and]
    return [normalized(c) for c in commands if c]


def normalized(argv: list[str]) -> list[str]:
    """Environment assignments and launchers dropped (``srun``; ``torchrun ... -m X``), console scripts as the
    ``python -m`` command they are, placeholders (``CKPT_DIR``, ``[OUT.ckpt]``) left out."""
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
        argv = argv[1:]
    if argv[:1] == ["srun"]:
        argv = argv[1:]
    if argv[:1] == ["torchrun"]:
        argv = ["python", *argv[argv.index("-m"):]]
    if argv and argv[0] in console_scripts():
        argv = ["python", "-m", argv[0].replace("lightning-shard-", "lightning_shard."), *argv[1:]]
    kept, in_brackets = [], False
    for token in argv:
        in_brackets = in_brackets or token.startswith("[")
        if not in_brackets and not re.fullmatch(r"[A-Z][A-Z0-9_]*", token):
            kept.append(token)
        in_brackets = in_brackets and not token.endswith("]")
    return kept


def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def console_scripts() -> set[str]:
    return {line.split("=")[0].strip() for line in setup_cfg()["options.entry_points"]["console_scripts"].split("\n")
            if line.strip()}


def requirement_names() -> tuple[set[str], set[str]]:
    """The extras setup.cfg declares, and every package it names."""
    cfg = setup_cfg()
    extras = dict(cfg["options.extras_require"])
    lines = [*cfg["options"]["install_requires"].split("\n"),
             *itertools.chain(*(value.split("\n") for value in extras.values()))]
    return set(extras), {re.split(r"[<>=!~\[; ]", line.strip())[0] for line in lines if line.strip()}


def problem_with(argv: list[str], helps: dict[str, list[str]]) -> str | None:
    """What is wrong with a command, or None; commands that need their --help are put in ``helps`` (target -> flags)."""
    if argv[:2] == ["pip", "install"] or argv[:4] == ["python", "-m", "pip", "install"]:
        extras, packages = requirement_names()
        args = argv[argv.index("install") + 1:]
        for i, arg in enumerate(args):
            if arg == "--index-url" or (i and args[i - 1] == "--index-url") or arg == "-e":
                continue
            if arg.startswith(".["):
                if not set(arg[2:-1].split(",")) <= extras:
                    return f"unknown extra in {arg} (setup.cfg has {sorted(extras)})"
            elif arg.startswith("-") or re.split(r"[<>=!~]", arg)[0] not in packages | {"torch"}:
                return f"{arg!r} is not a package of setup.cfg"
        return None
    if argv[:3] == ["python", "-m", "pytest"]:
        missing = [a for a in argv[3:] if not a.startswith("-") and not (ROOT / a.split("::")[0]).exists()]
        return f"no such test path: {missing}" if missing else None
    if argv[:1] == ["bash"]:
        proc = subprocess.run(["bash", "-n", str(ROOT / argv[1])], capture_output=True, text=True)
        return proc.stderr or None
    if argv[:2] == ["python", "-m"] and argv[2].startswith("tests."):
        return None if (ROOT / (argv[2].replace(".", "/") + ".py")).exists() else "no such test module"
    if argv[:2] == ["python", "-m"] and argv[2] in HYDRA_COMMANDS and "--help" not in argv:
        return overrides_problem(argv[2], [a for a in argv[3:] if a not in ("-m", "--multirun")])
    if argv[:2] == ["python", "-m"] and len(argv) > 2:
        if importlib.util.find_spec(argv[2]) is None:
            return "no such module"
        target, args = argv[2], argv[3:]
    elif argv[:1] == ["python"] and len(argv) > 1 and argv[1].endswith(".py"):
        if not (ROOT / argv[1]).exists():
            return "no such script"
        target, args = str(ROOT / argv[1]), argv[2:]
    else:
        return "a command this test cannot check: add a check for it"
    helps.setdefault(target, []).extend(a.split("=")[0] for a in args if a.startswith("--") and a != "--help")
    return None


def overrides_problem(command: str, overrides: list[str]) -> str | None:
    """The overrides compose with the packaged configs and pass the app's checks (a sweep: each of its values)."""
    from hydra import compose, initialize_config_dir

    from lightning_shard.app.checks import check_options
    from lightning_shard.app.train import CONF_DIR

    if [o for o in overrides if "=" not in o]:
        return f"not an override: {[o for o in overrides if '=' not in o]}"
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]  # Hydra's own settings
    variants = [overrides]
    for i, override in enumerate(overrides):  # a sweep: each value once, the others as written
        key, value = override.split("=", 1)
        if "," in value and not value.startswith(("[", "{", "'", '"')):
            variants += [[*overrides[:i], f"{key}={v}", *overrides[i + 1:]] for v in value.split(",")]
    for variant in variants[1:] if len(variants) > 1 else variants:
        said = io.StringIO()  # the app's one line for a bad value (cli.fail), then SystemExit
        try:
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"), contextlib.redirect_stderr(said):
                check_options(compose(config_name="config", overrides=variant), command, runs=False)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - what is wrong is the message
            return f"{' '.join(variant)}: {type(err).__name__}: {err} {said.getvalue().strip()}"
    return None


def check_commands(pages: list[Path]) -> list[str]:
    problems, helps = [], {}
    for page in pages:
        for argv in shown_commands(page):
            problem = problem_with(argv, helps)
            if problem:
                problems.append(f"{page.relative_to(ROOT)}: {shlex.join(argv)}: {problem}")
    # every --help in one interpreter (tests/cli_driver.py): an interpreter start costs more than a command
    targets = sorted(helps)
    driver = os.path.join(os.path.dirname(__file__), "cli_driver.py")
    proc = subprocess.run([sys.executable, driver, json.dumps([[t, ["--help"]] for t in targets])], cwd=ROOT,
                          capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for target, result in zip(targets, json.loads(proc.stdout.splitlines()[-1])):
        name = os.path.relpath(target, ROOT) if target.endswith(".py") else target
        if result["code"] != 0 or not ("usage:" in result["stdout"] or "powered by Hydra" in result["stdout"]):
            problems.append(f"{name} --help: exit {result['code']}: {result['stderr'][-500:]}")
        flags = set(re.findall(r"--[\w-]+", result["stdout"]))
        problems += [f"{name}: no option {flag} in its --help" for flag in sorted(set(helps[target]) - flags)]
    return problems


def test_every_command_the_pages_show_parses():
    problems = check_commands(ALL_PAGES)
    assert not problems, "\n".join(problems)


def extra_packages() -> dict[str, set[str]]:
    """Each extra of setup.cfg and the packages it names ("(none)": install_requires)."""
    cfg = setup_cfg()
    named = lambda value: {re.split(r"[<>=!~\[; ]", line.strip())[0] for line in value.split("\n") if line.strip()}
    return {"(none)": named(cfg["options"]["install_requires"]),
            **{name: named(value) for name, value in cfg["options.extras_require"].items()}}


def test_the_extras_tell_one_story():
    """README's table of extras lists setup.cfg's, package for package; `test` brings every package of `qlora`, and
    `.ci/run` installs every package a test imports (or what those bring)."""
    from importlib import metadata

    extras = extra_packages()
    text = README.read_text()
    table = list(itertools.takewhile(lambda line: line.startswith("|"),
                                     text[text.index("| extra | brings | needed for |"):].splitlines()))
    rows = {cells[0].strip("` "): set(INLINE.findall(cells[1])) for line in table[2:]
            for cells in [line.strip("|").split("|")]}
    rows = {name: packages for name, packages in rows.items() if name != "(none)" or packages}
    assert rows == extras, (rows, extras)
    assert extras["hf"] <= extras["qlora"] <= extras["test"]
    ci = next(shlex.split(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()
              if " install " in line and not line.startswith("#"))
    installed = set(extras["(none)"]).union(*(extras[e] for e in next(a for a in ci if a.startswith(".["))[2:-1]
                                                .split(",")))
    brought = set(installed)
    for package in installed:  # and what they require
        brought |= {re.split(r"[<>=!~\[; (]", r)[0] for r in (metadata.requires(package) or []) if "extra ==" not in r}
    names = {p.lower().replace("_", "-") for p in brought} | {"torch"}
    distributions = metadata.packages_distributions()
    imported = {node.names[0].name if isinstance(node, ast.Import) else node.module
                for path in (ROOT / "tests").glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.module and not node.level)}
    third_party = {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - {"lightning_shard", "tests"}
    missing = [m for m in sorted(third_party)
               if not {d.lower().replace("_", "-") for d in distributions.get(m, [m])} & names]
    assert missing == [], f"tests import {missing}, which .ci/run does not install"


def test_ci_runs_readmes_two_set_up_commands():
    """README's quick start is two commands, install-and-train and the tests; .ci/run installs the same way and runs
    the same test command."""
    text = README.read_text()
    quick_start = text[text.index("## Quick start"):]
    quick_start = quick_start[:quick_start.index("\n## ", 1)]
    blocks = [body.strip() for lang, body in FENCE.findall(quick_start) if lang == "bash"]
    assert len(blocks) == 2, blocks
    install, train = (shlex.split(part) for part in blocks[0].split("&&"))
    assert install[:2] == ["pip", "install"] and train == ["python", "-m", "lightning_shard.train"], blocks[0]
    ci = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    ci_install = next(argv for argv in ci if "install" in argv)
    assert set(install[2:]) <= set(ci_install), (install, ci_install)
    assert shlex.split(blocks[1]) in ci, (blocks[1], ci)


# -- code that runs ----------------------------------------------------------------------------------------------
def section(page: Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_qlora_recipe_of_hf_md_runs_and_its_adapter_reloads_to_the_sharded_logits(tmp_path):
    """docs/hf.md's QLoRA section is a script: run as it is (2 CPU ranks) on a tiny Llama folder, peft's reload of
    its adapter in one process gives the sharded model's logits exactly."""
    pytest.importorskip("bitsandbytes", reason="needs the qlora extra")
    from lightning_shard.app.models.tiny_llama import tiny_llama_folder

    scripts = [body for lang, body in FENCE.findall(section(ROOT / "docs" / "hf.md", "QLoRA: a 4-bit base"))
               if lang == "python"]
    assert len(scripts) == 1 and '"path/to/llama"' in scripts[0]
    folder = tiny_llama_folder(tmp_path / "llama", tie_word_embeddings=False)
    (tmp_path / "qlora.py").write_text(scripts[0].replace('"path/to/llama"', repr(str(folder))))
    proc = subprocess.run([sys.executable, "qlora.py"], cwd=tmp_path, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert float(proc.stdout.split("max |logits difference|")[1].split()[0]) == 0.0, proc.stdout[-2000:]


# -- figures read from the code ------------------------------------------------------------------------------------
SWEEP = (400000, 1600000, 3200000, 12800000)  # README's and docs/hydra.md's sweep command


def test_the_setup_reports_and_sweep_figures_the_pages_quote_are_what_the_code_gives(tmp_path):
    """The quick start's setup report in README, the sweep's GPT (parameters, blocks, units per unit size, setup
    estimates) in README and docs/hydra.md, and the plan docs/options.md shows: as the app's configs give them at
    setup on 2 ranks today."""
    from tests import docs_scenarios
    from tests.world import run_world

    runs = [[]] + [["experiment=unit_size_sweep", f"strategy.unit_size={size}"] for size in SWEEP]
    quick_start, *sweep = run_world(docs_scenarios.setup_reports, 2, runs, str(tmp_path), timeout=280)[0]
    readme, hydra = README.read_text(), (ROOT / "docs" / "hydra.md").read_text()
    shown = [body.strip() for lang, body in FENCE.findall(section(README, "Quick start")) if not lang]
    assert shown == [quick_start], (shown, quick_start)
    options = [body.strip() for lang, body in FENCE.findall((ROOT / "docs" / "options.md").read_text())
               if body.startswith("lightning_shard: sharding=")]
    one_block = sweep[SWEEP.index(3200000)]
    assert options == [one_block.split("\nlightning_shard: estimated")[0]], (options, one_block)
    parameters = {re.search(r"units over 2 ranks, ([\d.]+M) parameters", r).group(1) for r in sweep}
    blocks, block_size = re.search(r"(\d+) x Block +([\d.]+M) parameters each", one_block).groups()
    assert len(parameters) == 1
    total = parameters.pop()
    assert f"the benchmark GPT, {total} parameters, 2 ranks" in readme
    assert f"{total} parameters with the text's vocabulary: {blocks} blocks of {block_size}" in hydra
    units = {size: int(re.search(r"(\d+) units over", r).group(1)) for size, r in zip(SWEEP, sweep)}
    for page in (readme, hydra):
        rows = {int(size.replace(",", "")): int(n)
                for size, n in re.findall(r"^\| ([\d,]+)(?: \([^)]*\))? \| (\d+) \|", page, re.M)}
        assert rows == units, (rows, units)
    estimates = [re.search(r"before activations ([\d.]+) MiB", r).group(1) for r in sweep]
    assert f"the setup estimates: {', '.join(estimates[:-1])} and {estimates[-1]} MiB per rank" in hydra
