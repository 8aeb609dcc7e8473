"""Run by the TP tests (directly, under torchrun, or as a killable rank 0): greedy tokens to a JSON file.

usage: generate_tokens.py MODEL_DIR OUT_JSON TP [--engine-json JSON] [--pids PIDS_FILE] [--long]
"""
import argparse
import json
import os
import random

from nanovllm_tp import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("out")
parser.add_argument("tp", type=int)
parser.add_argument("--engine-json", default="{}")
parser.add_argument("--pids", help="write this rank-0 pid and its spawned workers' pids here, then keep going")
parser.add_argument("--long", action="store_true", help="a workload long enough to be killed in the middle")
args = parser.parse_args()

llm = LLM(args.model, tensor_parallel_size=args.tp, **json.loads(args.engine_json))
if args.pids:
    with open(args.pids + ".tmp", "w") as f:
        json.dump({"rank0": os.getpid(), "workers": [c.pid for c in llm.engine.children]}, f)
    os.replace(args.pids + ".tmp", args.pids)
vocab = llm.config.model_config.vocab_size
rng = random.Random(0)
lengths = [1, 7, 16, 33, 64, 100, 180, 257] * (40 if args.long else 1)
prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
params = SamplingParams(temperature=0, max_tokens=400 if args.long else 32, ignore_eos=True)
outs = llm.generate(prompts, params, use_tqdm=False)
with open(args.out, "w") as f:
    json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "local_ranks": llm.engine.local_ranks,
               "remote_ranks": llm.engine.remote_ranks, "pid": os.getpid(),
               "max_steps_in_flight": llm.engine.stats()["max_steps_in_flight"]}, f)
