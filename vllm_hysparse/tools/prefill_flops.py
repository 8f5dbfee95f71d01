# SPDX-License-Identifier: Apache-2.0
"""Prefill FLOPs of dense, HySparse and HySparse2 layouts for one prompt of n tokens (computed, not measured).

    python benchmarks/prefill_flops.py                 # `small` at 512/2048/4096 and the paper layouts at 1M
    python benchmarks/prefill_flops.py --lens 1024 32768
    python -m vllm_hysparse.tools.prefill_flops        # the same; `benchmarks/serve_bench.py` imports this module

Counting rules (see benchmarks/README.md, "Prefill FLOPs"):

- every matmul of an m×k by k×n is 2·m·k·n FLOPs; norms, RoPE, softmax, gates' sigmoid, masks and
  top-k selection are not matmuls and are not counted;
- projections: q/k/v, o, gates (HySparse sparse: two gates; HySparse2 sliding and cross sparse: one)
  and HySparse2's bridge K/V projections; MLP (SwiGLU: gate, up, down = 6·d·I per token);
  lm_head on one row (vLLM computes prompt logits for the last prompt token only);
- attention of one query over K keys: 2·H·(D_qk + D_v)·K (scores and values); full layers are causal
  (query t sees t+1 keys); sliding layers and HySparse's SWA branch see min(t+1, window) keys;
- HySparse's oracle block scores are the full layer's own attention scores (no extra FLOPs); a sparse
  layer's global branch sees min(t+1, topk·B) keys, an upper bound: when the query's own, partial block
  is among the top-k blocks, fewer than topk·B keys are visible;
- HySparse2 cross full layers score every causal key (the token selection reuses those scores);
  cross sparse layers see min(t+1, k_g + w) keys. With prefill early exit the self-decoder runs on all n
  tokens, the bridges project K/V for all n tokens and the cross-decoder runs on one row (the last
  token, t = n−1); without it the cross-decoder runs on all n rows;
- `path="cpu"` counts what our default CPU path executes (the C++ kernels of `csrc_triton/`): the same as
  the model, except that the token oracle of HySparse2's cross full layers scores every visible key of a
  prefill row a second time, once the row's softmax statistics are final (the reduced probabilities R,
  `reduce_pass` in `csrc_triton/oracle/cpu_tiled.cpp`), in each prefill chunk whose last row sees more than
  `ONE_PASS_MAX_KEYS` keys; the rows of shorter chunks, its decode rows, and the one row of each prompt that
  early exit leaves take the scores from their single pass. The prompt is prefilled in chunks of `chunk`
  tokens (vLLM's default `max_num_batched_tokens` for `vllm serve` on CPU is 2,048). HySparse's oracle keeps its block
  scores inside its single pass and its sparse layers read only their selected keys, as the model
  counts. Work the kernels discard (keys past a row's position inside a key tile) is not counted, nor
  the PyTorch fallback's (`VLLM_HYSPARSE_CPU_EXT=0`).
"""

import argparse
from dataclasses import dataclass

F, S, W = "full_attention", "sparse_attention", "sliding_attention"

# `csrc_triton/token_oracle/batched.py` scores a prefill chunk in one pass when its last row sees at most this many
# keys (tests/tools/test_prefill_flops.py holds the two equal; this offline tool does not import the kernels).
ONE_PASS_MAX_KEYS = 4096
SERVE_CHUNK = 2048  # vLLM 0.32's default max_num_batched_tokens for `vllm serve` on CPU (engine/arg_utils.py)


@dataclass(frozen=True)
class Layout:
    """What the FLOPs count needs from a model config (plain numbers, so paper variants are easy to state)."""

    kind: str  # "dense", "hysparse" or "hysparse2"
    layer_types: tuple[str, ...]
    hidden: int
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    intermediate: int  # 0: MLP not modelled
    vocab: int  # 0: lm_head not modelled
    gate_width: int = 0  # output width of one gate projection
    swa_window: int = 128
    block_size: int = 64  # HySparse
    topk_blocks: int = 16  # HySparse
    topk_tokens: int = 1024  # HySparse2 k_g
    recent_window: int = 128  # HySparse2 w
    num_self: int = 0  # HySparse2 self-decoder layers

    @property
    def layers(self) -> int:
        return len(self.layer_types)


def layout_from_config(config, kind: str | None = None, *, mlp: bool = True, lm_head: bool = True,
                       qk_dim: int | None = None, v_dim: int | None = None) -> Layout:
    """A Layout from a HySparseConfig / HySparse2Config (or, with kind="dense", any config of that shape)."""
    kind = kind or config.model_type
    d = config.head_dim
    qk, v = qk_dim or d, v_dim or d
    heads = config.num_attention_heads
    gate = heads * (v if getattr(config, "gate_type", "elementwise") == "elementwise" else 1)
    types = tuple(config.layer_types) if kind != "dense" else (F,) * config.num_hidden_layers
    extra = {}
    if kind == "hysparse":
        extra = dict(block_size=config.sparse_block_size, topk_blocks=config.sparse_topk_blocks)
    elif kind == "hysparse2":
        extra = dict(topk_tokens=config.sparse_topk_tokens, recent_window=config.recent_window,
                     num_self=config.num_self_decoder_layers)
    return Layout(kind=kind, layer_types=types, hidden=config.hidden_size, heads=heads,
                  kv_heads=config.num_key_value_heads, qk_dim=qk, v_dim=v,
                  intermediate=config.intermediate_size if mlp else 0, vocab=config.vocab_size if lm_head else 0,
                  gate_width=gate, swa_window=getattr(config, "swa_window", 128), **extra)


