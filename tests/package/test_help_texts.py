"""What a new user reads first: `serve --help` shows MODEL in its usage line and its flags in groups, most-used
first; `generate --help` gives every flag a help text with its default, and says where generate's defaults are
not the API's."""
import re

import pytest

from nanovllm_tp.config.flag_groups import GROUPS
from nanovllm_tp.launch import generate, serve


def _sections(text: str) -> list[str]:
    return re.findall(r"^(\S[^\n]*):$", text, re.M)


def test_serve_usage_shows_model_and_the_groups_come_most_used_first():
    text = serve.build_parser().format_help()
    assert text.startswith("usage: ") and "[MODEL] [options]" in text.splitlines()[0]
    assert len(text.splitlines()[0]) < 80
    sections = _sections(text)
    titles = [title for title, _ in GROUPS]
    shown = [s for s in sections if s in titles]
    assert shown[:4] == ["model", "server", "chat, tools and reasoning", "parallelism"]
    assert shown == [t for t in titles if t in shown]            # in GROUPS' order
    # no flag left in argparse's catch-all group but --help
    options = text[text.index("\noptions:\n"):].split("\n\n")[0]
    assert re.findall(r"^  (-\S+)", options, re.M) == ["-h,"]
    assert "--tensor-parallel-size, -tp, --tp N" in text and "TENSOR_PARALLEL_SIZE" not in text


def test_serve_takes_model_as_positional_anywhere_once():
    assert serve.model_first(["DIR", "--port", "1"]) == ["--model", "DIR", "--port", "1"]
    assert serve.model_first(["--port", "1"]) == ["--port", "1"]
    args = serve.build_parser().parse_args(["--port", "1", "DIR"])
    assert args.model_tag == "DIR" and args.model is None
    with pytest.raises(SystemExit) as exc:
        serve.main(["--port", "1", "A", "--model", "B"])
    assert exc.value.code == 2


def test_every_generate_flag_has_help_with_its_default():
    parser = generate.build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.option_strings
    text = parser.format_help()
    assert "[--model MODEL] [--prompt TEXT ...]" in text.splitlines()[0]
    flags = {a.dest: a for a in parser._actions}
    assert flags["max_tokens"].default == 48 and "the API's: 16" in flags["max_tokens"].help
    assert flags["temperature"].default == 0.0 and "the API's: 1.0" in flags["temperature"].help
    sections = _sections(text)
    assert sections.index("prompts and sampling") < sections.index("model")
