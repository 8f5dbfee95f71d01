# SPDX-License-Identifier: Apache-2.0
"""The committed deltas (`deltas/*`) fit the base they were trained on, checked without the registry: a
random-weight model built from the base's own config (`base_config.json`, written by `recovery train`) takes
every tensor of the delta (names, shapes, LoRA factors, the stage-0 record). The weights themselves are
checked by tests/models/test_smollm2_recovered.py, which rebuilds the student from the registry package."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import vllm_hysparse  # noqa: F401  (registers our configs)
from vllm_hysparse.recovery import __main__ as cli
from vllm_hysparse.recovery.folds import INIT_PREFIX, apply_init
from vllm_hysparse.recovery.lora import check_delta, converted_attention

DELTAS = Path(__file__).resolve().parents[2] / "deltas"
NAMES = sorted(p.name for p in DELTAS.iterdir() if (p / cli.DELTA_FILE).is_file())


def _random_base(fields: dict):
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_there_are_committed_deltas():
    assert NAMES == ["smollm2-hysparse", "smollm2-hysparse-15full", "smollm2-hysparse2"]


@pytest.mark.parametrize("name", NAMES)
def test_committed_delta_fits_its_base_layout(name):
    fields = json.loads((DELTAS / name / cli.BASE_CONFIG).read_text())
    model = _random_base(fields)
    tensors, meta = cli.read_delta(DELTAS / name)
    check_delta(model, tensors, meta)
    # Every converted layer of the base is adapted by the delta, and nothing else is named.
    named = {k.removeprefix(INIT_PREFIX).split(".self_attn.")[0] + ".self_attn" for k in tensors}
    assert named == set(converted_attention(model)), sorted(named ^ set(converted_attention(model)))
    record = {k: v for k, v in tensors.items() if k.startswith(INIT_PREFIX)}
    apply_init(model, record)  # a delta trained from stage 0 carries its record (checked to fit above)
    print(f"{name}: {len(tensors)} tensors ({len(record)} stage-0) fit {len(named)} converted layers")
    # A base cut before the last layer the delta adapts does not take it, with a one-line error naming what is
    # missing.
    last = max(int(path.split(".")[2]) for path in named)
    fields["num_hidden_layers"], fields["layer_types"] = last, fields["layer_types"][:last]
    short = _random_base(fields)
    with pytest.raises(ValueError, match="which the base model does not have|which the model does not have"):
        check_delta(short, tensors, meta)
