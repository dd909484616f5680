"""The loader replay (qconvert/engine/vllm_replay.py, docs/reload.md#loader-replay) on a toy model
driven by vLLM's own layerwise reload machinery, without a server: a replayed load leaves the
served tensors exactly as vLLM's layerwise reload of the same bytes leaves them, and each recording
a plan must not be kept from is refused with its reason. Against a real vLLM server (every served
tensor's digest equal to vLLM's layerwise reload of the same area): tests/test_reload_direct.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from qconvert.engine import vllm_replay  # noqa: E402

SHAPES = {"l0.q": (2, 8), "l0.k": (8, 2), "l1.w": (4, 8), "l1.s": (4,)}


class Staged:
    """One 'file' of BF16 tensors back to back; (name, view) in file order."""

    def __init__(self, seed: int, device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.offsets, at = {}, 0
        for name, shape in SHAPES.items():
            self.offsets[name] = at
            at += 2 * int(shape[0] * (shape[1] if len(shape) > 1 else 1))
        # on CUDA: as a GPU server's device chunks (docs/reload.md#vllm-staged-load)
        self.base = (torch.randn(at // 2, generator=g) * 10).to(torch.bfloat16).view(torch.uint8).to(device)

    def __iter__(self):
        for name, shape in SHAPES.items():
            o = self.offsets[name]
            n = 2 * int(shape[0] * (shape[1] if len(shape) > 1 else 1))
            yield name, self.base[o : o + n].view(torch.bfloat16).reshape(shape)


class Scaled(torch.nn.Module):
    """A module whose quant method transforms what is loaded (what makes vLLM rebuild it)."""

    def __init__(self, fused: bool):
        super().__init__()
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        class Double(QuantizeMethodBase):  # the served weight is twice the loaded one
            def create_weights(self, *a, **k):
                pass

            def apply(self, *a, **k):
                pass

            def process_weights_after_loading(self, layer):
                layer.weight.data.mul_(2)

        self.quant_method = Double()
        self.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16), requires_grad=False)
        if fused:  # q rows 0:2 as they are, k transposed into rows 2:4: a loader with a shard id
            self.weight.weight_loader = self._fused_loader
        else:
            self.scale = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)

    @staticmethod
    def _fused_loader(param, loaded_weight, shard_id):
        shard_id = getattr(shard_id, "value", shard_id)
        rows = {"q": (0, 2), "k": (2, 4)}[shard_id]
        src = loaded_weight if shard_id == "q" else loaded_weight.t()
        param.data[rows[0] : rows[1]].copy_(src)


class Toy(torch.nn.Module):
    def __init__(self, mangle=None, shard=str):
        super().__init__()
        from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

        self.l0, self.l1 = Scaled(fused=True), Scaled(fused=False)
        self.mangle, self.shard = mangle, shard
        record_metadata_for_reloading(self)  # as vLLM does once the model is built

    def load_weights(self, weights):
        for name, t in weights:
            if self.mangle is not None:
                t = self.mangle(name, t)
            if name.startswith("l0."):
                p = self.l0.weight
                p.weight_loader(p, t, self.shard(name[-1]))
            else:
                p = self.l1.weight if name == "l1.w" else self.l1.scale
                p.weight_loader(p, t)


def _layerwise(model, weights) -> None:
    """vLLM's layerwise reload (what ``reload_weights`` runs), the oracle."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    finalize_layerwise_reload(model, None)


def _recorded(model, staged):
    """One recording load of ``staged`` into ``model``: the recorder and the plan it gives
    (plan, why) (tests/test_loader_copies.py uses it too)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    with vllm_replay.recording(model) as rec:
        initialize_layerwise_reload(model)
        model.load_weights(rec.watch(iter(staged)))
        pending = rec.pending(model)
        finalize_layerwise_reload(model, None)
    return rec, rec.plan(("k",), pending, set())


def _record(model, staged):
    return _recorded(model, staged)[1]


def _replayed(model, plan, staged, copies=True) -> tuple[int, int]:
    """One replayed load: (modules replayed, of them by their copies)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    others, n, copied = plan.replay(iter(staged), copies)
    model.load_weights(others)
    finalize_layerwise_reload(model, None)
    return n, copied


def _replay(model, plan, staged) -> int:
    return _replayed(model, plan, staged)[0]


