# SPDX-License-Identifier: Apache-2.0
"""Plain PyTorch reference models and ops: the ground truth for vLLM models and kernels."""

from vllm_hysparse.reference.layers import ReferenceSwitches
from vllm_hysparse.reference.modeling_base import CheckpointError
from vllm_hysparse.reference.modeling_hysparse import HySparseForCausalLM
from vllm_hysparse.reference.modeling_hysparse2 import HySparse2ForCausalLM

__all__ = ["CheckpointError", "HySparseForCausalLM", "HySparse2ForCausalLM", "ReferenceSwitches"]
