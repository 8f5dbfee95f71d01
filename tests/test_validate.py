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
    span = -(-SEQ // validate.POSITION_SPANS)
    starts = list(range(0, SEQ, span))
    assert [p["start"] for p in final["by_position"]] == starts
    for p, a in zip(final["by_position"], starts):
        rows = range(a, min(a + span, SEQ))
        assert p["rows"] == len(rows)
        assert p["kl"] == pytest.approx(sum(float((t[i].exp() * (t[i] - s[i])).sum()) for i in rows) / len(rows),
                                        rel=1e-6, abs=1e-9)
        assert p["top1"] == pytest.approx(sum(int(t[i].argmax() == s[i].argmax()) for i in rows) / len(rows))
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


# ----------------------------------------------------------------------------- HySparse2

H2_STAGES = ["dense", "cross KV sharing", "sliding window", "token selection", "forced window", "bridge",
             "early exit"]


@pytest.fixture(scope="module")
def pair2(tmp_path_factory):
    """A peaked dense Llama teacher and its HySparse2 conversion: W F W | F S S, window 16 < SEQ."""
    root = tmp_path_factory.mktemp("validate2")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    teacher = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    teacher.save_pretrained(root / "teacher")
    build_hf_tokenizer().save_pretrained(root / "teacher")
    conv = plan_conversion(root / "teacher", "hysparse2", PlanOptions(swa_window=16, topk_tokens=8, recent_window=16))
    assert conv.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention",
                                       "full_attention", "sparse_attention", "sparse_attention"]
    convert(conv, root / "student")
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    report = validate.validate(str(root / "teacher"), str(root / "student"), text, seq_len=SEQ, max_windows=1)
    ids = validate.token_windows(validate.AutoTokenizer.from_pretrained(root / "student"), text, SEQ, 1)[0]
    return root, report, ids


def _teacher_logp(root, ids):
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(teacher(ids).logits[0].double(), -1)


def _kl(t_logp, s_logits):
    s_logp = torch.log_softmax(s_logits[0].double(), -1)
    return float((t_logp.exp() * (t_logp - s_logp)).sum(-1).mean())


def test_hysparse2_stages_follow_spec_order(pair2):
    _, report, _ = pair2
    assert [s["stage"] for s in report["stages"]] == H2_STAGES
    on = [name for name, sw in zip(H2_STAGES, (s["switches"] for s in report["stages"])) if all(sw.values())]
    assert on == ["early exit"]
    assert not any(report["stages"][0]["switches"].values())
    assert set(report["stages"][0]["switches"]) == {"cross_kv_sharing", "sliding_window", "token_selection",
                                                    "forced_window", "bridge", "early_exit"}
    assert all(s["rows"] == SEQ for s in report["stages"])


def test_hysparse2_dense_stage_reproduces_the_teacher(pair2):
    root, report, _ = pair2
    dense = report["stages"][0]
    assert dense["kl"] < 1e-9 and dense["top1"] == 1.0
    assert all(row["cosine"] > 1 - 1e-6 for row in dense["layers"].values())
    assert dense["perplexity"] == pytest.approx(report["teacher_perplexity"], rel=1e-6)
    # The teacher's K/V were borrowed in memory only: the student checkpoint still has none for its sparse layers.
    student = AutoModelForCausalLM.from_pretrained(root / "student", dtype=torch.float32)
    assert not hasattr(student.model.layers[4].self_attn, "k_proj")


def test_hysparse2_new_switches_match_loop_oracle_and_change_the_output(pair2):
    """KL of 'cross KV sharing' and 'sliding window' against the loop oracle of SPEC §3.3, and each one's effect."""
    from tests.reference._reference_math import hysparse2_forward

    root, report, ids = pair2
    student = AutoModelForCausalLM.from_pretrained(root / "student", dtype=torch.float32)
    sd = {k: v.detach() for k, v in student.state_dict().items()}
    t_logp = _teacher_logp(root, ids)
    stages = {s["stage"]: s for s in report["stages"]}
    off = dict(token_selection=False, forced_window=False, bridge=False)
    for stage, window in (("cross KV sharing", False), ("sliding window", True)):
        want = hysparse2_forward(sd, student.config.to_dict(), ids, sliding_window=window, **off)
        assert stages[stage]["kl"] == pytest.approx(_kl(t_logp, want), rel=1e-3, abs=1e-12), stage
    dense, shared, window = (stages[n]["layers"] for n in H2_STAGES[:3])
    # Sharing changes nothing before the first cross sparse layer (4), and that layer.
    assert all(shared[i]["cosine"] > 1 - 1e-6 for i in range(4))
    assert shared[4]["cosine"] < 0.999 and stages["cross KV sharing"]["kl"] > 1e3 * stages["dense"]["kl"] + 1e-4
    # The window changes the first sliding layer (0), which sharing left alone.
    assert window[0]["cosine"] < 0.999 < dense[0]["cosine"]
    assert stages["sliding window"]["kl"] != pytest.approx(stages["cross KV sharing"]["kl"], rel=1e-3)
    jumps = {j["stage"]: j for j in report["jumps"]}
    assert jumps["cross KV sharing"]["worst_layer"] in (4, 5)
    assert jumps["sliding window"]["cosine_drop"] > 1e-3


