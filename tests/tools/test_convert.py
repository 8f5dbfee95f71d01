# SPDX-License-Identifier: Apache-2.0
"""Dense -> HySparse / HySparse2 conversion: exact identity with the teacher, layout, plans, failures."""

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.vllm_utils import randomise
from vllm_hysparse.configs.tensors import expected_tensors, layer_kind
from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM
from vllm_hysparse.tools import convert as cv
from vllm_hysparse.tools.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
SEQ = 24
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Each source exercises something else: tied embeddings and q/k/v biases (Qwen2),
# qk norms and head_dim != hidden / heads (Qwen3), another RoPE theta (Mistral);
# MoE MLPs with renormalised top-k and a dense layer (Qwen3-MoE), a shared expert and
# `decoder_sparse_step` 2, i.e. dense even layers (Qwen2-MoE).
SOURCES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    "mistral": (MistralConfig, MistralForCausalLM,
                {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {**MOE, "head_dim": 32, "norm_topk_prob": True,
                                                        "mlp_only_layers": [1]}),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, {**MOE, "shared_expert_intermediate_size": 48,
                                                        "decoder_sparse_step": 2}),
}
# The dense layers of each MoE source, as the converted config must list them.
MLP_ONLY = {"qwen3_moe": [1], "qwen2_moe": [0, 2, 4]}
# Plans under which, with the identity switches, every block / token is selected and every window covers SEQ.
# HySparse2: W F W | F F S — layer 4 is made a no-op whose k/v layer 5 shares (see `make_kv_shareable`).
IDENTITY_PLANS = {
    "hysparse": ["--block-size", "4", "--topk-blocks", "6", "--swa-window", "32"],
    "hysparse2": ["--topk-tokens", "8", "--recent-window", "16", "--swa-window", "32",
                  "--cross-full-layers", "3,4", "--bridge-sources", "1,1"],
}
REFERENCE = {"hysparse": HySparseForCausalLM, "hysparse2": HySparse2ForCausalLM}
ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP spin-waiting on a shared CPU (as tests/reference)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_kv_shareable(model: torch.nn.Module, full: int, follower: int) -> None:
    """Make layer `full` a no-op whose k/v inputs and projections equal layer `follower`'s.

    A HySparse2 cross sparse layer reads the cross full layer's cache instead of
    its own k/v; on this teacher the two are equal, so the identity reaches the
    last layer and proves the cross sparse mapping (q, o x2, gate, sink).
    """
    a, b = model.model.layers[full], model.model.layers[follower]
    with torch.no_grad():
        a.self_attn.o_proj.weight.zero_()
        for name, p in a.mlp.named_parameters():  # dense, or every expert and the shared one
            if "down_proj" in name:
                p.zero_()
        b.input_layernorm.weight.copy_(a.input_layernorm.weight)
        for name in ("k_proj", "v_proj", "k_norm"):
            if hasattr(a.self_attn, name):
                getattr(b.self_attn, name).load_state_dict(getattr(a.self_attn, name).state_dict())


