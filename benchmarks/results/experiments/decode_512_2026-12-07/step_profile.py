"""One compiled engine (as `vllm serve` compiles the model, in this process) decoding one 512-token request: the
median decode step, then 5 steps under torch.profiler grouped by op and input shape. Run from the repository root:

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=nobind python .../step_profile.py dense|hysparse [CPROFILE]

With a second argument, 40 steps under cProfile instead (Python time by function).
"""
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process, where the profilers see it
import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

CHECKPOINTS = Path(__file__).resolve().parents[3] / "checkpoints"


def main():
    name = sys.argv[1]
    ckpt = CHECKPOINTS / f"{'llama' if name == 'dense' else name}-small"
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=1024, seed=0, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = torch.randint(10, 1000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r0", TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(12):  # the prefill, then warm decode steps
        engine.step()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
    print(f"{name}: decode step median {statistics.median(times):.2f} ms, min {min(times):.2f}")
    if len(sys.argv) > 2:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(40):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20,
                                                             max_name_column_width=50, max_shapes_column_width=60))


if __name__ == "__main__":
    main()
