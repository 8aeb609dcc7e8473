"""Structured outputs on their own: StructuredOutputsParams' checks, the llguidance backend (compile errors by
name, the cache, the time limit, matchers that follow and roll back), and the grammar mask as a logit modifier on
both samplers, against masks worked out from the token texts alone."""
import time

import numpy as np
import pytest
import torch

from nanovllm_tp.checkpoint.loader import load_tokenizer
from nanovllm_tp.layers.sampler import Sampler, mask_bits
from nanovllm_tp.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm_tp.scheduler import Sequence
from nanovllm_tp.structured.backend import GrammarBackend
from tests.unit.test_sampler import batch_of

VOCAB = 2003
EOS = 2000        # the tiny checkpoint's
NEG = np.float32(-np.inf)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, VOCAB, [EOS], timeout=30.0)
    yield b
    b.close()


def token_texts(tokenizer) -> list[str | None]:
    """Each token's text (None for special tokens, which no grammar here produces)."""
    special = set(tokenizer.all_special_ids)
    return [None if t in special or t >= len(tokenizer) else tokenizer.decode([t]) for t in range(VOCAB)]


@pytest.mark.parametrize("bad, error, match", [
    ({}, ValueError, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, ValueError, "got regex, choice"),
    ({"json": "{not json"}, ValueError, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, TypeError, "must be a JSON schema"),
    ({"regex": ""}, ValueError, "structured_outputs.regex cannot be empty"),
    ({"choice": []}, TypeError, "non-empty list of strings"),
    ({"choice": ["a", 3]}, TypeError, "each of structured_outputs.choice must be a string"),
    ({"grammar": 5}, TypeError, "structured_outputs.grammar must be a string"),
    ({"json_object": "yes"}, TypeError, "json_object must be true"),
    ({"json_object": True, "disable_any_whitespace": 1}, TypeError, "disable_any_whitespace must be a bool"),
])
def test_params_take_exactly_one_kind_of_a_checked_shape(bad, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**bad)
    with pytest.raises(error, match=match):
        SamplingParams(structured_outputs=bad)          # a dict is read as StructuredOutputsParams


def test_params_from_a_dict_refuse_unknown_fields_and_keep_a_canonical_key():
    with pytest.raises(ValueError, match="unknown or unsupported field.*'structural_tag'"):
        StructuredOutputsParams.from_dict({"json_object": True, "structural_tag": "x"})
    a = SamplingParams(structured_outputs={"json": '{"type": "object", "required": ["a"]}'}).structured_outputs
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert isinstance(a, StructuredOutputsParams) and a.key == b.key and a.kind == "json"
    assert StructuredOutputsParams.from_dict(b.to_dict()) == b


@pytest.mark.parametrize("spec, match", [
    ({"regex": "(?=a)b"}, "look-around"),
    ({"json": {"type": "strin"}}, "strin"),
    ({"json": {"$ref": "#/$defs/missing"}}, "/\\$defs/missing"),
    ({"json": {"type": "string", "format": "credit-card"}}, "Unknown format: credit-card"),
    ({"json": {"type": "array", "uniqueItems": True}}, "Unimplemented keys: \\[\"uniqueItems\"\\]"),
    ({"grammar": "root ::= missing_rule"}, "missing_rule"),
])
def test_a_constraint_that_cannot_compile_is_a_value_error_naming_it(backend, spec, match):
    params = StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=match):
        backend.compile(params)
    with pytest.raises(ValueError, match=match):        # cached: the same answer, not a new compile
        backend.compile(params)


def test_compiles_are_cached_and_a_missed_time_limit_fails_that_request_only(tokenizer, backend):
    params = StructuredOutputsParams(regex="[0-9]{3}")
    assert backend.submit(params).job is backend.submit(StructuredOutputsParams(regex="[0-9]{3}")).job
    assert backend.compile(params) is backend.compile(params)
    hurried = GrammarBackend(tokenizer, VOCAB, [EOS], timeout=1e-9)
    try:
        slow = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
        with pytest.raises(ValueError, match="did not compile within the time limit.*grammar_compile_timeout"):
            hurried.compile(slow)
        hurried.timeout = 30.0         # the timeout was that request's, not the constraint's verdict
        assert hurried.compile(slow) is hurried.compile(slow)
    finally:
        hurried.close()


