# SPDX-License-Identifier: Apache-2.0
"""The checkpoint writer: complete HF directories, peaked attention, safe writes, sharding."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import vllm_hysparse  # noqa: F401
from vllm_hysparse.configs.base import kv_bytes_per_token
from vllm_hysparse.reference import ops
from vllm_hysparse.tools import make_checkpoint as mc


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: mc.write_checkpoint(root / arch, arch, "tiny", seed=3) for arch in ("hysparse", "hysparse2")}


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_tiny_checkpoint_is_complete(tiny_dirs, arch):
    out = tiny_dirs[arch]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (out / name).is_file(), name
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == arch
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("def f(x):\n    return x + 1\n").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x + 1\n"
    assert max(ids) < config.vocab_size
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(out)
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert names == set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
        sinks = [n for n in names if n.endswith("sinks")]
        assert sinks and all(f.get_tensor(n).dtype == torch.float32 for n in sinks)


def _layer0_attention(out):
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = ("import os\nimport sys\n\ndef main(argv):\n    total = 0\n    for index, arg in enumerate(argv):\n"
            "        total += len(arg) * index\n        print(f'{index}: {arg!r}')\n    return total\n\n"
            "class Config:\n    def __init__(self, path):\n        self.path = os.path.abspath(path)\n")
    ids = tok(text, return_tensors="pt").input_ids
    attn = model.model.layers[1 if model.config.model_type == "hysparse2" else 0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    d = model.config.head_dim
    q = attn.q_proj(h).view(1, ids.shape[1], -1, d)
    k = attn.k_proj(h).view(1, ids.shape[1], -1, d)
    return model, q, k


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
def test_random_attention_is_peaked(tiny_dirs, arch):
    model, q, k = _layer0_attention(tiny_dirs[arch])
    with torch.no_grad():
        p = ops.sink_softmax(ops.attention_logits(q, k, q.shape[-1] ** -0.5), None)[0]  # [H, T, T]
    t = p.shape[-1]
    last = p[:, -1, :]
    entropy = -(last * last.clamp_min(1e-30).log()).sum(-1)
    # Uniform attention over t keys has entropy log(t); peaked random weights stay far below.
    assert entropy.mean() < 0.5 * math.log(t)
    # The strongest key is not just the query itself for every head.
    assert (last.argmax(-1) != t - 1).any()


def test_oracle_selection_is_nontrivial(tiny_dirs):
    model, q, k = _layer0_attention(tiny_dirs["hysparse"])
    cfg = model.config
    with torch.no_grad():
        ids = ops.oracle_block_topk(q, k, cfg.head_dim**-0.5, cfg.sparse_block_size, cfg.sparse_topk_blocks)
    last = ids[0, -1]  # [G, K] for the last query
    nb = math.ceil(q.shape[1] / cfg.sparse_block_size)
    assert nb > cfg.sparse_topk_blocks
    # Not simply "the most recent blocks": some older block wins somewhere.
    recent = set(range(nb - cfg.sparse_topk_blocks, nb))
    assert any(set(row.tolist()) != recent for row in last)


def test_refuses_to_overwrite_and_leaves_dir_intact(tiny_dirs):
    out = tiny_dirs["hysparse"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="--force"):
        mc.write_checkpoint(out, "hysparse", "tiny")
    assert mc.main(["--arch", "hysparse", "--out", str(out)]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_invalid_override_fails_without_writing(tmp_path, capsys):
    out = tmp_path / "bad"
    assert mc.main(["--arch", "hysparse2", "--out", str(out), "--set", "bridge_sources=[0,1]"]) == 2
    assert "bridge_sources[0]" in capsys.readouterr().err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_sharded_checkpoint_loads(tmp_path):
    out = mc.write_checkpoint(tmp_path / "sharded", "hysparse", "tiny", seed=5, max_shard_bytes=400_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    single = mc.write_checkpoint(tmp_path / "single", "hysparse", "tiny", seed=5)
    a, b = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(single)
    x = torch.randint(0, a.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch, full, windowed", [("hysparse", 5, 44), ("hysparse2", 5, 24)])
def test_paper_preset_is_config_only_with_paper_kv(tmp_path, arch, full, windowed):
    out = mc.write_checkpoint(tmp_path / arch, arch, "paper")
    assert not list(out.glob("*.safetensors"))
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.num_hidden_layers == 49
    kv = kv_bytes_per_token(cfg, dtype_bytes=1, context_len=1 << 20)
    assert (kv["full_length_caches"], kv["window_caches"]) == (full, windowed)
    # SPEC §3.4 / papers §2.6: FP8 full-length bytes per token are 6,400 (HySparse
    # as 192/128 in [HS2]; 5*4*2*128 = 5,120 with head_dim 128) and 2,560 (HySparse2).
    expected_full = {"hysparse": 5 * 2 * 4 * 128, "hysparse2": 5 * 2 * 1 * 256}[arch]
    window_part = windowed * 2 * cfg.num_key_value_heads * cfg.head_dim * 128 / (1 << 20)
    assert kv["bytes_per_token"] == pytest.approx(expected_full + window_part)
    if arch == "hysparse":
        # "nearly 10x" less KV than dense (49 / 5 = 9.8 before the SWA overhead).
        assert 9.0 < kv["dense_bytes_per_token"] / kv["bytes_per_token"] < 9.8


@pytest.mark.parametrize("arch, overrides, paper_gb", [
    # HySparse as the HySparse2 paper retrains it: q/k head dim 192, v head dim 128 (papers.md §1.2)
    ("hysparse", {"head_dim": 192, "v_head_dim": 128}, 6.72),
    ("hysparse2", {}, 2.69),
])
def test_paper_kv_cache_at_1m_tokens_matches_fig4(arch, overrides, paper_gb):
    """[HS2] Fig. 4: the KV cache at 1M tokens in FP8 is 6.72 GB (HySparse) and 2.69 GB (HySparse2).

    Expected bytes from first principles: one byte per element; every full-length cache holds
    `G * (D_k + D_v)` elements per token for all 2**20 tokens, every window cache for 128 tokens.
    """
    from vllm_hysparse.configs.base import kv_report

    cfg = mc.build_config(arch, "paper", overrides)
    g, d_k, d_v, full, windowed = {"hysparse": (4, 192, 128, 5, 44), "hysparse2": (1, 256, 256, 5, 24)}[arch]
    tokens, window = 1 << 20, 128
    per_token = g * (d_k + d_v)
    total = full * per_token * tokens + windowed * per_token * window
    assert round(total / 1e9, 2) == paper_gb
    kv = kv_bytes_per_token(cfg, dtype_bytes=1, context_len=tokens)
    assert kv["bytes_per_token"] * tokens == pytest.approx(total)
    assert f"HySparse KV cache: {full * per_token} bytes/token in {full} full-length caches" in kv_report(cfg, 1, None)
