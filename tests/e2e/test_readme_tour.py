"""README.md's commands, run as a reader runs them: the YAML's `--check`, `pdserve up` with no
argument (the embedded SmolLM2 on a local Ray, the router on 127.0.0.1:50051 and its HTTP front on
8000), then from another process the tour's chat turn and completion and its OpenAI client snippet,
taken from README.md's python block as it is printed there.

Each command is spelled here exactly as README.md spells it: tests/unit/test_docs.py maps every
README command to the file that runs it and checks that the file holds that string, so a command
changed in one place and not the other fails the fast lane. `pdserve` runs as `python -m pdserve`,
which README.md says is the same command, so that the checkout's interpreter is the one tested.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from helpers.up import START_TIMEOUT_S, router_address, stop_up

# `pdserve up` with no argument listens on the default ports, and the YAML's --check checks they
# are free: no other test that uses them runs meanwhile (tests/helpers/lanes.py).
pytestmark = [pytest.mark.slow, pytest.mark.exclusive("default-ports")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = "pdserve up deploy/examples/local-cpu.yaml --check"
UP = "pdserve up"
CHAT = 'pdserve chat "What is the capital of France?"'
GENERATE = 'pdserve generate "def fibonacci(n):"'
CLIENT_TIMEOUT_S = 300


def argv(command: str) -> list[str]:
    """The command line as this interpreter runs it (`pdserve ...` as `python -m pdserve ...`)."""
    words = shlex.split(command)
    assert words[0] == "pdserve", command
    return [sys.executable, "-m", "pdserve", *words[1:]]


def run(command: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        argv(command), cwd=ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-4000:]}"
    return done


def readme_python_block() -> str:
    """README.md's python block (the OpenAI client), as printed."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) == 1, "README.md should have one python block: the OpenAI client"
    return blocks[0]


@pytest.fixture(scope="module")
def default_deployment(tmp_path_factory):
    """`pdserve up` with no argument, serving until the module's tests are done."""
    err_path = tmp_path_factory.mktemp("readme") / "up.err"
    with open(err_path, "w") as err:
        up = subprocess.Popen(argv(UP), stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    try:
        yield router_address(up, START_TIMEOUT_S)
    finally:
        stop_up(up)
        if up.returncode not in (0, None):
            print(err_path.read_text()[-4000:])


def test_the_example_yaml_passes_check():
    out = run(CHECK).stdout
    assert "nothing started" in out


def test_the_tour_chats_and_completes_through_the_default_deployment(default_deployment):
    assert default_deployment == "127.0.0.1:50051"
    assert run(CHAT).stdout.strip()
    assert run(GENERATE).stdout.strip()


def test_the_readme_openai_client_streams_from_the_default_deployment(default_deployment):
    pytest.importorskip("openai")
    done = subprocess.run(
        [sys.executable, "-c", readme_python_block()],
        cwd=ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip()
