"""Median decode-step time in process (vLLM engine, prefix caching), compiled as served or eager:
`python engine_steps.py MODEL compiled|eager CTX [NREQ]`. Request 0 prefills the prompt, NREQ - 1 more (8 by
default) share it, then 40 engine steps are timed."""
import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

name, mode, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
nreq = int(sys.argv[4]) if len(sys.argv) > 4 else 8
ck = {"dense": "llama-small", "hysparse": "hysparse-small", "hysparse2": "hysparse2-small"}[name]
llm = LLM(model=f"benchmarks/checkpoints/{ck}", dtype="float32", max_model_len=ctx + 200,
          enforce_eager=(mode == "eager"), seed=0, enable_prefix_caching=True, max_num_batched_tokens=2048,
          max_num_seqs=8, block_size=128)
eng = llm.llm_engine
prompt = torch.randint(10, 1000, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
eng.add_request("r0", TokensPrompt(prompt_token_ids=prompt), params)
while not any(len(o.outputs[0].token_ids) >= 1 for o in eng.step()):
    pass
for i in range(1, nreq):
    eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt[:-1] + [1000 + i]), params)
for _ in range(6):
    eng.step()
ts = []
for _ in range(40):
    t = time.perf_counter()
    eng.step()
    ts.append((time.perf_counter() - t) * 1e3)
print(json.dumps({"model": name, "mode": mode, "ctx": ctx, "nreq": nreq, "median_ms": statistics.median(ts),
                  "min_ms": min(ts), "p90": sorted(ts)[36]}), flush=True)
