# SPDX-License-Identifier: Apache-2.0
"""Train a small dense Llama teacher on the Python standard library's sources, offline, on CPU.

    python -m vllm_hysparse.tools.train_teacher --out teacher/ [--size tiny|small] [--force]

No pretrained model or data set is downloaded. The corpus is the running
Python's stdlib `.py` files (sorted, the same selection the tokenizer is
trained on, see `vllm_hysparse.tools.tokenizer`), tokenized with our 8192-token
BPE. Every 20th file is held out and never trained on; up to `--heldout-bytes`
of it is written to `DIR/heldout.txt`, each file wrapped in the tokenizer's BOS
and EOS strings, so that

    tokenizer(Path(DIR, "heldout.txt").read_text(), add_special_tokens=False).input_ids

is exactly the token stream evaluated here. (The BPE merges were fitted on a
corpus that includes the held-out files; the model never sees them.)

The model is a plain `LlamaForCausalLM` (head_dim 64, grouped-query attention),
trained with AdamW, warmup then cosine decay, and gradient clipping, in float32;
embeddings, lm_head and norm gains learn `--embed-lr-mult` times faster than the
hidden matrices, which is what lets a few hundred steps get well past the unigram
baseline.
Training stops after `--steps` steps or `--time-budget-s` seconds of training,
whichever comes first; the learning-rate schedule follows whichever of the two
is further along, so a run cut short by its time budget still ends decayed
(such a run is not bitwise reproducible: how far it gets depends on the load).

Sizes (time on one loaded CPU core; `--threads 2` helps only on an idle machine):

    micro  hidden  64, 2 layers,  2 / 1 heads, seq 128 -- tests, ~20 s
    tiny   hidden 128, 4 layers,  4 / 2 heads, seq 256 -- ~3 min in all (150 s of training)
    small  hidden 256, 8 layers,  4 / 2 heads, seq 256 -- ~30 min (1500 steps or 1750 s of training)

The held-out perplexity of the trained model and of a unigram baseline (token
frequencies of the training stream with add-one smoothing) are printed and
written to `DIR/teacher_metrics.json`. The checkpoint is reloaded with
`AutoModelForCausalLM.from_pretrained` and must reproduce the perplexity. The
directory is written even when the model does not beat the unigram baseline
(so the run can be inspected), but the exit status is then 1; bad arguments
give 2.
"""

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from vllm_hysparse.tools.presets import TOKENIZER_VOCAB
from vllm_hysparse.tools.staging import check_replaceable, latch_interrupts, staged_output
from vllm_hysparse.tools.tokenizer import build_hf_tokenizer, corpus_files

HELDOUT_EVERY = 20
METRICS_FILE = "teacher_metrics.json"
HELDOUT_FILE = "heldout.txt"
# The reloaded checkpoint must give the same held-out perplexity up to float32 summation order.
RELOAD_RTOL = 1e-4

_MODEL_COMMON = {
    "vocab_size": TOKENIZER_VOCAB, "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}
MODEL_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")
SIZES: dict[str, dict] = {
    "micro": {
        "model": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
                  "num_attention_heads": 2, "num_key_value_heads": 1},
        "steps": 60, "batch": 8, "seq_len": 128, "lr": 3e-3, "warmup": 6, "time_budget_s": 120.0,
        "corpus_bytes": 1_000_000, "heldout_bytes": 24_000,
    },
    "tiny": {
        "model": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "steps": 600, "batch": 8, "seq_len": 256, "lr": 3e-3, "warmup": 15, "time_budget_s": 150.0,
        "corpus_bytes": 4_000_000, "heldout_bytes": 128_000,
    },
    "small": {
        "model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "steps": 1500, "batch": 8, "seq_len": 256, "lr": 2e-3, "warmup": 50, "time_budget_s": 1750.0,
        "corpus_bytes": 64_000_000, "heldout_bytes": 256_000,
    },
}


# ----------------------------------------------------------------------------- corpus


def split_corpus(files: list[Path], every: int = HELDOUT_EVERY) -> tuple[list[Path], list[Path]]:
    """(train, held-out): file `i` is held out when `i % every == every - 1`."""
    train = [f for i, f in enumerate(files) if i % every != every - 1]
    heldout = [f for i, f in enumerate(files) if i % every == every - 1]
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def wrap_document(text: str, bos: str, eos: str) -> str:
    return f"{bos}{text}{eos}"