# ---------------------------------------------------------------- key counts (sums over query rows)

def capped_keys(n: int, cap: int) -> int:
    """Σ_{t=0}^{n-1} min(t+1, cap): keys seen by n causal queries that each see at most `cap` keys."""
    if n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def causal_keys(n: int) -> int:
    return n * (n + 1) // 2


def rescored_keys(n: int, chunk: int) -> int:
    """Keys the token oracle scores a second time for n prefill rows run in chunks of `chunk`: every causal key of
    the rows of a chunk whose last row sees more than ONE_PASS_MAX_KEYS keys."""
    return sum(causal_keys(e) - causal_keys(s) for s in range(0, n, chunk)
               if (e := min(n, s + chunk)) > ONE_PASS_MAX_KEYS)


# ---------------------------------------------------------------- FLOPs

def _qkv_o(lay: Layout) -> int:
    """q, k, v and o projections of one token in a layer that owns its K/V."""
    d, h, g = lay.hidden, lay.heads, lay.kv_heads
    return 2 * d * (h * lay.qk_dim + g * lay.qk_dim + g * lay.v_dim) + 2 * h * lay.v_dim * d


def _q_o(lay: Layout) -> int:
    """q and o projections of one token in a HySparse2 cross layer (its K/V come from a bridge)."""
    return 2 * lay.hidden * lay.heads * lay.qk_dim + 2 * lay.heads * lay.v_dim * lay.hidden


def prefill_flops(lay: Layout, n: int, *, early_exit: bool = True, path: str = "model",
                  chunk: int = SERVE_CHUNK) -> dict[str, float]:
    """FLOPs to prefill one prompt of `n` tokens, by part (projections, mlp, attention, lm_head, total).

    `early_exit` only matters for HySparse2. `path="model"` counts the architecture, `path="cpu"` what our
    default CPU path executes (module docstring: the model's count plus the token oracle's second scoring of
    the prefill rows of chunks past ONE_PASS_MAX_KEYS keys, the prompt prefilled `chunk` tokens a step).
    """
    if path not in ("model", "cpu"):
        raise ValueError(f"path: must be 'model' or 'cpu' (got {path!r})")
    if chunk < 1:
        raise ValueError(f"chunk: must be a positive number of tokens (got {chunk})")
    cpu = path == "cpu"
    d = lay.hidden
    per_key = 2 * lay.heads * (lay.qk_dim + lay.v_dim)  # scores + values, one query, one key
    score_only = 2 * lay.heads * lay.qk_dim
    mlp_tok = 6 * d * lay.intermediate
    gate_tok = 2 * d * lay.gate_width
    proj = mlp = attn = 0.0

    if lay.kind in ("dense", "hysparse"):
        for kind in lay.layer_types:
            mlp += n * mlp_tok
            proj += n * _qkv_o(lay)
            if lay.kind == "dense" or kind == F:  # HySparse's oracle: its block scores come from this pass
                attn += causal_keys(n) * per_key
                continue
            proj += n * 2 * gate_tok  # sparse-branch and SWA-branch gates
            window = capped_keys(n, lay.swa_window) * per_key  # SWA branch
            glob = capped_keys(n, lay.topk_blocks * lay.block_size) * per_key
            attn += window + glob
    elif lay.kind == "hysparse2":
        for i in range(lay.num_self):  # self-decoder: every prompt token
            kind = lay.layer_types[i]
            mlp += n * mlp_tok
            proj += n * _qkv_o(lay) + (n * gate_tok if kind == W else 0)
            attn += (causal_keys(n) if kind == F else capped_keys(n, lay.swa_window)) * per_key
        cross_full = [i for i in range(lay.num_self, lay.layers) if lay.layer_types[i] == F]
        proj += len(cross_full) * n * 2 * d * lay.kv_heads * (lay.qk_dim + lay.v_dim)  # bridges, all n tokens
        rows = 1 if early_exit else n
        budget = lay.topk_tokens + lay.recent_window
        for i in range(lay.num_self, lay.layers):
            kind = lay.layer_types[i]
            mlp += rows * mlp_tok
            proj += rows * _q_o(lay) + (rows * gate_tok if kind == S else 0)
            if early_exit:  # the last prompt token, t = n - 1, one row (its scores from its single pass)
                keys_full, keys_sparse, rescored = n, min(n, budget), 0
            else:
                keys_full, keys_sparse = causal_keys(n), capped_keys(n, budget)
                rescored = rescored_keys(n, chunk) if cpu else 0  # the token oracle's second pass, long chunks
            attn += (keys_full * per_key + rescored * score_only) if kind == F else keys_sparse * per_key
    else:
        raise ValueError(f"kind: must be 'dense', 'hysparse' or 'hysparse2' (got {lay.kind!r})")
    head = 2.0 * d * lay.vocab  # one row of logits
    total = proj + mlp + attn + head
    return {"projections": proj, "mlp": mlp, "attention": attn, "lm_head": head, "total": total}


