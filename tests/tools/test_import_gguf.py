# SPDX-License-Identifier: Apache-2.0
"""GGUF -> dense HF import: weights, logits and tokenizer against the model the GGUF was written from.

Every GGUF here is written by the test itself with gguf's GGUFWriter the way
llama.cpp's convert script writes one (Q/K rows permuted for llama, some
tensors in F16 / Q8_0), so no model needs to be downloaded.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from vllm_hysparse.reference import HySparseForCausalLM
from vllm_hysparse.tools import convert as cv
from vllm_hysparse.tools import import_gguf as ig

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France is Paris.",
    "Sparse attention selects the top blocks of keys for each query, and a sliding window keeps the recent ones.",
    "def main():\n    return sum(x * x for x in range(10))\n",
] * 8
TEXT = "The capital of France is Paris. def f(x): return x"
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
# GGUF architecture -> (config class, model class, extra config). Each exercises something else:
# llama: permuted Q/K and a separate output.weight; qwen2: q/k/v biases and tied embeddings;
# qwen3: q/k norms and head_dim != hidden / heads (attention.key_length).
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True, "head_dim": 32}),
}
# llama.cpp's tensor names; `{}` is the layer.
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "blk.{}.attn_norm.weight",
    "post_attention_layernorm.weight": "blk.{}.ffn_norm.weight",
    "self_attn.q_proj.weight": "blk.{}.attn_q.weight",
    "self_attn.k_proj.weight": "blk.{}.attn_k.weight",
    "self_attn.v_proj.weight": "blk.{}.attn_v.weight",
    "self_attn.o_proj.weight": "blk.{}.attn_output.weight",
    "self_attn.q_proj.bias": "blk.{}.attn_q.bias",
    "self_attn.k_proj.bias": "blk.{}.attn_k.bias",
    "self_attn.v_proj.bias": "blk.{}.attn_v.bias",
    "self_attn.q_norm.weight": "blk.{}.attn_q_norm.weight",
    "self_attn.k_norm.weight": "blk.{}.attn_k_norm.weight",
    "mlp.gate_proj.weight": "blk.{}.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.{}.ffn_up.weight",
    "mlp.down_proj.weight": "blk.{}.ffn_down.weight",
}
# Not every tensor is float32 in a real GGUF: these are stored quantised (llama.cpp types).
STORED_AS = {
    "model.embed_tokens.weight": gguf.GGMLQuantizationType.F16,
    "model.layers.1.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q8_0,
    "model.layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.Q8_0,
}


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP spin-waiting on a shared CPU (as tests/reference)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of a few hundred tokens with ChatML specials at ids 0..2 (as SmolLM2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`: rotate-half pairs -> interleaved pairs.

    w: [heads * D, hidden]; each head's rows go from (2, D/2) order to (D/2, 2).
    """
    if n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        return GGUF_NAMES[".".join(parts[3:])].format(parts[2])
    return GGUF_NAMES[hf_name]


def stored(name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, gguf.GGMLQuantizationType]:
    """(data as written, what dequantising it gives back, its type)."""
    qtype = STORED_AS.get(name, gguf.GGMLQuantizationType.F32)
    if qtype == gguf.GGMLQuantizationType.F32:
        return w, w, qtype
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32), qtype
    data = gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype), qtype


