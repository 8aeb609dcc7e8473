"""How often a server's structured answers are valid: a fixed set of checks sent through the `openai` client to
any OpenAI-compatible server (ours, vLLM's, ...), each judged on what came back.

    nanovllm-tp bench struct-validity --launch --model /tmp/smollm2-f32 --dtype bfloat16
    nanovllm-tp bench struct-validity --base-url http://127.0.0.1:8000/v1 --label vllm
    nanovllm-tp bench struct-validity --compare ours.json vllm.json        # the table of two runs side by side

Each check is one chat (or completions) request, greedy (temperature 0) with --max-tokens (256), a prompt that
asks for the content, and one constraint: a JSON schema as `response_format` (json_schema), `json_object`, a JSON
schema, regex, choice or grammar in the `structured_outputs` body field (vLLM's name since it dropped the
`guided_*` fields; ours takes the same), or function tools with a named `tool_choice` or `"required"`, streamed
or not. The schemas are the kinds clients send: nested objects, arrays with minItems, enums, `$defs`/`$ref` as
pydantic writes them, optional (nullable) fields, bounded numbers, strings with a pattern or a format.

A check is `valid` when the answer parses and validates (jsonschema, with its format checker) / matches the regex
(re.fullmatch) / is one of the choices / matches the grammar's language (a regex of it), and for tools when there
is a call to the right function whose arguments validate against its parameters. Otherwise the verdict says why:
`length` (finish_reason "length": cut at max_tokens), `invalid JSON`, `schema: ...`, `no match`, `no tool call`,
`HTTP 400: ...`. `--launch` starts our server on a free 127.0.0.1 port with the engine flags given here (as
`bench serve --launch` does) and stops it at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import time

from nanovllm_tp.bench import common as bc

NAME = "bench_struct_validity"

# ================================================================================================ the schemas

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]}

COMPANY = {"type": "object", "properties": {
    "name": {"type": "string"},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                  "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"]}},
        "required": ["street", "city", "geo"]}},
    "required": ["name", "address"]}

FRUITS = {"type": "object", "properties": {
    "fruits": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 5}}, "required": ["fruits"]}

TASKS = {"type": "object", "properties": {"tasks": {"type": "array", "minItems": 2, "items": {
    "type": "object", "properties": {"title": {"type": "string"}, "done": {"type": "boolean"},
                                     "priority": {"enum": ["low", "medium", "high"]}},
    "required": ["title", "done", "priority"]}}}, "required": ["tasks"]}

SENTIMENT = {"type": "object", "properties": {
    "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["sentiment", "confidence"]}

# what pydantic v2 writes for: class Item(BaseModel): name: str; quantity: int = Field(ge=1); unit: Unit
# (Unit an Enum); class Order(BaseModel): order_id: str; items: list[Item] = Field(min_length=1);
# note: Optional[str] = None
ORDER = {"$defs": {
    "Item": {"properties": {"name": {"title": "Name", "type": "string"},
                            "quantity": {"minimum": 1, "title": "Quantity", "type": "integer"},
                            "unit": {"$ref": "#/$defs/Unit"}},
             "required": ["name", "quantity", "unit"], "title": "Item", "type": "object"},
    "Unit": {"enum": ["piece", "kg", "litre"], "title": "Unit", "type": "string"}},
    "properties": {"order_id": {"title": "Order Id", "type": "string"},
                   "items": {"items": {"$ref": "#/$defs/Item"}, "minItems": 1, "title": "Items", "type": "array"},
                   "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"}},
    "required": ["order_id", "items"], "title": "Order", "type": "object"}

# pydantic's Optional fields: class Profile(BaseModel): username: str; bio: Optional[str] = None;
# age: Optional[int] = Field(None, ge=0, le=120); website: Optional[str] = None
PROFILE = {"properties": {
    "username": {"title": "Username", "type": "string"},
    "bio": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Bio"},
    "age": {"anyOf": [{"maximum": 120, "minimum": 0, "type": "integer"}, {"type": "null"}], "default": None,
            "title": "Age"},
    "website": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Website"}},
    "required": ["username"], "title": "Profile", "type": "object"}

MEASURE = {"type": "object", "properties": {
    "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
    "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
    "wind_kmh": {"type": "number", "exclusiveMinimum": 0, "maximum": 300}},
    "required": ["temperature_c", "humidity_pct", "wind_kmh"]}

PRODUCT = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "name": {"type": "string", "minLength": 2, "maxLength": 40},
    "price": {"type": "number", "minimum": 0}}, "required": ["sku", "name", "price"]}

EVENT = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string", "format": "date"},
    "contact": {"type": "string", "format": "email"}}, "required": ["title", "date", "contact"]}

ANY_OBJECT = {"type": "object"}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
EMAIL_TOOL = {"type": "function", "function": {
    "name": "send_email", "description": "Send an email",
    "parameters": {"type": "object", "properties": {
        "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        "required": ["to", "subject", "body"]}}}
ORDER_TOOL = {"type": "function", "function": {
    "name": "place_order", "description": "Place an order", "parameters": ORDER}}
TOOLS = [WEATHER_TOOL, EMAIL_TOOL]

# a regular grammar in GBNF (llama.cpp's rules, which vLLM's xgrammar and our llguidance both read), and the
# same language as a Python regex, to judge the answer
GRAMMAR = ('root ::= "SELECT " cols " FROM " table ";"\n'
           'cols ::= col (", " col)*\n'
           'col ::= "id" | "name" | "email" | "age"\n'
           'table ::= "users" | "orders"\n')
GRAMMAR_RE = r"SELECT (id|name|email|age)(, (id|name|email|age))* FROM (users|orders);"

TOOL_PROMPT = ("You can call these functions: get_weather(city, unit) and send_email(to, subject, body). "
               "What is the weather in Paris, in celsius?")


def check(name, kind, prompt, schema=None, *, api="chat", stream=False, body=None, tools=None, tool_choice=None,
          pattern=None, choices=None):
    return {"name": name, "kind": kind, "prompt": prompt, "schema": schema, "api": api, "stream": stream,
            "body": body or {}, "tools": tools, "tool_choice": tool_choice, "pattern": pattern, "choices": choices}


def rf_schema(name, schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


CHECKS = [
    check("person (optional email)", "json_schema", "Give me a person as JSON: name, age and email.", PERSON,
          body=rf_schema("person", PERSON)),
    check("nested objects", "json_schema", "Describe a company as JSON: its name and address, with the street, "
                                           "city and geo coordinates.", COMPANY, body=rf_schema("company", COMPANY)),
    check("array minItems 3", "json_schema", "List three fruits as JSON.", FRUITS, body=rf_schema("fruits", FRUITS)),
    check("array of objects", "json_schema", "Give me a to-do list as JSON: two tasks, each with a title, whether "
                                             "it is done and its priority.", TASKS, body=rf_schema("tasks", TASKS)),
    check("enum + bounded number", "json_schema", "What is the sentiment of 'I love this phone'? Answer as JSON "
                                                  "with a confidence.", SENTIMENT,
          body=rf_schema("sentiment", SENTIMENT)),
    check("pydantic $defs/$ref", "json_schema", "Write an order as JSON: an order id and two items with "
                                                "quantities and units.", ORDER, body=rf_schema("Order", ORDER)),
    check("pydantic Optional fields", "json_schema", "Give me a user profile as JSON.", PROFILE,
          body=rf_schema("Profile", PROFILE)),
    check("number bounds", "json_schema", "Give today's weather measurements in London as JSON.", MEASURE,
          body=rf_schema("measure", MEASURE)),
    check("string pattern", "json_schema", "Give me a product as JSON with a SKU like ABC-1234, a name and a "
                                           "price.", PRODUCT, body=rf_schema("product", PRODUCT)),
    check("string formats (date, email)", "json_schema", "Give me a meeting as JSON: its title, date and a "
                                                         "contact email.", EVENT, body=rf_schema("event", EVENT)),
    check("json_schema streamed", "json_schema", "Give me a person as JSON: name, age and email.", PERSON,
          stream=True, body=rf_schema("person", PERSON)),
    check("json_object", "json_object", "Describe a cat as a JSON object.", ANY_OBJECT,
          body={"response_format": {"type": "json_object"}}),
    check("structured_outputs json", "so.json", "Give me a person as JSON: name, age and email.", PERSON,
          body={"structured_outputs": {"json": PERSON}}),
    check("completions API json", "so.json", "A person as JSON (name, age, email):\n", PERSON, api="completions",
          body={"structured_outputs": {"json": PERSON}}),
    check("regex: phone number", "so.regex", "What is the phone number of the White House? Write it as "
                                             "(XXX) XXX-XXXX.", pattern=r"\(\d{3}\) \d{3}-\d{4}",
          body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}}),
    check("regex: ISO date", "so.regex", "When did the first man land on the moon? Give the date as YYYY-MM-DD.",
          pattern=r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
          body={"structured_outputs": {"regex": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"}}),
    check("choice", "so.choice", "Is this review positive or negative? 'The food was cold and the waiter rude.'",
          choices=["positive", "negative"], body={"structured_outputs": {"choice": ["positive", "negative"]}}),
    check("grammar (GBNF)", "so.grammar", "Write an SQL query that selects the names and emails of all users.",
          pattern=GRAMMAR_RE, body={"structured_outputs": {"grammar": GRAMMAR}}),
    check("tool named", "tool", TOOL_PROMPT, tools=TOOLS,
          tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    check("tool named streamed", "tool", TOOL_PROMPT, tools=TOOLS, stream=True,
          tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    check("tool required", "tool", TOOL_PROMPT, tools=TOOLS, tool_choice="required"),
    check("tool required streamed", "tool", TOOL_PROMPT, tools=TOOLS, tool_choice="required", stream=True),
    check("tool named, $defs params", "tool", "You can call place_order(order_id, items, note). Order two kilos "
                                              "of apples.", tools=[ORDER_TOOL],
          tool_choice={"type": "function", "function": {"name": "place_order"}}),
]

# ================================================================================================ judging


def validate_json(text: str, schema: dict) -> str:
    import jsonschema
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"invalid JSON ({e.msg} at {e.pos} of {len(text)})"
    cls = jsonschema.validators.validator_for(schema)
    errors = sorted(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value), key=lambda e: e.path)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "top"
        return f"schema: {where}: {errors[0].message[:80]}"
    return "valid"


def judge(c: dict, answer: dict) -> str:
    """The verdict on one answer: "valid", or why not."""
    if answer.get("error"):
        return answer["error"]
    if c["kind"] == "tool":
        calls = answer["tool_calls"]
        if not calls:
            return "length" if answer["finish_reason"] == "length" else "no tool call"
        names = {t["function"]["name"]: t["function"]["parameters"] for t in c["tools"]}
        for call in calls:
            if call["name"] not in names:
                return f"unknown tool {call['name']!r}"
            if isinstance(c["tool_choice"], dict) and call["name"] != c["tool_choice"]["function"]["name"]:
                return f"tool {call['name']!r} not the one named"
            verdict = validate_json(call["arguments"], names[call["name"]])
            if verdict != "valid":
                return ("length" if answer["finish_reason"] == "length" else "arguments: " + verdict)
        return "valid"
    if answer["finish_reason"] == "length":
        return "length"
    text = answer["text"]
    if c["schema"] is not None:
        return validate_json(text, c["schema"])
    if c["choices"] is not None:
        return "valid" if text in c["choices"] else f"not a choice: {text[:40]!r}"
    return "valid" if re.fullmatch(c["pattern"], text) else f"no match: {text[:40]!r}"


# ================================================================================================ the client


def ask(client, model: str, c: dict, max_tokens: int) -> dict:
    """One check's request; the answer as text (or tool calls: name, arguments), finish_reason and tokens; an
    HTTP or client error as `error`."""
    import openai
    kw = {"model": model, "max_tokens": max_tokens, "temperature": 0, "extra_body": {}}
    for key, value in c["body"].items():
        if key == "response_format":
            kw[key] = value
        else:
            kw["extra_body"][key] = value
    if c["tools"]:
        kw["tools"], kw["tool_choice"] = c["tools"], c["tool_choice"]
    try:
        if c["api"] == "completions":
            kw.pop("response_format", None)
            r = client.completions.create(prompt=c["prompt"], stream=c["stream"], **kw)
            return completions_answer(r, c["stream"])
        messages = [{"role": "user", "content": c["prompt"]}]
        if c["stream"]:
            r = client.chat.completions.create(messages=messages, stream=True,
                                               stream_options={"include_usage": True}, **kw)
            return chat_stream_answer(r)
        r = client.chat.completions.create(messages=messages, **kw)
    except openai.APIStatusError as e:
        return {"error": f"HTTP {e.status_code}: {short_error(e)}"}
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {str(e)[:100]}"}
    choice = r.choices[0]
    calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in choice.message.tool_calls or []]
    return {"text": choice.message.content or "", "tool_calls": calls, "finish_reason": choice.finish_reason,
            "tokens": r.usage.completion_tokens if r.usage else None}


def short_error(e) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    msg = body.get("message") or (body.get("error") or {}).get("message") if body else None
    return " ".join(str(msg or e.message).split())[:120]


def completions_answer(r, stream: bool) -> dict:
    if not stream:
        return {"text": r.choices[0].text, "tool_calls": [], "finish_reason": r.choices[0].finish_reason,
                "tokens": r.usage.completion_tokens if r.usage else None}
    text, finish = "", None
    for chunk in r:
        for ch in chunk.choices:
            text += ch.text or ""
            finish = ch.finish_reason or finish
    return {"text": text, "tool_calls": [], "finish_reason": finish, "tokens": None}


def chat_stream_answer(stream) -> dict:
    """The streamed deltas put together: content, each tool call's name and arguments by index."""
    text, finish, tokens, calls = "", None, None, {}
    for chunk in stream:
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"name": "", "arguments": ""})
                if t.function and t.function.name:
                    call["name"] = t.function.name
                if t.function and t.function.arguments:
                    call["arguments"] += t.function.arguments
            finish = ch.finish_reason or finish
    return {"text": text, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "tokens": tokens}


