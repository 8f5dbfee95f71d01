"""The HySparse2 tiny reference's token-selection margins on the prompt of the CI failure of 2026-12-07 19:26
(`test_prompt_logprobs_per_request_with_early_exit`, seed 1920070014): per cross full layer, group and row, the
relative gap between the 16th and 17th largest R among the candidates. Run from the repository root:

    .venv/bin/python benchmarks/results/experiments/shared_decode_2026-12-07/tie_margin.py
"""
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))
from tests.vllm_utils import random_prompts
from tests.conftest import CANONICAL_SEED
from vllm_hysparse.tools.make_checkpoint import write_checkpoint
import vllm_hysparse  # noqa
from vllm_hysparse.reference import ops
from transformers import AutoModelForCausalLM
ckpt = write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "tiny", "hysparse2", "tiny", seed=CANONICAL_SEED)
ref = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
cfg = ref.config
p = random_prompts([150, 90, 120, 40, 200, 3], cfg.vocab_size, seed=1920070014)[0]
orig = ops.token_topk
gaps = []
def rec(q, k, scale, topk_tokens, recent_window, reduce="max", forced_window=True, positions=None):
    tq = q.shape[1]
    pr = ops.sink_softmax(ops.attention_logits(q, k, scale, positions), None)
    r = ops.reduce_heads(pr, k.shape[2], reduce)[0]  # [G, Tq, Tk]
    for row in range(tq):
        t = row if positions is None else int(positions[row])
        cand = r[:, row, : max(0, t - recent_window + 1)]
        if cand.shape[-1] > topk_tokens:
            s = torch.sort(cand, dim=-1, descending=True).values
            rel = ((s[:, topk_tokens - 1] - s[:, topk_tokens]) / s[:, topk_tokens - 1]).min().item()
            gaps.append((rel, t))
    return orig(q, k, scale, topk_tokens, recent_window, reduce, forced_window, positions)
import vllm_hysparse.reference.modeling_hysparse2 as m2
m2.ops.token_topk = rec
with torch.no_grad():
    ref(torch.tensor([p]), use_cache=False)
gaps.sort()
print("topk", cfg.sparse_topk_tokens, "window", cfg.recent_window, "smallest relative gaps (gap, row):",
      [(f"{g:.2e}", t) for g, t in gaps[:6]])
print("row 139 gaps:", [f"{g:.2e}" for g, t in gaps if t == 139])
