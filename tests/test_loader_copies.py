"""The loader copies of the loader replay (qconvert/engine/vllm_replay.py, docs/reload.md#loader-copies)
on toy MoE-like modules driven by vLLM's own layerwise reload machinery, without a server: a
replay that makes each module's recorded copies instead of calling its loaders leaves every served
byte as vLLM's layerwise reload of the same staged bytes leaves it (random bytes, NaN payloads
included), batches an expert parameter's copies, falls back to one copy each when the staged
tensors moved, and a module whose loaders do anything but copy staged views into its parameters
keeps its loader calls, with the reason. Against a real vLLM server: tests/test_reload_direct.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_loader_replay import _layerwise, _recorded  # noqa: E402
from test_loader_replay import _replayed as _replay  # noqa: E402

E, N, H = 12, 3, 4  # 12 experts: the names sort experts.0, experts.1, experts.10, experts.11, experts.2 ...
KINDS = {"gate": (N, H), "up": (N, H), "down": (H, N), "gate_s": (N,), "up_s": (N,), "down_s": (H,)}


def _names() -> list[tuple[str, tuple]]:
    """The staged tensors in the order a checkpoint writer that sorts names puts them."""
    got = [(f"moe.experts.{e}.{k}", shape) for e in range(E) for k, shape in KINDS.items()]
    got.append(("dense.w", (H, H)))
    return sorted(got)


class Staged:
    """One buffer of BF16 tensors (random bytes: NaNs with payloads among them), in ``order``."""

    def __init__(self, seed: int, device: str = "cpu", order=None):
        self.order = order or _names()
        g = torch.Generator().manual_seed(seed)
        self.offsets, at = {}, 0
        for name, shape in self.order:
            self.offsets[name] = at
            at += 2 * int(torch.Size(shape).numel())
        self.base = torch.randint(0, 256, (at,), dtype=torch.uint8, generator=g).to(device)

    def __iter__(self):
        for name, shape in self.order:
            o = self.offsets[name]
            yield name, self.base[o : o + 2 * int(torch.Size(shape).numel())].view(torch.bfloat16).reshape(shape)


def _method():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class Keep(QuantizeMethodBase):  # what makes vLLM rebuild the module; the served bytes are the loaded ones
        def create_weights(self, *a, **k):
            pass

        def apply(self, *a, **k):
            pass

        def process_weights_after_loading(self, layer):
            pass

    return Keep()


class Experts(torch.nn.Module):
    """vLLM's FusedMoE parameter shapes: w13 [E, 2N, H] (gate rows then up rows), w2 [E, H, N], and
    a scale per row of each; its loader narrows the expert's shard and copies, as vLLM's does.
    ``how`` makes the loader do something else as well (the refusals)."""

    def __init__(self, how: str = "copy"):
        super().__init__()
        self.quant_method = _method()
        self.how = how
        z = dict(dtype=torch.bfloat16)
        for name, shape in (("w13", (E, 2 * N, H)), ("w2", (E, H, N)), ("s13", (E, 2 * N)), ("s2", (E, H))):
            p = torch.nn.Parameter(torch.zeros(shape, **z), requires_grad=False)
            p.weight_loader = self.weight_loader
            setattr(self, name, p)

    def weight_loader(self, param, loaded_weight, shard_id, expert_id):
        dst = param.data[expert_id]
        if shard_id in ("w1", "w3"):
            rows = dst.shape[0] // 2
            dst = dst.narrow(0, 0 if shard_id == "w1" else rows, rows)
        if self.how == "fill":
            dst.fill_(0)
        if self.how == "computed":
            loaded_weight = loaded_weight * 1
        if self.how == "scratch":
            tmp = torch.empty(loaded_weight.shape, dtype=loaded_weight.dtype, device=loaded_weight.device)
            tmp.copy_(loaded_weight)
            loaded_weight = tmp
        dst.copy_(loaded_weight)
        if self.how == "overlap" and shard_id == "w3":  # also over the gate's last row
            param.data[expert_id][dst.shape[0] - 1].copy_(loaded_weight[0])


class Toy(torch.nn.Module):
    def __init__(self, how: str = "copy"):
        super().__init__()
        from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

        self.moe = Experts(how)
        self.dense = torch.nn.Linear(H, H, bias=False, dtype=torch.bfloat16)
        self.dense.quant_method = _method()
        self.dense.weight.requires_grad_(False)
        self.dense.weight.weight_loader = lambda param, w: param.data.copy_(w)
        record_metadata_for_reloading(self)

    def load_weights(self, weights):
        shard = {"gate": "w1", "up": "w3", "down": "w2"}
        for name, t in weights:
            if name == "dense.w":
                self.dense.weight.weight_loader(self.dense.weight, t)
                continue
            e, kind = name.split(".")[2:]
            p = {"gate": self.moe.w13, "up": self.moe.w13, "down": self.moe.w2}.get(kind)
            if p is None:
                p = self.moe.s2 if kind == "down_s" else self.moe.s13
            p.weight_loader(p, t, shard[kind.removesuffix("_s")], int(e))


def _record(model, staged):
    rec, (plan, why) = _recorded(model, staged)
    return plan, why, rec.copies_refused


def _same_bytes(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param


@torch.no_grad()
def test_copies_leave_what_the_layerwise_reload_leaves(device):
    with torch.device(device):
        model, oracle = Toy(), Toy()
    plan, why, refused = _record(model, Staged(0, device))
    assert why is None and refused == {}
    moe = next(m for m in plan.modules if m.module() is model.moe)
    # the experts' copies batched per shard kind in runs of the staged order (experts 0, 1 | 10, 11
    # | 2 ... 9): three strided copies each for 12 experts, not one copy each
    sizes = {p: sorted(len(b.names) for b in bs) for p, bs in moe.copies.items()}
    assert sizes == {"w13": [2, 2, 2, 2, 8, 8], "s13": [2, 2, 2, 2, 8, 8], "w2": [2, 2, 8], "s2": [2, 2, 8]}, sizes
    gate = min(moe.copies["w13"], key=lambda b: b.dst[2])
    assert gate.names == ("moe.experts.0.gate", "moe.experts.1.gate")
    assert gate.dst[1][0] == 2 * N * H  # a row is one expert of w13
    up = [b for b in moe.copies["w13"] if b.names[0] == "moe.experts.2.up"]
    assert len(up) == 1 and up[0].dst[2] == 2 * 2 * N * H + N * H  # expert 2's up rows, the second half
    _layerwise(oracle, Staged(0, device))
    assert _same_bytes(model, oracle)
    for seed, copies in ((1, True), (2, False), (3, True)):
        assert _replay(model, plan, Staged(seed, device), copies) == (2, 2 if copies else 0)
        _layerwise(oracle, Staged(seed, device))
        assert _same_bytes(model, oracle), (seed, copies)
    # the served experts hold the staged bytes where vLLM's loader put them
    s = dict(Staged(3, device))
    assert torch.equal(model.moe.w13[10, N:].view(torch.int16), s["moe.experts.10.up"].view(torch.int16))
    assert torch.equal(model.moe.s2[11].view(torch.int16), s["moe.experts.11.down_s"].view(torch.int16))


@torch.no_grad()
def test_staged_tensors_elsewhere_are_copied_one_by_one(device):
    """A replay whose staged tensors are not where the recording had them (checked at each batch)
    copies each on its own, to the same places."""
    with torch.device(device):
        model, oracle = Toy(), Toy()
    plan, why, _ = _record(model, Staged(0, device))
    assert why is None
    moved = list(reversed(_names()))
    assert _replay(model, plan, Staged(5, device, moved)) == (2, 2)
    _layerwise(oracle, Staged(5, device, moved))
    assert _same_bytes(model, oracle)


@pytest.mark.parametrize(
    "how, why",
    [
        ("fill", "parameter-written-otherwise"),
        ("overlap", "loader-copies-overlap"),
        ("computed", "staged-tensor-read-otherwise"),
        ("scratch", "staged-tensor-copied-elsewhere"),
    ],
)
@torch.no_grad()
def test_a_module_whose_loaders_do_more_keeps_its_calls(how, why):
    model, oracle = Toy(how), Toy(how)
    plan, got, refused = _record(model, Staged(0))
    assert got is None and refused == {why: 1}
    moe = next(m for m in plan.modules if m.module() is model.moe)
    assert moe.copies is None
    # the dense layer still copies; the experts replay vLLM's loader calls, to the same bytes
    assert _replay(model, plan, Staged(1)) == (2, 1)
    _layerwise(oracle, Staged(1))
    assert _same_bytes(model, oracle)