def heldout_documents(texts: list[str], max_bytes: int, overhead: int = 0) -> list[str]:
    """Whole held-out files while they fit in `max_bytes` of UTF-8; the next one cut at a line end.

    Each document is charged `overhead` bytes more (its BOS / EOS strings).
    """
    docs, total = [], 0
    for text in texts:
        size = len(text.encode("utf-8")) + overhead
        if total + size <= max_bytes:
            docs.append(text)
            total += size
            continue
        head = text.encode("utf-8")[: max(0, max_bytes - total - overhead)].decode("utf-8", errors="ignore")
        head = head[: head.rfind("\n") + 1]
        if head:
            docs.append(head)
        break
    return docs


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """One stream: `[bos] + ids(text) + [eos]` per document, concatenated. Returns (N,) int64."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stream = []
    for doc in ids:
        stream.append(tokenizer.bos_token_id)
        stream.extend(doc)
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.long)


def encode_heldout(tokenizer, text: str) -> torch.Tensor:
    """The held-out stream from the text of `heldout.txt` (documents carry BOS/EOS as text). (N,) int64."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


# ----------------------------------------------------------------------------- evaluation


def eval_windows(tokens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows over a stream: inputs and next-token targets, each (W, seq_len).

    Window `w` reads `tokens[w*T : w*T+T]` and predicts `tokens[w*T+1 : w*T+T+1]`; a tail
    shorter than a whole window is dropped, so each of `W*T` targets is predicted once.
    """
    n = (tokens.numel() - 1) // seq_len
    if n == 0:
        raise ValueError(f"held-out stream of {tokens.numel()} tokens is shorter than one window of {seq_len + 1}")
    inputs = tokens[: n * seq_len].view(n, seq_len)
    targets = tokens[1 : n * seq_len + 1].view(n, seq_len)
    return inputs, targets


@torch.inference_mode()
def model_nll(model, tokens: torch.Tensor, seq_len: int, batch: int = 16) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) of `model` over `eval_windows(tokens)`, and the count."""
    model.eval()
    inputs, targets = eval_windows(tokens, seq_len)
    total = 0.0
    for i in range(0, inputs.shape[0], batch):
        logits = model(input_ids=inputs[i : i + batch]).logits  # (b, T, V)
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets[i : i + batch].flatten(), reduction="sum")
        total += float(nll.double())
    return total, targets.numel()


@torch.inference_mode()
def no_context_nll(model, tokens: torch.Tensor, seq_len: int, chunk: int = 2048) -> tuple[float, int]:
    """Like `model_nll` on the same targets, but each token is predicted from itself alone (context 1).

    The gap to `model_nll` is what the model gets out of attending to earlier tokens.
    """
    model.eval()
    inputs, targets = (t.reshape(-1, 1) for t in eval_windows(tokens, seq_len))  # (W*T, 1)
    total = 0.0
    for i in range(0, inputs.shape[0], chunk):
        logits = model(input_ids=inputs[i : i + chunk]).logits[:, 0]  # (chunk, V)
        total += float(F.cross_entropy(logits.float(), targets[i : i + chunk, 0], reduction="sum").double())
    return total, targets.numel()


