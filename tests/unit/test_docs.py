"""The documents hold what they promise. Every repository path the README, BENCHMARKS.md, the
docs pages and the benchmark and experiment READMEs mention (a folder ending in `/`, or a file with
an extension) is checked against the tree, so a rename cannot leave a page pointing at nothing;
every relative link in README.md, BENCHMARKS.md and docs/ resolves to a file; the site's nav lists
every page.

Every shell command in README.md's code blocks is either run here (cheap ones: `pdserve --help`,
in this process) or named in RUN_BY with the files that run that exact command line, and each of
those files is checked to hold it: as a whole line of a shell script (.ci/run), or as a Python
string literal of a test (tests/e2e/test_readme_tour.py runs the tour's commands verbatim). A
command README.md gains that no test runs fails here. README.md stays a page (at most 10 KiB) and
BENCHMARKS.md one current result per benchmark (at most 250 lines)."""

from __future__ import annotations

import ast
import contextlib
import io
import pathlib
import re
import shlex

import pytest
import yaml

from pdserve.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
# the pages whose paths must exist today: the history pages under docs/experiments/ quote the
# paths of their day (scripts since deleted, bench/ before it became benchmarks/)
DOCS = [
    "README.md",
    "BENCHMARKS.md",
    "benchmarks/README.md",
    "experiments/README.md",
    *(p for p in PAGES if not p.startswith("docs/experiments/")),
]
# a relative path: segments of word characters joined by "/", ending in a file extension or "/"
PATH = re.compile(
    r"(?<![\w./~:-])((?:[A-Za-z_][\w.-]*/)+(?:[\w-]+\.(?:py|md|cpp|proto|yaml|json|sh|toml|csv|gz))?)"
)
TOP = {p.name for p in ROOT.iterdir()}
README_BYTES = 10 * 1024
BENCHMARKS_LINES = 250

# README.md's commands that are cheap and safe: run here, in this process.
CHEAP = {"pdserve --help"}
# Every other README.md command -> the files that run exactly that command line.
RUN_BY = {
    "bash scripts/setup.sh": [".ci/run"],
    "pdserve up": ["tests/e2e/test_readme_tour.py"],
    "bash scripts/test.sh": [".ci/run"],
    'pdserve chat "What is the capital of France?"': ["tests/e2e/test_readme_tour.py"],
    'pdserve generate "def fibonacci(n):"': ["tests/e2e/test_readme_tour.py"],
    "pdserve up deploy/examples/local-cpu.yaml --check": ["tests/e2e/test_readme_tour.py"],
}
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def named_paths(text: str) -> set[str]:
    """The repository paths `text` names, link targets aside (relative to their page: the link
    test checks those)."""
    found = set()
    for m in PATH.finditer(re.sub(r"\]\([^)]*\)", "]", text)):
        path = m.group(1)
        if path.split("/")[0] in TOP:  # not a path of some other tree (/dev/shm, ~/.cache, ...)
            found.add(path)
    return found


def shell_commands(markdown: str) -> list[str]:
    """The commands of the shell code blocks: continuation lines joined, comments dropped, each
    `&&` part a command of its own."""
    commands = []
    for block in SHELL_BLOCK.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            part: list[str] = []
            for word in [*words, "&&"]:
                if word == "&&":
                    commands.append(shlex.join(part).replace("'", '"'))
                    part = []
                else:
                    part.append(word)
    return commands


