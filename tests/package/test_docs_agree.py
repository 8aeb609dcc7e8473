"""The docs hold to the program: every `nanovllm-tp ...` and `python -m nanovllm_tp...` command shown in README.md
and docs/*.md (code blocks and inline code) names a command that exists, its --help runs, and every flag it shows
is one that command's parser takes; the bench kinds the README and docs/cli.md list are the program's.

The parsers are the commands' own, taken in this process as each command builds it (its main() runs up to
parse_args, which hands the parser back instead of parsing), so a flag added to a parser or a knob passes without a
line here. The --help runs are one Python process for every command form shown (the module forms through runpy,
as `python -m` runs them) and the installed `nanovllm-tp` script once."""
import argparse
import json
import pathlib
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

import pytest

from nanovllm_tp.launch import cli

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
STOPS = {"&&", "||", "|", ";", "&", ">", ">>", "<", "(", ")"}


@dataclass(slots=True)
class DocCommand:
    where: str                     # file: the text as the docs show it
    entry: str                     # "nanovllm-tp" or the module of `python -m`
    args: list[str] = field(default_factory=list)

    def target(self) -> tuple[str, ...] | None:
        """The command run, as (entry, subcommand[, kind]) or (module[, kind]); None where the docs show a
        placeholder (KIND, <name>, [KIND]) in its place."""
        if self.entry in ("nanovllm-tp", "nanovllm_tp.launch.cli"):
            if not self.args or self.args[0].startswith("-"):
                return ("nanovllm-tp",)
            sub = self.args[0]
            if placeholder(sub):
                return None
            if sub != "bench":
                return ("nanovllm-tp", sub)
            return ("nanovllm-tp", "bench", *self._kind(self.args[1:]))
        name = self.entry.rsplit(".", 1)[-1]
        if placeholder(name):
            return None
        if self.entry == "nanovllm_tp.bench":
            return (self.entry, *self._kind(self.args))
        return (self.entry,)

    @staticmethod
    def _kind(rest: list[str]) -> tuple[str, ...]:
        if not rest or rest[0].startswith("-"):
            return ("throughput",)
        return () if placeholder(rest[0]) else (rest[0],)

    def flags(self) -> list[str]:
        found = []
        for token in self.args:
            token = token.strip("[]")
            if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", token):
                found.append(token.split("=", 1)[0])
        return found


def placeholder(word: str) -> bool:
    return not word or word.startswith("[") or "<" in word or word.isupper() or word == "..."


def snippets(path: pathlib.Path):
    """(where, shell text) of every code block line and inline code span of a markdown file."""
    text = path.read_text()
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            yield f"{path.name}: {line.strip()}", line
    for span in SPAN.findall(FENCE.sub("", text)):
        yield f"{path.name}: `{span}`", span.replace("\n", " ")


def commands_in(where: str, text: str) -> list[DocCommand]:
    if "nanovllm-tp" not in text and "nanovllm_tp" not in text:
        return []
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise AssertionError(f"{where}: not a command line a shell reads ({exc})") from None
    found, current = [], None
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "nanovllm-tp" or token.endswith("/nanovllm-tp"):
            current = DocCommand(where, "nanovllm-tp")
            found.append(current)
        elif token == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("nanovllm_tp"):
            current = DocCommand(where, tokens[i + 1])
            found.append(current)
            i += 1
        elif token in STOPS or token.startswith((">", "2>")):
            current = None
        elif current is not None:
            current.args.append(token)
        i += 1
    return found


def doc_commands() -> list[DocCommand]:
    return [c for path in DOCS for where, text in snippets(path) for c in commands_in(where, text)]


COMMANDS = doc_commands()
TARGETS = sorted({c.target() for c in COMMANDS} - {None})


def help_argv(target: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """(module to run as `python -m`, or None for nanovllm-tp; its arguments) of `target --help`."""
    if target[0] == "nanovllm-tp":
        return None, [*target[1:], "--help"]
    return target[0], [*target[1:], "--help"]


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_of(target: tuple[str, ...], monkeypatch) -> argparse.ArgumentParser:
    """The parser `target` builds, taken at its parse_args (nothing is run past it)."""
    def hand_back(self, args=None, namespace=None):
        raise _Parsed(self)

    module, argv = help_argv(target)
    argv = argv[:-1]
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", hand_back)
        m.setattr(sys, "argv", [module or "nanovllm-tp", *argv])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)      # runpy: the module is imported already
                if module is None:
                    cli.main(argv)
                else:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
        except _Parsed as got:
            return got.parser
    raise AssertionError(f"{' '.join(target)} built no parser")


def test_the_docs_show_commands():
    """The scan finds what the docs show (a scan that found nothing would pass every check below)."""
    assert len(COMMANDS) > 50
    assert ("nanovllm-tp", "serve") in TARGETS and ("nanovllm-tp", "bench", "router-sim") in TARGETS
    assert ("nanovllm_tp.launch.generate",) in TARGETS and ("nanovllm_tp.bench.throughput",) in TARGETS


