# SPDX-License-Identifier: Apache-2.0
"""Corrupt checkpoints fail at load with one clear line, in `vllm serve` and in our own loaders.

Cases: a truncated safetensors shard, a shard named in
`model.safetensors.index.json` that does not exist, NaN / inf weights, and
HySparse2 configs whose `layer_types` or `bridge_sources` do not fit together.
Config errors come from the config class (no engine needed); each kind is also
shown through `vllm serve`, where the user sees it.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import vllm_hysparse  # noqa: F401  (registers our configs and models)
from tests.entrypoints.serve_utils import VLLM, server_env
from tests.vllm_utils import offline_load_errors
from vllm_hysparse.reference import CheckpointError
from vllm_hysparse.tools import convert as cv
from vllm_hysparse.tools.harness import free_port
from vllm_hysparse.tools.make_checkpoint import write_checkpoint

SHARD = "model-00002-of-00008.safetensors"
NAN_TENSOR = "model.layers.2.mlp.down_proj.weight"

# case -> the one line the user must see (also checked in our reference loader where it applies)
WEIGHT_CASES = {
    "truncated": "truncated or corrupt checkpoint file(s): {dir}/" + SHARD
                 + " (Error while deserializing header: incomplete metadata, file not fully covered)",
    "missing_shard": "Weight files referenced in index but missing: {{'{dir}/" + SHARD + "'}}",
    "nan": f"checkpoint tensor {NAN_TENSOR} has non-finite values (1 NaN, 1 inf of 32768); the checkpoint is corrupt",
}
# HySparse2 tiny: [W, F, W | F, S, S, F, S], 3 self-decoder layers, bridge_sources [1, 1]
CONFIG_CASES = {
    "self_layer_sparse": ({"layer_types": ["sparse_attention", "full_attention", "sliding_attention",
                                           "full_attention", "sparse_attention", "sparse_attention",
                                           "full_attention", "sparse_attention"]},
                          "layer_types[0]: self-decoder layers must be 'full_attention' or 'sliding_attention' "
                          "(got 'sparse_attention')"),
    "layer_types_length": ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                            "full_attention", "sparse_attention", "sparse_attention",
                                            "full_attention"]},
                           "layer_types: must have num_hidden_layers=8 entries (got '7 entries')"),
    "sliding_in_cross": ({"num_self_decoder_layers": 2},
                            "layer_types[2]: cross-decoder layers must be 'full_attention' or 'sparse_attention' "
                            "(got 'sliding_attention')"),
    "bridge_count": ({"bridge_sources": [1]},
                     "bridge_sources: must have one entry per cross-decoder full layer (2: [3, 6]) (got [1])"),
    "bridge_to_sliding": ({"bridge_sources": [1, 2]},
                          "bridge_sources[1]: must be the index of a self-decoder 'full_attention' layer (got 2)"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("corrupt")


@pytest.fixture(scope="module")
def good(root):
    """Tiny HySparse in 8 shards (1 MB each) with an index."""
    out = write_checkpoint(root / "good", "hysparse", "tiny", seed=7, max_shard_bytes=1 << 20)
    assert (out / SHARD).is_file() and (out / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def good2(root):
    return write_checkpoint(root / "good2", "hysparse2", "tiny", seed=8)


def corrupt_weights(good: Path, dst: Path, how: str) -> Path:
    shutil.copytree(good, dst)
    if how == "truncated":
        data = (dst / SHARD).read_bytes()
        (dst / SHARD).write_bytes(data[: len(data) // 2])
    elif how == "missing_shard":
        (dst / SHARD).unlink()
    elif how == "nan":
        index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
        path = dst / index[NAN_TENSOR]
        weights = load_file(path)
        weights[NAN_TENSOR][0, 0] = float("nan")
        weights[NAN_TENSOR][1, 1] = float("inf")
        save_file(weights, path, metadata={"format": "pt"})
    else:
        raise AssertionError(how)
    return dst


def corrupt_config(good2: Path, dst: Path, how: str) -> Path:
    shutil.copytree(good2, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(CONFIG_CASES[how][0])
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _line(message: str, text: str) -> str:
    """The log line carrying `message` (it must be on one line)."""
    lines = [line for line in text.splitlines() if message in line]
    assert lines, f"{message!r} not in the output:\n{text[-5000:]}"
    return lines[0]


def serve_fails(model: Path) -> str:
    """`vllm serve` on `model` must exit non-zero, by itself and in bounded time; returns its output."""
    result = subprocess.run([VLLM, "serve", str(model), "--dtype", "float32", "--host", "127.0.0.1",
                             "--port", str(free_port()), "--max-model-len", "512", "--enforce-eager"],
                            capture_output=True, text=True, timeout=300, env=server_env())
    assert result.returncode != 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# Config errors: the config class, hence every loader (transformers, vLLM, our tools)


@pytest.mark.parametrize("how", list(CONFIG_CASES))
def test_hysparse2_config_inconsistent(good2, tmp_path, how):
    bad = corrupt_config(good2, tmp_path / how, how)
    message = CONFIG_CASES[how][1]
    with pytest.raises(ValueError) as info:
        AutoConfig.from_pretrained(bad)
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        AutoModelForCausalLM.from_pretrained(bad)


# ---------------------------------------------------------------------------------------------
# Weight errors in our reference loader (validate, distill, generate) and the converter


@pytest.mark.parametrize("how, error, message", [
    ("truncated", CheckpointError, WEIGHT_CASES["truncated"]),
    # transformers' own message already names the file
    ("missing_shard", OSError, "No such file or directory: {dir}/" + SHARD),
    ("nan", CheckpointError, WEIGHT_CASES["nan"]),
], ids=["truncated", "missing_shard", "nan"])
def test_reference_loader(good, tmp_path, how, error, message):
    bad = corrupt_weights(good, tmp_path / how, how)
    with pytest.raises(error) as info:
        AutoModelForCausalLM.from_pretrained(bad)
    text = str(info.value)
    assert message.format(dir=bad) in text and "\n" not in text, text


@pytest.fixture(scope="module")
def dense(root):
    out = root / "dense"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(
        out, max_shard_size="60KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    return out


@pytest.mark.parametrize("how", ["truncated", "missing_shard"])
def test_convert_refuses_corrupt_source(dense, tmp_path, capsys, how):
    bad = tmp_path / "src"
    shutil.copytree(dense, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
        message = f"error: {shard}: truncated or corrupt safetensors file (Error while deserializing header"
    else:
        shard.unlink()
        message = f"error: {bad}: shard {shard.name} named in the index does not exist"
    rc = cv.main(["--src", str(bad), "--dst", str(tmp_path / "out"), "--arch", "hysparse"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# What a `vllm serve` user sees: one line naming the problem, and the server exits


def test_offline_llm_refuses_corrupt_weights(good, tmp_path):
    bad = {how: corrupt_weights(good, tmp_path / how, how) for how in WEIGHT_CASES}
    errors = offline_load_errors(list(bad.values()), tmp_path, timeout_s=400)
    for how, path in bad.items():
        error = errors[str(path)]
        assert error is not None, f"{how}: LLM(...) loaded a corrupt checkpoint"
        assert WEIGHT_CASES[how].format(dir=path) in error and "\n" not in error, (how, error)


def test_serve_refuses_nan_weights(good, tmp_path):
    """What a `vllm serve` user sees (engine core and worker in their own processes): the same line."""
    bad = corrupt_weights(good, tmp_path / "nan", "nan")
    line = _line(WEIGHT_CASES["nan"], serve_fails(bad))
    assert "ValueError" in line, line


def test_serve_refuses_inconsistent_hysparse2_config(good2, tmp_path):
    bad = corrupt_config(good2, tmp_path / "bridge", "bridge_to_sliding")
    _line(CONFIG_CASES["bridge_to_sliding"][1], serve_fails(bad))
