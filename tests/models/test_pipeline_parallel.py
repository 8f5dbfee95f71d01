# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallelism (CPU, two stages) against the reference model, and the splits we refuse.

HySparse `tiny` ([F, S, S | F, S, S]) splits evenly between its two blocks; its checkpoint here is `tiny_moe`
(MoE MLPs from layer 1, vLLM's FusedMoE on both stages) with variant `a` of tests/feature_variants.py (qk_norm,
attention bias, headwise gates, yarn RoPE and tied embeddings: the embedding lives on stage 0, the tied LM head
on stage 1).
HySparse2 `tiny` ([W, F, W | F, S, S, F, S], bridges from layer 1) runs at
the self / cross boundary (3 + 5) and with its second cross block alone on
stage 1 (6 + 2): there both stages run cross layers with prefill early exit,
and layer 1's residual stream travels to stage 1 for the bridge built there.
A split that separates layers sharing a KV cache is a one-line error raised by
our config hook, before any worker starts.
"""

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM

import vllm_hysparse  # noqa: F401
from tests.feature_variants import variant_overrides
from tests.vllm_utils import (
    check_logprobs_close,
    kv_cache_layout,
    make_llm,
    random_prompts,
    reference_greedy,
    shutdown,
    vllm_greedy,
)
from vllm_hysparse.models.pipeline import PARTITION_ENV, check_pipeline_split, suggest_partition
from vllm_hysparse.tools.make_checkpoint import build_config, write_checkpoint

LENGTHS = [1, 17, 40, 90, 150]
MAX_TOKENS = 8
ENGINE = dict(enforce_eager=True, block_size=32, max_model_len=512, pipeline_parallel_size=2)


def _split_error(config, pp_size: int) -> str:
    with pytest.raises(ValueError) as info:
        check_pipeline_split(config, pp_size)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------
# The split rule (config logic; get_pp_indices is vLLM's own)


def test_hysparse_split_keeps_blocks_together(monkeypatch):
    tiny = build_config("hysparse", "tiny")
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    check_pipeline_split(tiny, 2)  # [0, 3) | [3, 6): one block each
    monkeypatch.setenv(PARTITION_ENV, "2,4")
    message = _split_error(tiny, 2)
    assert message == (
        "pipeline_parallel_size=2 splits layers [0, 2) | [2, 6), which puts layer 2 on stage 1 but layer 0, "
        "whose KV cache and index buffer it reads, on stage 0 (vLLM shares KV caches only within a stage); "
        f"set {PARTITION_ENV}=3,3 (layers per stage) so every block starts a stage")
    monkeypatch.delenv(PARTITION_ENV)
    assert "fewer blocks than pipeline_parallel_size=3" in _split_error(tiny, 3)


def test_paper_layouts(monkeypatch):
    """HySparse 80B: the even split [25, 24] cuts block 24..35; HySparse2 80B splits at its self / cross boundary."""
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    hs = build_config("hysparse", "paper")
    message = _split_error(hs, 2)
    assert "puts layer 25 on stage 1 but layer 24" in message and f"{PARTITION_ENV}=24,25" in message
    assert suggest_partition(hs, 4) == "12,12,12,13"
    monkeypatch.setenv(PARTITION_ENV, "12,12,12,13")
    check_pipeline_split(hs, 4)
    monkeypatch.delenv(PARTITION_ENV)
    hs2 = build_config("hysparse2", "paper")
    check_pipeline_split(hs2, 2)  # [0, 25) | [25, 49): self-decoder | cross-decoder
    check_pipeline_split(hs2, 4)  # cuts at 13 (self), 25 and 37 (cross block starts)


def test_hysparse2_split_keeps_cross_blocks_together(monkeypatch):
    tiny = build_config("hysparse2", "tiny")
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    message = _split_error(tiny, 2)  # [0, 4) | [4, 8) cuts cross block 3..5
    assert "puts layer 4 on stage 1 but layer 3," in message and f"{PARTITION_ENV}=3,5" in message
    for ok in ("1,7", "2,6", "3,5", "6,2"):  # self layers go anywhere; cross blocks start at 3 and 6
        monkeypatch.setenv(PARTITION_ENV, ok)
        check_pipeline_split(tiny, 2)
    monkeypatch.setenv(PARTITION_ENV, "7,1")
    assert "puts layer 7 on stage 1 but layer 6," in _split_error(tiny, 2)


# ---------------------------------------------------------------------------------------------
# The real engine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    return {"hysparse": write_checkpoint(root / "hysparse", "hysparse", "tiny_moe", seed=23,
                                         overrides=variant_overrides("hysparse", "a")),
            "hysparse2": write_checkpoint(root / "hysparse2", "hysparse2", "tiny", seed=23)}


def _stage_layers(layout: dict) -> set[str]:
    """Attention layer names a worker allocated or mapped a KV cache for."""
    return {name for group in layout["groups"] for name in group["layers"]} | set(layout["shared"])


def _run_pp(ckpt, monkeypatch, partition: str | None):
    if partition is None:
        monkeypatch.delenv(PARTITION_ENV, raising=False)
    else:
        monkeypatch.setenv(PARTITION_ENV, partition)  # the workers inherit it
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompts = random_prompts(LENGTHS, reference.config.vocab_size, seed=4)
    expected = reference_greedy(reference, prompts, MAX_TOKENS)
    llm = make_llm(ckpt, **ENGINE)
    try:
        got = vllm_greedy(llm, prompts, MAX_TOKENS)
        layouts = llm.collective_rpc(kv_cache_layout)
    finally:
        shutdown(llm)
    matched = check_logprobs_close(expected, got)
    return matched, layouts


def test_hysparse_pp2_matches_reference(checkpoints, monkeypatch):
    config = AutoConfig.from_pretrained(checkpoints["hysparse"])
    assert config.tie_word_embeddings and config.qk_norm and config.rope_scaling["rope_type"] == "yarn"
    assert config.num_experts > 1 and config.mlp_only_layers == [0]  # MoE on both stages
    matched, layouts = _run_pp(checkpoints["hysparse"], monkeypatch, None)
    assert matched >= 0.9 * len(LENGTHS) * MAX_TOKENS
    attn = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    stage0, stage1 = map(_stage_layers, layouts)
    assert set(attn[:3]) <= stage0 and not set(attn[3:]) & stage0
    assert set(attn[3:]) <= stage1 and not set(attn[:3]) & stage1
    # The sparse layers share their own stage's full layer.
    assert layouts[1]["shared"] == {attn[4]: attn[3], attn[5]: attn[3]}


@pytest.mark.parametrize("partition", ["3,5", "6,2"])
def test_hysparse2_pp2_matches_reference(checkpoints, monkeypatch, partition):
    matched, layouts = _run_pp(checkpoints["hysparse2"], monkeypatch, partition)
    assert matched >= 0.8 * len(LENGTHS) * MAX_TOKENS
    cut = int(partition.split(",")[0])
    stages = list(map(_stage_layers, layouts))
    for c in (3, 6):  # each bridge lives with its cross block
        stage = int(c >= cut)
        assert f"model.bridges.{c}.attn" in stages[stage] and f"model.bridges.{c}.attn" not in stages[1 - stage]
    for i in range(8):
        stage = int(i >= cut)
        assert f"model.layers.{i}.self_attn.attn" in stages[stage]
        assert f"model.layers.{i}.self_attn.attn" not in stages[1 - stage]


@pytest.mark.parametrize("arch, partition, needle", [
    ("hysparse", "2,4", "puts layer 2 on stage 1 but layer 0,"),
    ("hysparse2", None, "puts layer 4 on stage 1 but layer 3,"),
])
def test_bad_split_is_refused_at_engine_start(checkpoints, monkeypatch, arch, partition, needle):
    """vLLM builds its config in a pydantic validator, which wraps our ValueError; the line is ours, unchanged."""
    if partition is None:
        monkeypatch.delenv(PARTITION_ENV, raising=False)
    else:
        monkeypatch.setenv(PARTITION_ENV, partition)
    with pytest.raises(ValidationError) as info:
        make_llm(checkpoints[arch], **ENGINE)
    (error,) = info.value.errors()
    ours = error["ctx"]["error"]
    assert isinstance(ours, ValueError) and needle in str(ours) and "\n" not in str(ours)
    assert str(ours).startswith("pipeline_parallel_size=2 splits layers ") and PARTITION_ENV in str(ours)
