# SPDX-License-Identifier: Apache-2.0
"""Recovery training of converted students (`python -m vllm_hysparse.recovery`)."""
