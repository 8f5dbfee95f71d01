# SPDX-License-Identifier: Apache-2.0
"""The `small` checkpoints the serving benchmarks compare (random weights, nothing downloaded), each written once.

`ensure_hysparse_checkpoint` (HySparse or HySparse2) and `ensure_dense_checkpoint` (a Llama of the same shape
and tokenizer), `small_checkpoint` for either by name; `benchmarks/serve_bench.py`, `layer_breakdown.py` and
`paired_steps.py` run them. torch and
transformers are imported inside the functions, so importing this module stays as light as the harness.
"""

from pathlib import Path

from vllm_hysparse.tools.staging import staged_output


def ensure_hysparse_checkpoint(path: Path, arch: str = "hysparse") -> Path:
    """The `small` HySparse (or HySparse2) checkpoint at `path`, written once."""
    from vllm_hysparse.tools.make_checkpoint import write_checkpoint

    if not (path / "config.json").exists():
        write_checkpoint(path, arch, "small", force=True)
    return path


def dense_llama_config(hysparse_config, tokenizer):
    """A LlamaConfig with the HySparse model's dimensions, every layer full attention."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=hysparse_config.vocab_size, hidden_size=hysparse_config.hidden_size,
        intermediate_size=hysparse_config.intermediate_size, num_hidden_layers=hysparse_config.num_hidden_layers,
        num_attention_heads=hysparse_config.num_attention_heads,
        num_key_value_heads=hysparse_config.num_key_value_heads, head_dim=hysparse_config.head_dim,
        max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=hysparse_config.rms_norm_eps,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")


def ensure_dense_checkpoint(path: Path, hysparse_path: Path, seed: int = 0) -> Path:
    """A randomly initialised float32 Llama with the same dimensions and tokenizer, written once."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from vllm_hysparse.configs import HySparseConfig
    from vllm_hysparse.tools.presets import TOKENIZER_VOCAB
    from vllm_hysparse.tools.tokenizer import build_hf_tokenizer

    tokenizer = build_hf_tokenizer(TOKENIZER_VOCAB)
    config = dense_llama_config(HySparseConfig.from_pretrained(hysparse_path), tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with staged_output(path) as tmp:  # written aside and renamed into place: no half checkpoint if interrupted
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
    return path


def small_checkpoint(name: str, root: Path) -> Path:
    """The `small` checkpoint of `name` ("dense", "hysparse" or "hysparse2") under `root`, written once: the
    benchmarks' `llama-small`, `hysparse-small` and `hysparse2-small` (dense has HySparse's dims and tokenizer)."""
    hysparse = ensure_hysparse_checkpoint(root / "hysparse-small")
    if name == "dense":
        return ensure_dense_checkpoint(root / "llama-small", hysparse)
    return ensure_hysparse_checkpoint(root / f"{name}-small", name)
