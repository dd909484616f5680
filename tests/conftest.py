"""Shared fixtures: the built-in demo models, built once per test session."""

from __future__ import annotations

import importlib.util
import os

import pytest

from qconvert.convert.demo import build_demo_model


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def demo_moe(tmp_path_factory):
    """Tiny Qwen3-MoE BF16 checkpoint (3 shards + index, tokenizer)."""
    return build_demo_model(tmp_path_factory.mktemp("demo") / "qwen3-moe", arch="qwen3-moe")


@pytest.fixture(scope="session")
def demo_dense(tmp_path_factory):
    """Tiny dense Qwen3 BF16 checkpoint."""
    return build_demo_model(tmp_path_factory.mktemp("demo") / "qwen3", arch="qwen3")


# Skips expected on a CPU-only machine (README.md, "Tests": what is skipped on CPU and why). With
# QCONVERT_REQUIRE_ORACLES=1 (set by scripts/test.sh) any other skip fails the test: every oracle
# that can run on CPU (vLLM, FlashInfer, ModelOpt, torchao, compressed-tensors, the CUDA-header
# NVFP4 reference, the C kernels) must run, not vanish with a missing package.
CPU_ONLY_SKIPS = (
    "needs a CUDA GPU",
    "needs two GPUs",
    "needs CUDA",
    "no AVX2 loops on this CPU",
    "cannot mount a tmpfs here",
)


def _refuse_skip(report) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    if os.environ.get("QCONVERT_REQUIRE_ORACLES") != "1":
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(CPU_ONLY_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"skipped ({reason}), but QCONVERT_REQUIRE_ORACLES=1 requires it to run on CPU"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _refuse_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _refuse_skip(outcome.get_result())


def shm_dir(tmp_path):
    """A staging root for a test. With CUDA it lies on /dev/shm: the Refitter registers its mappings
    with cudaHostRegister, which fails for files outside tmpfs (the product's default root is
    /dev/shm/qconvert); without CUDA the test's own tmp_path."""
    import torch

    if not torch.cuda.is_available():
        return tmp_path / "shm"
    from pathlib import Path

    return Path("/dev/shm") / "qconvert-test" / f"{os.getpid()}-{tmp_path.name}"