def write_side_files(out: Path) -> None:
    (out / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (out / "tokenizer_config.json").write_text('{"model_max_length": 128}')


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Source name -> checkpoint dir of a small random dense model (Qwen3 sharded)."""
    root = tmp_path_factory.mktemp("teachers")
    out = {}
    for i, (name, (config_cls, model_cls, extra)) in enumerate(SOURCES.items()):
        torch.manual_seed(i)
        model = model_cls(config_cls(**COMMON, **extra)).eval()
        randomise(model, seed=i)
        make_kv_shareable(model, 4, 5)
        shard = "40KB" if name == "qwen3" else "50MB"
        model.save_pretrained(root / name, max_shard_size=shard)
        write_side_files(root / name)
        out[name] = root / name
    assert (out["qwen3"] / "model.safetensors.index.json").is_file()
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cv.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def converted_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in out.glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors


def teacher_logits(src: Path, ids: torch.Tensor) -> torch.Tensor:
    _, model_cls, _ = SOURCES[json.loads((src / "config.json").read_text())["model_type"]]
    with torch.no_grad():
        return model_cls.from_pretrained(src, dtype=torch.float32).eval()(ids).logits.float()


def check_layout(out: Path, config, src: Path) -> None:
    """Exactly `expected_tensors`; gates zero, sinks float32 at SINK_INIT, o_proj scaled per layer kind."""
    tensors = converted_tensors(out)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_tensors(config)
    teacher = {}
    for path in src.glob("*.safetensors"):
        teacher.update(load_file(path))
    for name, t in tensors.items():
        if name.endswith("sinks"):
            assert t.dtype == torch.float32 and bool((t == cv.SINK_INIT).all()), name
        elif "self_attn." in name and name.endswith("gate_proj.weight"):
            assert not t.any(), name
        elif ".mlp." in name:  # dense or MoE MLPs are copied as they are
            torch.testing.assert_close(t, teacher[name], rtol=0, atol=0)
    for i in range(config.num_hidden_layers):
        scale = 2.0 if layer_kind(config, i) in ("sliding", "cross_sparse") else 1.0
        name = f"model.layers.{i}.self_attn.o_proj.weight"
        torch.testing.assert_close(tensors[name], teacher[name] * scale, rtol=0, atol=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


@pytest.mark.parametrize("arch", ["hysparse", "hysparse2"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_identity_with_teacher(teachers, tmp_path, capsys, source, arch):
    src, dst = teachers[source], tmp_path / "out"
    shard = ["--max-shard-size", "100KB"] if source == "llama" else []
    rc, out, err = run(capsys, "--src", src, "--dst", dst, "--arch", arch, *IDENTITY_PLANS[arch], *shard)
    assert rc == 0, err
    assert "wrote" in out and "warning" not in err
    config = REFERENCE[arch].config_class.from_pretrained(dst)
    check_layout(dst, config, src)
    if shard:
        assert len(set(json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert config.qk_norm == source.startswith("qwen3") and config.attention_bias == source.startswith("qwen2")
    assert config.tie_word_embeddings == (source == "qwen2")
    moe = source in MLP_ONLY
    assert config.num_experts == (MOE["num_experts"] if moe else 0)
    if moe:
        teacher_cfg = SOURCES[source][0].from_pretrained(src)
        assert (config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob) == (
            2, 32, teacher_cfg.norm_topk_prob)
        assert config.shared_expert_intermediate_size == (48 if source == "qwen2_moe" else 0)
        assert config.mlp_only_layers == MLP_ONLY[source]
    if arch == "hysparse2":
        assert config.full_rope and config.swa_rotary_dim == config.head_dim
        assert config.swa_rope_theta == config.rope_theta
        assert config.layer_types[-1] == "sparse_attention"

    model = REFERENCE[arch].from_pretrained(dst, dtype=torch.float32).eval()
    ids = torch.randint(0, COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(7))
    model.set_switches(**cv.identity_switches(config))
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
    want = teacher_logits(src, ids)
    assert want.abs().max() > 1.0  # non-trivial logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # The real architecture (every switch on) runs and differs from the teacher.
    model.set_switches(kv_sharing=True, bridge=True)
    with torch.no_grad():
        real = model(ids).logits
    assert torch.isfinite(real).all() and not torch.allclose(real, want, atol=1e-3)


@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
def test_rope_scaling_carries_over(tmp_path, capsys, rope):
    src = tmp_path / "src"
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 3}, rope_parameters=ROPE_SCALINGS[rope])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    randomise(model, seed=3)
    model.save_pretrained(src)
    rc, _, err = run(capsys, "--src", src, "--dst", tmp_path / "hs", "--arch", "hysparse",
                     *IDENTITY_PLANS["hysparse"])
    assert rc == 0, err
    converted = HySparseForCausalLM.from_pretrained(tmp_path / "hs", dtype=torch.float32).eval()
    assert converted.config.rope_parameters == ROPE_SCALINGS[rope]
    converted.set_switches(kv_sharing=False)
    ids = torch.randint(0, COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    # HySparse2 sliding layers use plain RoPE (swa_rope_theta): the converter says so.
    rc, _, err = run(capsys, "--src", src, "--dst", tmp_path / "hs2", "--arch", "hysparse2", "--dry-run")
    assert rc == 0 and "warning: rope_scaling" in err


def test_verify_flag(teachers, tmp_path, capsys):
    rc, out, err = run(capsys, "--src", teachers["qwen3"], "--dst", tmp_path / "a", "--arch", "hysparse2",
                       "--verify")
    assert rc == 0, err
    # The default plan has cross sparse layers right after the cross full layer: the match ends there.
    assert "verify: hidden states entering layer 4" in out
    rc, out, err = run(capsys, "--src", teachers["llama"], "--dst", tmp_path / "b", "--arch", "hysparse",
                       *IDENTITY_PLANS["hysparse"], "--verify")
    assert rc == 0 and "verify: logits" in out, err


def test_failed_verify_writes_nothing(tmp_path, capsys):
    # Linear RoPE scaling cannot reach HySparse2 sliding layers (plain RoPE): layer 0 differs.
    src, outs = tmp_path / "src", tmp_path / "outs"
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 3}, rope_parameters=ROPE_SCALINGS["linear"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    randomise(model, seed=4)
    model.save_pretrained(src)
    outs.mkdir()
    rc, _, err = run(capsys, "--src", src, "--dst", outs / "x", "--arch", "hysparse2", "--verify")
    assert rc == 2 and "warning: rope_scaling 'linear'" in err
    assert err.strip().splitlines()[-1].startswith("error: verify: logits")
    assert list(outs.iterdir()) == []


def test_default_plans_follow_the_papers():
    paper = PRESETS["hysparse"]["paper"]["layer_types"]
    assert cv.hysparse_plan(49, cv.PlanOptions())["layer_types"] == paper
    assert cv.default_hysparse_full_layers(36) == [0, 4, 8, 12, 16, 20, 24, 28, 32, 35]
    assert cv.default_hysparse_full_layers(6, period=3) == [0, 3, 5]
    plan2 = cv.hysparse2_plan(49, cv.PlanOptions())
    want = PRESETS["hysparse2"]["paper"]
    assert plan2["layer_types"] == want["layer_types"]
    assert plan2["num_self_decoder_layers"] == want["num_self_decoder_layers"]
    assert plan2["bridge_sources"] == want["bridge_sources"]
    shallow = cv.hysparse2_plan(12, cv.PlanOptions())
    F, S, W = "full_attention", "sparse_attention", "sliding_attention"
    assert shallow["layer_types"] == [W, W, W, F, W, W] + [F, S, S] * 2
    assert shallow["bridge_sources"] == [3, 3]


def test_dry_run_prints_plan_and_writes_nothing(teachers, tmp_path, capsys):
    dst = tmp_path / "dry"
    rc, out, _ = run(capsys, "--src", teachers["llama"], "--dst", dst, "--arch", "hysparse", "--dry-run")
    assert rc == 0 and not dst.exists()
    lines = out.splitlines()
    assert any(line.split()[:2] == ["1", "sparse"] for line in lines)
    assert any(line.split()[:2] == ["5", "full"] for line in lines)
    # Dense: 2 x 96 x 64 embeddings + 64 + 6 x (12,288 attention + 18,432 MLP + 128 norms); each of
    # the 3 sparse layers adds two 64 x 64 gates and two 4-head sinks.
    assert "parameters: 197,440 -> 222,040 (+12.5%)" in lines
    # Dense: 6 layers x 2 x 2 KV heads x 16 x 4 bytes; HySparse keeps 3 full-length caches.
    kv = next(line for line in lines if line.startswith("KV cache"))
    assert "1,536 -> " in kv and "3 full-length + 3 window caches" in kv


def _drop_tensor(src: Path, name: str) -> None:
    tensors = load_file(src / "model.safetensors")
    del tensors[name]
    save_file(tensors, src / "model.safetensors")


def _add_tensor(src: Path, name: str) -> None:
    tensors = load_file(src / "model.safetensors")
    tensors[name] = torch.zeros(3)
    save_file(tensors, src / "model.safetensors")


def _edit_config(src: Path, **changes) -> None:
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, **changes}))


BAD_INPUTS = {
    "missing-tensor": ("hysparse", [], lambda s: _drop_tensor(s, "model.layers.2.self_attn.k_proj.weight"),
                       "missing tensor(s) model.layers.2.self_attn.k_proj.weight"),
    "unknown-tensor": ("hysparse", [], lambda s: _add_tensor(s, "model.layers.1.self_attn.rel_bias"),
                       "unknown source tensor model.layers.1.self_attn.rel_bias"),
    "unknown-architecture": ("hysparse", [], lambda s: _edit_config(s, model_type="gpt2"),
                             "unsupported source architecture"),
    "mistral-window": ("hysparse", [], lambda s: _edit_config(s, sliding_window=32),
                       "sliding-window attention"),
    "first-layer-sparse": ("hysparse", ["--full-layers", "1,3"], None, "layer_types[0]"),
    "bridge-to-sliding": ("hysparse2", ["--bridge-sources", "0"], None, "bridge_sources[0]"),
    "self-full-outside": ("hysparse2", ["--self-full-layers", "4"], None, "--self-full-layers"),
    "option-for-other-arch": ("hysparse2", ["--full-period", "3"], None, "--full-period"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_one_line_and_writes_nothing(teachers, tmp_path, capsys, case):
    arch, extra, corrupt, reason = BAD_INPUTS[case]
    src = tmp_path / "src"
    shutil.copytree(teachers["mistral"], src)
    if corrupt:
        corrupt(src)
    outs = tmp_path / "outs"
    outs.mkdir()
    rc, _, err = run(capsys, "--src", src, "--dst", outs / "ckpt", "--arch", arch, *extra)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], err
    assert list(outs.iterdir()) == []


MOE_BAD_INPUTS = {
    "missing-expert": (lambda s: _drop_tensor(s, "model.layers.0.mlp.experts.3.up_proj.weight"),
                       "missing tensor(s) model.layers.0.mlp.experts.3.up_proj.weight"),
    # The config says layer 0 is dense, the tensors say MoE.
    "experts-in-dense-layer": (lambda s: _edit_config(s, mlp_only_layers=[0, 1]),
                               "missing tensor(s) model.layers.0.mlp.down_proj.weight"),
    "top-k-over-experts": (lambda s: _edit_config(s, num_experts_per_tok=5),
                           "num_experts_per_tok: must be at most num_experts=4 (got 5)"),
    "sparse-step": (lambda s: _edit_config(s, decoder_sparse_step=0),
                    "source decoder_sparse_step must be a positive integer (got 0)"),
}


@pytest.mark.parametrize("case", list(MOE_BAD_INPUTS))
def test_bad_moe_source_fails_with_one_line(teachers, tmp_path, capsys, case):
    corrupt, reason = MOE_BAD_INPUTS[case]
    src = tmp_path / "src"
    shutil.copytree(teachers["qwen3_moe"], src)
    corrupt(src)
    rc, _, err = run(capsys, "--src", src, "--dst", tmp_path / "out", "--arch", "hysparse", "--dry-run")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], err


def test_moe_dry_run_describes_the_copied_mlps(teachers, tmp_path, capsys):
    rc, out, err = run(capsys, "--src", teachers["qwen2_moe"], "--dst", tmp_path / "dry", "--arch", "hysparse2",
                       "--dry-run")
    assert rc == 0, err
    assert "source: " in out and "Qwen2MoeForCausalLM" in out
    assert ("MLP: MoE, 4 experts, top-2, expert size 32, shared expert 48, dense layers [0, 2, 4] (copied)"
            in out.splitlines())
    assert not (tmp_path / "dry").exists()


def test_refuses_non_empty_destination(teachers, tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    rc, _, err = run(capsys, "--src", teachers["llama"], "--dst", dst, "--arch", "hysparse")
    assert rc == 2 and "--force" in err
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert run(capsys, "--src", teachers["llama"], "--dst", dst, "--arch", "hysparse", "--force")[0] == 0
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()


def test_streams_one_source_shard_at_a_time(teachers, tmp_path, monkeypatch):
    opened, peak = [], [0]
    real_open = safe_open

    class Tracked:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            opened.append(self)
            peak[0] = max(peak[0], len(opened))
            return self.f.__enter__()

        def __exit__(self, *exc):
            opened.remove(self)
            return self.f.__exit__(*exc)

    for module in (cv.source, cv.write):  # where the headers are read and the weights streamed
        monkeypatch.setattr(module, "safe_open", Tracked)
    conv = cv.plan_conversion(teachers["qwen3"], "hysparse")
    assert len(conv.shards) > 1
    max_bytes = 30_000
    cv.convert(conv, tmp_path / "out", max_shard_bytes=max_bytes)
    assert peak[0] == 1
    for path in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            sizes = [f.get_slice(n).get_shape() for n in f.keys()]
        nbytes = sum(torch.Size(s).numel() * 4 for s in sizes)
        assert nbytes <= max_bytes or len(sizes) == 1


def test_script_wrapper(teachers, tmp_path, monkeypatch, capsys):
    argv = ["convert_checkpoint.py", "--src", str(teachers["qwen2"]), "--dst", str(tmp_path / "x"),
            "--arch", "hysparse2", "--dry-run"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "scripts" / "convert_checkpoint.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert "cross_sparse" in capsys.readouterr().out and not (tmp_path / "x").exists()


def _write_separate_v_source(src: Path, head_dim: int, v_head_dim: int) -> None:
    """A dense Llama-type source whose config carries `v_head_dim` (SPEC §2.6), tensors shaped by hand."""
    e, h, g, layers, inter = 64, 4, 4, 6, 96
    cfg = LlamaConfig(vocab_size=96, hidden_size=e, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=h, num_key_value_heads=g, head_dim=head_dim, max_position_embeddings=128)
    cfg.v_head_dim = v_head_dim
    src.mkdir()
    cfg.save_pretrained(src)
    t = {"model.embed_tokens.weight": (96, e), "model.norm.weight": (e,), "lm_head.weight": (96, e)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": (h * head_dim, e), p + "self_attn.k_proj.weight": (g * head_dim, e),
                  p + "self_attn.v_proj.weight": (g * v_head_dim, e),
                  p + "self_attn.o_proj.weight": (e, h * v_head_dim),
                  p + "mlp.gate_proj.weight": (inter, e), p + "mlp.up_proj.weight": (inter, e),
                  p + "mlp.down_proj.weight": (e, inter), p + "input_layernorm.weight": (e,),
                  p + "post_attention_layernorm.weight": (e,)})
    save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in t.items()}, src / "model.safetensors")


def test_dry_run_kv_bytes_with_separate_v_head_dim(tmp_path, capsys):
    """The 192 / 128 head layout: V-type tensors and o_proj follow v_head_dim, and the KV line counts K and V
    at their own widths."""
    src = tmp_path / "src"
    _write_separate_v_source(src, 192, 128)
    rc, out, _ = run(capsys, "--src", src, "--dst", tmp_path / "dry", "--arch", "hysparse", "--dry-run",
                     "--swa-window", "32")
    assert rc == 0, out
    assert "4 heads / 4 KV heads x 192 (v 128)" in out
    # bf16: one layer costs 4 KV heads x (192 + 128) x 2 bytes = 2,560 bytes per token. Dense: 6 layers.
    # HySparse (full at 0, 4 and the last, 5): 3 full-length caches, and 3 window caches of 32 tokens, at
    # the 128-token context a quarter of a full-length cache each.
    kv = next(line for line in out.splitlines() if line.startswith("KV cache"))
    assert f"{6 * 2560:,} -> {int(2560 * (3 + 3 * 32 / 128)):,} bytes/token" in kv, kv
    # an FP8 KV cache: 1 byte per element, 4 x (192 + 128) = 1,280 bytes per layer and token
    kv8 = next(line for line in out.splitlines() if line.startswith("KV cache (kv_cache_dtype=fp8)"))
    assert f"{6 * 1280:,} -> {int(1280 * (3 + 3 * 32 / 128)):,} bytes/token" in kv8, kv8
    conv = cv.plan_conversion(src, "hysparse")
    shapes = expected_tensors(conv.config)
    assert shapes["model.layers.1.self_attn.swa_v_proj.weight"] == (4 * 128, 64)
    assert shapes["model.layers.1.self_attn.sparse_gate_proj.weight"] == (4 * 128, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 4 * 128)