def test_hysparse2_early_exit_stage_changes_nothing(pair2):
    _, report, _ = pair2
    before, exit_ = report["stages"][-2:]
    assert (before["stage"], exit_["stage"]) == ("bridge", "early exit")
    for key in ("rows", "kl", "top1", "perplexity", "layers"):
        assert exit_[key] == before[key], key
    assert exit_["perplexity"] is not None and len(exit_["layers"]) == 6
    jump = report["jumps"][-1]
    assert jump["kl_change"] == 0 and jump["top1_change"] == 0 and jump["worst_layer"] is None
    # The cross-decoder run on a few rows alone gives the previous stage's logits there.
    check = exit_["early_exit_check"]
    assert check["taken"] and check["rows"][0] == 0 and check["rows"][-1] == SEQ - 1 and len(check["rows"]) == 8
    assert check["max_abs_logit_diff"] < 1e-4
    assert "early_exit_check" not in before
    md = validate.markdown_report(report)
    assert "| early exit | +0 | +0.000 | – (none drops) | 0.0000 |" in md
    assert "n/a" not in md


def test_hysparse2_early_exit_check_sees_a_difference(pair2):
    """The check compares real logits: against another stage's it reports a difference."""
    root, report, _ = pair2
    student = AutoModelForCausalLM.from_pretrained(root / "student", dtype=torch.float32).eval()
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    windows = validate.token_windows(validate.AutoTokenizer.from_pretrained(root / "student"), text, SEQ, 1)
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32).eval()
    with torch.no_grad():
        runs = [(o.logits, o.hidden_states) for o in (teacher(w, output_hidden_states=True) for w in windows)]
    all_off = dict(report["stages"][0]["switches"])
    dense = validate.evaluate_stage(runs, student, windows, "dense", all_off,
                                    validate.teacher_cross_kv(teacher, student))
    assert dense.kl / dense.tokens == pytest.approx(report["stages"][0]["kl"], rel=1e-6, abs=1e-12)
    on = {k: True for k in all_off}
    last = validate.evaluate_stage(runs, student, windows, "early exit", on, previous=dense)
    assert last.early_exit_check["max_abs_logit_diff"] > 1e-3
    # The borrowed K/V are gone after the stage: with sharing off the student now refuses to run.
    student.set_switches(cross_kv_sharing=False)
    with pytest.raises(ValueError, match="no K/V projections"):
        student(windows[0], use_cache=False)


def test_hysparse2_teacher_without_the_layers_kv_is_refused(pair2, tmp_path, capsys):
    root, _, _ = pair2
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "other")
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py")
    assert validate.main(["--teacher", str(tmp_path / "other"), "--student", str(root / "student"), "--text",
                          str(text), "--out", str(tmp_path / "r")]) == 2
    assert "has no model.layers.4.self_attn.k_proj.weight" in capsys.readouterr().err


@pytest.mark.parametrize("fixture", ["pair", "pair2"])
def test_final_only_is_the_last_stage_of_the_full_report(fixture, request):
    """`--final-only` evaluates the real architecture alone; its numbers are the full report's last stage."""
    root, report = request.getfixturevalue(fixture)[:2]
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    short = validate.validate(str(root / "teacher"), str(root / "student"), text, seq_len=report["seq_len"],
                              max_windows=report["windows"], final_only=True)
    assert [s["stage"] for s in short["stages"]] == [report["stages"][-1]["stage"]]
    got, want = short["stages"][0], report["stages"][-1]
    assert got["switches"] == want["switches"]
    for key in ("kl", "top1", "perplexity"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9)
