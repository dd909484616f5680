"""The direct reload's copy plan (qconvert/engine/vllm_direct.py, docs/reload.md#vllm-direct-load)
on a toy load, without a server: the replayed plan writes what the load itself writes, and every
recording the plan must not be kept from is refused with its reason. The plan against a real vLLM
server (replayed loads equal a fresh server) is tests/test_reload_direct.py."""

from __future__ import annotations

import pytest
import torch

from qconvert.engine.vllm_direct import CopyPlan, record_plan

SHAPES = {"a": (2, 8), "b": (8, 2), "n": (8,), "x": (3,)}


class Staged:
    """What vllm_staged.StagedTensors gives the direct load: one 'file' (a byte buffer) holding
    BF16 tensors back to back; views of it by name, the file's whole view, the file of a name."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.offsets, at = {}, 0
        for name, shape in SHAPES.items():
            self.offsets[name] = at
            at += 2 * int(torch.tensor(shape).prod())
        self.base = (torch.randn(at // 2, generator=g) * 10).to(torch.bfloat16).view(torch.uint8)
        self.layout = tuple((n, s, self.offsets[n]) for n, s in SHAPES.items())

    def tensor(self, name):
        o, n = self.offsets[name], 2 * int(torch.tensor(SHAPES[name]).prod())
        return self.base[o : o + n].view(torch.bfloat16).reshape(SHAPES[name])

    def __iter__(self):
        return self.others(())

    def others(self, skip):
        return ((n, self.tensor(n)) for n in SHAPES if n not in skip)

    def whole(self, file, dtype):
        return self.base.view(dtype)

    def file_of(self, name):
        return "f"


def _served():
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16), requires_grad=False)
    m.norm = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)
    other = torch.zeros(3, dtype=torch.bfloat16)  # a layerwise module's fresh tensor: not served
    return m, [(m, "w", m.w), (m, "norm", m.norm)], other


def _loader(m, other, extra=None):
    """A weight loader in vLLM's manner: slices of the destination, a transposed source, a
    narrowed source; ``extra(name, t)`` adds one thing a plan must refuse."""

    def load(weights):
        for name, t in weights:
            if name == "a":
                m.w.data[0:2].copy_(t)
            elif name == "b":
                m.w.data[2:4].copy_(t.t().narrow(0, 0, 2))
            elif name == "n":
                m.norm.data.copy_(t)
            else:
                other.copy_(t)
            if extra is not None:
                extra(m, name, t)

    return load


@torch.no_grad()
def test_replayed_plan_writes_what_the_load_writes():
    m, served, other = _served()
    plan, why = record_plan(served, Staged(0), _loader(m, other), key=("k",))
    assert why is None and isinstance(plan, CopyPlan)
    assert sorted(plan.copies) == ["a", "b", "n"]  # x went elsewhere: loaded by the load itself
    staged = Staged(1)
    want_m, _, want_other = _served()
    _loader(want_m, want_other)(iter(staged))  # the oracle: the load itself on the new bytes
    assert plan.replay(staged) == 3
    _loader(m, other)(staged.others(plan.copies))
    assert torch.equal(m.w, want_m.w) and torch.equal(m.norm, want_m.norm) and torch.equal(other, want_other)
    assert not torch.equal(m.w[2:4], torch.zeros(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "extra, why",
    [
        (lambda m, n, t: m.w.data.add_(1) if n == "a" else None, "direct-write-by-aten.add_.Tensor"),
        (lambda m, n, t: m.norm.data.copy_(t.clone()) if n == "n" else None, "direct-write-not-a-staged-copy"),
        (lambda m, n, t: float(t.float().sum()) if n == "a" else None, "staged-tensor-copied-and-used-otherwise"),
    ],
    ids=["in-place-op", "copy-of-a-copy", "read-otherwise"],
)
@torch.no_grad()
def test_recording_refused(extra, why):
    m, served, other = _served()
    plan, got = record_plan(served, Staged(0), _loader(m, other, extra), key=("k",))
    assert plan is None and got == why


def test_direct_load_is_cpu_only(monkeypatch):
    """A model whose parameters are not on the CPU (a GPU server) reloads every module layerwise,
    decided before any vLLM-version-specific form check runs (docs/reload.md#vllm-direct-load);
    with the loader replay on, the default, see the next test."""
    from qconvert.engine.vllm_direct import GPU_REPLAY_ENV, Why, choose

    on_meta = torch.nn.Linear(4, 4, device="meta")
    monkeypatch.setenv(GPU_REPLAY_ENV, "0")
    assert choose(on_meta, enabled=True, layout=None) == (None, Why.NOT_CPU)
    assert choose(on_meta, enabled=False, layout=None) == (None, Why.DISABLED)


def test_gpu_server_replays_the_loader_calls_unless_turned_off(monkeypatch):
    """By default (and with QCONVERT_GPU_LOADER_REPLAY=1) a GPU server's load takes the direct load
    for the loader replay alone: every module layerwise (docs/reload.md#loader-replay); ``0``
    turns it off."""
    from qconvert.engine.vllm_direct import GPU_REPLAY_ENV, Form, Why, choose

    on_meta = torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta"), torch.nn.ReLU())
    every_module_layerwise = ({on_meta[0]: (Form.LAYERWISE, Why.NOT_CPU)}, None)
    monkeypatch.delenv(GPU_REPLAY_ENV, raising=False)
    assert choose(on_meta, enabled=True, layout=None) == every_module_layerwise
    assert choose(on_meta, enabled=False, layout=None) == (None, Why.DISABLED)
    monkeypatch.setenv(GPU_REPLAY_ENV, "1")
    assert choose(on_meta, enabled=True, layout=None) == every_module_layerwise
    assert choose(on_meta, enabled=True, layout={"x": 1}) == (None, Why.PRESHUFFLED)
    monkeypatch.setenv(GPU_REPLAY_ENV, "0")
    assert choose(on_meta, enabled=True, layout=None) == (None, Why.NOT_CPU)


def test_direct_forms_named_by_the_server_environment(monkeypatch):
    """QCONVERT_DIRECT_RELOAD: unset or 1 takes every direct form, a comma-separated list only
    those (the others reload layerwise), an unknown name is one line naming it and the choices
    (docs/reload.md#vllm-direct-load)."""
    from qconvert.engine.vllm_direct import DIRECT_ENV, Form, direct_enabled, enabled_forms, parse_forms

    monkeypatch.delenv(DIRECT_ENV, raising=False)
    assert enabled_forms() is None and direct_enabled()
    monkeypatch.setenv(DIRECT_ENV, " cpu-moe, cpu-nvfp4-moe ")
    assert enabled_forms() == {Form.CPU_MOE, Form.CPU_NVFP4_MOE} and direct_enabled()
    monkeypatch.setenv(DIRECT_ENV, "0")
    assert not direct_enabled()
    monkeypatch.setenv(DIRECT_ENV, "cpu-moe,layerwise")
    with pytest.raises(ValueError, match=r"^QCONVERT_DIRECT_RELOAD=cpu-moe,layerwise: unknown direct-load form "):
        enabled_forms()
    assert parse_forms([]) == frozenset()
    msg = str(pytest.raises(ValueError, parse_forms, ["cpu-mxfp8"]).value)
    assert "\n" not in msg and "'cpu-mxfp8'" in msg and "cpu-mxfp8-moe" in msg
