"""Shared fixtures: a tiny synthetic checkpoint written once per test session."""
from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_global_generator():
    """Each test starts from the same global random state, so that what it draws without a generator of
    its own does not depend on which tests ran before it (a CI run once failed on such a draw)."""
    torch.manual_seed(0)


@pytest.fixture
def dequant_from_512(monkeypatch):
    """The experts' dequantized path from 512 tokens, as a device's tuning may set it (gpu_quant's default sets
    none since session 58): for the tests of that path's scratch and of the captured passes' cap below it."""
    from ostinato.layers.moe import gpu_quant as gq

    monkeypatch.setitem(gq.DEFAULT_QUANT_TUNING, "dequant_min_tokens", 512)
    gq.clear_quant_tuning_cache()
    yield 512
    monkeypatch.undo()
    gq.clear_quant_tuning_cache()


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep the tokenizer cache inside the test run unless the caller chose one."""
    if "OSTINATO_CACHE" not in os.environ:
        os.environ["OSTINATO_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, _isolated_cache):
    from ostinato.synth.build import write_checkpoint

    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
