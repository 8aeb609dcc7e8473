"""Structured outputs through the engine: every output of a set of JSON schemas validates with jsonschema (tiny
checkpoint here, SmolLM2 behind `slow`), regex and choice outputs match, a GBNF arithmetic grammar's outputs
parse, through n > 1, preemption, aborts and TP=2; bad constraints are refused before the engine, which keeps
serving."""
import json
import re

import jsonschema
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.sampling_params import RequestOutputKind, StructuredOutputsParams
from tests.helpers import GGUF, smollm2

pytestmark = pytest.mark.kernel_paths     # run again by .ci/run under --packed-linear c+onednn

# Bounded strings, arrays and integers: a random-weight model stops only where the schema makes it.
SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 500},
                                      "label": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"}},
     "required": ["id", "label"], "additionalProperties": False},
    {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}},
            "required": ["name", "tags"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 6}}, "required": ["owner"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 2,
                                               "maxItems": 4}, "closed": {"type": "boolean"}},
     "required": ["path", "closed"], "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"},
                                          {"const": "x"}]}, "minItems": 3, "maxItems": 5},
]
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"""
# The same language with bounded repetition and one level of parentheses (a random model stops in it), and
# a Python regex of that language to check outputs against
BOUNDED = """root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" num (("+" | "-" | "*" | "/") num){0,3} ")"
num ::= [0-9]{1,3}
"""
_NUM = "[0-9]{1,3}"
_FACTOR = rf"(?:{_NUM}|\({_NUM}(?:[-+*/]{_NUM}){{0,3}}\))"
_TERM = rf"{_FACTOR}(?:[*/]{_FACTOR}){{0,2}}"
BOUNDED_RE = rf"{_TERM}(?:[-+]{_TERM}){{0,3}}"
REGEX = r"[a-c]{2,5}-[0-9]{3}( ok)?"
PROMPTS = ["The quick brown fox", "Return a list of", "Hello"]


def structured(seed=None, temperature=0.0, max_tokens=256, **spec) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def assert_valid_json(outputs, schemas):
    for out, schema in zip(outputs, schemas, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.stop_reason is None, c      # ended by EOS, where it may
            jsonschema.validate(json.loads(c.text), schema)


def is_arithmetic(text: str) -> bool:
    """Whether text is in ARITHMETIC's language, by a recursive-descent parser of its own."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        digits = re.match(r"[0-9]{1,3}", text[pos:])
        if digits:
            pos += digits.end()
            return True
        if text[pos:pos + 1] != "(":
            return False
        pos += 1
        if not expr() or text[pos:pos + 1] != ")":
            return False
        pos += 1
        return True

    def chain(item, ops) -> bool:
        nonlocal pos
        if not item():
            return False
        while text[pos:pos + 1] in ops and pos < len(text):
            pos += 1
            if not item():
                return False
        return True

    def expr() -> bool:
        return chain(lambda: chain(factor, "*/"), "+-")

    return expr() and pos == len(text)


@pytest.mark.parametrize("compact", [False, True], ids=["whitespace", "compact"])
def test_json_schema_outputs_validate(tiny_llm, compact):
    params = [structured(seed=s, temperature=t, json=schema, disable_any_whitespace=compact)
              for t, s in ((0.0, None), (1.0, 3), (1.0, 4)) for schema in SCHEMAS]
    outs = tiny_llm.generate([PROMPTS[i % 3] for i in range(len(params))], params, use_tqdm=False)
    assert_valid_json(outs, SCHEMAS * 3)
    between = [re.sub(r'"(?:[^"\\]|\\.)*"', '""', o.outputs[0].text) for o in outs]    # strings emptied
    assert compact == (not any(ch.isspace() for text in between for ch in text))


def test_json_object_regex_choice_and_grammar_outputs_match(tiny_llm):
    kinds = [dict(json_object=True), dict(regex=REGEX), dict(choice=["yes", "no", "maybe later"]),
             dict(grammar=BOUNDED)]
    params = [structured(seed=7, temperature=1.0, **k) for k in kinds]
    params += [SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=256,
                              structured_outputs=StructuredOutputsParams(**k)) for k in kinds]
    outs = tiny_llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        kind = kinds[i % len(kinds)]
        assert len(out.outputs) == (1 if i < len(kinds) else 3)
        for c in out.outputs:
            if "json_object" in kind:      # unbounded strings: a random model may run to the length limit
                assert c.text.lstrip().startswith("{")
                assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict), c
                continue
            assert c.finish_reason == "stop", c
            if "regex" in kind:
                assert re.fullmatch(REGEX, c.text), c.text
            elif "choice" in kind:
                assert c.text in kind["choice"]
            else:
                assert re.fullmatch(BOUNDED_RE, c.text) and is_arithmetic(c.text), c.text
    assert len({c.text for c in outs[-1].outputs}) > 1, "n > 1 siblings each follow their own matcher"