def unigram_logprobs(train_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(v) = log((count(v) + 1) / (N + V)) over the training stream. Returns (V,) float64."""
    counts = torch.bincount(train_tokens, minlength=vocab_size).double()
    return torch.log((counts + 1.0) / (train_tokens.numel() + vocab_size))


def unigram_nll(logprobs: torch.Tensor, tokens: torch.Tensor, seq_len: int) -> tuple[float, int]:
    """Summed unigram NLL over the same targets as `model_nll`, and the count."""
    _, targets = eval_windows(tokens, seq_len)
    return float(-logprobs[targets.flatten()].sum()), targets.numel()


def perplexity(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / count)


# ----------------------------------------------------------------------------- model and training


def build_config(size: str, tokenizer) -> LlamaConfig:
    config = LlamaConfig(**_MODEL_COMMON, **SIZES[size]["model"],
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    config.dtype = torch.float32
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    return config


def sample_batch(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """`batch` random windows of the training stream: inputs and targets, each (batch, seq_len)."""
    starts = torch.randint(0, tokens.numel() - seq_len, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # (batch, seq_len + 1)
    windows = tokens[idx]
    return windows[:, :-1], windows[:, 1:]


def lr_factor(step: int, steps: int, warmup: int, elapsed: float, budget: float, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps times a cosine from 1 to `floor`.

    The cosine runs on progress = max(step / steps, elapsed / budget): whichever
    of the step count and the time budget will stop training first.
    """
    progress = min(1.0, max(step / steps, elapsed / budget))
    cosine = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return min(1.0, (step + 1) / max(1, warmup)) * cosine


def make_optimizer(model: torch.nn.Module, lr: float, embed_lr_mult: float, weight_decay: float):
    """AdamW with two groups, each carrying its `lr_mult` for the schedule.

    Hidden matrices: `lr`, weight decay. Token embeddings, lm_head and norm gains:
    `lr * embed_lr_mult`, no decay. An embedding row only learns when its token
    occurs, and the logits need lm_head weights far above their 0.02 init, so at
    one learning rate for all a short run barely gets past token frequencies.
    """
    fast_ids = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    fast = [p for p in model.parameters() if id(p) in fast_ids or p.ndim < 2]
    hidden = [p for p in model.parameters() if not (id(p) in fast_ids or p.ndim < 2)]
    groups = [{"params": hidden, "weight_decay": weight_decay, "lr_mult": 1.0},
              {"params": fast, "weight_decay": 0.0, "lr_mult": embed_lr_mult}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train(model, tokens: torch.Tensor, *, steps: int, batch: int, seq_len: int, lr: float, embed_lr_mult: float,
          warmup: int, time_budget_s: float, seed: int, weight_decay: float = 0.1, grad_clip: float = 1.0) -> dict:
    """Train in place on random windows of `tokens` (N,); returns a summary with the loss curve."""
    gen = torch.Generator().manual_seed(seed + 1)
    opt = make_optimizer(model, lr, embed_lr_mult, weight_decay)
    model.train()
    losses: list[float] = []
    stopped_by = "steps"
    start = time.monotonic()
    ema = None
    with tqdm(total=steps, desc="training", unit="step", dynamic_ncols=True, mininterval=0.5) as bar:
        for step in range(steps):
            elapsed = time.monotonic() - start
            if step and elapsed >= time_budget_s:
                stopped_by = "time_budget"
                break
            scale = lr_factor(step, steps, warmup, elapsed, time_budget_s)
            for group in opt.param_groups:
                group["lr"] = lr * scale * group["lr_mult"]
            inputs, targets = sample_batch(tokens, batch, seq_len, gen)
            logits = model(input_ids=inputs).logits  # (batch, seq_len, V)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            losses.append(loss.item())
            ema = losses[-1] if ema is None else 0.9 * ema + 0.1 * losses[-1]
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr * scale:.2e}")
            bar.update()
    model.eval()
    seconds = time.monotonic() - start
    k = max(1, min(10, len(losses) // 10))
    every = max(1, len(losses) // 50)
    return {
        "steps": len(losses), "max_steps": steps, "stopped_by": stopped_by, "seconds": round(seconds, 2),
        "tokens_seen": len(losses) * batch * seq_len,
        "first_loss": sum(losses[:k]) / k if losses else None,
        "final_loss": sum(losses[-k:]) / k if losses else None,
        "loss_curve": [[i, round(losses[i], 4)] for i in range(0, len(losses), every)],
    }


# ----------------------------------------------------------------------------- driver


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset options from the size and validate them (ValueError names the option)."""
    for key in ("steps", "batch", "seq_len", "lr", "warmup", "time_budget_s", "corpus_bytes", "heldout_bytes"):
        if getattr(args, key) is None:
            setattr(args, key, SIZES[args.size][key])
    positive = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "embed_lr_mult": args.embed_lr_mult,
                "time_budget_s": args.time_budget_s, "corpus_bytes": args.corpus_bytes,
                "heldout_bytes": args.heldout_bytes, "threads": args.threads}
    for key, value in positive.items():
        if not value > 0:
            raise ValueError(f"--{key.replace('_', '-')}: must be positive (got {value})")
    if args.seq_len < 2 or args.seq_len > _MODEL_COMMON["max_position_embeddings"]:
        raise ValueError(f"--seq-len: must be in [2, {_MODEL_COMMON['max_position_embeddings']}] (got {args.seq_len})")
    if args.warmup < 0:
        raise ValueError(f"--warmup: must be >= 0 (got {args.warmup})")
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument("--size", choices=list(SIZES), default="tiny", help="model and schedule preset (micro: tests)")
    p.add_argument("--steps", type=int, help="maximum optimizer steps")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--seq-len", type=int, help="tokens per training / evaluation window")
    p.add_argument("--lr", type=float, help="peak learning rate of the hidden matrices")
    p.add_argument("--embed-lr-mult", type=float, default=20.0,
                   help="learning-rate multiplier for embeddings, lm_head and norm gains")
    p.add_argument("--warmup", type=int, help="warmup steps")
    p.add_argument("--time-budget-s", type=float, help="stop training after this many seconds of training")
    p.add_argument("--corpus-bytes", type=int, help="read about this many bytes of stdlib sources")
    p.add_argument("--heldout-bytes", type=int, help="at most this much held-out text in heldout.txt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared CPU more threads often run slower)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    return p


@dataclass
class Corpus:
    """Training and held-out token streams; `heldout_text` is what `heldout.txt` holds."""

    files: list[Path]
    train_files: list[Path]
    heldout_files: list[Path]  # every held-out file, whether or not it made it into `heldout_text`
    evaluated_files: list[Path]
    heldout_text: str
    train_tokens: torch.Tensor  # (N_train,) int64
    heldout_tokens: torch.Tensor  # (N_heldout,) int64


def prepare_corpus(tokenizer, corpus_bytes: int, heldout_bytes: int, seq_len: int) -> Corpus:
    files = corpus_files(corpus_bytes)
    train_files, heldout_files = split_corpus(files)
    wrapper_bytes = len(wrap_document("", tokenizer.bos_token, tokenizer.eos_token).encode("utf-8"))
    docs = heldout_documents([read_text(f) for f in heldout_files], heldout_bytes, wrapper_bytes)
    if not docs:
        raise ValueError(f"--corpus-bytes {corpus_bytes}: too small to hold out a file "
                         f"(every {HELDOUT_EVERY}th of {len(files)} files)")
    heldout_text = "".join(wrap_document(d, tokenizer.bos_token, tokenizer.eos_token) for d in docs)
    texts = [read_text(f) for f in tqdm(train_files, desc="reading corpus", unit="file", leave=False)]
    corpus = Corpus(files, train_files, heldout_files, heldout_files[: len(docs)], heldout_text,
                    encode_documents(tokenizer, texts), encode_heldout(tokenizer, heldout_text))
    if corpus.train_tokens.numel() <= seq_len:
        raise ValueError(f"--corpus-bytes {corpus_bytes}: {corpus.train_tokens.numel()} training tokens do not "
                         f"fill one --seq-len {seq_len} window")
    eval_windows(corpus.heldout_tokens, seq_len)  # raises when the held-out text is shorter than a window
    return corpus


def save_checkpoint(path: Path, model, tokenizer, heldout_text: str) -> None:
    """Weights (safetensors, float32), config, tokenizer, generation config and `heldout.txt`."""
    config = model.config
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(path)
    (path / HELDOUT_FILE).write_text(heldout_text, encoding="utf-8")


def reloaded_nll(path: Path, tokenizer, seq_len: int) -> float:
    """Held-out NLL sum of the checkpoint at `path`, loaded as any user would load it."""
    model = AutoModelForCausalLM.from_pretrained(path)
    dtype = next(model.parameters()).dtype
    if type(model) is not LlamaForCausalLM or dtype != torch.float32:
        raise RuntimeError(f"{path} loads as {type(model).__name__} in {dtype}, expected a float32 LlamaForCausalLM")
    return model_nll(model, encode_heldout(tokenizer, (path / HELDOUT_FILE).read_text("utf-8")), seq_len)[0]


def run(args: argparse.Namespace) -> tuple[Path, dict]:
    """Prepare data, train, evaluate, save and verify, for `resolve_args` output; returns (out, metrics)."""
    t0 = time.monotonic()
    out = Path(args.out)
    check_replaceable(out, args.force)
    tokenizer = build_hf_tokenizer(TOKENIZER_VOCAB)
    config = build_config(args.size, tokenizer)
    corpus = prepare_corpus(tokenizer, args.corpus_bytes, args.heldout_bytes, args.seq_len)
    uni_sum, n_eval = unigram_nll(unigram_logprobs(corpus.train_tokens, config.vocab_size), corpus.heldout_tokens,
                                  args.seq_len)

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus: {len(corpus.train_files)} training files, {corpus.train_tokens.numel()} tokens; "
          f"{len(corpus.heldout_files)} held out, {n_eval} tokens evaluated; "
          f"model: {n_params / 1e6:.2f}M parameters", file=sys.stderr)
    summary = train(model, corpus.train_tokens, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                    lr=args.lr, embed_lr_mult=args.embed_lr_mult, warmup=args.warmup,
                    time_budget_s=args.time_budget_s, seed=args.seed)
    nll_sum, _ = model_nll(model, corpus.heldout_tokens, args.seq_len)
    no_context_sum, _ = no_context_nll(model, corpus.heldout_tokens, args.seq_len)

    with staged_output(out) as tmp:  # published only when complete; `out` is never deleted in place
        save_checkpoint(tmp, model, tokenizer, corpus.heldout_text)
        ppl, uni_ppl = perplexity(nll_sum, n_eval), perplexity(uni_sum, n_eval)
        reload_ppl = perplexity(reloaded_nll(tmp, tokenizer, args.seq_len), n_eval)
        if not math.isclose(ppl, reload_ppl, rel_tol=RELOAD_RTOL):
            raise RuntimeError(f"the saved checkpoint gives held-out perplexity {reload_ppl:.4f}, "
                               f"the trained model {ppl:.4f}")
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        metrics = {
            "perplexity": ppl, "unigram_perplexity": uni_ppl, "beats_unigram": ppl < uni_ppl,
            "eval": {"tokens": n_eval, "seq_len": args.seq_len, "nll_per_token": nll_sum / n_eval,
                     "unigram_nll_per_token": uni_sum / n_eval, "reloaded_perplexity": reload_ppl,
                     "no_context_perplexity": perplexity(no_context_sum, n_eval),
                     "unigram": "training-token counts + 1 over vocab_size, on the same targets"},
            "size": args.size, "seed": args.seed, "threads": args.threads,
            "model": {**{k: getattr(config, k) for k in MODEL_FIELDS}, "parameters": n_params},
            "train": {**summary, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
                      "embed_lr_mult": args.embed_lr_mult, "warmup": args.warmup,
                      "time_budget_s": args.time_budget_s},
            "corpus": {"stdlib": str(stdlib), "python": platform.python_version(),
                       "corpus_bytes": args.corpus_bytes, "files": len(corpus.files),
                       "heldout_every": HELDOUT_EVERY, "train_files": len(corpus.train_files),
                       "train_tokens": corpus.train_tokens.numel(),
                       "heldout_files": [f.relative_to(stdlib).as_posix() for f in corpus.evaluated_files],
                       "heldout_files_not_evaluated": len(corpus.heldout_files) - len(corpus.evaluated_files),
                       "heldout_bytes": len(corpus.heldout_text.encode("utf-8")),
                       "heldout_tokens": corpus.heldout_tokens.numel()},
            "seconds_total": round(time.monotonic() - t0, 2),
        }
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
        check_replaceable(out, args.force)  # nobody filled it while we trained
    return out, metrics


def main(argv: list[str] | None = None) -> int:
    latch_interrupts()
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    try:
        args = resolve_args(args)
        torch.set_num_threads(args.threads)
        out, m = run(args)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    t = m["train"]
    print(f"held-out perplexity {m['perplexity']:.2f} vs unigram baseline {m['unigram_perplexity']:.2f} "
          f"(context of 1 token: {m['eval']['no_context_perplexity']:.2f}) on {m['eval']['tokens']} tokens")
    print(f"{t['steps']} steps in {t['seconds']:.0f} s (stopped by {t['stopped_by'].replace('_', ' ')}), "
          f"training loss {t['first_loss']:.3f} -> {t['final_loss']:.3f}")
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    if not m["beats_unigram"]:
        print(f"error: the teacher's held-out perplexity {m['perplexity']:.2f} is not below the unigram baseline's "
              f"{m['unigram_perplexity']:.2f}, so it has learned no more than token frequencies; train longer "
              "(--steps, --time-budget-s) or change --lr", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
