# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C (SIGINT) or SIGKILL at a random moment never leaves a half-written checkpoint.

Each tool runs as a user runs it (a subprocess of its documented command) on
an input large enough that writing takes a while, and is interrupted at a
moment drawn at random: mostly while its temporary directory is being filled
(the moment that matters), sometimes earlier. Afterwards the output directory
is absent, the complete new checkpoint, or (with `--force` over an existing
one) the complete old one; after SIGINT nothing temporary is left beside it,
after SIGKILL only directories named `.<name>.tmp-*`.

The moments are drawn from a fixed seed (0; `HYSPARSE_INTERRUPT_SEED` picks others, and the seed is in
every failure message). Each test asserts how many of its runs the signal really interrupted: the early
one and at least one while the temporary directory was filling, or it would prove nothing.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import vllm_hysparse  # noqa: F401  (registers our configs)
from vllm_hysparse.tools import convert as cv
from vllm_hysparse.tools.make_checkpoint import write_checkpoint
from vllm_hysparse.tools.presets import TOKENIZER_VOCAB
from vllm_hysparse.tools.staging import TMP_MARK, temporary_names
from vllm_hysparse.tools.tokenizer import build_hf_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("HYSPARSE_INTERRUPT_SEED", "0"))
RUN_TIMEOUT_S = 180
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
# A dense Llama of ~35M parameters (~140 MB float32): conversion and saving take a moment.
TEACHER = dict(vocab_size=TOKENIZER_VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
# Distillation trains the reference model (seconds per step at TEACHER's size): a smaller pair.
SMALL_TEACHER = {**TEACHER, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 2}


def _rng(name: str) -> random.Random:
    return random.Random(f"{SEED}-{name}")


@dataclass
class Moment:
    """When to send the signal: `delay` s after the first of these that is given happens:
    `files` entries exist in the output's temporary directory; `log` appears in the tool's output;
    the tool started (neither given)."""

    delay: float
    files: int | None = None
    log: str | None = None

    def __str__(self):
        what = (f"{self.files} file(s) in the temporary dir" if self.files else
                f"{self.log!r} in the log" if self.log else "the start")
        return f"{self.delay:.2f} s after {what}"


def _staged_entries(out: Path) -> int | None:
    """Entries in `out`'s temporary (not moved-aside) directory, or None while there is none."""
    for tmp in temporary_names(out):
        if TMP_MARK + "old-" not in tmp.name:
            try:
                return len(list(tmp.iterdir()))
            except FileNotFoundError:  # renamed into place right now
                return None
    return None


def run_interrupted(cmd: list[str], out: Path, sig: int, moment: Moment, log: Path) -> dict:
    """Run `cmd` and send it `sig` at `moment` (unless it finishes first). Returns what happened."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        # SIGINT back to its default: a shell starts background jobs (`cmd &`) with SIGINT ignored, and a
        # child inherits that, so under such a CI launch the tool would never see the signal.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen_tmp = armed = sent_at = None
    try:
        while proc.poll() is None:
            now = time.monotonic()
            assert now - t0 < RUN_TIMEOUT_S, f"{cmd} ran past {RUN_TIMEOUT_S} s"
            entries = _staged_entries(out)
            if seen_tmp is None and entries is not None:
                seen_tmp = now
            if armed is None:
                if moment.files is not None:
                    armed = now if entries is not None and entries >= moment.files else None
                elif moment.log is not None:
                    armed = now if moment.log in log.read_text(errors="replace") else None
                else:
                    armed = t0
            if armed is not None and now - armed >= moment.delay:
                proc.send_signal(sig)
                sent_at = now - t0
                break
            time.sleep(0.003)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text(errors="replace")
    return {"rc": rc, "signalled_at": sent_at, "tmp_seen_at": None if seen_tmp is None else seen_tmp - t0,
            "moment": str(moment), "log": text[-3000:],
            "python_dropped": "Exception ignored" in text and "KeyboardInterrupt" in text}


def check_checkpoint(path: Path) -> AutoConfig:
    """Complete and loadable: every tensor of the config's layout, readable, and a tokenizer."""
    config = AutoConfig.from_pretrained(path)
    cv.check_written(config, path)  # exactly the expected tensors, every header and data range intact
    for shard in path.glob("*.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(shard).values() if t.is_floating_point())
    if (path / "model.safetensors.index.json").exists():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert {p.name for p in path.glob("*.safetensors")} == set(index["weight_map"].values())
    AutoTokenizer.from_pretrained(path)
    return config


def check_outcome(out: Path, sig: int, result: dict, *, old_hidden: int | None, new_hidden: int) -> str:
    """The invariant; returns which outcome it was (for the failure messages of the others)."""
    where = f"seed {SEED}, {signal.Signals(sig).name} {result['moment']}, at {result['signalled_at']} s " \
            f"(temporary dir seen at {result['tmp_seen_at']} s), rc {result['rc']}\n{result['log']}"
    leftovers = temporary_names(out)
    others = {p.name for p in out.parent.iterdir()} - {out.name} - {p.name for p in leftovers}
    assert not others, f"unexpected files beside the output: {others}; {where}"
    if result["signalled_at"] is None:
        assert result["rc"] == 0, where
    if sig == signal.SIGINT or result["signalled_at"] is None:
        assert not leftovers, f"temporary directories left behind: {leftovers}; {where}"
    else:
        assert all(p.name.startswith(f".{out.name}{TMP_MARK}") for p in leftovers), where
    if not out.exists():
        # Only an old checkpoint being replaced can be absent for an instant, moved aside intact.
        if old_hidden is not None:
            moved = [p for p in leftovers if p.name.startswith(f".{out.name}{TMP_MARK}old-")]
            assert sig == signal.SIGKILL and moved, f"the old checkpoint is gone; {where}"
            assert check_checkpoint(moved[0]).hidden_size == old_hidden, where
        return "absent"
    hidden = check_checkpoint(out).hidden_size
    assert hidden in {old_hidden, new_hidden}, where
    return "new" if hidden == new_hidden else "old"


def _summary(outcome: str, result: dict) -> str:
    at = result["signalled_at"]
    return f"{outcome} ({result['moment']}: {'finished first' if at is None else f'sent at {at:.2f} s'})"


def interrupted(result: dict, sig: int) -> bool:
    """The signal reached the tool before it finished: sent while it ran, and its exit status shows it."""
    return result["signalled_at"] is not None and (result["rc"] == -sig if sig == signal.SIGKILL else result["rc"] != 0)


def check_interrupted(tool: str, sig: int, results: list[dict]) -> None:
    """The last run (the early moment) and at least one staged run were really interrupted, the staged one
    while its temporary directory existed."""
    hit = [interrupted(r, sig) for r in results]
    staged = sum(h and r["tmp_seen_at"] is not None and r["signalled_at"] >= r["tmp_seen_at"]
                 for h, r in zip(hit[:-1], results[:-1]))
    print(f"{tool} {signal.Signals(sig).name} (seed {SEED}): {sum(hit)} of {len(results)} runs interrupted, "
          f"{staged} while staging")
    assert hit[-1], f"seed {SEED}: the early {signal.Signals(sig).name} did not interrupt {tool}: {results[-1]}"
    assert staged >= 1, f"seed {SEED}: no {signal.Signals(sig).name} reached {tool} while it staged its output"


# A staged moment that comes too late (the tool finished writing first) is drawn again, tighter, this often.
STAGED_TRIES = 3
# An early SIGINT lands while the tool's modules import (5 s of torch and transformers on a slow machine),
# before its `main` can latch Ctrl-C (`tools.staging.latch_interrupts`). If it lands in a finaliser or
# weakref callback there (importlib's module-lock callback, seen once in CI), Python reports the
# KeyboardInterrupt as "Exception ignored" and drops it, and the tool rightly runs to completion: no code
# of ours has run yet. Such a run is tried again, this often in all.
EARLY_TRIES = 3


def dropped_by_python(result: dict) -> bool:
    """A SIGINT that Python swallowed in a finaliser: the tool finished, and Python said so in its log."""
    return result["rc"] == 0 and result["signalled_at"] is not None and result["python_dropped"]


def run_moments(name: str, n_files: int, staged: int, early: Moment, run_one) -> list[dict]:
    """Run `run_one(i, moment) -> result` at `staged` random moments while the temporary directory fills
    (after a random number of its `n_files` entries, plus up to 50 ms), then at `early`, before anything is
    written. A staged run that finished before the signal is tried again with a shorter delay and fewer
    files (a loaded machine writes a small output within the delay); `check_interrupted` still asserts
    that one staged signal landed; an early SIGINT that Python dropped is tried again (`EARLY_TRIES`).
    Returns every result, the early one last."""
    rng = _rng(name)
    results = []
    for _ in range(staged):
        moment = Moment(rng.uniform(0.0, 0.05), files=rng.randint(1, n_files))
        for _ in range(STAGED_TRIES):
            results.append(run_one(len(results), moment))
            if results[-1]["rc"] != 0:
                break
            moment = Moment(moment.delay / 4, files=max(1, moment.files - 1))
    for _ in range(EARLY_TRIES):
        results.append(run_one(len(results), early))
        if not dropped_by_python(results[-1]):
            break
        print(f"seed {SEED}: Python dropped the early signal ({early}) inside a finaliser; drawn again")
    return results


# ---------------------------------------------------------------------------------------------
# make_checkpoint

# The small preset cut to 6 layers of width 512: ~120 MB in 7 shards, writing takes a moment.
NEW_HIDDEN = 512
MAKE_CMD = [sys.executable, "-m", "vllm_hysparse.tools.make_checkpoint", "--arch", "hysparse", "--preset",
            "small", "--max-shard-size", "20MB", "--seed", "5", "--set", f"hidden_size={NEW_HIDDEN}",
            "--set", "intermediate_size=1536", "--set", "num_hidden_layers=6",
            "--set", "layer_types=" + json.dumps(["full_attention", "sparse_attention", "sparse_attention"] * 2)]


@pytest.fixture(scope="module")
def old_tiny(tmp_path_factory):
    """An existing checkpoint that `--force` replaces (tiny: another hidden size than small)."""
    return write_checkpoint(tmp_path_factory.mktemp("old") / "tiny", "hysparse", "tiny", seed=1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_make_checkpoint_interrupted(tmp_path, old_tiny, sig):
    outcomes = []

    def run_one(i: int, moment: Moment) -> dict:
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        out = parent / "ckpt"
        force = i % 2 == 0  # alternately over an existing checkpoint and into nothing
        if force:
            shutil.copytree(old_tiny, out)
        result = run_interrupted([*MAKE_CMD, "--out", str(out), *(["--force"] if force else [])], out, sig,
                                 moment, log=tmp_path / f"run{i}.log")
        outcomes.append(_summary(check_outcome(out, sig, result, old_hidden=128 if force else None,
                                               new_hidden=NEW_HIDDEN), result))
        return result

    # 13 entries: config, 3 tokenizer files, generation config, 7 shards, index
    results = run_moments(f"make-{sig}", 13, 2, Moment(_rng(f"make-early-{sig}").uniform(0.3, 1.5)), run_one)
    print(f"make_checkpoint {signal.Signals(sig).name} (seed {SEED}): {outcomes}")
    check_interrupted("make_checkpoint", sig, results)


# ---------------------------------------------------------------------------------------------
# convert


def _dense(out: Path, fields: dict) -> Path:
    """A random dense Llama checkpoint with our tokenizer (distillation tokenizes text) in 20 MB shards."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**fields)).eval().save_pretrained(out, max_shard_size="20MB")
    build_hf_tokenizer(TOKENIZER_VOCAB).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return _dense(tmp_path_factory.mktemp("teacher") / "dense", TEACHER)


CONVERT_CMD = [sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), "--arch", "hysparse",
               "--max-shard-size", "20MB"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_convert_interrupted(tmp_path, teacher, sig):
    old = tmp_path / "old"
    write_checkpoint(old, "hysparse", "tiny", seed=2)
    outcomes = []

    def run_one(i: int, moment: Moment) -> dict:
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        out = parent / "student"
        force = i % 2 == 0
        if force:
            shutil.copytree(old, out)
        result = run_interrupted([*CONVERT_CMD, "--src", str(teacher), "--dst", str(out),
                                  *(["--force"] if force else [])], out, sig, moment,
                                 log=tmp_path / f"run{i}.log")
        outcomes.append(_summary(check_outcome(out, sig, result, old_hidden=128 if force else None,
                                               new_hidden=TEACHER["hidden_size"]), result))
        return result

    # config, 4 side files, 7 parts of 20 MB (renamed to shards at the end), index
    results = run_moments(f"convert-{sig}", 12, 2, Moment(_rng(f"convert-early-{sig}").uniform(0.3, 1.5)),
                          run_one)
    print(f"convert {signal.Signals(sig).name} (seed {SEED}): {outcomes}")
    check_interrupted("convert", sig, results)


# ---------------------------------------------------------------------------------------------
# distill


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """(teacher, converted student) for distillation."""
    root = tmp_path_factory.mktemp("distill")
    teacher = _dense(root / "dense", SMALL_TEACHER)
    student = cv.convert(cv.plan_conversion(teacher, "hysparse"), root / "student", max_shard_bytes=1 << 30)
    return teacher, student


@pytest.fixture(scope="module")
def train_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text((Path(shutil.__file__)).read_text()[:40_000])
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_distill_interrupted(tmp_path, small_pair, train_text, sig):
    teacher, student = small_pair
    outcomes = []

    def run_one(i: int, moment: Moment) -> dict:
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        out = parent / "distilled"
        cmd = [sys.executable, "-m", "vllm_hysparse.distill", "--teacher", str(teacher), "--student", str(student),
               "--text", str(train_text), "--out", str(out), "--steps", "4", "--seq-len", "32",
               "--batch-size", "1", "--heldout-windows", "1"]
        result = run_interrupted(cmd, out, sig, moment, log=tmp_path / f"run{i}.log")
        outcomes.append(_summary(check_outcome(out, sig, result, old_hidden=None,
                                               new_hidden=SMALL_TEACHER["hidden_size"]), result))
        return result

    # config, generation config, weights, 3 tokenizer files; early: while it trains
    early = Moment(_rng(f"distill-early-{sig}").uniform(0.0, 0.3), log="distill:")
    results = run_moments(f"distill-{sig}", 6, 1, early, run_one)
    print(f"distill {signal.Signals(sig).name} (seed {SEED}): {outcomes}")
    check_interrupted("distill", sig, results)