def test_structured_requests_survive_preemption_and_aborts(tiny_model_dir, tiny_llm):
    """A pool that holds few requests at once preempts (recompute keeps the tokens, so the matchers stay where
    they were): the same greedy outputs as on a roomy engine. An aborted request leaves; the others end valid."""
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(8)]
    params = [structured(json=SCHEMAS[i % len(SCHEMAS)]) for i in range(8)]
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    small = LLM(tiny_model_dir, kvcache_block_size=16, max_model_len=320, kv_cache_memory=21 * 32768)
    try:
        got = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert_valid_json(got, [SCHEMAS[i % len(SCHEMAS)] for i in range(8)])
        ids = [small.add_request(p, structured(json=SCHEMAS[1], temperature=1.0, seed=i)) for i, p in
               enumerate(prompts[:3])]
        for _ in range(4):
            small.step()
        small.abort_request(ids[1])
        done = {}
        while small.has_unfinished_requests():
            for out in small.step():
                if out.finished:
                    done[out.request_id] = out
        assert done[ids[1]].outputs[0].finish_reason == "abort"
        assert_valid_json([done[ids[0]], done[ids[2]]], [SCHEMAS[1]] * 2)
        assert small.engine.scheduler.block_manager.num_free_blocks == small.engine.scheduler.block_manager.num_blocks
    finally:
        small.close()


@pytest.mark.parametrize("spec, error, match", [
    (dict(regex="(?=a)b"), ValueError, "look-around"),
    (dict(json={"type": "array", "uniqueItems": True}), ValueError, "uniqueItems"),
    (dict(json={"properties": {"a": {"$ref": "#/$defs/nowhere"}}}), ValueError, "nowhere"),
    (dict(grammar="root ::= \"a\" undefined"), ValueError, "undefined"),
    (dict(choice="yes"), TypeError, "choice must be a non-empty list"),
])
def test_a_bad_constraint_is_refused_before_the_engine_and_it_keeps_serving(tiny_llm, spec, error, match):
    with pytest.raises(error, match=match):
        tiny_llm.generate([PROMPTS[0], PROMPTS[1]], [structured(choice=["a"]), SamplingParams(
            structured_outputs=spec)], use_tqdm=False)
    assert not tiny_llm.has_unfinished_requests()
    out, = tiny_llm.generate([PROMPTS[0]], structured(choice=["a", "b"]), use_tqdm=False)
    assert out.outputs[0].text in ("a", "b")


def test_a_compile_past_the_time_limit_fails_that_request_only(tiny_model_dir):
    llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20, grammar_compile_timeout=1e-9)
    try:
        with pytest.raises(ValueError, match="did not compile within the time limit of 1e-09 s"):
            llm.add_request(PROMPTS[0], structured(json_object=True))
        out, = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_a_grammar_left_nothing_by_other_knobs_ends_its_request_as_abort(tiny_llm):
    """min_tokens keeps EOS out where the grammar allows only EOS: that request ends ("abort", logged), and the
    request beside it finishes as usual."""
    clash = SamplingParams(temperature=0, max_tokens=40, min_tokens=30,
                           structured_outputs=StructuredOutputsParams(choice=["a"]))
    outs = tiny_llm.generate([PROMPTS[0], PROMPTS[1]], [clash, structured(choice=["a", "b"])], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort" and outs[0].outputs[0].text.startswith("a")
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].text in ("a", "b")


def test_numbers_end_within_their_digit_bounds_where_the_model_would_write_digits_forever(tiny_llm):
    """A logit bias makes "1" the model's choice wherever the mask allows it: a number's integer part, fraction
    and exponent each end at their bound (16, 16, 3 digits), and the output ends as JSON well within max_tokens
    (without the bounds it wrote ones until max_tokens)."""
    one = tiny_llm.tokenizer.encode("1", add_special_tokens=False)
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "m": {"type": "number"}},
              "required": ["n", "m"]}
    params = [SamplingParams(temperature=t, seed=s, max_tokens=120, logit_bias={one[0]: 100.0},
                             structured_outputs=StructuredOutputsParams(json=schema))
              for t, s in ((0.0, None), (0.8, 1), (0.8, 2), (1.0, 3))]
    for out in tiny_llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        value = json.loads(c.text)
        jsonschema.validate(value, schema)
        for number in re.findall(r"-?[0-9][0-9.eE+-]*", c.text):
            whole, _, rest = number.lstrip("-").partition(".")
            part, _, exponent = rest.replace("E", "e").partition("e")
            if "e" in whole.replace("E", "e"):
                whole, _, exponent = whole.replace("E", "e").partition("e")
            assert len(whole) <= 16 and len(part) <= 16 and len(exponent.lstrip("+-")) <= 3, number
        assert "1" * 16 in c.text, c.text             # the bias did push digits up to the bound


def test_streamed_structured_output_concatenates_to_valid_json(tiny_llm):
    rid = tiny_llm.add_request(PROMPTS[2], SamplingParams(temperature=1.0, seed=5, max_tokens=256,
                                                          output_kind=RequestOutputKind.DELTA,
                                                          structured_outputs={"json": SCHEMAS[2]}))
    text, last = "", None
    while tiny_llm.has_unfinished_requests():
        for out in tiny_llm.step():
            if out.request_id == rid:
                text += out.outputs[0].text
                last = out
    assert last.finished and last.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[2])


