"""`pip install nanovllm-tp[bench]` holds what the benchmarks import: every package a bench module imports (at
module level or inside a function) is a requirement, in the [bench] extra, or one of the named others (gguf and
plot extras, a peer's own interpreter); launch/cli.py's BENCH_NEEDS names, per kind, the [bench] packages its
module imports, and a kind whose packages are missing is refused in one line that names the extra."""
import ast
import configparser
import pathlib
import re
import sys

from nanovllm_tp.launch import cli

REPO = pathlib.Path(__file__).resolve().parents[2]
# the module a distribution is imported as, where the names differ
IMPORT_NAME = {"pyzmq": "zmq", "prometheus_client": "prometheus_client"}
# imported by bench modules, on purpose not in [bench]: their own extras, or a peer's interpreter
ELSEWHERE = {"gguf": "the [gguf] extra", "matplotlib": "the [plot] extra", "vllm": "bench/peer.py, vLLM's python",
             "openvino": "bench/openvino_peer.py", "openvino_genai": "bench/openvino_peer.py"}


def _names(section: str) -> set[str]:
    names = set()
    for line in section.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.match(r"[A-Za-z0-9_.-]+", line).group(0)
            names.add(IMPORT_NAME.get(name, name.replace("-", "_")))
    return names


def _config() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def imports_of(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("nanovllm_tp", "__future__")}


def test_every_bench_import_is_installed_by_an_extra():
    cfg = _config()
    required = _names(cfg["options"]["install_requires"])
    bench = _names(cfg["options.extras_require"]["bench"])
    for path in sorted((REPO / "bench").glob("*.py")):
        stray = imports_of(path) - required - bench - set(ELSEWHERE)
        assert not stray, f"bench/{path.name} imports {sorted(stray)}: add them to setup.cfg's [bench] extra"


def test_bench_needs_names_each_kinds_bench_packages():
    bench = _names(_config()["options.extras_require"]["bench"])
    for kind, needs in cli.BENCH_NEEDS.items():
        assert kind in cli.BENCHES and set(needs) <= bench, kind
    for kind, (module, _) in cli.BENCHES.items():
        path = REPO / "bench" / f"{module.rsplit('.', 1)[-1]}.py"
        wanted = imports_of(path) & bench
        if kind == "struct":
            wanted -= {"jsonschema"}        # optional there: without it the answers are not judged
        assert wanted <= set(cli.BENCH_NEEDS.get(kind, ())), (kind, wanted)


def test_a_kind_without_its_packages_is_refused_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "httpx", None)        # what an import of a missing package finds
    assert cli.main(["bench", "limits"]) == 2
    err = capsys.readouterr().err
    assert err == "nanovllm-tp bench limits: needs httpx: pip install 'nanovllm-tp[bench]'\n"
