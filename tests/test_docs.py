"""The documentation (README.md and docs/*.md) against the repository and the command line.

Relative links resolve, and their anchors name a heading of the target page (GitHub's slug rules);
every ``raytpu`` command the docs show (in shell code blocks, and inline code that starts with
``raytpu``) names a real subcommand, flags that subcommand accepts and config keys that exist;
the dotted config keys, repository paths and ``raytpu`` modules named in inline code exist; YAML
configs shown with a ``job:`` section load; the README stays a short front page that links every
page. Nothing here starts Ray or a worker: the parser, the config schema and the jobs' classes are
read, the jobs' modules imported.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytpu.config.args import OVERRIDE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "dev").glob("*.md"))
DOCS = [README, *PAGES]
README_MAX_LINES = 260
SHIPPED_JOBS = ("mshnet", "cdeit", "causal_lm")
#: jobs besides the shipped ones whose ``job.*`` keys the docs may name
OTHER_JOBS = ("tests.toy_job", "examples.classifier")
SECTIONS = ("job", "run", "scaling", "xla", "data", "optim", "loop", "checkpoint", "logging", "tune")

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DOTTED_KEY = re.compile(r"^[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+$")
SHORT_KEY = re.compile(r"^[a-z_][a-z0-9_]*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FILE_NAME = r"\w+\.(?:py|ya?ml|md|json|pt|npy|txt|sh)$"  # `xla.py` names a file, not the key xla.py
CONFIG_KEY_SPAN = re.compile(rf"^(?:{'|'.join(SECTIONS)})\.(?!{FILE_NAME})[\w.]+(?:=\S*)?$")
REPO_PATH = re.compile(r"^(?:raytpu|jobs|tests|bench|examples|scripts|docs)/[\w./-]*$")
MODULE_NAME = re.compile(r"\braytpu(?:\.[A-Za-z_]\w*)+")
#: code blocks read line by line as shell commands; ``PROMPTED`` ones only where a line starts with ``$``
SHELL_LANGS = {"", "bash", "sh", "shell", "zsh"}
PROMPTED_LANGS = {"text", "console"}


# ------------------------------------------------------------------ reading Markdown
@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # the opening fence's line


@dataclass(frozen=True)
class Doc:
    path: Path
    lines: tuple[str, ...]
    paragraphs: tuple[tuple[int, str], ...]  # text outside code blocks: (first line, text)
    blocks: tuple[Block, ...]
    headings: tuple[str, ...]


def parse_text(path: Path, text: str) -> Doc:
    """Split a Markdown text into its paragraphs, fenced code blocks and headings."""
    lines = text.splitlines()
    paragraphs: list[tuple[int, str]] = []
    blocks: list[Block] = []
    headings: list[str] = []
    current: list[str] = []
    start = 0
    fence: tuple[str, str, int, list[str]] | None = None
    for number, line in enumerate(lines, 1):
        if fence is not None:
            marker, lang, opened, body = fence
            stripped = line.strip()
            if stripped.startswith(marker) and set(stripped) == {marker[0]}:
                blocks.append(Block(lang, "".join(f"{item}\n" for item in body), opened))
                fence = None
            else:
                body.append(line)
            continue
        opening = FENCE.match(line)
        if opening or not line.strip():
            if current:
                paragraphs.append((start, "\n".join(current)))
                current = []
            if opening:
                fence = (opening.group(1), opening.group(2).lower(), number, [])
            continue
        heading = HEADING.match(line)
        if heading:
            headings.append(heading.group(2))
        if not current:
            start = number
        current.append(line)
    assert fence is None, f"{path}: a code block opened at line {fence[2]} is never closed"
    if current:
        paragraphs.append((start, "\n".join(current)))
    return Doc(path, tuple(lines), tuple(paragraphs), tuple(blocks), tuple(headings))


@functools.cache
def parse(path: Path) -> Doc:
    return parse_text(path, path.read_text())


def name_of(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than ``-`` and ``_`` dropped,
    spaces turned into ``-`` (Markdown in the heading counts by its text: link targets dropped)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor GitHub gives the headings of ``path`` (a repeated one gets ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in parse(path).headings:
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def code_spans(doc: Doc) -> Iterator[tuple[int, str]]:
    """Inline code outside code blocks, with a table's escaped ``\\|`` read as ``|``."""
    for line, paragraph in doc.paragraphs:
        for match in CODE_SPAN.finditer(paragraph):
            text = " ".join(match.group(2).replace("\\|", "|").split())
            yield line + paragraph.count("\n", 0, match.start()), text


