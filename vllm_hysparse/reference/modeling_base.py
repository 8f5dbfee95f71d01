# SPDX-License-Identifier: Apache-2.0
"""transformers plumbing shared by both reference models: init, strict loading, cache, logits."""

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from vllm_hysparse.configs.tensors import check_finite, unreadable_files_message
from vllm_hysparse.reference.layers import RMSNorm, ReferenceSwitches


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config."""


class ReferencePreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    _skip_keys_device_placement = ["past_key_values"]
    # SPEC §2.2: sinks are float32 in memory whatever the model dtype.
    _keep_in_fp32_modules = ["sinks"]
    _supports_sdpa = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        for name, param in module.named_parameters(recurse=False):
            if name.endswith("sinks"):
                nn.init.zeros_(param)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # transformers would build a cache from `layer_types`, which it does not
        # know; our forward makes a plain per-layer cache itself.
        return False

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Load a checkpoint; any missing, unexpected, mis-shaped or non-finite tensor, or an unreadable
        safetensors file, is a `CheckpointError` naming it."""
        want_info = kwargs.pop("output_loading_info", False)
        # True makes transformers report mis-shaped tensors in `info` instead of
        # raising a RuntimeError that does not name them; we raise below anyway.
        kwargs["ignore_mismatched_sizes"] = True
        try:
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except SafetensorError as e:
            # safetensors names no file; say which one is truncated or corrupt.
            raise CheckpointError(unreadable_files_message(str(args[0]) if args else "", e)) from None
        problems = [f"missing tensor {k}" for k in sorted(info.get("missing_keys", []))]
        problems += [f"unexpected tensor {k}" for k in sorted(info.get("unexpected_keys", []))]
        problems += [f"mis-shaped tensor {m[0] if isinstance(m, tuple) else m}"
                     for m in info.get("mismatched_keys", [])]
        if problems:
            raise CheckpointError(f"{args[0] if args else ''}: " + "; ".join(problems))
        for name, tensor in model.state_dict().items():
            try:
                check_finite(name, tensor)
            except ValueError as e:
                raise CheckpointError(f"{args[0] if args else ''}: {e}") from None
        return (model, info) if want_info else model


class ReferenceCausalLM(ReferencePreTrainedModel, GenerationMixin):
    """Shared `forward` of the two causal LMs; subclasses name their body (`model_class`, built from the config)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    model_class: type

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.switches = ReferenceSwitches()
        self.post_init()

    def set_switches(self, **changes) -> ReferenceSwitches:
        """Change validation switches (see `ReferenceSwitches`); returns the new set."""
        for name, value in changes.items():
            if not hasattr(self.switches, name):
                raise ValueError(f"unknown switch {name!r}; known: {list(vars(self.switches))}")
            setattr(self.switches, name, bool(value))
        return self.switches

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits `[B, kept rows, vocab]` for `input_ids [B, T]` continuing `past_key_values`.

        Rows of a batch are independent sequences of equal length: padding
        (`attention_mask` with zeros) is not supported. `logits_to_keep` as in
        transformers: an int keeps the last n rows (0 = all), a 1-D tensor names rows.
        """
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("the reference model does not support padding: attention_mask must be all ones")
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        seq_len = inputs_embeds.shape[1]
        positions = torch.arange(past, past + seq_len, device=inputs_embeds.device)
        rows = logits_rows(logits_to_keep, seq_len, inputs_embeds.device)
        hidden, all_hidden = self.model(
            inputs_embeds, positions, past_key_values, rows, self.switches, bool(output_hidden_states))
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            # Shift over the whole sequence first: kept row i predicts token i + 1.
            shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
            loss = self.loss_function(logits=logits, labels=None, shift_labels=shifted[:, rows].contiguous(),
                                      vocab_size=self.vocab_size)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden)


def logits_rows(logits_to_keep: int | torch.Tensor, seq_len: int, device) -> torch.Tensor:
    """Row indices `[R]` whose logits are wanted, ascending."""
    if isinstance(logits_to_keep, torch.Tensor):
        rows = logits_to_keep.to(device=device, dtype=torch.long).flatten()
        if rows.numel() == 0 or rows.min() < 0 or rows.max() >= seq_len:
            raise ValueError(f"logits_to_keep must index rows in [0, {seq_len})")
        return torch.sort(rows).values
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0 (got {logits_to_keep})")
    n = seq_len if logits_to_keep == 0 else min(logits_to_keep, seq_len)
    return torch.arange(seq_len - n, seq_len, device=device)


def normed_outputs(norm, h: torch.Tensor, rows: torch.Tensor, hiddens: list | None):
    """(final normed hidden `[B, R, hidden]` at `rows`, the per-layer hiddens as a tuple or None) of a model body
    whose last layer gave `h` `[B, T, hidden]`. As transformers does, the last entry of the hiddens becomes the
    final normed hidden state."""
    if hiddens is not None:
        hiddens[-1] = norm(h)
    return norm(h[:, rows]), tuple(hiddens) if hiddens is not None else None
