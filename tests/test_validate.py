# SPDX-License-Identifier: Apache-2.0
"""The validation report's numbers against hand computations on a tiny teacher -> student pair."""

import math
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import vllm_hysparse  # noqa: F401
from tests.reference._reference_math import block_keys, brute_block_topk, rope
from vllm_hysparse import validate
from vllm_hysparse.tools.convert import PlanOptions, convert, plan_conversion
from vllm_hysparse.tools.tokenizer import build_hf_tokenizer

SEQ = 96


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    teacher = LlamaForCausalLM(cfg)
    with torch.no_grad():  # peaked attention, so that selection matters
        for layer in teacher.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    teacher.save_pretrained(root / "teacher")
    build_hf_tokenizer().save_pretrained(root / "teacher")
    conv = plan_conversion(root / "teacher", "hysparse",
                           PlanOptions(full_layers=[0], block_size=16, topk_blocks=2, swa_window=24))
    convert(conv, root / "student")
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    report = validate.validate(str(root / "teacher"), str(root / "student"), text, seq_len=SEQ, max_windows=1)
    ids = validate.token_windows(validate.AutoTokenizer.from_pretrained(root / "student"), text, SEQ, 1)[0]
    return root, report, ids


def _stage(report, name):
    return next(s for s in report["stages"] if s["stage"] == name)


def test_dense_stage_reproduces_the_teacher(pair):
    _, report, _ = pair
    dense = _stage(report, "dense")
    assert dense["kl"] < 1e-9 and dense["top1"] == 1.0
    assert all(row["cosine"] > 1 - 1e-6 for row in dense["layers"].values())


def test_final_stage_logit_metrics_match_hand_computation(pair):
    root, report, ids = pair
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(root / "student", dtype=torch.float32).eval()
    with torch.no_grad():
        t = torch.log_softmax(teacher(ids).logits[0].double(), -1)
        s = torch.log_softmax(student(ids).logits[0].double(), -1)
    kl = sum(float((t[i].exp() * (t[i] - s[i])).sum()) for i in range(SEQ)) / SEQ
    top1 = sum(int(t[i].argmax() == s[i].argmax()) for i in range(SEQ)) / SEQ
    nll = -sum(float(s[i, ids[0, i + 1]]) for i in range(SEQ - 1)) / (SEQ - 1)
    final = _stage(report, "SWA branch")
    assert final["kl"] == pytest.approx(kl, rel=1e-6, abs=1e-9)
    assert final["top1"] == pytest.approx(top1)
    assert final["perplexity"] == pytest.approx(math.exp(nll), rel=1e-6)
    assert final["kl"] > 1e-4, "sparse attention should cost something on a peaked teacher"


def test_coverage_and_recall_match_hand_computation(pair):
    root, report, ids = pair
    student = AutoModelForCausalLM.from_pretrained(root / "student", dtype=torch.float32).eval()
    cfg = student.config
    student.set_switches(sparse_selection=True, kv_sharing=True, swa_branch=False)
    with torch.no_grad():
        hidden = student(ids, output_hidden_states=True).hidden_states
        layer, d = student.model.layers[1], cfg.head_dim
        x = layer.input_layernorm(hidden[1])
        q = rope(layer.self_attn.q_proj(x).view(1, SEQ, -1, d), list(range(SEQ)), cfg.rope_theta)
        k_own = rope(layer.self_attn.swa_k_proj(x).view(1, SEQ, -1, d), list(range(SEQ)), cfg.rope_theta)
        full = student.model.layers[0]
        x0 = full.input_layernorm(hidden[0])
        q0 = rope(full.self_attn.q_proj(x0).view(1, SEQ, -1, d), list(range(SEQ)), cfg.rope_theta)
        k0 = rope(full.self_attn.k_proj(x0).view(1, SEQ, -1, d), list(range(SEQ)), cfg.rope_theta)
    scale = d**-0.5
    used = brute_block_topk(q0, k0, scale, cfg.sparse_block_size, cfg.sparse_topk_blocks)  # the full layer's
    own = brute_block_topk(q, k_own, scale, cfg.sparse_block_size, cfg.sparse_topk_blocks)
    per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    coverage, recall = 0.0, 0.0
    for t in range(SEQ):
        for h in range(cfg.num_attention_heads):
            g = h // per_kv
            z = torch.tensor([float(q[0, t, h] @ k_own[0, j, g]) * scale for j in range(t + 1)], dtype=torch.float64)
            p = torch.softmax(z, 0)
            coverage += float(sum(p[j] for j in block_keys(used[0, t, g].tolist(), cfg.sparse_block_size, t)))
        for g in range(cfg.num_key_value_heads):
            mine = {b for b in own[0, t, g].tolist() if b >= 0}
            recall += len(mine & set(used[0, t, g].tolist())) / len(mine) / cfg.num_key_value_heads
    row = _stage(report, "KV sharing")["layers"][1]
    assert row["coverage"] == pytest.approx(coverage / (SEQ * cfg.num_attention_heads), abs=1e-4)
    assert row["epsilon"] == pytest.approx(1 - row["coverage"])
    assert row["recall"] == pytest.approx(recall / SEQ, abs=1e-4)
    assert row["coverage"] < 0.999, "the tiny case must select a strict subset of the mass"


def test_report_locates_the_jump_and_writes_files(pair, tmp_path):
    root, report, _ = pair
    jumps = {j["stage"]: j for j in report["jumps"]}
    assert set(jumps) == {"oracle indices (own KV)", "KV sharing", "SWA branch"}
    assert all(j["worst_layer"] in (1, 2) for j in jumps.values() if j["cosine_drop"] > 0)
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py")
    assert validate.main(["--teacher", str(root / "teacher"), "--student", str(root / "student"), "--text",
                          str(text), "--out", str(tmp_path / "r"), "--seq-len", "64", "--max-windows", "1"]) == 0
    for name in ("report.md", "report.json", "plots.png"):
        assert (tmp_path / "r" / name).stat().st_size > 0
    assert "Where the error jumps" in (tmp_path / "r" / "report.md").read_text()


def test_bad_inputs_fail_with_one_line_reason(pair, tmp_path, capsys):
    root, _, _ = pair
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    args = ["--teacher", str(root / "teacher"), "--student", str(root / "student"), "--out", str(tmp_path / "r")]
    assert validate.main(args + ["--text", str(short)]) == 2
    assert "fewer than one window" in capsys.readouterr().err
    assert validate.main(args + ["--text", str(tmp_path / "missing.txt")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_distillation_lowers_kl_in_the_validation_report(pair, tmp_path, capsys):
    from vllm_hysparse import distill

    root, report, _ = pair
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py")
    out = tmp_path / "distilled"
    assert distill.main(["--teacher", str(root / "teacher"), "--student", str(root / "student"), "--text",
                         str(text), "--out", str(out), "--steps", "60", "--lr", "1e-3", "--seq-len", "64",
                         "--batch-size", "4"]) == 0
    assert "held-out KL" in capsys.readouterr().out
    after = validate.validate(str(root / "teacher"), str(out), text.read_text(), seq_len=SEQ, max_windows=1)
    before_kl, after_kl = report["stages"][-1]["kl"], after["stages"][-1]["kl"]
    assert after_kl < 0.9 * before_kl, (before_kl, after_kl)
    # The distilled checkpoint is complete: our strict loader accepts it.
    AutoModelForCausalLM.from_pretrained(out)
    assert distill.main(["--teacher", str(root / "teacher"), "--student", str(root / "student"), "--text",
                         str(text), "--out", str(out), "--steps", "1"]) == 2
