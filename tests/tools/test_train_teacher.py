# SPDX-License-Identifier: Apache-2.0
"""The dense teacher trainer: a real (micro) training run, its metrics recomputed by hand, CLI failures."""

import json
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from vllm_hysparse.tools import train_teacher as tt
from vllm_hysparse.tools.tokenizer import corpus_files

CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "heldout.txt", "teacher_metrics.json")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the trainer uses: on a shared CPU more threads are often much slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """Train the `micro` size once (about 60 steps of 8 x 128 tokens)."""
    out = tmp_path_factory.mktemp("teacher") / "micro"
    assert tt.main(["--size", "micro", "--out", str(out), "--seed", "1"]) == 0
    return out, json.loads((out / "teacher_metrics.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(teacher):
    return AutoTokenizer.from_pretrained(teacher[0])


def heldout_targets(tokenizer, out, seq_len):
    """Next-token targets of whole seq_len windows over heldout.txt, and their inputs, computed afresh."""
    ids = tokenizer((out / "heldout.txt").read_text("utf-8"), add_special_tokens=False)["input_ids"]
    n = (len(ids) - 1) // seq_len
    return ids[: n * seq_len], ids[1 : n * seq_len + 1]


def test_checkpoint_is_complete_and_llama(teacher, tokenizer):
    out, m = teacher
    for name in CHECKPOINT_FILES:
        assert (out / name).is_file(), name
    assert not list(out.parent.glob(".micro.*")), "temporary directory left behind"
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.head_dim == 64 and config.vocab_size == 8192 == len(tokenizer)
    assert config.num_key_value_heads < config.num_attention_heads
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert m["model"]["num_hidden_layers"] == config.num_hidden_layers
    assert m["train"]["steps"] == m["train"]["max_steps"] == 60 and m["seed"] == 1


def test_beats_unigram_and_uses_context(teacher):
    _, m = teacher
    assert m["beats_unigram"] and m["perplexity"] < 0.8 * m["unigram_perplexity"], m
    # Attention earns something: seeing only the current token is clearly worse.
    assert m["perplexity"] < 0.9 * m["eval"]["no_context_perplexity"]
    assert m["train"]["final_loss"] < m["train"]["first_loss"] - 1.0
    assert m["eval"]["reloaded_perplexity"] == pytest.approx(m["perplexity"], rel=1e-4)


def test_heldout_perplexity_recomputed_from_saved_model(teacher, tokenizer):
    out, m = teacher
    seq_len = m["eval"]["seq_len"]
    inputs, targets = heldout_targets(tokenizer, out, seq_len)
    assert len(targets) == m["eval"]["tokens"]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor(inputs).view(-1, seq_len)
    y = torch.tensor(targets).view(-1, seq_len)
    total = 0.0
    with torch.no_grad():
        for i in range(0, x.shape[0], 8):
            logp = F.log_softmax(model(input_ids=x[i : i + 8]).logits, dim=-1)  # (8, T, V)
            total -= logp.gather(2, y[i : i + 8, :, None]).double().sum().item()
    assert math.exp(total / len(targets)) == pytest.approx(m["perplexity"], rel=1e-4)


def test_unigram_perplexity_by_hand(teacher, tokenizer):
    out, m = teacher
    # The split, independently: sorted stdlib files, every 20th held out.
    files = corpus_files(m["corpus"]["corpus_bytes"])
    train = [f for i, f in enumerate(files) if i % 20 != 19]
    counts = Counter()
    for f in train:
        text = f.read_text(encoding="utf-8", errors="replace")
        counts.update([tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"],
                       tokenizer.eos_token_id])
    n_train, vocab = sum(counts.values()), m["model"]["vocab_size"]
    assert n_train == m["corpus"]["train_tokens"]
    _, targets = heldout_targets(tokenizer, out, m["eval"]["seq_len"])
    nll = -sum(math.log((counts[t] + 1) / (n_train + vocab)) for t in targets)
    assert math.exp(nll / len(targets)) == pytest.approx(m["unigram_perplexity"], rel=1e-9)


def test_heldout_text_is_never_trained_on(teacher, tokenizer):
    out, m = teacher
    files = corpus_files(m["corpus"]["corpus_bytes"])
    heldout = [f for i, f in enumerate(files) if i % 20 == 19]
    stdlib = m["corpus"]["stdlib"]
    names = [f.relative_to(stdlib).as_posix() for f in heldout]
    assert m["corpus"]["heldout_files"] == names[: len(m["corpus"]["heldout_files"])]
    assert m["corpus"]["train_files"] == len(files) - len(heldout)
    text = (out / "heldout.txt").read_text("utf-8")
    assert len(text.encode()) <= tt.SIZES["micro"]["heldout_bytes"]
    docs = text.split("<|end_of_text|>")[:-1]
    assert len(docs) == len(m["corpus"]["heldout_files"]) and all(d.startswith("<|begin_of_text|>") for d in docs)
    bodies = [d.removeprefix("<|begin_of_text|>") for d in docs]
    for body, f in zip(bodies, heldout):
        assert f.read_text(encoding="utf-8", errors="replace").startswith(body)
    # Evaluation reads the same token format as training: BOS + document + EOS, per document.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tt.encode_documents(tokenizer, bodies).tolist() == ids


def test_non_empty_output_refused_without_force(teacher, capsys):
    out, _ = teacher
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert tt.main(["--size", "micro", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "--force" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps"),
    (["--lr", "-1"], "--lr"),
    (["--seq-len", "1"], "--seq-len"),
    (["--threads", "0"], "--threads"),
    (["--corpus-bytes", "1000"], "--corpus-bytes"),
])
def test_bad_arguments(tmp_path, capsys, argv, message):
    out = tmp_path / "t"
    assert tt.main(["--size", "micro", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err
    assert not out.exists()


def test_unknown_size_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tt.main(["--size", "huge", "--out", str(tmp_path / "t")])
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_time_budget_stops_and_weak_teacher_fails(tmp_path, capsys):
    """A budget of 0.1 s stops after one step: written, flagged, exit status 1 with the reason."""
    out = tmp_path / "t"
    assert tt.main(["--size", "micro", "--out", str(out), "--steps", "1000", "--time-budget-s", "0.1"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "not below the unigram baseline" in err
    m = json.loads((out / "teacher_metrics.json").read_text())
    assert m["train"]["stopped_by"] == "time_budget" and m["train"]["steps"] < 1000
    assert not m["beats_unigram"]


def test_lr_schedule():
    # Warmup, then cosine down to 10 %; the time budget advances the cosine as much as the step count.
    assert tt.lr_factor(0, 100, 10, 0.0, 1e9) == pytest.approx(0.1, rel=1e-2)
    assert tt.lr_factor(9, 100, 10, 0.0, 1e9) == pytest.approx(0.98, abs=0.01)
    assert tt.lr_factor(50, 100, 10, 0.0, 1e9) == pytest.approx(0.55)
    assert tt.lr_factor(10, 100, 10, 30.0, 60.0) == pytest.approx(0.55)
    assert tt.lr_factor(99, 100, 10, 0.0, 1e9) == pytest.approx(0.1, abs=1e-3)


def test_eval_windows_cover_each_target_once():
    tokens = torch.arange(11)
    inputs, targets = tt.eval_windows(tokens, 4)
    assert inputs.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert targets.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    with pytest.raises(ValueError):
        tt.eval_windows(torch.arange(4), 4)
