# SPDX-License-Identifier: Apache-2.0
"""vLLM attention layers and backends for full, sparse and sliding HySparse layers."""
