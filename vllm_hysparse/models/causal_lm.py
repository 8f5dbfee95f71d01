# SPDX-License-Identifier: Apache-2.0
"""The causal LM around a model body, shared by `hysparse.py` and `hysparse2.py`.

Follows the `*ForCausalLM` classes of vLLM's model files (`qwen3.py`'s `Qwen3ForCausalLM`): the body, an lm head
(tied or its own), a logits processor and the empty tensors of pipeline stages. It differs in checking the config
class once, in the KV report it logs, and in the strict loader (`loader.load_checked`) in place of
`AutoWeightsLoader`. A model file subclasses it with its config class, its body, its checkpoint stacks and
vLLM's `packed_modules_mapping`.
"""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors

from vllm_hysparse.models.layers import log_kv_report, make_lm_head
from vllm_hysparse.models.loader import load_checked


class HybridForCausalLM(nn.Module, SupportsPP):
    config_class: type  # the checkpoint's config class (`HySparseConfig`, `HySparse2Config`)
    model_class: type  # the body, built as `model_class(vllm_config=..., prefix="model")`
    stacks: dict  # the checkpoint tensors each fused module stacks (`loader.load_checked`)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if not isinstance(config, self.config_class):
            raise ValueError(f"{type(self).__name__} needs a {self.config_class.model_type!r} config "
                             f"(got model_type {config.model_type!r})")
        self.config = config
        self.before_body(vllm_config)
        self.model = self.model_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = make_lm_head(config, vllm_config, self.model.embed_tokens, maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        log_kv_report(config, vllm_config)

    def before_body(self, vllm_config: VllmConfig) -> None:
        """Runs before the body is built (nothing here)."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Strict loading: an unknown, missing or mis-shaped tensor is a one-line error naming it."""
        return load_checked(self, self.config, self.stacks, weights)

    def lora_renames(self) -> dict[str, str]:
        """Checkpoint module prefix -> the name vLLM's LoRA loader gives it (none here)."""
        return {}

    def lora_mismatch(self, factors: dict[str, tuple[tuple, tuple]]) -> str | None:
        """The first adapter module whose LoRA factors do not fit this checkpoint, as one line; None when all fit.

        `factors`: module name as vLLM's LoRA loader names it -> (lora_a shape `[r, in]`, lora_b shape `[out, r]`).
        vLLM copies factors into slots sized for the model, so factors made for a smaller base load without a word
        and serve garbage. The projections' shapes are those of this config's reference model, built on the meta
        device (nothing allocated), under `lora_renames`.
        """
        shapes = self._linear_shapes()
        for name, (a, b) in sorted(factors.items()):
            if name not in shapes:
                continue  # vLLM's own module check names unknown modules
            fan_in, fan_out = shapes[name]
            if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b[0] != fan_out or a[0] != b[1]:
                return (f"the adapter does not fit this model: {name} has lora_A {list(a)} and lora_B {list(b)}, "
                        f"but the module maps {fan_in} -> {fan_out} features (an adapter for another base model?)")
        return None

    def _linear_shapes(self) -> dict[str, tuple[int, int]]:
        shapes = getattr(self, "_lora_shapes", None)
        if shapes is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                reference = AutoModelForCausalLM.from_config(self.config)
            renames = self.lora_renames()
            shapes = self._lora_shapes = {renames.get(name, name): (m.in_features, m.out_features)
                                          for name, m in reference.named_modules() if isinstance(m, nn.Linear)}
        return shapes