def _served(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param


@torch.no_grad()
def test_replay_leaves_what_the_layerwise_reload_leaves(device):
    with torch.device(device):  # vLLM builds (and so materializes) the model under its device
        model, oracle = Toy(), Toy()
    plan, why = _record(model, Staged(0, device))
    assert why is None and [len(m.calls) for m in plan.modules] == [2, 2]
    assert all(c.order is not None for m in plan.modules for c in m.calls)  # replayed by the fast binding
    _layerwise(oracle, iter(Staged(0, device)))
    assert _served(model).keys() == _served(oracle).keys()
    for seed in (1, 2):  # each replay loads new bytes: equal to vLLM's own reload of them
        assert _replay(model, plan, Staged(seed, device)) == 2
        _layerwise(oracle, iter(Staged(seed, device)))
        got, want = _served(model), _served(oracle)
        assert all(torch.equal(got[k], want[k]) for k in want), seed
        assert model.l1.weight.device.type == device
    # the served tensors are the ones vLLM processed: weights twice the loaded bytes, k transposed
    s = dict(Staged(2, device))
    assert torch.equal(model.l0.weight[2:4], s["l0.k"].t() * 2) and torch.equal(model.l1.weight, s["l1.w"] * 2)
    assert torch.equal(model.l1.scale, s["l1.s"])


class Shard:
    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize(
    "mangle, shard, why",
    [
        (lambda n, t: t.clone() if n == "l1.w" else t, str, "loader-argument-not-a-staged-view"),
        (lambda n, t: t * 1 if n == "l0.k" else t, str, "loader-argument-not-a-staged-view"),
        (None, Shard, "loader-argument-not-plain"),
    ],
    ids=["a-copy", "computed", "an-object-argument"],
)
@torch.no_grad()
def test_recording_refused(mangle, shard, why):
    model = Toy(mangle, shard)
    plan, got = _record(model, Staged(0))
    assert plan is None and got == why


@torch.no_grad()
def test_a_tensor_read_by_two_modules_or_elsewhere_gives_no_plan():
    model = Toy()

    def twice(weights):
        for name, t in weights:
            if name == "l0.q":  # the same staged tensor also gives l1's scale (its own is skipped)
                model.l1.scale.weight_loader(model.l1.scale, t[0, :4])
            if name != "l1.s":
                Toy.load_weights(model, [(name, t)])

    model.load_weights = twice
    plan, why = _record(model, Staged(0))
    assert plan is None and why == "staged-tensor-read-by-two-modules"
    model = Toy()
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    with vllm_replay.recording(model) as rec:
        initialize_layerwise_reload(model)
        model.load_weights(rec.watch(iter(Staged(0))))
        pending = rec.pending(model)
        finalize_layerwise_reload(model, None)
    plan, why = rec.plan(("k",), pending, {"l1.s"})  # copied into a direct module as well
    assert plan is None and why == "staged-tensor-also-used-otherwise"


class StagedArea(Staged):
    """What vllm_staged.StagedTensors gives the direct load: a layout (the plan's key) and others()."""

    layout = ("toy", tuple(SHAPES.items()))

    def others(self, skip):
        return ((n, t) for n, t in self if n not in skip)


@torch.no_grad()
def test_direct_load_without_direct_modules_replays(device):
    """The GPU server's form of the direct load (every module layerwise, docs/reload.md#loader-replay):
    the first load records the loader calls without a dispatch mode, the next ones replay them and
    leave what vLLM's layerwise reload leaves."""
    from qconvert.engine.vllm_direct import Form, Why, load_direct

    with torch.device(device):
        model, oracle = Toy(), Toy()
    forms = {model.l0: (Form.LAYERWISE, Why.NOT_CPU), model.l1: (Form.LAYERWISE, Why.NOT_CPU)}
    outcomes = []
    for seed in (0, 1, 2):
        st = load_direct(model, None, StagedArea(seed, device), forms)
        outcomes.append((st["plan"], st["replay"], st["replayed-modules"]))
        _layerwise(oracle, iter(Staged(seed, device)))
        got, want = _served(model), _served(oracle)
        assert all(torch.equal(got[k], want[k]) for k in want), seed
    assert outcomes == [("recorded", "recorded", 0), ("replayed", "replayed", 2), ("replayed", "replayed", 2)]


def _loader_a(param, loaded_weight, shard_id=None, *, expert_id=0, return_success=False):
    pass


def _loader_b(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
    pass


def _loader_var(param, loaded_weight, *rest, **extra):
    pass


@pytest.mark.parametrize(
    "loader, bound",
    [
        (_loader_a, {"loaded_weight": 1, "shard_id": "w1", "expert_id": 3}),
        (_loader_a, {"loaded_weight": 1, "expert_id": 3}),  # shard_id left to its default: expert_id by keyword
        (_loader_a, {"loaded_weight": 1, "return_success": True}),
        (_loader_b, {"loaded_weight": 1, "weight_name": "w", "shard_id": "w3", "expert_id": 7}),
        (_loader_b, {"loaded_weight": 1, "weight_name": "w", "shard_id": "w2", "expert_id": 0, "return_success": True}),
    ],
)
def test_replayed_arguments_are_what_inspect_gives(loader, bound):
    """A replayed call's ``args``/``kwargs``, in an order computed once, equal inspect's own for the same binding."""
    import inspect

    sig = inspect.signature(loader)
    order = vllm_replay.arg_order(sig, ["param", *bound])
    assert order is not None
    call = vllm_replay.Call("w", sig, tuple(bound.items()), (), order)
    fast = call.bind({})
    want = inspect.BoundArguments(sig, dict(bound))
    # as vLLM does: the parameter set after binding, then the call
    fast.arguments["param"] = want.arguments["param"] = "Q"
    assert type(fast) is not inspect.BoundArguments  # the order computed once, not inspect's walk
    assert (fast.args, fast.kwargs) == (want.args, want.kwargs)


def test_var_arguments_keep_inspects_properties():
    import inspect

    sig = inspect.signature(_loader_var)
    assert vllm_replay.arg_order(sig, ["param", "loaded_weight", "rest"]) is None
    assert vllm_replay.arg_order(sig, ["param", "loaded_weight"]) == (("param", "loaded_weight"), ())
