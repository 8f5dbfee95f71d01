# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2 policy (`models.config_hooks.select_v1_runner`), as far as a CPU can test it.

vLLM 0.32 picks its V2 runner wherever Triton sees a GPU; this CPU has none, so a GPU-like machine is
stubbed (`HAS_TRITON` in vllm/config/vllm.py, the platform's device type) on a real `VllmConfig` of a
HySparse checkpoint. A HySparse config then resolves to V1 with our PIC worker, saying so in one line;
a user's explicit choice of runner stands; and on this CPU nothing changes.
"""

import logging
import os

import pytest

import vllm_hysparse  # noqa: F401
from vllm_hysparse.models.config_hooks import PIC_WORKERS, V2_RUNNER_ENV, select_pic_worker
from vllm_hysparse.tools.make_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("policy") / "tiny", "hysparse", "tiny", seed=2)


@pytest.fixture
def lines():
    """What the plugin logs during the test."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("vllm.hysparse")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


@pytest.fixture
def runner_env():
    """The runner variable as the test leaves it is put back as it was."""
    before = os.environ.pop(V2_RUNNER_ENV, None)
    yield
    os.environ.pop(V2_RUNNER_ENV, None)
    if before is not None:
        os.environ[V2_RUNNER_ENV] = before


def _config(ckpt):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(ckpt), dtype="float32", enforce_eager=True, max_model_len=256).create_engine_config()


def _gpu_like(monkeypatch):
    import vllm.config.vllm as vllm_config_module
    from vllm.platforms import current_platform

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(current_platform, "device_type", "cuda")


def test_on_this_cpu_nothing_changes(ckpt, runner_env, lines):
    config = _config(ckpt)
    assert not config.use_v2_model_runner and V2_RUNNER_ENV not in os.environ
    assert config.parallel_config.worker_cls == PIC_WORKERS["cpu"]
    assert not [m for m in lines if "V1 model runner" in m]


def test_a_gpu_default_resolves_to_v1_with_the_pic_worker(ckpt, runner_env, lines, monkeypatch):
    config = _config(ckpt)
    config.parallel_config.worker_cls = "auto"
    _gpu_like(monkeypatch)
    assert config.use_v2_model_runner, "the stub did not make vLLM pick V2"
    select_pic_worker(config)
    assert os.environ[V2_RUNNER_ENV] == "0" and not config.use_v2_model_runner
    assert config.parallel_config.worker_cls == PIC_WORKERS["cuda"]
    said = [m for m in lines if "V1 model runner" in m]
    assert len(said) == 1 and "\n" not in said[0] and V2_RUNNER_ENV in said[0], lines


@pytest.mark.parametrize("choice", ["1", "0"])
def test_a_users_choice_of_runner_stands(ckpt, runner_env, lines, monkeypatch, choice):
    config = _config(ckpt)
    config.parallel_config.worker_cls = "auto"
    _gpu_like(monkeypatch)
    os.environ[V2_RUNNER_ENV] = choice
    select_pic_worker(config)
    assert os.environ[V2_RUNNER_ENV] == choice and config.use_v2_model_runner == (choice == "1")
    # V2 chosen: vLLM's own worker stays (PIC requests are refused); V1 chosen: ours.
    assert config.parallel_config.worker_cls == ("auto" if choice == "1" else PIC_WORKERS["cuda"])
    assert not [m for m in lines if "V1 model runner" in m]
