"""Shared fixtures: the built-in demo models, built once per test session."""

from __future__ import annotations

import importlib.util

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
