# SPDX-License-Identifier: Apache-2.0
"""KV cache of the papers' 80B layouts at 1M tokens, against the HySparse2 paper's Fig. 4 and the dense baseline.

Reads our KV accounting (`configs.base.kv_bytes_per_token`, the numbers the server log and
`convert --dry-run` print) for the `paper` presets. HySparse is taken as the HySparse2 paper
retrains it (q/k head dim 192, v head dim 128). Prints a table and writes JSON + Markdown
under benchmarks/results/.

    python benchmarks/paper_kv.py
"""

import json
import time
from pathlib import Path

from vllm_hysparse.configs.base import kv_bytes_per_token
from vllm_hysparse.tools import make_checkpoint as mc

TOKENS = 1 << 20
# [HS2] Fig. 4: KV cache at 1M tokens in FP8, GB.
LAYOUTS = [("hysparse", {"head_dim": 192, "v_head_dim": 128}, 6.72), ("hysparse2", {}, 2.69)]


def main() -> None:
    rows = []
    for arch, overrides, paper_gb in LAYOUTS:
        cfg = mc.build_config(arch, "paper", overrides)
        for name, width in (("fp8", 1), ("bf16", 2)):
            kv = kv_bytes_per_token(cfg, dtype_bytes=width, context_len=TOKENS)
            gb, dense_gb = kv["bytes_per_token"] * TOKENS / 1e9, kv["dense_bytes_per_token"] * TOKENS / 1e9
            rows.append({"arch": arch, "kv_cache_dtype": name, "bytes_per_token": kv["bytes_per_token"],
                         "gb_at_1m": round(gb, 3), "dense_gb_at_1m": round(dense_gb, 3),
                         "vs_dense": round(gb / dense_gb, 4),
                         "paper_fig4_gb": paper_gb if name == "fp8" else None})
    header = "| arch | KV dtype | bytes/token | GB at 2^20 tokens | dense GB | ratio to dense | Fig. 4 GB |"
    lines = [header, "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['arch']} | {r['kv_cache_dtype']} | {r['bytes_per_token']:,.1f} | {r['gb_at_1m']:.2f} | "
                     f"{r['dense_gb_at_1m']:.2f} | {r['vs_dense']:.3f} | {r['paper_fig4_gb'] or '-'} |")
    table = "\n".join(lines)
    print(table)
    out = Path(__file__).parent / "results" / f"paper_kv_{time.strftime('%Y-%m-%d_%H%M')}"
    out.with_suffix(".json").write_text(json.dumps({"tokens": TOKENS, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(f"# Paper layouts: KV cache at {TOKENS:,} tokens\n\n"
                                      f"Command: `python benchmarks/paper_kv.py`\n\n{table}\n")
    print(f"wrote {out}.json / .md")


if __name__ == "__main__":
    main()