def test_the_mask_allows_exactly_the_tokens_that_continue_a_choice(both_paths, tokenizer, backend):
    """From the start, a token is allowed iff its text is a non-empty prefix of a choice; after "ye" only what
    finishes "yes"; once complete, EOS alone. On both samplers, with a bias and the allowed set on top."""
    choices = ["yes", "no", "maybe"]
    compiled = backend.compile(StructuredOutputsParams(choice=choices))
    texts = token_texts(tokenizer)
    ye = tokenizer.encode("ye", add_special_tokens=False)
    yes = tokenizer.encode("yes", add_special_tokens=False)

    def want(done: str) -> set[int]:
        allowed = {t for t, s in enumerate(texts) if s and any(c.startswith(done + s) for c in choices)}
        return allowed | ({EOS} if done in choices else set())

    some = sorted(want(""))[::2] + list(range(100, 140))       # half the grammar's tokens, and others

    params = [SamplingParams(temperature=0, structured_outputs={"choice": choices}),
              SamplingParams(temperature=0, structured_outputs={"choice": choices}, logit_bias={yes[0]: 7.0}),
              SamplingParams(temperature=0, structured_outputs={"choice": choices}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, structured_outputs={"choice": choices}, allowed_token_ids=some)]
    batch = batch_of(params, prompts=[[5]] * 5, outputs=[[], [], yes, [], []])
    for seq in batch.seqs[:3] + batch.seqs[4:]:
        seq.grammar = compiled.new()
    logits = torch.from_numpy(np.random.default_rng(0).standard_normal((5, VOCAB)).astype(np.float32))
    sampler = Sampler(eos_token_ids=[EOS])
    fast, reference = both_paths(lambda: sampler.modified(logits, batch))
    assert torch.equal(fast, reference)
    allowed = [set(np.flatnonzero(~np.isneginf(row)).tolist()) for row in fast.numpy()]
    assert allowed[0] == allowed[1] == want("") and yes[0] in allowed[0] and EOS not in allowed[0]
    assert allowed[2] == {EOS} and allowed[3] == set(range(VOCAB))
    assert fast[1, yes[0]] == logits[1, yes[0]] + 7.0 and fast[0, yes[0]] == logits[0, yes[0]]
    assert fast[3].equal(logits[3])
    assert allowed[4] == want("") & set(some)                 # the allowed set and the grammar: both hold
    if len(ye) == 1:                       # part-way: only what completes "yes"
        seq = Sequence(9, [5] + ye, params[0], grammar=compiled.new())
        masks = backend.fill_masks([(seq.grammar, seq)])
        assert set(np.flatnonzero(mask_bits(masks, VOCAB)[0]).tolist()) == want("ye")


def test_a_matcher_follows_its_sequence_and_rolls_back(tokenizer, backend):
    compiled = backend.compile(StructuredOutputsParams(regex="[a-z]+-[0-9]{2}"))
    text = tokenizer.encode("ab-12", add_special_tokens=False)
    seq = Sequence(0, [7, 8], SamplingParams(temperature=0), grammar=compiled.new())
    fresh = backend.fill_masks([(seq.grammar, seq)])
    for t in text:
        seq.token_ids.append(t)
        assert seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens) is None
    assert seq.grammar.consumed == len(text)
    assert np.flatnonzero(mask_bits(backend.fill_masks([(seq.grammar, seq)]), VOCAB)[0]).tolist() == [EOS]
    del seq.token_ids[2:]                     # back to the prompt: the mask of the start again
    assert np.array_equal(backend.fill_masks([(seq.grammar, seq)]), fresh) and seq.grammar.consumed == 0
    seq.token_ids += [EOS]                    # EOS where the language cannot end: an error, named
    assert "output token 1 (id 2000) does not continue the structured output" in seq.grammar.advance(seq.token_ids, 2)
    assert not seq.grammar.constrains