def run_checks(args, checks: list[dict]) -> list[dict]:
    import openai
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "EMPTY", timeout=args.timeout,
                           max_retries=0)
    rows = []
    for c in checks:
        start = time.perf_counter()
        answer = ask(client, args.model_name, c, args.max_tokens)
        verdict = judge(c, answer)
        rows.append({"check": c["name"], "kind": c["kind"], "stream": c["stream"], "verdict": verdict,
                     "valid": verdict == "valid", "seconds": time.perf_counter() - start, **answer})
        bc.log(args, f"{c['name']:<30} {verdict}")
    return rows


# ================================================================================================ report


def short(verdict: str, width: int = 56) -> str:
    return verdict if len(verdict) <= width else verdict[:width - 3] + "..."


def table(runs: list[dict]) -> str:
    """One row per check, one column per run (its label); the counts last."""
    names = [r["check"] for r in runs[0]["checks"]]
    by_label = [{r["check"]: r for r in run["checks"]} for run in runs]
    rows = [[name] + [short(by.get(name, {}).get("verdict", "-")) for by in by_label] for name in names]
    rows.append(["valid"] + [f"{run['valid']}/{run['total']}" for run in runs])
    title = (f"bench_struct_validity: {len(names)} checks, greedy, max_tokens "
             f"{runs[0]['config']['max_tokens']}")
    return bc.format_table(["check"] + [run["label"] for run in runs], rows, title)


