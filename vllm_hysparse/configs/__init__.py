# SPDX-License-Identifier: Apache-2.0
from vllm_hysparse.configs.hysparse import HySparseConfig
from vllm_hysparse.configs.hysparse2 import HySparse2Config

__all__ = ["HySparseConfig", "HySparse2Config"]