def test_structured_requests_take_no_speculative_proposals():
    from nanovllm_tp.scheduler.speculative import speculates
    assert speculates(SamplingParams(temperature=0))
    assert not speculates(SamplingParams(temperature=0, structured_outputs={"regex": "[ab]+"}))


def test_structured_outputs_cross_the_wire_as_plain_fields():
    from nanovllm_tp.serving import wire
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"},
                                                                   disable_any_whitespace=True))
    raw = wire.pack({"op": "add", "params": wire.params_to_wire(sp)})
    back = wire.params_from_wire(wire.unpack(raw)["params"])
    back.validate()
    assert back.structured_outputs == sp.structured_outputs


def test_compile_lanes_keep_small_constraints_apart_and_drop_what_nobody_waits_for(tokenizer):
    """A large grammar holds the large lane: a small constraint compiles at once beside it; a second large one
    queued behind it, whose only request gives up, is dropped without ever running."""
    b = GrammarBackend(tokenizer, VOCAB, [EOS], timeout=60.0)
    try:
        wide = StructuredOutputsParams(grammar="start: " + " | ".join(f'"b{i}"' for i in range(20000)))
        blocker = b.submit(wide)
        while not blocker.future.running():
            time.sleep(0.001)
        b.timeout = 0.2
        queued = b.submit(StructuredOutputsParams(grammar="start: " + " | ".join(f'"q{i}"' for i in range(3000))))
        start = time.monotonic()
        b.compile(StructuredOutputsParams(choice=["yes", "no"]))
        assert time.monotonic() - start < 0.2 and not blocker.future.done()
        with pytest.raises(ValueError, match="did not compile within the time limit"):
            queued.result()
        assert queued.future.cancelled()             # never started: no CPU spent on it
        assert b.submit(queued.job.params).job is not queued.job      # asked again: a new compile
    finally:
        b.close()