def test_every_command_shown_exists():
    for c in COMMANDS:
        target = c.target()
        if target is None or target == ("nanovllm-tp",):
            continue
        if target[0] == "nanovllm-tp":
            assert target[1] in cli.COMMANDS, f"{c.where}: no subcommand {target[1]!r}"
            if target[1:2] == ("bench",) and len(target) == 3:
                assert target[2] in cli.BENCHES, f"{c.where}: no bench kind {target[2]!r}"
        elif target[0] == "nanovllm_tp.bench":
            assert target[1:] == () or target[1] in cli.BENCHES, f"{c.where}: no bench kind {target[1]!r}"
        else:
            import importlib.util
            assert importlib.util.find_spec(target[0]) is not None, f"{c.where}: no module {target[0]}"


@pytest.mark.spawn
def test_every_command_shown_answers_help():
    """`COMMAND --help` exits with 0 for every command form the docs show: one process runs them all, as
    `nanovllm-tp` and `python -m` would (runpy is what -m runs)."""
    runs = [help_argv(t) for t in TARGETS if t != ("nanovllm-tp",)] + [(None, ["--help"])]
    script = """
import contextlib, io, json, runpy, sys, warnings
from nanovllm_tp.launch import cli
codes = []
for module, argv in json.loads(sys.argv[1]):
    sys.argv = [module or "nanovllm-tp", *argv]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            code = cli.main(argv) if module is None else runpy.run_module(module, run_name="__main__") and 0
    except SystemExit as exc:
        code = exc.code
    codes.append([module, argv, code, "usage:" in out.getvalue(), out.getvalue()[-300:]])
print(json.dumps(codes))
"""
    done = subprocess.run([sys.executable, "-c", script, json.dumps(runs)], capture_output=True, text=True,
                          cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    failed = [r for r in json.loads(done.stdout.splitlines()[-1]) if r[2] not in (0, None) or not r[3]]
    assert not failed, failed
    script = shutil.which("nanovllm-tp")
    if script is not None:           # the installed command itself
        helped = subprocess.run([script, "bench", "--help"], capture_output=True, text=True, timeout=60)
        assert helped.returncode == 0 and "kinds:" in helped.stdout, helped.stderr


def test_every_flag_shown_is_taken(monkeypatch):
    parsers = {}
    unknown = []
    for c in COMMANDS:
        target = c.target()
        if target is None or not c.flags():
            continue
        if target not in parsers:
            parsers[target] = parser_of(target, monkeypatch) if target != ("nanovllm-tp",) else None
        taken = (parsers[target]._option_string_actions if parsers[target] is not None
                 else {"-h", "--help", "-V", "--version"})
        unknown += [f"{c.where}: {flag}" for flag in c.flags() if flag not in taken]
    assert not unknown, "\n".join(unknown)


def _same_kinds(where: str, listed: list[str]) -> None:
    missing, unknown = sorted(set(cli.BENCHES) - set(listed)), sorted(set(listed) - set(cli.BENCHES))
    assert not missing and not unknown and len(listed) == len(set(listed)), \
        f"{where}: missing {missing}, not kinds {unknown} (the kinds: launch/cli.py's BENCHES)"


def test_the_bench_kinds_listed_are_the_programs():
    readme = (REPO / "README.md").read_text()
    listed = re.search(r"`bench KIND` \(([^)]*)\)", readme)
    assert listed, "README: the Commands section's `bench KIND` (kinds) list"
    _same_kinds("README.md's Commands list", [k.strip() for k in listed.group(1).split(",")])
    cli_md = (REPO / "docs" / "cli.md").read_text()
    table = cli_md[cli_md.index("## Benchmarks"):]
    rows = re.findall(r"^\| `([a-z-]+)`(?: \(default\))? \| `bench/(\w+)\.py` \|", table, re.M)
    _same_kinds("docs/cli.md's KIND table", [kind for kind, _ in rows])
    for kind, module in rows:
        assert cli.BENCHES[kind][0] == f"nanovllm_tp.bench.{module}", kind


def test_each_subcommand_is_the_module_the_docs_name():
    """README and docs/cli.md: every subcommand but bench is `python -m nanovllm_tp.launch.<its name, _ for ->`,
    and each such module runs its main as `python -m` (a __main__ block)."""
    for name, (module, _) in cli.COMMANDS.items():
        if name == "bench":
            assert module is None
            continue
        assert module == f"nanovllm_tp.launch.{name.replace('-', '_')}", name
        source = (REPO / "launch" / f"{module.rsplit('.', 1)[-1]}.py").read_text()
        assert 'if __name__ == "__main__":' in source, module