def links(doc: Doc) -> Iterator[tuple[int, str]]:
    """Link targets outside code (inline code removed first: a link shown as code is no link)."""
    for line, paragraph in doc.paragraphs:
        text = CODE_SPAN.sub(lambda span: "\n" * span.group(0).count("\n"), paragraph)  # keeps line numbers
        for match in LINK.finditer(text):
            yield line + text.count("\n", 0, match.start()), match.group(1)


# ------------------------------------------------------------------ commands in the docs
@dataclass(frozen=True)
class Command:
    where: str  # file:line
    words: tuple[str, ...]  # after ``raytpu``

    def __str__(self) -> str:
        return f"{self.where}: raytpu {' '.join(self.words)}"


def shell_words(text: str, where: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise AssertionError(f"{where}: not a shell command ({exc}): {text}") from exc


def raytpu_words(words: list[str]) -> list[str] | None:
    """The words after ``raytpu`` (or ``.venv/bin/raytpu``), when the line runs it: first, after
    environment assignments, or after ``ray job submit ... --``."""
    for index, word in enumerate(words):
        if word == "raytpu" or word.endswith("/raytpu"):
            before = words[:index]
            if all(ENV_ASSIGNMENT.match(item) for item in before):
                return words[index + 1 :]
            if before[:1] == ["ray"] and before[-1:] == ["--"]:
                return words[index + 1 :]
            return None
    return None


def block_commands(doc: Doc) -> Iterator[Command]:
    for block in doc.blocks:
        if block.lang not in SHELL_LANGS | PROMPTED_LANGS:
            continue
        pending, first = "", 0
        for offset, line in enumerate(block.text.splitlines(), 1):
            if block.lang in PROMPTED_LANGS:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            elif line.startswith("$ "):
                line = line[2:]
            first = first or block.line + offset
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text, pending = pending + line, ""
            where = f"{name_of(doc.path)}:{first}"
            first = 0
            words = raytpu_words(shell_words(text, where))
            if words:
                yield Command(where, tuple(words))


def inline_commands(doc: Doc) -> Iterator[Command]:
    for line, span in code_spans(doc):
        if span.startswith("raytpu "):
            where = f"{name_of(doc.path)}:{line}"
            yield Command(where, tuple(shell_words(span[len("raytpu ") :], where)))


def commands_in(doc: Doc) -> list[Command]:
    return [*block_commands(doc), *inline_commands(doc)]


def is_placeholder(word: str) -> bool:
    return "<" in word or ">" in word or "..." in word or word.isupper()


def bare(word: str) -> str:
    """A word without the ``[...]`` that marks it optional in a usage line."""
    return word.lstrip("[").rstrip("]")


# ------------------------------------------------------------------ what the code accepts
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@dataclass(frozen=True)
class Cli:
    commands: dict[str, set[str]]  # "train", "data synth", "submit launch" -> accepted flags
    short_keys: set[str]  # runtime, num_workers, precision
    synth_options: dict[str, set[str]]  # job -> --options of its synthesize


@functools.cache
def cli() -> Cli:
    from raytpu.cli import build_parser
    from raytpu.config.args import take_both_spellings
    from raytpu.config.loading import COMMON_ALIASES
    from raytpu.driver.search import FLAGS
    from raytpu.job import load_job

    parser = build_parser()
    take_both_spellings(parser)  # what parsing a command line adds: every long option's other spelling
    top = subparsers(parser)
    parsers = {name: sub for name, sub in top.items() if name != "data"}
    parsers.update({f"data {name}": sub for name, sub in subparsers(top["data"]).items()})
    commands = {name: options(sub) for name, sub in parsers.items()}
    aliases = {flag for flag in COMMON_ALIASES if flag.startswith("--")}
    for job in SHIPPED_JOBS:
        aliases |= set(load_job(job).aliases)
    run_flags = {"--local", "--verbose", "--address", "--checkpoint"}
    commands["train"] |= aliases | run_flags
    commands["test"] |= aliases | run_flags
    commands["tune"] |= aliases | set(FLAGS) | {"--search", "--mutate", "--address", "--verbose"}
    commands["submit"] |= aliases | {"--address", "--no-wait"}
    commands["submit launch"] = commands["launch"] | {"--address", "--no-wait"}
    commands["export"] |= aliases | {"--checkpoint", "--out"}
    synth = {}
    for job in SHIPPED_JOBS:
        names = [p for p in inspect.signature(load_job(job).synthesize).parameters if p not in ("self", "out")]
        synth[job] = {f"--{name}" for name in names} | {f"--{name.replace('_', '-')}" for name in names}
    short = {key for key in COMMON_ALIASES if not key.startswith("-")}
    return Cli(commands, short, synth)


def job_config_keys(job_name: str) -> set[str]:
    import dataclasses

    from raytpu.job import load_job

    return {f"job.{f.name}" for f in dataclasses.fields(load_job(job_name).config_class)}


@functools.cache
def config_keys() -> tuple[frozenset[str], frozenset[str]]:
    """Every dotted config key, and those whose value is a mapping (any sub-key is theirs)."""
    from raytpu.config import Config
    from raytpu.config.loading import all_keys

    cfg = Config()
    keys = set(all_keys(cfg))
    for job in (*SHIPPED_JOBS, *OTHER_JOBS):
        keys |= job_config_keys(job)
    mappings = {"job.model_config"}
    for key in all_keys(cfg):
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if isinstance(value, dict):
            mappings.add(key)
    return frozenset(keys), frozenset(mappings)


def key_exists(key: str) -> bool:
    from raytpu.config.loading import RENAMED_KEYS

    keys, mappings = config_keys()
    if key in keys or key in RENAMED_KEYS:  # a key under its earlier name is still read
        return True
    parent, _, last = key.rpartition(".")
    if parent in keys and last.isdigit():  # a list item: optim.betas.0
        return True
    return any(key.startswith(f"{mapping}.") for mapping in mappings)


def command_problems(command: Command) -> list[str]:
    """What in ``command`` the command line would refuse: the subcommand, a flag, a config key."""
    known = cli()
    words = [bare(word) for word in command.words]
    words = [word for word in words if word]
    if not words or is_placeholder(words[0]) or words[0] in ("--help", "-h"):
        return []
    name, rest = words[0], words[1:]
    if name == "data" or (name == "submit" and rest[:1] == ["launch"]):
        if not rest or is_placeholder(rest[0]):
            return []
        name, rest = f"{name} {rest[0]}", rest[1:]
    if name not in known.commands:
        return [f"{command}: unknown subcommand {name!r}"]
    accepted = set(known.commands[name]) | {"--help", "-h"}
    if name == "data synth":
        job = rest[0] if rest and not is_placeholder(rest[0]) else None
        if job in known.synth_options:
            accepted |= known.synth_options[job]
        elif job is None:
            accepted |= set().union(*known.synth_options.values())
    if name in ("launch", "submit launch"):
        script = next((index for index, word in enumerate(rest) if word.endswith(".py")), len(rest))
        rest = rest[:script]  # the script's own arguments are its business
    problems = []
    for previous, word in zip(["", *rest], rest):
        if previous.startswith("--") and "=" not in previous and not word.startswith("-") and not OVERRIDE.match(word):
            continue  # a flag's value, as the parser takes it (--config_overrides "n_embd=64,...")
        if word.startswith("--") and len(word) > 2:
            flag = word.split("=", 1)[0]
            if flag not in accepted:
                problems.append(f"{command}: {name} does not accept {flag}")
        elif "=" in word and not word.startswith("-"):
            key = word.split("=", 1)[0]
            if DOTTED_KEY.match(key) and not key_exists(key):
                problems.append(f"{command}: no config key {key}")
            elif SHORT_KEY.match(key) and key not in known.short_keys:
                problems.append(f"{command}: {key}= is neither a dotted key nor one of {sorted(known.short_keys)}")
    return problems


# ------------------------------------------------------------------ names in inline code
def module_file(parts: list[str]) -> Path | None:
    """The source file of the module ``raytpu.<parts>`` (``raytpu.jobs`` is the repository's ``jobs/``)."""
    shipped_jobs = parts[:2] == ["raytpu", "jobs"]
    path = ROOT.joinpath("jobs", *parts[2:]) if shipped_jobs else ROOT.joinpath("raytpu", *parts[1:])
    for candidate in (path.with_suffix(".py") if len(parts) > 1 else None, path / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


@functools.cache
def defined_names(path: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level, and those its ``__all__`` names (loaded
    on first use by a module ``__getattr__``)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            if any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets):
                found |= set(ast.literal_eval(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return frozenset(found)


def module_exists(name: str) -> bool:
    """``raytpu.a.b`` is a module, or ``raytpu.a`` defines ``b`` (the first attribute is checked)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        path = module_file(parts[:end])
        if path is not None:
            return end == len(parts) or parts[end] in defined_names(path)
    return False


@functools.cache
def committed_paths() -> frozenset[str]:
    """Every file git tracks and every folder above one: what a clean clone (CI) has."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    folders = {str(parent) for name in files for parent in Path(name).parents}
    return frozenset(files) | folders


def named_problems(doc: Doc) -> list[str]:
    """Config keys, repository paths and raytpu modules named in inline code that do not exist."""
    problems = []
    for line, span in code_spans(doc):
        where = f"{name_of(doc.path)}:{line}"
        if CONFIG_KEY_SPAN.match(span):
            key = span.split("=", 1)[0]
            if not key_exists(key):
                problems.append(f"{where}: no config key {key} (`{span}`)")
        for word in span.split():
            word = word.strip("`'\",;:()[]")
            if REPO_PATH.match(word) and word.rstrip("/") not in committed_paths():
                problems.append(f"{where}: no such path {word}")
        for name in MODULE_NAME.findall(span):
            if not module_exists(name):
                problems.append(f"{where}: no module or name {name}")
    return problems


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("path", DOCS, ids=name_of)
def test_relative_links_and_their_anchors_resolve(path: Path) -> None:
    doc = parse(path)
    broken = []
    for line, target in links(doc):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{name_of(path)}:{line}: {target}: no such file or folder")
        elif anchor and linked.suffix != ".md":
            broken.append(f"{name_of(path)}:{line}: {target}: an anchor into a file that is not Markdown")
        elif anchor and anchor not in anchors(linked):
            broken.append(f"{name_of(path)}:{line}: {target}: no heading #{anchor} in {name_of(linked)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("path", DOCS, ids=name_of)
def test_every_raytpu_command_subcommand_flag_and_override_exists(path: Path) -> None:
    problems = [problem for command in commands_in(parse(path)) for problem in command_problems(command)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=name_of)
def test_config_keys_paths_and_modules_named_in_inline_code_exist(path: Path) -> None:
    problems = named_problems(parse(path))
    assert not problems, "\n".join(problems)


def test_the_docs_show_every_subcommand() -> None:
    commands = [command for path in DOCS for command in commands_in(parse(path))]
    assert len(commands) > 50, "the extraction of commands from the docs found too few"
    shown = set()
    for command in commands:
        words = [bare(word) for word in command.words]
        shown |= {words[0], " ".join(words[:2])} if words else set()
    missing = [f"raytpu {name}" for name in cli().commands if name not in shown]
    assert not missing, f"no doc shows {missing}"


def test_a_flag_or_key_that_does_not_exist_is_caught() -> None:
    text = """# Page

Run `raytpu train jobs/mshnet/small.yaml --no-such-flag 1` or `raytpu frobnicate` here.

```bash
CPU_NUM_DEVICES=4 raytpu train jobs/mshnet/small.yaml optim.lrr=0.1 runtime=xla \\
    --batch-size 8
raytpu data synth mshnet --out data/x --n-train 4      # cdeit's option, not mshnet's
ray job submit --address http://<head>:8265 -- raytpu tune CONFIG --samplez 4
raytpu launch --num_processes 2 --nope 1 examples/accelerate/train.py --epochs 2
```

Inline: `loop.ema_betta`, `raytpu/launcher.py`, `raytpu.driver.nothing_here`.
"""
    doc = parse_text(ROOT / "docs" / "fake.md", text)
    problems = "\n".join(problem for command in commands_in(doc) for problem in command_problems(command))
    for expected in (
        "does not accept --no-such-flag",
        "unknown subcommand 'frobnicate'",
        "no config key optim.lrr",
        "does not accept --n-train",
        "does not accept --samplez",
        "does not accept --nope",
    ):
        assert expected in problems, problems
    assert "accept --batch-size" not in problems and "accept --epochs" not in problems, problems
    named = "\n".join(named_problems(doc))
    for expected in ("loop.ema_betta", "raytpu/launcher.py", "raytpu.driver.nothing_here"):
        assert expected in named, named


def test_the_design_page_names_every_module() -> None:
    design = (ROOT / "docs" / "dev" / "design.md").read_text()
    modules = sorted(name_of(path) for path in (ROOT / "raytpu").rglob("*.py") if path.name != "__init__.py")
    missing = [module for module in modules if f"`{module}`" not in design]
    assert not missing, f"docs/dev/design.md does not describe {missing}"


def test_github_slugs() -> None:
    assert slug("Local runs without Ray (`--local`)") == "local-runs-without-ray---local"
    assert slug("EMA of the weights (`loop.ema_*`)") == "ema-of-the-weights-loopema_"
    assert slug("MSHNet: infrared small-target segmentation (CVPR 2024)") == (
        "mshnet-infrared-small-target-segmentation-cvpr-2024"
    )


def test_yaml_configs_shown_in_the_docs_load(tmp_path: Path) -> None:
    from raytpu.config import load_config

    shown = 0
    for path in DOCS:
        for block in parse(path).blocks:
            if block.lang not in ("yaml", "yml"):
                continue
            data = yaml.safe_load(block.text)
            if isinstance(data, dict) and "job" in data:
                config = tmp_path / f"shown-{shown}.yaml"
                config.write_text(block.text)
                load_config(config, [])  # raises with the reason when a key or value is wrong
                shown += 1
    assert shown >= 2  # the README's minimal config and the example job's


def test_the_readme_is_a_short_front_page_that_links_every_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference text to docs/"
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(parse(README))}
    missing = [name_of(page) for page in PAGES if page.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"
    assert "bash scripts/test.sh" in README.read_text()  # the test command CI (.ci/run) runs


@pytest.mark.parametrize("path", PAGES, ids=name_of)
def test_every_page_starts_with_a_summary_and_names_its_commands(path: Path) -> None:
    doc = parse(path)
    first_line, first = doc.paragraphs[0]
    assert first_line == 1 and first.startswith("# "), f"{name_of(path)} must start with its title"
    summary = doc.paragraphs[1][1]
    assert not summary.startswith(("#", "|", "-", "**")), f"{name_of(path)}: a summary must follow the title"
    assert any(text.startswith("**Commands:**") for _, text in doc.paragraphs[:4]), (
        f"{name_of(path)}: say which commands the page documents (a **Commands:** line)"
    )