def test_objects_that_list_properties_take_no_other_unless_the_schema_or_the_request_says_so(backend, tokenizer):
    """The default closes objects that list properties (not those under allOf, not json_object); True closes
    every object; False keeps JSON Schema's open objects."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "free": {"type": "object"},
                                               "part": {"allOf": [{"properties": {"b": {"type": "integer"}}}]}},
              "required": ["a"]}

    def takes(text: str, **options) -> bool:
        g = backend.compile(StructuredOutputsParams(json=schema, **options)).new()
        return g.matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and \
            g.matcher.is_accepting()
    assert takes('{"a": 1}') and not takes('{"a": 1, "z": 2}')
    assert takes('{"a": 1, "free": {"z": 2}}') and takes('{"a": 1, "part": {"b": 1, "z": 2}}')
    assert takes('{"a": 1, "z": 2}', disable_additional_properties=False)
    assert not takes('{"a": 1, "free": {"z": 2}}', disable_additional_properties=True)
    anything = backend.compile(StructuredOutputsParams(json_object=True)).new().matcher
    assert anything.consume_tokens(tokenizer.encode('{"z": 2}', add_special_tokens=False)) and anything.is_accepting()


def test_integers_stay_in_jsons_interoperable_range_unless_the_schema_bounds_them(backend, tokenizer):
    """An integer without bounds takes at most 2^53 - 1 either way (16 digits, so a sampled answer cannot write
    digits until max_tokens); a bound the schema sets is kept on its side, and one past the range is not made
    empty; numbers that are not integers, and schema-like values inside enum / const data, are left alone."""
    def takes(schema, text: str) -> bool:
        g = backend.compile(StructuredOutputsParams(json=schema)).new().matcher
        return g.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and g.is_accepting()
    integer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert takes(integer, '{"n": 9007199254740991}') and takes(integer, '{"n": -9007199254740991}')
    assert not takes(integer, '{"n": 9007199254740992}') and not takes(integer, '{"n": 12345678901234567}')
    nullable = {"type": ["integer", "null"], "minimum": 5}
    assert takes(nullable, "null") and takes(nullable, "9007199254740991") and not takes(nullable, "4")
    assert not takes(nullable, "9007199254740992")
    huge = {"type": "integer", "minimum": 10 ** 17}
    assert takes(huge, str(10 ** 17 + 7)) and not takes(huge, "5")
    below = {"type": "integer", "exclusiveMaximum": -(10 ** 16)}
    assert takes(below, str(-(10 ** 17))) and not takes(below, "0")
    assert takes({"type": "number"}, "12345678901234567890.5")
    assert takes({"const": {"type": "integer"}}, '{"type": "integer"}')        # data, not a schema


def test_properties_keep_the_schemas_order(backend, tokenizer):
    """An answer writes the properties in the order the schema lists them (as xgrammar and llguidance do), while
    the compile cache's key stays the same for the same schema written with its keywords in another order."""
    order = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "city": {"type": "string", "enum": ["Paris"]}},
             "required": ["name", "age", "city"]}
    g = backend.compile(StructuredOutputsParams(json=order)).new().matcher
    assert g.consume_tokens(tokenizer.encode('{"name": "A", "age": 3, "city": "Paris"}', add_special_tokens=False))
    assert g.is_accepting()
    g = backend.compile(StructuredOutputsParams(json=order)).new().matcher
    assert not g.consume_tokens(tokenizer.encode('{"age": 3, "city": "Paris", "name": "A"}', add_special_tokens=False))
    shuffled = {"required": ["name", "age", "city"], "properties": order["properties"], "type": "object"}
    assert StructuredOutputsParams(json=shuffled).key == StructuredOutputsParams(json=order).key
    reordered = {**order, "properties": dict(reversed(order["properties"].items()))}
    assert StructuredOutputsParams(json=reordered).key != StructuredOutputsParams(json=order).key


def A(node: dict) -> dict:
    return {"$defs": {"A": node}, "$ref": "#/$defs/A"}


@pytest.mark.parametrize("schema, ends", [
    (A({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}), True),             # a not required
    (A({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}), False),
    (A({"properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}), True),           # no type: 5 is one
    (A({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}},
        "required": ["a"]}), True),
    (A({"type": "object", "properties": {"k": {"type": "array", "items": {"$ref": "#/$defs/A"}}},
        "required": ["k"]}), True),                                                         # [] ends it
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, False),
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
    ({"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
                "B": {"type": "array", "prefixItems": [{"$ref": "#/$defs/A"}], "minItems": 1}},
      "$ref": "#/$defs/A"}, False),                                                         # through another def
])
def test_a_schema_whose_references_never_end_is_refused_and_others_pass(schema, ends):
    from nanovllm_tp.structured.schema import check_terminates
    if ends:
        check_terminates(schema)
    else:
        with pytest.raises(ValueError, match="accepts no finite JSON value"):
            check_terminates(schema)


def test_a_grammar_that_failed_masks_its_row_to_eos_and_keeps_its_error(tokenizer, backend):
    """A token its matcher refuses, found while the masks are made: the row's mask is EOS alone (never empty),
    and the error names the output token for the request's abort."""
    compiled = backend.compile(StructuredOutputsParams(regex="[a-z]+-[0-9]{2}"))
    seq = Sequence(0, [7, 8], SamplingParams(temperature=0), grammar=compiled.new())
    ab = tokenizer.encode("ab", add_special_tokens=False)
    seq.token_ids += ab + [EOS]
    masks = backend.fill_masks([(seq.grammar, seq)])
    assert np.flatnonzero(mask_bits(masks, VOCAB)[0]).tolist() == [EOS]
    assert seq.grammar.error.startswith(f"output token {len(ab) + 1} (id {EOS}) does not continue")
    assert not seq.grammar.constrains
