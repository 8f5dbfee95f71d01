import os, sys, time, statistics, json
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
import torch
from collections import defaultdict
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
name, ckpt, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
from csrc_triton import cpu_ext
for n in getattr(cpu_ext, "NAMES", ()): cpu_ext.load(n)
llm = LLM(model=ckpt, dtype="float32", max_model_len=ctx + 128, enforce_eager=False, seed=0,
          enable_prefix_caching=True, max_num_batched_tokens=2048, max_num_seqs=1, block_size=128)
eng = llm.llm_engine
g = torch.Generator().manual_seed(0)
prompt = torch.randint(10, 1000, (ctx,), generator=g).tolist()
eng.add_request("r0", TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
for _ in range(6): eng.step()
ts = []
for _ in range(30):
    t0 = time.perf_counter(); eng.step(); ts.append((time.perf_counter() - t0) * 1e3)
print(name, "step ms median", statistics.median(ts), "min", min(ts))
N = 10
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(N): eng.step()
rows = []
for e in prof.key_averages():
    rows.append((e.self_cpu_time_total / 1e3 / N, e.count / N, e.key))
rows.sort(reverse=True)
tot = sum(r[0] for r in rows)
print(f"{name} self-time sum per step {tot:.2f} ms")
for r in rows[:40]:
    print(f"{r[0]:8.3f} ms  {r[1]:6.1f}x  {r[2][:110]}")