# ---------------------------------------------------------------- configurations of the serving benchmark

CONFIGS = ("dense", "hysparse", "hysparse2", "hysparse2-noexit")


def small_layouts() -> dict[str, Layout]:
    """The served `small` layouts: dense Llama of HySparse's shape, HySparse, HySparse2 (exit on / off share one)."""
    from vllm_hysparse.tools.make_checkpoint import build_config

    hs, hs2 = build_config("hysparse", "small", None), build_config("hysparse2", "small", None)
    return {"dense": layout_from_config(hs, "dense"), "hysparse": layout_from_config(hs),
            "hysparse2": layout_from_config(hs2)}


def config_flops(layouts: dict[str, Layout], config: str, n: int, path: str = "model") -> dict[str, float]:
    """prefill_flops of one benchmark configuration (`hysparse2-noexit`: HySparse2 without early exit)."""
    if config == "hysparse2-noexit":
        return prefill_flops(layouts["hysparse2"], n, early_exit=False, path=path)
    return prefill_flops(layouts[config], n, path=path)


def flops_table(lens: list[int]) -> dict:
    """{n: {config: {"model": total, "cpu": total, "model_parts": {...}}}} for the `small` configurations."""
    layouts = small_layouts()
    out = {}
    for n in lens:
        out[n] = {}
        for c in CONFIGS:
            m = config_flops(layouts, c, n)
            out[n][c] = {"model": m["total"], "cpu": config_flops(layouts, c, n, "cpu")["total"], "model_parts": m}
    return out


PAPER_ANCHOR = 2.92  # HySparse2 paper, Fig. 4: prefill FLOPs vs HySparse at 1M tokens


def paper_ratio(n: int = 1 << 20) -> dict:
    """HySparse 80B / HySparse2 80B prefill FLOPs at n tokens, attention + projections only (no MoE FFN, no lm_head).

    HySparse is counted twice: with the head dims of our `paper` preset (128/128, the HySparse paper's
    Table 1) and with the 192/128 (QK/V) that the HySparse2 paper's Table 1 gives its HySparse baseline.
    """
    from vllm_hysparse.tools.make_checkpoint import build_config

    hs, hs2 = build_config("hysparse", "paper", None), build_config("hysparse2", "paper", None)
    lay2 = layout_from_config(hs2, mlp=False, lm_head=False)
    h2 = prefill_flops(lay2, n, early_exit=True)
    h2_noexit = prefill_flops(lay2, n, early_exit=False)
    rows = {}
    for label, qk in (("HySparse head dim 128/128 (our `paper` preset)", None),
                      ("HySparse head dim QK 192 / V 128 (HySparse2 paper's baseline)", 192)):
        h = prefill_flops(layout_from_config(hs, mlp=False, lm_head=False, qk_dim=qk, v_dim=hs.head_dim), n)
        rows[label] = {"hysparse": h["total"], "hysparse_attention": h["attention"],
                       "ratio_exit": h["total"] / h2["total"], "ratio_noexit": h["total"] / h2_noexit["total"]}
    return {"n": n, "hysparse2": h2["total"], "hysparse2_attention": h2["attention"],
            "hysparse2_noexit": h2_noexit["total"], "rows": rows, "paper_anchor": PAPER_ANCHOR}


def _g(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", type=int, nargs="+", default=[512, 2048, 4096])
    args = parser.parse_args(argv)
    table = flops_table(args.lens)
    print("| prompt | config | GFLOPs (model) | GFLOPs (our CPU path, approx.) | HySparse/this | dense/this |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n, row in table.items():
        for c in CONFIGS:
            f = row[c]["model"]
            print(f"| {n} | {c} | {_g(f)} | {_g(row[c]['cpu'])} | {row['hysparse']['model'] / f:.2f}× | "
                  f"{row['dense']['model'] / f:.2f}× |")
    p = paper_ratio()
    print(f"\nPaper layouts at n = {p['n']:,} tokens (attention + projections; MoE FFN and lm_head not modelled):")
    print(f"HySparse2 80B, early exit: {p['hysparse2'] / 1e15:,.1f} PFLOPs; "
          f"without: {p['hysparse2_noexit'] / 1e15:,.1f}")
    for label, r in p["rows"].items():
        print(f"{label}: {r['hysparse'] / 1e15:,.1f} PFLOPs; HySparse / HySparse2 = {r['ratio_exit']:.2f}× "
              f"(early exit), {r['ratio_noexit']:.2f}× (no exit); paper: {PAPER_ANCHOR}×")


if __name__ == "__main__":
    main()
