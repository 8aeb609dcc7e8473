"""The messages between the HTTP process and the engine loop: sampling parameters and real outputs (logprobs,
prompt logprobs, n > 1, stop reasons) come back equal after msgpack, and parameters are validated on arrival."""
import pytest

from nanovllm_tp import SamplingParams
from nanovllm_tp.sampling_params import RequestOutputKind
from nanovllm_tp.serving import wire


def test_sampling_params_round_trip_every_field():
    p = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=11, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.2, stop=["\n", "end"], stop_token_ids=[3],
                       include_stop_str_in_output=True, ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=3,
                       prompt_logprobs=1, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
                       stream_interval=3, logit_bias={5: 1.5, 1999: -100.0}, allowed_token_ids=[1, 5, 7],
                       bad_words=["the", "a b"])
    msg = wire.unpack(wire.pack({"op": "add", "params": wire.params_to_wire(p)}))
    back = wire.params_from_wire(msg["params"])
    back.validate()
    assert back == p and list(back.logit_bias) == [5, 1999]       # int keys survive msgpack
    assert back.bias_arrays[1].tolist() == [1.5, -100.0] and back.allowed_array.tolist() == [1, 5, 7]


def test_params_are_validated_again_on_arrival(tiny_llm):
    """The HTTP side built them (validated); the engine process validates what arrives once, when LLM.add_request
    takes it, and refuses it there with the constructor's message."""
    d = wire.params_to_wire(SamplingParams())
    for bad, exc, message in (({"temperature": -1.0}, ValueError, "temperature"),
                              ({"logit_bias": {3: "high"}}, TypeError, r"logit_bias\[3\]"),
                              ({"allowed_token_ids": [2003]}, ValueError, "allowed_token_ids .* outside the vocab")):
        with pytest.raises(exc, match=message):
            tiny_llm.add_request("x", wire.params_from_wire({**d, **bad}))
    assert not tiny_llm.has_unfinished_requests()
    with pytest.raises(TypeError):
        wire.params_from_wire({**d, "no_such_knob": 1})


def test_outputs_round_trip(tiny_llm):
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, logprobs=2, prompt_logprobs=2,
                            stop=[" the"])
    for out in tiny_llm.generate(["The quick brown fox", "Hello"], params, use_tqdm=False):
        back = wire.output_from_wire(wire.unpack(wire.pack({"op": "outputs", "o": wire.output_to_wire(out)}))["o"])
        assert back == out
        assert back.prompt_logprobs[0] is None and back.outputs[0].logprobs
        msg = wire.pack({"op": "outputs", "o": wire.output_to_wire(out, with_prompt=False)})
        later = wire.output_from_wire(wire.unpack(msg)["o"])      # a later output: the prompt stays behind
        assert later.prompt is None and later.prompt_token_ids is None and later.outputs == out.outputs


def test_a_message_without_an_op_is_refused():
    with pytest.raises(ValueError):
        wire.unpack(wire.pack([1, 2]))


def test_embedding_params_and_outputs_round_trip(tiny_llm):
    from nanovllm_tp import EmbeddingRequestOutput, PoolingParams
    p = PoolingParams(normalize=False, truncate_prompt_tokens=5)
    back = wire.params_from_wire(wire.unpack(wire.pack({"op": "add", "params": wire.params_to_wire(p)}))["params"])
    assert back == p and back.output_kind == RequestOutputKind.FINAL_ONLY
    with pytest.raises(ValueError, match="dimensions"):
        wire.params_from_wire({"pooling": {"dimensions": 0}})
    out = tiny_llm.embed([[5, 6, 7]], use_tqdm=False)[0]
    got = wire.output_from_wire(wire.unpack(wire.pack({"op": "outputs", "outputs": [wire.output_to_wire(out)]}))
                                ["outputs"][0])
    assert isinstance(got, EmbeddingRequestOutput)
    assert (got.request_id, got.prompt_token_ids, got.finished) == (out.request_id, [5, 6, 7], True)
    assert got.outputs.embedding == out.outputs.embedding        # float32 values, exact
