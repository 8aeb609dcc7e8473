"""The bounds on JSON numbers' digits (structured/number_digits.py): a number part takes at most 16 integer
digits, 16 fraction digits and 3 exponent digits through the grammar's token mask, in schemas and json_object
alike; strings and other grammars are left alone, a schema's own long numbers raise the bound, and a rollback
brings the count back."""
import numpy as np
import pytest

from nanovllm_tp.layers.sampler import mask_bits
from nanovllm_tp.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm_tp.scheduler import Sequence
from nanovllm_tp.structured.number_digits import DigitLimits, NumberDigits, TokenDigits

from tests.unit.test_structured import EOS, VOCAB, backend, tokenizer     # noqa: F401 (fixtures)
NUMBER = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}



def taken(backend, tokenizer, text: str, **spec) -> tuple[str, bool]:
    """The longest prefix of `text` (by its tokens) that the masks let through, and whether EOS may follow it."""
    seq = Sequence(0, [7, 8], SamplingParams(temperature=0),
                   grammar=backend.compile(StructuredOutputsParams(**spec)).new())
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not mask_bits(backend.fill_masks([(seq.grammar, seq)]), VOCAB)[0, t]:
            return tokenizer.decode(seq.token_ids[2:]), False
        seq.token_ids.append(t)
    return text, bool(mask_bits(backend.fill_masks([(seq.grammar, seq)]), VOCAB)[0, EOS])


def test_a_number_takes_16_integer_and_fraction_digits_and_3_exponent_digits(backend, tokenizer):
    def whole(text, **spec) -> bool:
        return taken(backend, tokenizer, text, **spec) == (text, True)
    assert taken(backend, tokenizer, '{"n": ' + "1" * 30 + "}", json=NUMBER) == ('{"n": ' + "1" * 16, False)
    assert whole('{"n": ' + "1" * 16 + "}", json=NUMBER)
    assert whole('{"n": -1.' + "5" * 16 + "}", json=NUMBER)
    assert not whole('{"n": 1.' + "5" * 17 + "}", json=NUMBER)
    assert whole('{"n": 2.5e-123}', json=NUMBER) and whole('{"n": 7E+12}', json=NUMBER)
    assert not whole('{"n": 2.5e-1234}', json=NUMBER)
    # json_object's free values: every number, in arrays and nested objects too; strings are not numbers
    assert taken(backend, tokenizer, '{"a": ' + "1" * 30 + "}", json_object=True)[1] is False
    assert not whole('{"a": [true, {"b": 1.' + "2" * 17 + "}]}", json_object=True)
    assert whole('{"a": [true, false, null, -0.5e10, "' + "3" * 40 + '", "\\"' + "4" * 20 + '"]}',
                 json_object=True)
    # an integer keeps the schema rewrite's 2^53 - 1; a regex's digits are its own
    assert whole('{"n": 9007199254740991}', json={"type": "object", "properties": {"n": {"type": "integer"}}})
    assert whole("1" * 40, regex="[0-9]+")


def test_numbers_the_schema_writes_raise_the_bound_on_their_side():
    assert DigitLimits.of_schema(NUMBER) == DigitLimits(16, 16, 3)
    assert DigitLimits.of_schema({"type": "number", "minimum": 1e17, "maximum": 10 ** 20}).integer == 22
    assert DigitLimits.of_schema({"type": "number", "exclusiveMinimum": 0, "maximum": 1e-18}).fraction == 19
    assert DigitLimits.of_schema({"enum": [1, 0.125, True, "12345678901234567890"]}) == DigitLimits()


def test_a_schema_needing_longer_numbers_still_gets_them(backend, tokenizer):
    big = {"type": "number", "minimum": 1e17}
    assert taken(backend, tokenizer, "1" * 19, json=big) == ("1" * 19, True)
    tiny = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-18}
    assert taken(backend, tokenizer, "0." + "0" * 18 + "1", json=tiny) == ("0." + "0" * 18 + "1", True)
    assert taken(backend, tokenizer, "100000000000000000", json={"const": 10 ** 17})[1]


def test_tokens_are_masked_by_the_digits_they_start_with_and_a_rollback_restores_the_count(tokenizer, backend):
    digits = backend.token_digits()
    three = tokenizer.encode("000", add_special_tokens=False)
    assert len(three) == 1 and digits.lead[three[0]] == 3          # the tiny tokenizer has multi-digit tokens
    assert mask_bits(digits.fitting(2)[None], VOCAB)[0, three[0]] == 0
    assert digits.widest == 3 and digits.fitting(3) is None          # every token fits: no mask at all
    seq = Sequence(0, [7, 8], SamplingParams(temperature=0),
                   grammar=backend.compile(StructuredOutputsParams(json=NUMBER)).new())
    head = tokenizer.encode('{"n": ' + "1" * 16, add_special_tokens=False)
    one = tokenizer.encode("1", add_special_tokens=False)[0]
    seq.token_ids += head
    assert not mask_bits(backend.fill_masks([(seq.grammar, seq)]), VOCAB)[0, one]
    del seq.token_ids[-3:]                         # a rollback: three digits fewer, room again
    assert mask_bits(backend.fill_masks([(seq.grammar, seq)]), VOCAB)[0, one]


@pytest.mark.parametrize("text, state", [
    (b'"a\\"1234', (1, 0)),             # inside a string (past an escaped quote)
    (b"[true, -12", (3, 2)),             # the e of true is no exponent
    (b"3.25", (4, 2)), (b"1e+07", (5, 2)), (b"1E-", (5, 0)), (b"1.5, ", (0, 0)),
])
def test_the_lexer_finds_the_number_part_and_its_digits(text, state):
    tokens = TokenDigits([bytes([c]) for c in range(256)], 8)
    numbers = NumberDigits.start(DigitLimits(), tokens)
    for c in text:
        numbers.push(c)
    assert numbers.states[-1] == state
    numbers.pop(len(text))
    assert numbers.states == [(0, 0)]
    row = np.full(8, -1, np.int32)
    numbers.restrict(row)
    assert (row == -1).all()
