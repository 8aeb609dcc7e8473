"""Disaggregated prefill and decode (`serve -dp 2 --replica-roles prefill,decode`) against a real server on
127.0.0.1: each streamed request is prefilled on replica 0, then moves with its KV to replica 1, which decodes the
rest; every answer is the undisturbed engine's under --batch-invariant (greedy with logprobs, seeded n = 2, a stop
string, and the same prompt again, which finds its prefix held on the decode side); non-streamed requests move
the same way, their answers whole, and one whose decode replica dies goes on from the tokens it had."""
import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from nanovllm_tp import SamplingParams
from nanovllm_tp.sampling_params import StructuredOutputsParams
from tests.helpers import hf_greedy
from tests.procs import TORCHRUN, free_port, python_cmd, started
from tests.serving.test_data_parallel import wait_all_ready
from tests.serving.test_healing import invariant_llm, sigterm_exits_0, titled  # noqa: F401  (a fixture)
from tests.serving.test_serve import ENGINE_ARGS, start_server

pytestmark = [pytest.mark.spawn, pytest.mark.slow]
PROMPT = "The quick brown fox jumps over the lazy dog and then"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def streamed(port: int, body: dict) -> tuple[dict, dict, list]:
    """Each choice's text and token logprobs from a streamed /v1/completions, and the events."""
    texts, logprobs, events = {}, {}, []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            for ch in [] if data == "[DONE]" else events[-1]["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                if ch.get("logprobs"):
                    logprobs.setdefault(ch["index"], []).extend(ch["logprobs"]["token_logprobs"])
    assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e], events[-3:]
    return texts, logprobs, events


def streamed_killing(port: int, body: dict, proc, title: str, at_chunk: int) -> tuple[str, int | None]:
    """A streamed /v1/completions' text (no error event allowed), the server's process titled `title` killed (kill -9)
    once `at_chunk` chunks have come; and that process's pid (None: the stream ended first)."""
    text, chunks, killed = "", 0, None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += "".join(ch["text"] for ch in event["choices"])
            chunks += 1
            if chunks == at_chunk and killed is None:
                killed = titled(proc.pid, title)
                os.kill(killed, signal.SIGKILL)
    return text, killed


def counter(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf'nanovllm_tp:{name}_total\{{[^}}]*{labels}[^}}]*\}} (\S+)', text)
    assert match, name
    return float(match.group(1))


