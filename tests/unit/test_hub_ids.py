"""Hugging Face hub ids as the model (nanovllm_tp/checkpoint/hub.py), without the network: a hub cache is built in
tmp_path in huggingface_hub's layout (models--org--name/refs/main holding a commit, snapshots/<commit>/ entries
linked to blobs), and the download path runs against a stand-in hub on 127.0.0.1 (HF_ENDPOINT) that answers the
routes snapshot_download asks: the revision, the file tree, and each file."""
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.checkpoint.hub import gguf_patterns, parse_hub_id, resolve_model
from nanovllm_tp.config.engine_config import EngineConfig

COMMIT, COMMIT2 = "a" * 40, "b" * 40
PROMPTS = ["The quick brown fox", "Hello, my name is"]
KNOBS = {"kvcache_block_size": 16, "kv_cache_memory": 64 << 20}
NOT_FETCHED = {"pytorch_model.bin": b"bin", "flax_model.msgpack": b"msgpack", "tf_model.h5": b"h5",
               "onnx/model.onnx": b"onnx", "consolidated.pt": b"pt"}


def model_files(model_dir: str) -> dict[str, bytes]:
    return {name: open(os.path.join(model_dir, name), "rb").read() for name in sorted(os.listdir(model_dir))}


def hub_snapshot(cache: str, repo_id: str, files: dict[str, bytes], commit: str = COMMIT,
                 refs: tuple[str, ...] = ("main",)) -> str:
    """A repo's snapshot as a download leaves it in huggingface_hub's cache: each file a blob named by its hash,
    the snapshot's entries relative symlinks to them, refs/<name> holding the commit. Returns the snapshot."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    for name, data in files.items():
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache that huggingface_hub uses, offline. The library reads HF_HUB_CACHE and HF_HUB_OFFLINE
    once, when it is imported (transformers imported it long before this test), so its constants are set too."""
    from huggingface_hub import constants
    cache = str(tmp_path / "hf" / "hub")
    os.makedirs(cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


# -- what reads as a hub id ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, parsed", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", None)),
    ("gpt2", ("gpt2", None)),
    ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", ("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")),
    ("org/name:model-q8_0.gguf", ("org/name", "model-q8_0.gguf")),
    ("/abs/dir", None), ("./dir", None), ("a/b/c", None), ("~/dir", None), ("missing.gguf", None),
    ("dir/missing.gguf", None), ("org/name:", None), ("org--x/y", None), ("a/../b", None),
])
def test_the_hub_id_form(model, parsed):
    assert parse_hub_id(model) == parsed


def test_gguf_picks_match_vllm_and_llama_cpp_names():
    import fnmatch
    names = ["Qwen3-0.6B-Q4_K_M.gguf", "qwen2.5-0.5b-instruct-q4_k_m.gguf", "tinyllama.Q4_K_M.gguf",
             "Qwen3-0.6B-Q4_K_S.gguf", "Qwen3-0.6B-Q4_K_M-00001-of-00002.gguf"]
    assert [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in gguf_patterns("Q4_K_M"))] == names[:3]
    assert gguf_patterns("x-F16.gguf") == ["x-F16.gguf"]


def test_a_local_path_wins_over_a_hub_id_of_the_same_spelling(hub_cache, tiny_model_dir, tmp_path, monkeypatch):
    hub_snapshot(hub_cache, "org/tiny", {"config.json": b"{}"})
    monkeypatch.chdir(tmp_path)
    os.makedirs("org")
    os.symlink(tiny_model_dir, "org/tiny")
    assert resolve_model("org/tiny") == "org/tiny"


# -- the cache, offline ----------------------------------------------------------------------------------------------

def test_llm_of_a_hub_id_generates_what_the_local_directory_does(hub_cache, tiny_model_dir, tiny_llm):
    snapshot = hub_snapshot(hub_cache, "org/tiny", {**model_files(tiny_model_dir)})
    llm = LLM("org/tiny", **KNOBS)
    try:
        assert llm.config.model == snapshot
        params = SamplingParams(temperature=0, max_tokens=16)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want and all(got)
    finally:
        llm.close()


def test_an_id_in_no_cache_is_refused_in_one_line_naming_the_id_and_the_cache(hub_cache, tmp_path):
    with pytest.raises(ValueError) as info:
        LLM("org/absent", **KNOBS)
    message = str(info.value)
    assert "'org/absent'" in message and hub_cache in message and "HF_HUB_OFFLINE=1" in message
    assert "\n" not in message
    elsewhere = str(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=f"looked in the cache {elsewhere}$"):
        EngineConfig.from_kwargs("org/absent", download_dir=elsewhere).validate()


def test_revision_picks_its_snapshot_and_download_dir_is_the_cache(hub_cache, tiny_model_dir, tmp_path):
    files = model_files(tiny_model_dir)
    config = json.loads(files["config.json"])
    main = hub_snapshot(hub_cache, "org/tiny", files)
    second = hub_snapshot(hub_cache, "org/tiny", {**files, "config.json": json.dumps(
        {**config, "max_position_embeddings": 77}).encode()}, commit=COMMIT2, refs=("dev",))

    def resolved(**knobs):
        c = EngineConfig.from_kwargs("org/tiny", **knobs)
        c.validate()
        return c.model, c.model_config.max_position_embeddings
    assert resolved() == (main, config["max_position_embeddings"])
    assert resolved(revision=COMMIT2) == resolved(revision="dev") == (second, 77)
    with pytest.raises(ValueError, match="at revision 'nope'"):
        resolved(revision="nope")
    other = str(tmp_path / "downloads")
    inside = hub_snapshot(other, "org/tiny", files, commit=COMMIT2)
    assert resolved(download_dir=other)[0] == inside
    with pytest.raises(TypeError, match="revision must be a string"):
        resolved(revision=3)