@pytest.mark.slow
@pytest.mark.spawn
def test_tp2_gives_the_tokens_of_tp1(tiny_model_dir, tiny_llm):
    params = [structured(json=s, temperature=t, seed=2) for s in SCHEMAS for t in (0.0, 1.0)]
    params.append(structured(grammar=ARITHMETIC, temperature=1.0, seed=1))
    prompts = [PROMPTS[i % 3] for i in range(len(params))]
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_model_dir, tensor_parallel_size=2, kvcache_block_size=16, kv_cache_memory=16 << 20) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


SMOL_CASES = [
    ("Give me a person as JSON.", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}}, "required": ["name", "age"]}),
    ("Describe Paris as JSON: its population and three districts.", {"type": "object", "properties": {
        "city": {"type": "string"}, "population": {"type": "number", "minimum": 0, "maximum": 1e8},
        "districts": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["city", "population", "districts"]}),
    ("Give two points and a color as JSON.", {"$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -999, "maximum": 999}, "y": {"type": "integer", "minimum": -999,
        "maximum": 999}}, "required": ["x", "y"], "additionalProperties": False}}, "type": "object",
        # open points let a sampled row nest objects, or write digits, until max_tokens
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"},
                       "color": {"enum": ["red", "green", "blue"]}}, "required": ["a", "b", "color"]}),
    ("Rate the movie Alien as JSON.", {"type": "object", "properties": {
        "title": {"type": "string"}, "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "review": {"type": "object", "properties": {"pros": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 2}, "verdict": {"enum": ["watch", "skip"]}},
                   "required": ["verdict"]}}, "required": ["title", "rating", "review"]}),
]


@pytest.mark.slow
@smollm2
def test_smollm2_outputs_validate():
    """A real model's outputs under JSON schemas validate wherever they end by EOS. Whether a small model ends
    one at all before max_tokens is the model's doing, and where its near ties fall the CPU's (on an Intel Xeon
    with AMX one sampled row of these eight wrote extra properties until max_tokens): most must end by EOS, and
    each that does must validate; the others must have run to max_tokens (no other way to end)."""
    with LLM(GGUF, max_model_len=1024) as llm:
        chats = [[{"role": "user", "content": p}] for p, _ in SMOL_CASES]
        params = [structured(json=s, temperature=t, seed=1, max_tokens=200) for _, s in SMOL_CASES for t in (0, 0.8)]
        outs = llm.chat([c for c in chats for _ in range(2)], params, use_tqdm=False)
        schemas = [s for _, s in SMOL_CASES for _ in range(2)]
        ended = [(o, s) for o, s in zip(outs, schemas) if o.outputs[0].finish_reason == "stop"]
        assert len(ended) >= len(outs) - 2, [o.outputs[0].text for o in outs]
        assert_valid_json(*zip(*ended))
        for out in outs:
            assert out.outputs[0].finish_reason == "stop" or len(out.outputs[0].token_ids) == 200
        expr, obj = llm.chat([[{"role": "user", "content": "Write an arithmetic expression that equals 10."}],
                              [{"role": "user",
                                "content": "Reply with only a JSON object holding a cat's name and age."}]],
                             [structured(grammar=ARITHMETIC, max_tokens=40), structured(json_object=True,
                                                                                         max_tokens=300)],
                             use_tqdm=False)
        assert expr.outputs[0].finish_reason == "stop" and is_arithmetic(expr.outputs[0].text)
        assert obj.outputs[0].finish_reason == "stop" and isinstance(json.loads(obj.outputs[0].text), dict)


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
                  "({{ t.function.parameters | tojson }}){% endfor %}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_renders_tools_as_transformers_does(tiny_llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    out, = tiny_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=TOOLS_TEMPLATE,
                         tools=tools)
    want = tiny_llm.tokenizer.apply_chat_template(messages, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                                  add_generation_prompt=True)
    assert "get_weather" in want and out.prompt_token_ids == tiny_llm.tokenizer.encode(want, add_special_tokens=False)
    with pytest.raises(TypeError, match="tools must be a list of dicts"):
        tiny_llm.chat(messages, use_tqdm=False, tools="get_weather")


@pytest.mark.slow
def test_bench_struct_runs_and_reports_figures(tiny_model_dir, tmp_path, capsys):
    from nanovllm_tp.bench import structured as bench_struct
    result = bench_struct.main(["--model", tiny_model_dir, "--num-requests", "3", "--max-tokens", "600",
                                "--repeats", "2", "--kv-cache-memory", str(32 << 20), "--quiet",
                                "--out", str(tmp_path / "s.json")])
    f = result["figures"]
    assert f["invalid_outputs"] == 0 and f["tokens"] > 3 and f["ratio"] > 0 and f["mask_us_per_row"] > 0
    assert json.loads((tmp_path / "s.json").read_text())["figures"] == f
    assert "JSON/free" in capsys.readouterr().out.rstrip().splitlines()[-4]
