"""The server's own knobs (launch/serve's flags beside the engine's), declared once with knobs.knob: the command's
flags, their checks and what the HTTP process is told all come from these fields.

The limits keep one client from holding the server: each is refused with a 4xx that names its flag (README,
"Limits")."""
import json
import os
from dataclasses import asdict, dataclass

from nanovllm_tp.config.knobs import add_args, check_knobs, knob, kwargs_of
from nanovllm_tp.entrypoints.chat_template import load_chat_template
from nanovllm_tp.serving.reasoning import PARSERS
from nanovllm_tp.serving.router import POLICIES
from nanovllm_tp.serving.tool_calls import check_tool_parser

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(slots=True)
class ServerConfig:
    host: str = knob("127.0.0.1", help="address to bind (127.0.0.1: loopback only)")
    port: int = knob(8000, help="TCP port to listen on", minimum=0, maximum=65535)
    api_key: str | None = knob(None, help="require 'Authorization: Bearer KEY' on /v1 (default: "
                                          "$NANOVLLM_TP_API_KEY)")
    served_model_name: str | None = knob(None, help="the model name clients use (default: --model or 'tiny')")
    max_waiting_requests: int = knob(1024, help="beyond this many waiting requests, new ones get 429", minimum=1)
    log_level: str = knob("warning", help="uvicorn's log level (its own messages; its access lines: "
                                          "--disable-uvicorn-access-log)", choices=LOG_LEVELS)
    threads: int | None = knob(None, help="CPU threads per rank (default: $OMP_NUM_THREADS, else this node's cores "
                                          "shared by its ranks; the HTTP process uses what they leave idle)",
                               minimum=1)
    http_priority: str = knob("auto", help="the HTTP process's CPU priority: idle runs it only where nothing else "
                                           "wants a core; auto: idle when the engine runs on CPU with several "
                                           "threads per rank, else normal",
                              choices=("auto", "idle", "normal"))
    # limits: what one request may ask for
    max_n: int = knob(128, help="most completions per prompt (n) one request may ask for", minimum=1)
    max_request_body_bytes: int = knob(16 << 20, help="largest request body; a larger one gets 413 before it is "
                                                      "read in full", minimum=1)
    max_prompts_per_request: int = knob(2048, help="most prompts in one completions request", minimum=1)
    max_choices_per_request: int = knob(4096, help="most completions (choices: prompts x n) one request may ask "
                                                   "for", minimum=1)
    max_stop_strings: int = knob(32, help="most stop strings one request may give", minimum=0)
    max_stop_string_chars: int = knob(1024, help="longest stop string, in characters", minimum=1)
    trust_request_chat_template: bool = knob(False, help="render a chat template sent in a request "
                                                         "(chat_template_kwargs.chat_template); refused otherwise")
    chat_template: str | None = knob(None, help="the chat template conversations are rendered with (chat "
                                                "completions, responses, /tokenize with messages) instead of the "
                                                "tokenizer's: a file, or the template itself (vLLM's)",
                                     metavar="FILE|TEMPLATE")
    enable_auto_tool_choice: bool = knob(True, help="read the tool calls a model writes by itself (tool_choice "
                                                    "\"auto\", the default with tools; format: --tool-call-parser); "
                                                    "off: \"auto\" is refused with a 400, as vLLM refuses it "
                                                    "without this flag")
    tool_call_parser: str | None = knob(None, help="the tool-call format tool_choice \"auto\" reads (vLLM's "
                                                   "names): hermes (<tool_call>{...}</tool_call>, as Qwen2.5/3 and "
                                                   "Hermes templates ask for) or llama3_json / llama4_json (JSON "
                                                   "{\"name\", \"parameters\"} calls); default: either",
                                        metavar="NAME")
    reasoning_parser: str | None = knob(None, help="split a chat answer's think block into reasoning_content "
                                                   "(vLLM's parsers: qwen3, deepseek_r1)",
                                        choices=tuple(PARSERS))
    disable_fastapi_docs: bool = knob(False, help="no /docs, /redoc or /openapi.json")
    disable_log_stats: bool = knob(False, help="no stats line in the log (by default one every 10 s while requests "
                                               "run: throughput, queues, KV cache, prefix cache hit rate)")
    enable_log_requests: bool = knob(True, help="the request log: one line when a request is accepted (id, route, "
                                                "prompt tokens, max_tokens, n, stream), one when it ends (finish "
                                                "reasons or HTTP status, tokens, seconds, TTFT), one for each "
                                                "refused request (vLLM's flag; off: --no-enable-log-requests or "
                                                "--disable-log-requests)")
    disable_log_requests: bool = knob(False, help="no request log (vLLM's older flag)")
    max_log_len: int | None = knob(None, help="the request log shows the first N characters of a request's (first) "
                                              "prompt too (default: no prompt text)", minimum=0, metavar="N")
    disable_uvicorn_access_log: bool = knob(False, help="no access line per HTTP request (uvicorn's, at INFO "
                                                        "whatever --log-level: client, method, path, status)")
    # LoRA adapters (with the engine's --enable-lora)
    lora_modules: list | None = knob(None, help="LoRA adapters served by name, as vLLM's: NAME=PATH or a JSON "
                                                "object {\"name\": ..., \"path\": ...}; a request picks one by its "
                                                "model field", metavar="NAME=PATH")
    allow_runtime_lora_updating: bool = knob(help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                                  "(default from $NANOVLLM_TP_ALLOW_RUNTIME_LORA_UPDATING)",
                                             default_factory=lambda: _env_on("NANOVLLM_TP_ALLOW_RUNTIME_LORA_UPDATING"))
    lora_root: str | None = knob(None, help="the directory adapters loaded at run time must lie in (a relative "
                                            "lora_path starts there; no symbolic link may lead out of it); without "
                                            "it, lora_path must be absolute", metavar="DIR")
    # data-parallel replicas behind this one endpoint (replica_set.py, router.py)
    data_parallel_size: int = knob(1, help="engine replicas, each with --tensor-parallel-size ranks, its own "
                                           "scheduler and KV cache, behind this one endpoint",
                                   flags=("--data-parallel-size", "-dp"), minimum=1)
    router: str = knob("prefix-aware", help="how a request picks its replica: prefix-aware (the replica most "
                                            "likely to hold its prompt's first blocks, unless far busier than the "
                                            "least loaded or than an idle one), least-load, round-robin",
                       choices=tuple(POLICIES))
    replica_roles: str | None = knob(None, help="one role per replica, comma-separated: prefill (computes new "
                                                "requests' prompts and first tokens, then hands each stream's KV to a "
                                                "decode replica), decode, or mixed (both: the default); e.g. "
                                                "prefill,decode", metavar="ROLES")
    rebalance: bool = knob(True, help="with -dp: when a replica queues requests (its KV or its sequence slots "
                                      "full) while another has room, move some of its running streams there with "
                                      "their KV")
    migrate_kv_on_restart: bool = knob(True, help="on a rolling restart (SIGHUP), a replica's open streams move "
                                                  "to the others with their KV (off: the replicas they move to "
                                                  "compute their prompts and output so far again)")
    restart_dead_replicas: bool = knob(True, help="start a replica again when its process dies (the others serve "
                                                  "meanwhile)")
    # liveness and shutdown
    engine_iteration_timeout: float = knob(60.0, help="seconds the engine loop may go silent (one step, or a "
                                                      "stuck one) before /health answers 503", minimum=0.0,
                                           open_minimum=True)
    shutdown_timeout: float = knob(5.0, help="seconds a step in flight may take after SIGTERM before every rank "
                                             "is killed", minimum=0.0)

    @property
    def log_requests(self) -> bool:
        return self.enable_log_requests and not self.disable_log_requests

    def to_json(self) -> str:
        """For the HTTP process's command line: the API key is left out (it goes in the environment)."""
        return json.dumps({**asdict(self), "api_key": None})

    @classmethod
    def from_json(cls, text: str) -> "ServerConfig":
        config = cls(**json.loads(text))
        check_knobs(config)
        return config