def add_tokenizer(writer: gguf.GGUFWriter, tok: Tokenizer) -> None:
    """llama.cpp's `gpt2` tokenizer metadata: byte-level tokens, types, merges, special ids, chat template."""
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([control if t in SPECIALS else normal for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def add_hparams(writer: gguf.GGUFWriter, config) -> None:
    head = head_dim(config)
    writer.add_name(f"tiny test {config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head)
    writer.add_key_length(head)
    writer.add_value_length(head)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)


def write_gguf(path: Path, arch: str, model, tok: Tokenizer) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; returns the HF state dict a faithful reader must give back."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_hparams(writer, config)
    add_tokenizer(writer, tok)
    expected = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = t.detach().float().numpy()
        data, back, qtype = stored(name, w)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = llama_cpp_permute(data, config.num_attention_heads, kv)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        expected[name] = torch.from_numpy(np.ascontiguousarray(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def random_model(arch: str, vocab_size: int, seed: int):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra, vocab_size=vocab_size)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            # Non-unit norms and non-zero biases make a mis-mapped tensor visible in the logits.
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise if name.endswith("bias")
                    else noise / p.shape[-1] ** 0.5)
    return model


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer):
    """GGUF arch -> (gguf path, original model, expected dequantised state dict)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for seed, arch in enumerate(ARCHS):
        model = random_model(arch, tokenizer.get_vocab_size(), seed)
        (root / arch).mkdir()
        path = root / arch / f"tiny-{arch}.gguf"
        out[arch] = (path, model, write_gguf(path, arch, model, tokenizer))
    return out


@pytest.fixture(scope="module")
def imported(sources, tmp_path_factory):
    """GGUF arch -> dense checkpoint directory written by the importer (float32)."""
    root = tmp_path_factory.mktemp("imported")
    return {arch: ig.import_gguf(path, root / arch, check=True) for arch, (path, _, _) in sources.items()}


def load_written(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def ids_of(vocab_size: int, n: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_weights_equal_the_originals(sources, imported, arch):
    _, model, expected = sources[arch]
    written = load_written(imported[arch])
    assert set(written) == set(expected)
    for name, want in expected.items():
        assert written[name].dtype == torch.float32, name
        # Exact: float32 tensors unchanged, F16 / Q8_0 ones equal to their dequantised values,
        # and the Q/K un-permutation is the inverse of llama.cpp's permutation.
        assert torch.equal(written[name], want), name
    original = model.state_dict()
    float32 = [n for n in expected if n not in STORED_AS]
    assert all(torch.equal(written[n], original[n]) for n in float32)
    config = json.loads((imported[arch] / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert config["architectures"] == [type(model).__name__]
    assert config["tie_word_embeddings"] == model.config.tie_word_embeddings
    assert config.get("head_dim", 16) == head_dim(model.config)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_equal_the_gguf_model(sources, imported, arch):
    path, model, expected = sources[arch]
    ids = ids_of(model.config.vocab_size)
    # transformers' GGUF config reader ignores qwen3.attention.key_length (head_dim falls back to
    # Qwen3Config's 128); the importer reads it from the file, and so does this reference.
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.head_dim = head_dim(model.config)
    with torch.no_grad():
        gguf_model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=config, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True)).eval()
        dense = AutoModelForCausalLM.from_pretrained(imported[arch], dtype=torch.float32).eval()
        got = dense(ids).logits
        torch.testing.assert_close(got, gguf_model(ids).logits, rtol=0, atol=0)
        # And the model the file was written from, with the same rounding applied to its weights.
        model.load_state_dict(expected, strict=False)
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert got.abs().max() > 1.0


def test_tokenizer_round_trips_and_keeps_the_chat_template(imported, tokenizer):
    out = imported["llama"]
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    assert tok.chat_template == CHAT_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
    assert chat_ids[0] == tokenizer.token_to_id("<|im_start|>")  # a special token stays whole
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256


def test_bf16_output(sources, tmp_path):
    path, _, expected = sources["qwen2"]
    out = ig.import_gguf(path, tmp_path / "bf16", dtype="bf16", check=True)
    written = load_written(out)
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    assert all(torch.equal(written[n], expected[n].to(torch.bfloat16)) for n in expected)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_converter_accepts_the_import(sources, imported, tmp_path, capsys):
    """Two steps (import, then convert the directory) and one (convert the .gguf) give the same student."""
    plan = ["--arch", "hysparse", "--full-layers", "0", "--verify"]
    rc = cv.main(["--src", str(imported["llama"]), "--dst", str(tmp_path / "two"), *plan])
    out = capsys.readouterr()
    assert rc == 0 and "verify: logits" in out.out, out.err
    work = tmp_path / "one"
    work.mkdir()
    rc = cv.main(["--src", str(sources["llama"][0]), "--dst", str(work / "student"), *plan])
    out = capsys.readouterr()
    assert rc == 0 and "verify: logits" in out.out, out.err
    assert [p.name for p in work.iterdir()] == ["student"]  # the temporary dense import is gone
    two, one = load_written(tmp_path / "two"), load_written(work / "student")
    assert set(two) == set(one) and all(torch.equal(two[n], one[n]) for n in two)
    student = HySparseForCausalLM.from_pretrained(work / "student", dtype=torch.float32)
    assert student.config.layer_types == ["full_attention", "sparse_attention"]
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (work / "student" / name).read_bytes() == (imported["llama"] / name).read_bytes()


def write_other_arch(path: Path, arch: str) -> None:
    """A well-formed GGUF of an architecture the importer does not take."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _truncate(keep):
    def make(src: Path, good: Path) -> None:
        data = good.read_bytes()
        src.write_bytes(data[:keep(len(data))])
    return make


BAD_INPUTS = {
    "missing-file": (lambda src, good: None, "no such file"),
    "truncated-header": (_truncate(lambda n: 40), "not a readable GGUF file"),
    "truncated-data": (_truncate(lambda n: n - 100), "not a readable GGUF file"),
    "not-gguf": (lambda src, good: src.write_bytes(b"PK\x03\x04" + bytes(200)), "not a readable GGUF file"),
    "arch-gpt2": (lambda src, good: write_other_arch(src, "gpt2"), "architecture 'gpt2' is not supported"),
    "arch-bert": (lambda src, good: write_other_arch(src, "bert"), "architecture 'bert' is not supported"),
}


def check_failed(rc: int, err: str, reason: str, outs: Path) -> None:
    lines = err.strip().splitlines()
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], err
    assert "Traceback" not in err
    assert list(outs.iterdir()) == []  # no --dst, no temporary directory


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_one_line_and_writes_nothing(sources, tmp_path, capsys, case):
    make, reason = BAD_INPUTS[case]
    src, outs = tmp_path / "bad.gguf", tmp_path / "outs"
    make(src, sources["llama"][0])
    outs.mkdir()
    rc = ig.main(["--src", str(src), "--dst", str(outs / "ckpt")])
    check_failed(rc, capsys.readouterr().err, reason, outs)
    # The converter reports the same line when given the file directly.
    rc = cv.main(["--src", str(src), "--dst", str(outs / "student"), "--arch", "hysparse"])
    check_failed(rc, capsys.readouterr().err, reason, outs)


