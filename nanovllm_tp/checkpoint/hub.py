"""Hugging Face hub ids as the model, resolved to a local path as vLLM resolves them: through huggingface_hub's
snapshot_download, in its cache (HF_HUB_CACHE, else HF_HOME/hub, as the library reads them at import) or
`download_dir`, fetched from the hub where missing unless HF_HUB_OFFLINE=1 (the library's own switch: the cache
only). A local path always wins: only a string that is no file or directory and reads as a hub id is looked up.

    org/name                 the files the engine reads (config, generation config, tokenizer, *.safetensors)
    org/name:Q4_K_M          one GGUF file of a GGUF repo, by its quantization (vLLM's `repo_id:quant_type`)
    org/name:FILE.gguf       one GGUF file of a repo, by its name

The path is resolved once, where the command line or LLM(...)'s arguments are read, before any rank starts: ranks
get the local path and never look at the hub."""
import fnmatch
import logging
import os
import re

log = logging.getLogger("nanovllm_tp")

# Only what the engine reads of a HF directory (checkpoint/loader.py, model_config.py, pooling/params.py): no
# *.bin / *.pt / *.msgpack / *.h5 / onnx copies of the same weights, which many repos carry beside safetensors.
ALLOW_PATTERNS = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
    "*.safetensors", "*.safetensors.index.json",
    "modules.json", "*Pooling/config.json",          # sentence-transformers' pooling (embedding models)
)
_NAME = r"[A-Za-z0-9][\w.-]*"
_REPO_ID = re.compile(rf"(?:{_NAME}/)?{_NAME}")
_PICK = re.compile(r"[\w.+-]+")


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, GGUF pick or None) of a string of the hub's id form, `org/name`, `name`, either with `:PICK`; None
    for anything else (a path: absolute, relative with ./ or several parts, or a .gguf file name)."""
    repo_id, _, pick = model.partition(":") if ":" in model else (model, "", None)
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return None
    if pick is None:
        return None if repo_id.endswith(".gguf") else (repo_id, None)     # x.gguf: a file that is not there
    return (repo_id, pick) if _PICK.fullmatch(pick) else None


def cache_dir(download_dir: str | None) -> str:
    """Where a hub id is looked for and downloaded to: download_dir, else huggingface_hub's cache."""
    from huggingface_hub import constants
    return os.path.abspath(os.path.expanduser(download_dir or constants.HF_HUB_CACHE))


