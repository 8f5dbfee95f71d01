# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters through `vllm serve --enable-lora --lora-modules` on HySparse2, with the OpenAI client.

The adapter is written here (PEFT format, random factors on every projection, the bridged K/V included) and its
answers are compared with the reference model with the adapter merged; the base model's answers with the
reference without it. Bad adapters, loaded at run time (`/v1/load_lora_adapter`), are refused with one line
that names the problem (vLLM answers these with status 500), and the server keeps serving: a rank over the limit,
a module the model lacks, and factors made for another base (which vLLM 0.32 itself would load into its slots).
"""

import json
import shutil

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.entrypoints.serve_utils import error_of, serve
from tests.lora_utils import ALL_TARGETS, write_adapter
from tests.vllm_utils import random_prompts, reference_greedy
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

SEED = 20261205
MAX_LORA_RANK = 8
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(server, base checkpoint, adapter dir, merged reference, adapters that must be refused)."""
    print(f"seed {SEED}")
    root = tmp_path_factory.mktemp("lora-serve")
    base = write_checkpoint(root / "tiny", "hysparse2", "tiny", seed=SEED % 1000)
    adapter = write_adapter(base, root / "mine", 4, 8.0, ALL_TARGETS["hysparse2"], SEED)
    merged = AutoModelForCausalLM.from_pretrained(root / "mine" / "merged", dtype=torch.float32).eval()
    bad = {
        # rank 16 > --max-lora-rank 8
        "rank": write_adapter(base, root / "big", 16, 8.0, ["q_proj"], SEED + 1),
        # a module the model does not have
        "module": _renamed(write_adapter(base, root / "odd", 4, 8.0, ["q_proj"], SEED + 2), "q_proj", "qq_proj"),
        # made for another base: a narrower MLP (vLLM itself would load these factors into its wider slots)
        "base": write_adapter(write_checkpoint(root / "other", "hysparse2", "tiny", seed=SEED % 997,
                                               overrides={"intermediate_size": 192}),
                              root / "other-adapter", 4, 8.0, ["q_proj", "down_proj"], SEED + 3),
    }
    log = root / "serve.log"
    with serve(base, log, "--enforce-eager", "--max-model-len", "512", "--enable-lora", "--max-lora-rank",
               str(MAX_LORA_RANK), "--max-loras", "2", "--lora-modules", f"mine={adapter}",
               env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:
        yield server, base, adapter, merged, bad


def _renamed(adapter, old: str, new: str):
    """The adapter with every `old` module renamed `new`, in its tensors and its config."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k.replace(f".{old}.", f".{new}."): v for k, v in tensors.items()}, adapter / "adapter_model.safetensors")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["target_modules"] = [new if m == old else m for m in cfg["target_modules"]]
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    return adapter


def _tokens(client, model: str, prompt: list[int]) -> list[int]:
    got = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    return got.choices[0].token_ids


def test_served_adapter_and_base_match_their_references(setup):
    server, base, _, merged, _ = setup
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    assert {m.id for m in client.models.list().data} == {str(base), "mine"}
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = random_prompts([7, 40, 130], reference.config.vocab_size, seed=SEED)
    want_adapter = [c.token_ids for c in reference_greedy(merged, prompts, MAX_TOKENS)]
    want_base = [c.token_ids for c in reference_greedy(reference, prompts, MAX_TOKENS)]
    assert want_adapter != want_base, "the adapter must change the answers, or this test could not fail"
    assert [_tokens(client, "mine", p) for p in prompts] == want_adapter
    assert [_tokens(client, str(base), p) for p in prompts] == want_base
    assert "prefill early exit off, because LoRA is enabled" in server.log.read_text()


@pytest.mark.parametrize("what", ["rank", "module", "base"])
def test_bad_adapter_is_refused_in_one_line_and_server_keeps_serving(setup, what):
    server, _, _, merged, bad = setup
    expected = {"rank": "lora rank 16 is greater than max_lora_rank 8", "module": "qq_proj",
                "base": "does not fit this model: model.layers.0.mlp.down_proj has lora_a [4, 192]"}[what]
    with httpx.Client(timeout=120) as http:
        r = http.post(f"{server.root}/v1/load_lora_adapter",
                      json={"lora_name": f"bad-{what}", "lora_path": str(bad[what])})
    message, _ = error_of(r)
    assert r.status_code in (400, 500), (r.status_code, r.text[:2000])
    assert expected in message.lower() and "\n" not in message.strip(), message
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    prompt = random_prompts([20], merged.config.vocab_size, seed=SEED + 9)[0]
    assert _tokens(client, "mine", prompt) == reference_greedy(merged, [prompt], MAX_TOKENS)[0].token_ids
    shutil.rmtree(bad[what].parent / "merged", ignore_errors=True)