def relative_links(markdown: str) -> list[str]:
    """The link targets outside code (fenced blocks and inline spans) that are not a URL or an
    anchor of the same page, without their #anchor."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    targets = [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:|#", t)]
    return [t.split("#")[0] for t in targets]


def holds_command(path: pathlib.Path, command: str) -> bool:
    """`command` is a whole line (or an `&&` part of one) of a script, or a string literal of a
    Python file."""
    text = path.read_text()
    if path.suffix == ".py":
        literals = {n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant)}
        return command in literals
    return any(command in shell_commands(f"```bash\n{line}\n```") for line in text.splitlines())


def test_the_path_pattern_finds_files_and_folders():
    text = "see `engine/scheduler.py` and router/ (and not /dev/shm/x.py or ~/.cache/pdserve/)"
    assert named_paths(text) == {"engine/scheduler.py", "router/"}
    assert named_paths("[a page](experiments/x.md) and `deploy/`") == {"deploy/"}
    names = set().union(*(named_paths((ROOT / doc).read_text()) for doc in DOCS))
    assert len(names) > 50, "the documents name few paths: the pattern is broken"


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_document_names_exists(doc):
    paths = named_paths((ROOT / doc).read_text())
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_shell_commands_are_split_as_a_shell_would():
    text = '```bash\nbash a.sh && b up   # a comment\nc "x y" \\\n  --flag\n```\n```python\nd\n```'
    assert shell_commands(text) == ["bash a.sh", "b up", 'c "x y" --flag']


def test_every_readme_command_is_run_by_a_test():
    commands = shell_commands((ROOT / "README.md").read_text())
    assert "pdserve up" in commands, "the command extraction found no `pdserve up`: it is broken"
    unrun = [c for c in commands if c not in CHEAP and c not in RUN_BY]
    assert not unrun, f"README.md commands no test runs (add them to RUN_BY or CHEAP): {unrun}"
    stale = sorted(set(RUN_BY) - set(commands))
    assert not stale, f"RUN_BY names commands README.md no longer has: {stale}"


@pytest.mark.parametrize("command", sorted(RUN_BY))
def test_the_files_named_for_a_readme_command_run_it(command):
    for name in RUN_BY[command]:
        assert holds_command(ROOT / name, command), f"{name} does not run `{command}`"


@pytest.mark.parametrize("command", sorted(CHEAP))
def test_the_cheap_readme_commands_run(command, capsys):
    words = shlex.split(command)
    assert words[0] == "pdserve"
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as done:
        main(words[1:])
    assert done.value.code in (0, None)
    assert capsys.readouterr().out.strip()


def test_readme_is_a_page_and_benchmarks_one_result_each():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_BYTES, f"README.md is {size} bytes: move reference into docs/"
    lines = len((ROOT / "BENCHMARKS.md").read_text().splitlines())
    assert lines <= BENCHMARKS_LINES, f"BENCHMARKS.md has {lines} lines: history goes to docs/"


@pytest.mark.parametrize("doc", ["README.md", "BENCHMARKS.md", *PAGES])
def test_every_relative_link_resolves_to_a_file(doc):
    page = ROOT / doc
    broken = [t for t in relative_links(page.read_text()) if not (page.parent / t).is_file()]
    assert not broken, f"{doc} links to what is not a file: {broken}"


def test_a_link_outside_code_is_found_and_a_url_is_not():
    text = "[a](x.md#top) [b](https://e.org) [c](#here) `[d](no.md)`\n```\n[e](no.md)\n```\n"
    assert relative_links(text) == ["x.md"]


def test_the_site_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav):
        for item in nav:
            if isinstance(item, str):
                yield item
            else:
                for value in item.values():
                    yield from pages(value) if isinstance(value, list) else [value]

    listed = sorted(f"docs/{p}" for p in pages(config["nav"]))
    assert listed == PAGES


def test_the_cli_page_shows_the_commands_pdserve_help_shows(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out.split("`pdserve` command line.\n\n")[1]
    summary = [line.strip() for line in usage.split("\n\npositional arguments")[0].splitlines()]
    page = (ROOT / "docs" / "cli.md").read_text()
    block = re.search(r"```text\n(.*?)```", page, re.S)[1]
    assert [line.strip() for line in block.splitlines()] == summary


def test_the_deploying_page_shows_the_example_yaml_as_it_is():
    page = (ROOT / "docs" / "deploying.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", page, re.S)[1]
    assert block == (ROOT / "deploy" / "examples" / "local-cpu.yaml").read_text()