def _env_on(name: str) -> bool:
    from nanovllm_tp import envs
    return envs.get(name, "0") not in ("0", "", "false", "False")


def lora_modules(config: ServerConfig) -> list[tuple[str, str]]:
    """(name, path) of each --lora-modules entry (NAME=PATH, or vLLM's JSON form); ValueError naming the flag."""
    modules = []
    for entry in config.lora_modules or ():
        if entry.lstrip().startswith("{"):
            try:
                item = json.loads(entry)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {entry!r}: not JSON ({exc})") from None
            name, path = (item.get("name"), item.get("path")) if isinstance(item, dict) else (None, None)
        else:
            name, _, path = entry.partition("=")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {entry!r}: give NAME=PATH or {{\"name\": NAME, \"path\": PATH}}")
        if name in {n for n, _ in modules}:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append((name, path))
    return modules


def add_server_args(parser) -> None:
    add_args(ServerConfig, parser, "server")


def server_config(args) -> ServerConfig:
    """The parsed server flags, checked (ValueError / TypeError naming the flag's field)."""
    config = ServerConfig(**kwargs_of(ServerConfig, args))
    check_knobs(config)
    load_chat_template(config.chat_template)         # a missing file or a syntax error: one line, before the engine
    check_tool_parser(config.tool_call_parser, config.enable_auto_tool_choice)
    if config.lora_root is not None and not os.path.isdir(config.lora_root):
        raise ValueError(f"--lora-root {config.lora_root!r} is not a directory")
    return config
