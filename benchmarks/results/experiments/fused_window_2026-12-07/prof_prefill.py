import os, sys, time, statistics
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
name, ckpt, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=ckpt, dtype="float32", max_model_len=ctx + 256, seed=0, enable_prefix_caching=True,
          max_num_batched_tokens=2048, max_num_seqs=1, block_size=128)
eng = llm.llm_engine
g = torch.Generator().manual_seed(0)
def run(i):
    prompt = torch.randint(10, 1000, (ctx,), generator=g).tolist()
    eng.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests(): eng.step()
for i in range(3): run(i)
N = 3
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
    for i in range(N): run(10 + i)
rows = sorted(((e.self_cpu_time_total / 1e3 / N, e.count / N, e.key + " " + str(e.input_shapes)[:50]) for e in prof.key_averages(group_by_input_shape=True)), reverse=True)
print(name, "total", sum(r[0] for r in rows))
for r in rows[:16]: print(f"{r[0]:8.2f} ms {r[1]:5.1f}x {r[2][:120]}")