def build_parser() -> argparse.ArgumentParser:
    from nanovllm_tp.config.engine_config import add_engine_args
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)     # --model: the name sent to --base-url, or a directory (the name then comes from
    # the server); with --launch, the model our server loads
    srv = parser.add_argument_group("server")
    srv.add_argument("--base-url", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    srv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    srv.add_argument("--launch", action="store_true", help="start our own server on a free port for the run")
    srv.add_argument("--server-args", default="", help="with --launch: more serve flags, one string")
    srv.add_argument("--label", help="the run's column in the table (default: ours with --launch, else the host)")
    srv.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--checks", nargs="+", metavar="NAME",
                        help="only these checks (by name, or a prefix of one; default: all)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="print the table of earlier runs side by "
                                                                     "side (their JSON files) and exit")
    bc.add_output_args(parser)
    return parser


def selected(names) -> list[dict]:
    if not names:
        return CHECKS
    out = [c for c in CHECKS if any(c["name"] == n or c["name"].startswith(n) for n in names)]
    if not out:
        raise SystemExit(f"no check named {names}; --list shows them")
    return out


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.list:
        for c in CHECKS:
            print(f"{c['name']:<30} {c['kind']:<12} {'streamed' if c['stream'] else ''}")
        return {}
    if args.compare:
        runs = [json.load(open(path)) for path in args.compare]
        text = table(runs)
        print(text, flush=True)
        return {"runs": runs, "table": text}
    if not args.launch and not args.base_url:
        raise SystemExit("give --base-url, or --launch")
    checks = selected(args.checks)
    try:
        import jsonschema  # noqa: F401
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("bench struct-validity needs openai and jsonschema: pip install 'nanovllm-tp[bench]'") \
            from None
    env = bc.environment()
    proc = None
    from nanovllm_tp.launch import serve_process
    try:
        if args.launch:
            from nanovllm_tp.config.engine_config import engine_argv
            args.model = bc.resolve_model(args)
            proc, args.base_url = serve_process.start(engine_argv(args) + shlex.split(args.server_args),
                                                      args.api_key)
            bc.log(args, f"server at {args.base_url}")
        by_name = args.model and not args.launch and not os.path.exists(args.model)
        if by_name:
            args.model_name = args.model
        else:
            import openai
            client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "EMPTY", max_retries=0)
            args.model_name = client.models.list().data[0].id
        label = args.label or ("ours" if args.launch else args.base_url.split("//")[-1].split("/")[0])
        start = time.perf_counter()
        rows = run_checks(args, checks)
        seconds = time.perf_counter() - start
    finally:
        if proc is not None:
            serve_process.stop(proc)
    config = bc.config_dict(args)
    config.pop("api_key", None)
    valid = sum(r["valid"] for r in rows)
    result = {"name": NAME, "label": label, "config": config, "environment": bc.finish_environment(env),
              "model": args.model_name, "valid": valid, "total": len(rows), "seconds": seconds,
              "failed": {r["check"]: r["verdict"] for r in rows if not r["valid"]}, "checks": rows}
    result["table"] = table([result])
    out = bc.out_path(args, NAME)
    result["out"] = str(out)
    bc.say_written(bc.write_json(out, result))
    print(result["table"], flush=True)
    return result


if __name__ == "__main__":
    main()