def test_gguf_picks_one_file_of_a_repo(hub_cache):
    files = {name: b"GGUF" + name.encode() for name in
             ("tiny-Q8_0.gguf", "tiny-UD-Q8_0.gguf", "tiny-f32.gguf", "tiny-Q4_K_M-00001-of-00002.gguf")}
    snapshot = hub_snapshot(hub_cache, "org/tiny-GGUF", {**files, "README.md": b"x"})
    assert resolve_model("org/tiny-GGUF:Q8_0") == os.path.join(snapshot, "tiny-Q8_0.gguf")   # vLLM: fewest dashes
    assert resolve_model("org/tiny-GGUF:F32") == os.path.join(snapshot, "tiny-f32.gguf")
    assert resolve_model("org/tiny-GGUF:tiny-UD-Q8_0.gguf") == os.path.join(snapshot, "tiny-UD-Q8_0.gguf")
    for pick in ("Q4_K_M", "Q6_K", "other.gguf"):
        with pytest.raises(ValueError, match=f"'org/tiny-GGUF:{pick}'.*no GGUF file matching.*in the cache"):
            resolve_model(f"org/tiny-GGUF:{pick}")
    with pytest.raises(ValueError, match="no \\*.safetensors weights .* org/tiny-GGUF:Q4_K_M or"):
        resolve_model("org/tiny-GGUF")


def test_llm_of_a_gguf_pick_generates_what_the_file_does(hub_cache, tiny_model_dir, tmp_path):
    """The picked file is the snapshot's symlink to its blob: the engine reads config, tokenizer and weights
    through it as through the file itself."""
    import pathlib
    from tests.gguf_tiny import write_gguf
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = write_gguf(hf, pathlib.Path(tiny_model_dir), tmp_path / "tiny-F32.gguf", arch="qwen3", qtype="F32",
                      embed_qtype="F32")
    snapshot = hub_snapshot(hub_cache, "org/tiny-GGUF", {"tiny-F32.gguf": open(path, "rb").read()})
    params = SamplingParams(temperature=0, max_tokens=12)
    runs = []
    for model in ("org/tiny-GGUF:F32", str(path)):
        llm = LLM(model, **KNOBS)
        try:
            runs.append([o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)])
            if model.startswith("org/"):
                assert llm.config.model == os.path.join(snapshot, "tiny-F32.gguf")
        finally:
            llm.close()
    assert runs[0] == runs[1] and all(runs[0])


# -- downloads, from a stand-in hub ----------------------------------------------------------------------------------

def stand_in_hub(repos: dict[str, tuple[str, dict[str, bytes]]]):
    """(server, requests seen) of a hub on 127.0.0.1 serving repos {id: (commit, {path: bytes})}: the routes
    huggingface_hub's snapshot_download asks (revision, recursive tree, HEAD and GET of each file); 404 for the
    rest, with the hub's error codes."""
    seen = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(code)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self):
            seen.append(f"{self.command} {self.path}")
            parts = unquote(urlparse(self.path).path).strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                repo = "/".join(parts[2:4])
                if repo not in repos:
                    return self.reply(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                commit, files = repos[repo]
                body = ({"id": repo, "sha": commit, "siblings": [{"rfilename": p} for p in files]}
                        if parts[4] == "revision" else
                        [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                         for p, b in files.items()])
                return self.reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, path = "/".join(parts[:2]), "/".join(parts[4:])
                if repo not in repos or path not in repos[repo][1]:
                    return self.reply(404, b"", {"X-Error-Code": "EntryNotFound"})
                commit, files = repos[repo]
                return self.reply(200, files[path], {"X-Repo-Commit": commit,
                                                     "ETag": f'"{hashlib.sha1(files[path]).hexdigest()}"'})
            self.reply(404)

        do_HEAD = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


RESOLVE = "import sys; from nanovllm_tp.checkpoint.hub import resolve_model; print(resolve_model(sys.argv[1]))"


@pytest.mark.spawn
def test_an_id_missing_from_the_cache_is_downloaded_from_the_hub(tiny_model_dir, tmp_path):
    """HF_HUB_OFFLINE unset: snapshot_download fetches the engine's files (not the .bin/.msgpack/.h5/onnx/.pt
    copies) from HF_ENDPOINT into the cache; offline afterwards, the cache answers. In a child process: the
    library reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported."""
    files = model_files(tiny_model_dir)
    server, seen = stand_in_hub({"org/tiny": (COMMIT, {**files, **NOT_FETCHED})})
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    cache = str(tmp_path / "hub")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=cache, HF_HOME=str(tmp_path / "home"))

    def resolve(model: str, **extra) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", RESOLVE, model], env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)
    try:
        done = resolve("org/tiny")
        assert done.returncode == 0, done.stderr[-3000:]
        path = done.stdout.strip().splitlines()[-1]
        assert path == os.path.join(cache, "models--org--tiny", "snapshots", COMMIT)
        assert model_files(path) == files                      # every file the engine reads, and nothing else
        assert "GET /api/models/org/tiny/revision/main" in seen
        assert any(r.startswith("GET /org/tiny/resolve/") for r in seen)
        assert not any(name in r for r in seen for name in NOT_FETCHED)
        seen.clear()
        again = resolve("org/tiny", HF_HUB_OFFLINE="1")
        assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == path and not seen
        absent = resolve("org/absent")
        last = absent.stderr.strip().splitlines()[-1]
        assert absent.returncode != 0 and f"was not found on {endpoint}" in last and cache in last, absent.stderr
    finally:
        server.shutdown()