def test_rope_scaling_is_refused(tmp_path, capsys):
    src, outs = tmp_path / "scaled.gguf", tmp_path / "outs"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    outs.mkdir()
    rc = ig.main(["--src", str(src), "--dst", str(outs / "ckpt")])
    check_failed(rc, capsys.readouterr().err, "RoPE scaling (linear)", outs)


def test_refuses_non_empty_destination(sources, tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    path = sources["qwen2"][0]
    rc = ig.main(["--src", str(path), "--dst", str(dst)])
    err = capsys.readouterr().err
    assert rc == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert ig.main(["--src", str(path), "--dst", str(dst), "--force"]) == 0
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_refuses_to_replace_the_directory_holding_the_source(sources, tmp_path, capsys):
    src = tmp_path / "models" / "tiny.gguf"
    src.parent.mkdir()
    src.write_bytes(sources["qwen2"][0].read_bytes())
    rc = ig.main(["--src", str(src), "--dst", str(tmp_path), "--force"])
    err = capsys.readouterr().err
    assert rc == 2 and "holds --src" in err and src.is_file()


def test_module_cli_has_no_traceback(sources, tmp_path):
    """`python -m vllm_hysparse.tools.import_gguf` on a truncated file: one line, exit code 2."""
    good = sources["llama"][0].read_bytes()
    src = tmp_path / "cut.gguf"
    src.write_bytes(good[: len(good) // 2])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "vllm_hysparse.tools.import_gguf", "--src", str(src),
                           "--dst", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]
