"""A served request's output stream: delta outputs its reader has not taken yet are merged into one, and the
merged output says what the request's cumulative output says (text, tokens, logprobs, finish)."""
import asyncio

import pytest

from nanovllm_tp import SamplingParams
from nanovllm_tp.outputs import CompletionOutput, RequestOutput, merge_delta
from nanovllm_tp.sampling_params import RequestOutputKind
from nanovllm_tp.serving.engine_client import EngineDead, RequestStream

PROMPTS = ["The quick brown fox", "Once upon a time there"]


def run_both(llm, **knobs):
    """Each prompt's DELTA outputs in step order, and its CUMULATIVE final output, from one batch."""
    deltas, finals = {}, {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        params = SamplingParams(max_tokens=24, output_kind=kind, **knobs)
        for i, p in enumerate(PROMPTS):
            llm.add_request(p, params, request_id=f"{kind.name}-{i}")
    while llm.has_unfinished_requests():
        for out in llm.step():
            kind, i = out.request_id.split("-")
            if kind == "DELTA":
                deltas.setdefault(int(i), []).append(out)
            elif out.finished:
                finals[int(i)] = out
    return deltas, finals


def same_completion(a, b) -> None:
    assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == \
        (b.index, b.text, b.token_ids, b.finish_reason, b.stop_reason)
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob) if b.cumulative_logprob is not None else True
    if b.logprobs is not None:
        assert [{t: lp.logprob for t, lp in pos.items()} for pos in a.logprobs] == \
            [{t: lp.logprob for t, lp in pos.items()} for pos in b.logprobs]


@pytest.mark.parametrize("knobs", [dict(temperature=0), dict(temperature=0.9, seed=3, n=2, logprobs=3),
                                   dict(temperature=0, stop=[" the"], include_stop_str_in_output=True)])
def test_unread_deltas_merge_into_the_cumulative_output(tiny_llm, knobs):
    deltas, finals = run_both(tiny_llm, **knobs)

    async def read_all(outs, reads_after):
        """Put the outputs in as the engine would, reading only after the steps in reads_after."""
        stream, got = RequestStream(RequestOutputKind.DELTA), []
        for step, out in enumerate(outs):
            stream.put(out)
            if step in reads_after:
                got.append(stream.take())
        while (out := await stream.next()) is not None:
            got.append(out)
        return got

    for i, outs in deltas.items():
        assert len(outs) > 3
        got = asyncio.run(read_all(outs, reads_after={1}))
        assert len(got) == 2                          # two reads: all the rest merged into the second
        merged = got[0]
        merge_delta(merged, got[1])
        assert merged.finished
        by_index = {c.index: c for c in merged.outputs}
        assert sorted(by_index) == sorted(c.index for c in finals[i].outputs)
        for c in finals[i].outputs:
            same_completion(by_index[c.index], c)


def test_a_failed_stream_raises_after_what_arrived_before():
    async def go():
        stream = RequestStream(RequestOutputKind.DELTA)
        first = RequestOutput("r", None, [1, 2], outputs=[CompletionOutput(0, " a", [7])], finished=False)
        stream.put(first)                              # an output not yet read when the engine died
        stream.fail(EngineDead("the engine stopped"))
        assert await stream.next() is first
        with pytest.raises(EngineDead):
            await stream.next()
        assert not stream.done
    asyncio.run(go())


@pytest.mark.parametrize("knobs", [dict(temperature=0), dict(temperature=0.9, seed=3, n=2, logprobs=3)])
def test_a_whole_stream_gives_the_final_output_once(tiny_llm, knobs):
    """A non-streamed request carried as deltas (RequestStream(whole=True), what a data-parallel server does so
    that it can move between replicas): nothing to read and no wake-up until the last delta, then one output equal
    to the engine's final one, completions in index order."""
    deltas, finals = run_both(tiny_llm, **knobs)

    async def read(outs):
        stream = RequestStream(RequestOutputKind.DELTA, whole=True)
        for out in outs[:-1]:
            stream.put(out)
            assert not stream.ready.is_set() and not stream.has_news and stream.take() is None
        stream.put(outs[-1])
        assert stream.ready.is_set() and stream.has_news
        out = stream.take()
        assert stream.done and await stream.next() is None
        return out

    for i, outs in deltas.items():
        got = asyncio.run(read(outs))
        assert got.finished and [c.index for c in got.outputs] == sorted(c.index for c in got.outputs)
        assert [c.index for c in got.outputs] == [c.index for c in finals[i].outputs]
        for a, b in zip(got.outputs, finals[i].outputs):
            same_completion(a, b)


def test_a_whole_stream_raises_its_error_at_once():
    async def go():
        stream = RequestStream(RequestOutputKind.DELTA, whole=True)
        stream.put(RequestOutput("r", None, [1, 2], outputs=[CompletionOutput(0, " a", [7])], finished=False))
        stream.fail(EngineDead("the engine stopped"))
        assert stream.has_news
        with pytest.raises(EngineDead):          # half an answer is none
            await stream.next()
    asyncio.run(go())
