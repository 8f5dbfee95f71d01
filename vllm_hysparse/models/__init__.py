# SPDX-License-Identifier: Apache-2.0
"""vLLM model implementations (HySparseForCausalLM, HySparse2ForCausalLM)."""
