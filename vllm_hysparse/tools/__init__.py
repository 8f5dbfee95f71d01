# SPDX-License-Identifier: Apache-2.0
"""Command-line tools: demo/test checkpoint generation."""