def gguf_patterns(pick: str) -> list[str]:
    """The file names a GGUF pick matches: FILE.gguf itself, or a quantization as vLLM matches it (`*-Q4_K_M.gguf`;
    `*.Q4_K_M.gguf` too, TheBloke's naming), as typed, upper and lower case (Qwen's files are lower case). Split
    files (`-00001-of-00003.gguf`) are not matched: the engine reads one file."""
    if pick.endswith(".gguf"):
        return [pick]
    return [f"*{sep}{quant}.gguf" for quant in dict.fromkeys((pick, pick.upper(), pick.lower())) for sep in "-."]


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local path `model` names: itself when it exists or is not of the hub's id form, else the hub id's
    snapshot folder (or its picked .gguf file) in the cache, downloaded first where missing and the hub reachable.
    ValueError in one line naming the id and the cache directory when it cannot be had."""
    parsed = None if os.path.exists(model) else parse_hub_id(model)
    if parsed is None:
        return model
    repo_id, pick = parsed
    from huggingface_hub import constants, snapshot_download
    offline = constants.HF_HUB_OFFLINE
    cache = cache_dir(download_dir)
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    patterns = gguf_patterns(pick) if pick is not None else list(ALLOW_PATTERNS)
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns,
                                   local_files_only=offline)
    except Exception as exc:       # the library's errors (HTTP, cache, validation, transport) vary by version
        raise ValueError(f"model {model!r} is not a local path, and the Hugging Face hub id {where} "
                         f"{_why(exc, offline, revision)}; looked in the cache {cache}") from None
    path = folder if pick is None else _picked(folder, patterns)
    if path is None:
        raise ValueError(f"model {model!r}: the Hugging Face repo {where} has no GGUF file matching "
                         f"{' or '.join(patterns[:2])} (split files are not read"
                         f"{'; HF_HUB_OFFLINE=1: the cache only' if offline else ''}); looked in the cache {cache}")
    if pick is None and not any(name.endswith(".safetensors") for _, _, names in os.walk(folder) for name in names):
        raise ValueError(f"model {model!r}: the Hugging Face repo {where} has no *.safetensors weights (in {folder}; "
                         f".bin/.pt copies are not fetched). A GGUF repo? Pick one file: {repo_id}:Q4_K_M or "
                         f"{repo_id}:FILE.gguf")
    log.info("model %s: %s", model, path)
    return path


TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja",
                      "chat_template.json", "config.json")


def resolve_tokenizer(tokenizer: str, download_dir: str | None = None) -> str:
    """The local path a tokenizer knob names (a model's own tokenizer taken from elsewhere): itself when it exists or
    is not of the hub's id form, else the hub id's snapshot with its tokenizer files only (no weights; config.json,
    which some tokenizers read for their class), from the cache or downloaded there. `org/name:FILE.gguf` or
    `org/name:QUANT`: the GGUF file whose vocabulary to use. ValueError in one line, as for the model."""
    parsed = None if os.path.exists(tokenizer) else parse_hub_id(tokenizer)
    if parsed is None:
        return tokenizer
    repo_id, pick = parsed
    from huggingface_hub import constants, snapshot_download
    offline, cache = constants.HF_HUB_OFFLINE, cache_dir(download_dir)
    patterns = gguf_patterns(pick) if pick is not None else list(TOKENIZER_PATTERNS)
    try:
        folder = snapshot_download(repo_id, cache_dir=cache, allow_patterns=patterns, local_files_only=offline)
    except Exception as exc:       # the library's errors vary by version (see resolve_model)
        raise ValueError(f"tokenizer {tokenizer!r} is not a local path, and the Hugging Face hub id {repo_id!r} "
                         f"{_why(exc, offline, None)}; looked in the cache {cache}") from None
    path = folder if pick is None else _picked(folder, patterns)
    if path is None:
        raise ValueError(f"tokenizer {tokenizer!r}: the Hugging Face repo {repo_id!r} has no GGUF file matching "
                         f"{' or '.join(patterns[:2])}; looked in the cache {cache}")
    log.info("tokenizer %s: %s", tokenizer, path)
    return path


def _picked(folder: str, patterns: list[str]) -> str | None:
    """The GGUF file of `folder` the pick names; of several, vLLM's choice: the fewest dashes, then by name."""
    found = [os.path.relpath(os.path.join(root, name), folder)
             for root, _, names in os.walk(folder) for name in names]
    matched = sorted((p for p in found if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)),
                     key=lambda p: (p.count("-"), p))
    return os.path.join(folder, matched[0]) if matched else None


def _why(exc: Exception, offline: bool, revision: str | None) -> str:
    """What went wrong, in a few words: the library's messages run over several lines."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    if offline:
        return "is not in the cache (HF_HUB_OFFLINE=1: the cache only; unset it to download)"
    if isinstance(exc, RevisionNotFoundError):
        return f"has no revision {revision!r} on {constants.ENDPOINT}"
    if isinstance(exc, GatedRepoError):
        return f"is gated on {constants.ENDPOINT}: accept its terms there and log in (hf auth login, or HF_TOKEN)"
    if isinstance(exc, RepositoryNotFoundError):
        return (f"was not found on {constants.ENDPOINT} (a private repo needs a login: hf auth login, or "
                "HF_TOKEN)")
    cause = exc.__cause__ or exc.__context__
    detail = f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(exc).__name__}: {exc}"
    detail = " ".join(detail.split())[:300]
    return f"is not in the cache and could not be downloaded from {constants.ENDPOINT} ({detail})"
