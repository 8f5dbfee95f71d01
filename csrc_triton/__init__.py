# SPDX-License-Identifier: Apache-2.0
"""Triton kernels of vllm_hysparse, one kernel family per module.

Each kernel module sits beside a plain PyTorch reference with the same
signature (the dense ground truth is `vllm_hysparse.reference.ops`). Importing
this package imports no Triton and touches no GPU; launchers import Triton
lazily so CPU-only installs work.
"""
