"""The package as a user installs it: a wheel built from the checkout, installed into a fresh virtual environment
(reusing this interpreter's torch and the other dependencies through --system-site-packages, nothing downloaded),
and run from a directory outside the checkout through its `nanovllm-tp` command."""
import configparser
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.procs import free_port, started
from tests.serving.test_serve import client, wait_ready

pytestmark = [pytest.mark.spawn, pytest.mark.slow]
REPO = pathlib.Path(__file__).resolve().parents[2]


def source_files() -> set[str]:
    """Every module and package-data file of the source tree, by its path inside an installed package: each folder
    of setup.cfg's package_dir under its package's name."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    dirs = dict(line.replace(" ", "").split("=") for line in cfg["options"]["package_dir"].strip().splitlines())
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    out = set()
    for name, folder in dirs.items():
        for path in tracked:
            inside = path.removeprefix(folder + "/")
            if inside != path and (REPO / path).is_file() and path.endswith((".py", ".c", ".h", ".txt")):
                out.add(name.replace(".", "/") + "/" + inside)
    return out


def copy_checkout(dest: pathlib.Path) -> None:
    """The checkout's files as a clone has them (tracked, and new ones not ignored), copied under dest."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for path in files:
        if (REPO / path).is_file():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, dest / path)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel of the checkout's files (tracked, and new ones not ignored), built from a copy of them so that
    the build leaves nothing in the checkout."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    copy_checkout(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    str(src), "-w", str(out)], check=True, timeout=300)
    found, = out.glob("nanovllm_tp-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=120)
    subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300)
    return root


def test_every_module_and_data_file_of_the_tree_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = source_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}"
    assert {"nanovllm_tp/lora/__init__.py", "nanovllm_tp/scheduler/scheduler.py", "nanovllm_tp/launch/cli.py",
            "nanovllm_tp/layers/csrc/linear.c", "nanovllm_tp/data/corpus.txt"} <= names
    assert not any(n.startswith(("scheduler/", "workers/", "launch/", "tests/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "nanovllm-tp = nanovllm_tp.launch.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def _run(venv, *args, timeout=300, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_the_installed_wheel_imports_generates_and_serves_from_outside_the_checkout(venv, tmp_path):
    where = _run(venv, "python", "-c", "import nanovllm_tp, nanovllm_tp.lora, nanovllm_tp.scheduler.scheduler; "
                 "from nanovllm_tp import LLM, SamplingParams; print(nanovllm_tp.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert pathlib.Path(where.stdout.strip()).is_relative_to(venv)       # the wheel's copy, not the checkout
    version = _run(venv, "nanovllm-tp", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("nanovllm-tp 0."), version
    gen = _run(venv, "nanovllm-tp", "generate", "--prompt", "hi", "--max-tokens", "4", cwd=tmp_path)
    assert gen.returncode == 0 and "Completion 0 (4 tokens, length)" in gen.stdout, gen.stderr[-3000:]
    helped = _run(venv, "nanovllm-tp", "serve", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--port" in helped.stdout and "--tensor-parallel-size" in helped.stdout
    model = _run(venv, "nanovllm-tp", "make-tiny", str(tmp_path / "tiny"), cwd=tmp_path)
    assert model.returncode == 0, model.stderr[-3000:]
    port = free_port()
    cmd = [str(venv / "bin" / "nanovllm-tp"), "serve", str(tmp_path / "tiny"), "--port", str(port),
           "--served-model-name", "tiny", "--kv-cache-memory", str(32 << 20), "--max-model-len", "256"]
    with started(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        wait_ready(port, proc)
        got = client(port).completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5,
                                              temperature=0)
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 5
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_a_first_run_says_what_it_builds_and_a_second_run_says_nothing(tmp_path):
    """A fresh cache: one line for the kernels' compile and one for the kernel table's measurement, on stderr
    with no logging set up; the second run finds both cached and prints neither."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "nanovllm_tp.launch.cli", "generate", "--prompt", "hi", "--max-tokens", "2"]
    first, second = (subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
                     for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:]
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("nanovllm_tp: ")]
    from nanovllm_tp.layers import cpu_kernels
    kernels = cpu_kernels.load()
    timed = kernels is not None and "float32" in str(kernels.linear_dtypes)   # two fp32 kernels to time (AVX-512 F)
    assert len(lines) == 1 + timed, first.stderr[-3000:]
    assert "compiling the CPU kernels once for this machine" in lines[0]
    assert not timed or "measuring the linear kernels" in lines[1]
    assert "nanovllm_tp: " not in second.stderr and "Completion 0" in second.stdout


def test_the_command_names_its_subcommands_and_refuses_unknown_ones(capsys):
    from nanovllm_tp.launch import cli
    assert cli.main(["--help"]) == 0 and "serve" in capsys.readouterr().out
    assert cli.main(["bench", "--help"]) == 0 and "kernels" in capsys.readouterr().out
    assert cli.main(["serv"]) == 2 and "unknown subcommand 'serv'" in capsys.readouterr().err
    assert cli.main(["bench", "nope"]) == 2 and "unknown kind 'nope'" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"nanovllm-tp {cli.version()}"
    with pytest.raises(SystemExit) as exc:           # the module's own parser: its flags, under the command's name
        cli.main(["bench", "kv", "--help"])
    assert exc.value.code == 0 and "nanovllm-tp bench kv" in capsys.readouterr().out