def test_streams_are_prefilled_on_one_replica_and_decoded_on_the_other(tiny_model_dir, invariant_llm):
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=1)
    want_greedy = invariant_llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    stop = want_greedy.text[30:34]
    cases = [   # (body, SamplingParams of the same request offline)
        ({"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "logprobs": 1}, greedy),
        ({"prompt": PROMPT + " more", "n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 40, "ignore_eos": True},
         SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)),
        ({"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stop": [stop]},
         SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[stop])),
        ({"prompt": "Hello, my name is", "max_tokens": 200, "temperature": 0, "structured_outputs": {"json": SCHEMA}},
         SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA))),
    ]
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--replica-roles", "prefill,decode",
                             "--batch-invariant", "--max-model-len", "1024")
    with ctx as proc:
        wait_all_ready(port, proc)
        for body, params in cases:
            want = invariant_llm.generate([body["prompt"]], params, use_tqdm=False)[0]
            texts, logprobs, events = streamed(port, {"model": "tiny", **body,
                                                      "stream_options": {"include_usage": True}})
            assert texts == {c.index: c.text for c in want.outputs}, body
            if "structured_outputs" in body:      # the grammar went on where the prefill replica left it
                assert isinstance(json.loads(texts[0])["n"], int)
            assert events[-2]["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)
            if params.logprobs is not None:
                got, ref = logprobs[0], [lp[t].logprob for lp, t in zip(want.outputs[0].logprobs,
                                                                       want.outputs[0].token_ids)]
                assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert counter(metrics, "router_requests_handed_off") == len(cases)
        assert counter(metrics, "router_kv_handoff_bytes") > 0
        assert counter(metrics, "router_requests_routed", 'dp_rank="1"') == len(cases)     # only hand-offs
        # each replica's own counts: blocks out of the prefill replica, into the decode replica (the third request's
        # prompt blocks were held there already: fewer written than sent)
        sent, written = (counter(metrics, "kv_transfer_blocks_out", 'dp_rank="0"'),
                         counter(metrics, "kv_transfer_blocks_in", 'dp_rank="1"'))
        assert 0 < written < sent and counter(metrics, "kv_transfer_blocks_in", 'dp_rank="0"') == 0
        # the KV went from pool to pool (kv_shared_pool): the payloads through the HTTP process are each request's
        # state, a few kB, and the decode replica copied the blocks it did not hold
        sent_bytes = counter(metrics, "kv_transfer_bytes_out", 'dp_rank="0"')
        assert counter(metrics, "router_kv_handoff_bytes") < 4096 * len(cases) < sent_bytes
        assert sent_bytes * written / sent == counter(metrics, "kv_transfer_bytes_in", 'dp_rank="1"')
        # non-streamed requests move too, and their answers are whole: the same text, logprobs and usage
        for body, params in cases[:2]:
            want = invariant_llm.generate([body["prompt"]], params, use_tqdm=False)[0]
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={"model": "tiny", **body})
            assert r.status_code == 200, r.text
            choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
            assert [ch["text"] for ch in choices] == [c.text for c in want.outputs], body
            assert r.json()["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)
            if params.logprobs is not None:
                got = choices[0]["logprobs"]["token_logprobs"]
                ref = [lp[t].logprob for lp, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
                assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
            "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert counter(metrics, "router_requests_handed_off") == len(cases) + 3
        assert counter(metrics, "router_requests_routed", 'dp_rank="1"') == len(cases) + 3
        sigterm_exits_0(proc)


def test_a_non_streamed_request_goes_on_from_its_tokens_when_its_decode_replica_dies(tiny_model_dir, invariant_llm,
                                                                                      monkeypatch):
    """kill -9 of the decode replica while it computes a handed-off non-streamed request (each step made 5 ms
    slower): the answer comes whole, equal to the undisturbed run, resumed on the prefill replica from the tokens
    it had (not computed again from its first one)."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(os.path.dirname(os.path.dirname(__file__)), "tp_scripts",
                                                  "fault_injection") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("NVTP_TEST_STEP_SLEEP_S", "0.005")
    params = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    want = invariant_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--replica-roles", "prefill,decode",
                             "--batch-invariant", "--max-model-len", "1024")
    with ctx as proc:
        wait_all_ready(port, proc)
        answer = {}
        client = threading.Thread(target=lambda: answer.update(r=httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)))
        client.start()
        deadline = time.monotonic() + 60
        while counter(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text,
                      "router_requests_handed_off") < 1:
            assert time.monotonic() < deadline and client.is_alive()
            time.sleep(0.05)
        time.sleep(0.5)                 # some 100 tokens decoded on the decode replica
        assert client.is_alive(), "finished before the decode replica could be killed"
        os.kill(titled(proc.pid, "nanovllm_tp::dp1::tp0"), signal.SIGKILL)
        client.join(300)
        r = answer["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text and r.json()["usage"]["completion_tokens"] == 600
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert counter(metrics, "router_requests_resumed") == 1
        assert counter(metrics, "router_requests_resubmitted") == 0
        wait_all_ready(port, proc)
        sigterm_exits_0(proc)


def test_a_decode_replica_killed_mid_stream_loses_nothing(tiny_model_dir, invariant_llm):
    """kill -9 of the decode replica while it streams a handed-off request: the stream goes on (computed again on
    the prefill replica, the only one up) with no error and no repeated text, equal to the undisturbed run; once
    the decode replica is back, new streams are handed to it again."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    want = invariant_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--replica-roles", "prefill,decode",
                             "--batch-invariant", "--max-model-len", "1024")
    with ctx as proc:
        wait_all_ready(port, proc)
        text, killed = streamed_killing(port, body, proc, "nanovllm_tp::dp1::tp0", 20)
        assert killed is not None and text == want
        wait_all_ready(port, proc)
        before = counter(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, "router_requests_handed_off")
        texts, _, _ = streamed(port, {**body, "max_tokens": 30})
        assert texts[0] == want[:len(texts[0])] and texts[0]
        after = counter(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, "router_requests_handed_off")
        assert after == before + 1
        sigterm_exits_0(proc)


def test_a_prefill_replica_killed_before_its_blocks_are_copied_loses_nothing(tiny_model_dir, invariant_llm,
                                                                             monkeypatch, tmp_path):
    """The prefill replica hands a stream over by reference and is killed (kill -9) half a second later, while the
    decode replica waits 2 s before copying its blocks: the copy finds that pool gone, the decode replica computes
    the prompt again, and the stream goes on with no error and no repeated text, equal to the undisturbed run."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(os.path.dirname(os.path.dirname(__file__)), "tp_scripts",
                                                  "fault_injection") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("NVTP_TEST_DIE_AFTER_HANDOFF", str(tmp_path / "died"))
    monkeypatch.setenv("NVTP_TEST_SLOW_POOL_COPY", "2")
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    want = invariant_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--replica-roles", "prefill,decode",
                             "--batch-invariant", "--max-model-len", "1024")
    with ctx as proc:
        wait_all_ready(port, proc)
        prefill = titled(proc.pid, "nanovllm_tp::dp0::tp0")
        texts, _, _ = streamed(port, {"model": "tiny", "prompt": PROMPT, "max_tokens": 80, "temperature": 0,
                                      "ignore_eos": True})
        assert texts[0] == want
        assert (tmp_path / "died").exists() and not os.path.exists(f"/proc/{prefill}")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert counter(metrics, "router_requests_handed_off") == 1
        assert counter(metrics, "kv_transfer_blocks_in", 'dp_rank="1"') == 0         # nothing could be copied
        wait_all_ready(port, proc)                                                 # the prefill replica is back
        texts, _, _ = streamed(port, {"model": "tiny", "prompt": PROMPT, "max_tokens": 80, "temperature": 0,
                                      "ignore_eos": True})
        assert texts[0] == want
        sigterm_exits_0(proc)


@pytest.mark.parametrize("tp", [1, 2])
def test_two_torchrun_nodes_hand_off_over_the_network(tiny_model_dir, invariant_llm, hf_model, tmp_path, tp):
    """`serve -dp 2 --replica-roles prefill,decode` as two torchrun nodes on 127.0.0.1, a replica each (of one rank,
    or of two under -tp 2): the decode replica is on the other node, so each hand-off carries its KV as bytes over
    the authenticated (CURVE) sockets through the HTTP process, and the streams equal the undisturbed engine's
    (at TP 2, in fp32 without --batch-invariant: transformers' greedy text)."""
    port, master = free_port(), free_port()
    secret = {"NANOVLLM_TP_SECRET": "two-node-disaggregated-secret-0123456789"}
    flags = ["--batch-invariant"] if tp == 1 else ["--tensor-parallel-size", "2"]
    nodes = [python_cmd(*TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", str(tp),
                        "--master-addr", "127.0.0.1", "--master-port", str(master),
                        "-m", "nanovllm_tp.launch.serve", "--model", tiny_model_dir, "--port", str(port),
                        "--served-model-name", "tiny", *ENGINE_ARGS, "--data-parallel-size", "2",
                        "--replica-roles", "prefill,decode", *flags, "--max-model-len", "1024")
             for n in (0, 1)]
    logs = [open(tmp_path / f"node{n}.log", "w+") for n in (0, 1)]
    cases = [PROMPT, PROMPT + " again", "Hello, my name is"]
    with started(nodes[1], env=secret, stdout=logs[1], stderr=subprocess.STDOUT) as node1, \
            started(nodes[0], env=secret, stdout=logs[0], stderr=subprocess.STDOUT) as node0:
        wait_all_ready(port, node0)
        tok = invariant_llm.get_tokenizer()
        for prompt in cases:
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            want = invariant_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text if tp == 1 else \
                tok.decode(hf_greedy(hf_model, tok.encode(prompt), 40))
            texts, _, _ = streamed(port, {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                                          "ignore_eos": True})
            assert texts[0] == want, prompt
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert counter(metrics, "router_requests_handed_off") == len(cases)
        sent = counter(metrics, "kv_transfer_bytes_out", 'dp_rank="0"')
        assert counter(metrics, "router_kv_handoff_bytes") > sent > 0       # the KV itself crossed, as bytes
        assert counter(metrics, "kv_transfer_blocks_in", 'dp_rank="1"') > 0
        node0.send_signal(signal.SIGTERM)
        node0.wait(timeout=60)
        assert node1.wait(timeout=60) == 0, open(tmp_path / "node1.log").read()[-3000:]


def test_a_replica_that_queues_moves_requests_to_one_with_room(tiny_model_dir, invariant_llm):
    """Rebalancing: -dp 2, one sequence slot a replica, round-robin; replica 0 gets five long non-streamed
    requests (four wait), replica 1 four short streamed ones, done at once. Replica 0 queues while replica 1 has
    room: its running request moves there with its KV, a waiting one starts; every text equals the undisturbed
    engine's."""
    long_params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    prompts = [f"{PROMPT} {i}" for i in range(9)]
    want = [invariant_llm.generate([p], long_params if i % 2 == 0 else SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text for i, p in enumerate(prompts)]
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--router", "round-robin",
                             "--max-num-seqs", "1", "--batch-invariant", "--max-model-len", "1024")
    with ctx as proc:
        wait_all_ready(port, proc)
        got = [None] * len(prompts)

        def run(i):
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 900 if i % 2 == 0 else 8,
                    "temperature": 0, "ignore_eos": True}
            if i % 2 == 0:   # the long ones, which move, are not streamed; the short ones are
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
                got[i] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            else:
                got[i] = streamed(port, body)[0][0]
        threads = []
        for i in range(len(prompts)):          # in order: the even ones to replica 0, the odd ones to replica 1
            threads.append(threading.Thread(target=run, args=(i,)))
            threads[-1].start()
            time.sleep(0.05)
        for t in threads:
            t.join(300)
        assert got == want
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert counter(metrics, "router_requests_rebalanced") >= 1
        assert counter(metrics, "kv_transfer_blocks_in", 'dp_rank="1"') > 0
        assert counter(metrics, "kv_transfer_blocks_out", 'dp_rank="0"') > 0
        sigterm_exits_0(proc)


def test_a_lora_request_is_prefilled_on_one_replica_and_decoded_on_the_other(tiny_model_dir, tmp_path):
    """`--enable-lora --lora-modules`: a streamed and a non-streamed request of an adapter move from the prefill
    replica to the decode replica with their KV and their adapter, and answer as the same request on one engine;
    the adapter changes the answer (else this proves nothing)."""
    pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm_tp import LLM
    from nanovllm_tp.launch.make_lora import make_lora
    from nanovllm_tp.lora import LoRARequest
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    path = make_lora(hf, tmp_path / "a1", rank=8, alpha=16, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_model_dir, batch_invariant=True, max_model_len=1024, kv_cache_memory=32 << 20,
             kvcache_block_size=16, enable_lora=True) as llm:
        want = llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest("a1", 1, str(path)))[0]
        base = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert want.outputs[0].text != base.outputs[0].text
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--replica-roles", "prefill,decode",
                             "--batch-invariant", "--max-model-len", "1024", "--enable-lora",
                             "--lora-modules", f"a1={path}")
    with ctx as proc:
        wait_all_ready(port, proc)
        body = {"model": "a1", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        texts, _, _ = streamed(port, body)
        assert texts[0] == want.outputs[0].text
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.outputs[0].text
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert counter(metrics, "router_requests_handed_off") == 2
        assert counter(metrics, "kv_transfer_blocks_in", 'dp_rank="1"') > 0
        sigterm_exits_0(proc)


def test_tp2_replicas_hand_off_every_rank_s_kv(tiny_model_dir, hf_model):
    """`-dp 2 -tp 2 --replica-roles prefill,decode`: each replica's two ranks hold a KV head each; a hand-off
    gathers both on the prefill replica's rank 0 and the decode replica's rank 0 hands each of its ranks its own.
    Streamed and non-streamed greedy requests answer transformers' text; the same prompt again finds its prefix
    held on the decode side (fewer blocks written); a decode rank killed mid-stream loses nothing."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = list(range(7, 7 + 45))
    want = tok.decode(hf_greedy(hf_model, prompt, 40))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                             "--replica-roles", "prefill,decode")
    with ctx as proc:
        wait_all_ready(port, proc)
        metrics = lambda: httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text  # noqa: E731
        assert streamed(port, body)[0][0] == want
        first_blocks = counter(metrics(), "kv_transfer_blocks_in", 'dp_rank="1"')
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        text = metrics()
        assert counter(text, "router_requests_handed_off") == 2
        assert first_blocks == 3            # 45 prompt tokens + the first: 46 tokens' KV, 3 blocks, both ranks
        assert 0 < counter(text, "kv_transfer_blocks_in", 'dp_rank="1"') - first_blocks < first_blocks
        assert counter(text, "kv_transfer_bytes_out", 'dp_rank="0"') > 0

        long_want = tok.decode(hf_greedy(hf_model, prompt[:20], 300))
        got, killed = streamed_killing(port, {**body, "prompt": prompt[:20], "max_tokens": 300, "stream": True}, proc,
                                       "nanovllm_tp::dp1::tp1", 10)
        assert killed is not None and got == long_want
        sigterm_exits_0(proc)


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_rank_that_dies_in_a_tp2_hand_off_loses_no_request(tiny_model_dir, hf_model, kind, monkeypatch,
                                                             tmp_path):
    """-dp 2 -tp 2 --replica-roles prefill,decode; rank 1 of the prefill replica dies (kill -9) as it joins the
    gather of a hand-off's KV ("read"), or rank 1 of the decode replica as it joins the scatter of it ("write"):
    the replica whose rank died stops (its rank killed: no failure of its own, no traceback) and is started again,
    the request goes on elsewhere, its answer transformers', no error; later requests are handed off again."""
    from transformers import AutoTokenizer
    monkeypatch.setenv("PYTHONPATH", os.path.join(os.path.dirname(os.path.dirname(__file__)), "tp_scripts",
                                                  "fault_injection") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("NVTP_TEST_DIE_IN_KV_MOVE", f"{kind}:{tmp_path / 'died'}")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = list(range(7, 7 + 45))
    want = tok.decode(hf_greedy(hf_model, prompt, 40))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    log = tmp_path / "serve.log"
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                             "--replica-roles", "prefill,decode", stderr=open(log, "w"))
    with ctx as proc:
        wait_all_ready(port, proc)
        assert streamed(port, body)[0][0] == want
        assert (tmp_path / "died").exists()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        wait_all_ready(port, proc)                     # the replica is back
        before = counter(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, "router_requests_handed_off")
        assert streamed(port, body)[0][0] == want
        after = counter(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, "router_requests_handed_off")
        assert after == before + 1
        sigterm_exits_0(proc)
    text = log.read_text()
    assert "Traceback" not in text and "was killed (exit code 4): starting it again" in text, text[-3000:]
