"""LLM's step loop: one engine step at a time, the outputs of the requests that progressed (detokenized, stop
strings matched, grammars advanced), aborts, and the loop that runs generate's and embed's requests to the end.
A part of LLM."""
import logging
import time
from collections.abc import Iterable

from nanovllm_tp import trace
from nanovllm_tp.output_processor import RequestState
from nanovllm_tp.outputs import RequestOutput
from nanovllm_tp.scheduler import Sequence

log = logging.getLogger("nanovllm_tp")


class StepLoop:
    """Mixed into LLM: uses its engine and request tables (_requests, _by_seq, _dirty)."""

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """End requests now, wherever they are (waiting, running, preempted); their blocks are freed at once and
        the next step() reports them with finish_reason "abort". Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self._requests.get(rid)
            if state is None or state.finished:
                continue
            for c in state.completions:
                self.engine.finish(c.seq, "abort")
            self._dirty[rid] = None

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that progressed (per its output_kind),
        including what happened to step()-driven requests since the last call."""
        if self.engine.has_unfinished():
            with trace.span("step"):
                self._engine_step()
        outputs = []
        for rid in list(self._dirty):
            del self._dirty[rid]
            state = self._requests[rid]
            out = state.output()
            if out is not None:
                outputs.append(out)
            if state.finished:
                self._forget(state)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished() or bool(self._dirty)

    def _engine_step(self) -> tuple[int, bool]:
        """One engine step: detokenize, match stop strings, mark the requests that progressed."""
        try:
            progressed, num_tokens, is_prefill = self.engine.step()
        except BaseException:
            for state in list(self._requests.values()):     # the engine failed them all; the error says why
                self._forget(state)
            self._dirty.clear()
            raise
        with trace.span("detokenize"):
            for seq in progressed:
                state = self._by_seq[seq.seq_id]
                if seq.grammar is not None and not seq.is_finished:
                    self._advance_grammar(seq)
                hit = state.update(seq)
                if hit is not None:           # a stop string: the sequence ends at the token that completes it
                    self.engine.finish(seq, "stop", *hit)
                    state.update(seq)
                self._dirty[state.request_id] = None
        return num_tokens, is_prefill

    def _advance_grammar(self, seq: Sequence) -> None:
        """The sequence's matcher takes its new tokens; a token outside the language (another knob left the grammar
        nothing to choose: min_tokens against its end, allowed_token_ids, bad_words) ends the request."""
        error = seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
        if error is not None:
            log.warning("request %s: structured output ended: %s", self._by_seq[seq.seq_id].request_id, error)
            self.engine.finish(seq, "abort")

    def _run(self, ids: list[str], use_tqdm: bool, desc: str) -> list:
        """Step until the requests `ids` have finished; their whole outputs in that order."""
        mine = [self._requests[i] for i in ids]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc=desc, dynamic_ncols=True)
        prefill_tps = decode_tps = 0.0
        done = 0
        try:
            while not all(s.finished for s in mine):
                start = time.perf_counter()
                with trace.span("step"):
                    num_tokens, is_prefill = self._engine_step()
                rate = num_tokens / max(time.perf_counter() - start, 1e-9)
                prefill_tps, decode_tps = (rate, decode_tps) if is_prefill else (prefill_tps, rate)
                if bar is not None:
                    now_done = sum(s.finished for s in mine)
                    bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False)
                    bar.update(now_done - done)
                    done = now_done
        finally:
            if bar is not None:
                bar.close()
        outputs = []
        for state in mine:
            outputs.append(state.output(full=True))
            self._dirty.pop(state.request_id, None)
            self._forget(state)
        return outputs

    def _forget(self, state: RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for c in state.completions:
            self._by_seq.pop(c.seq.seq_id, None)
