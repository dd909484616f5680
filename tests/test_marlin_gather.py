"""The Marlin gather (qconvert/engine/vllm_marlin.py, docs/reload.md#marlin-gather) against vLLM's own
``prepare_mxfp8_moe_layer_for_marlin``: the gathered tensors equal vLLM's byte for byte on random and
adversarial bytes, the shapes and dtypes where vLLM's function is no byte permutation are left to it,
and a gather that stops agreeing with vLLM on the first expert is dropped.

On CPU, vLLM's CUDA-only ``gptq_marlin_repack`` op is replaced by vLLM's own Python form of the same
repack (``marlin_weights`` in vLLM's Marlin test utilities); on a GPU the real op runs. Against a real
GPU server (every served tensor's digest equal with and without the gather): scripts/gpu_vllm_check.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from qconvert.engine import vllm_marlin  # noqa: E402


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param


@pytest.fixture
def vllm_fn(device, monkeypatch):
    """vLLM's function, its repack op vLLM's Python reference where the CUDA op is absent."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as m8

    if device == "cpu" or not hasattr(torch.ops._C, "gptq_marlin_repack"):
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights

        def repack(b_q_weight, size_k, size_n, num_bits, **_):
            # GPTQ packing: four consecutive k rows of one column in one int32, lowest byte first
            q = b_q_weight.view(torch.uint8).reshape(size_k // 4, size_n, 4).permute(0, 2, 1)
            q = q.reshape(size_k, size_n).to(torch.int64).cpu()
            return marlin_weights(q, size_k, size_n, num_bits, get_weight_perm(num_bits)).to(b_q_weight.device)

        monkeypatch.setattr(ops, "gptq_marlin_repack", repack)
    return m8.prepare_mxfp8_moe_layer_for_marlin


def _inputs(e: int, n: int, k: int, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        flat = b.view(-1)
        flat[:256] = torch.arange(256, dtype=torch.uint8)  # every byte value, NaN scales (0xFF) included
        flat[-64:] = 0
        return b.to(device)

    w13 = rnd(e, 2 * n, k).view(torch.float8_e4m3fn)
    w2 = rnd(e, k, n).view(torch.float8_e4m3fn)
    s13 = rnd(e, 2 * n, k // 32)
    s2 = rnd(e, k, n // 32)
    s2[-1] = 0xFF  # a whole expert of NaN scales
    return w13, w2, s13, s2


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _same_bytes(got, want) -> list[bool]:
    """Byte for byte, dtype and shape: a value comparison would call two NaN scales different."""
    return [a.dtype == b.dtype and a.shape == b.shape and torch.equal(_raw(a), _raw(b)) for a, b in zip(got, want)]


@pytest.fixture
def bf16_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the model dtype, as in vLLM's worker
    yield
    torch.set_default_dtype(old)


def test_gather_equals_vllm_byte_for_byte(vllm_fn, device, bf16_default):
    g = vllm_marlin.MarlinGather()
    fast = g.wrap(vllm_fn)
    for seed in (0, 1):
        ins = _inputs(6, 128, 256, device, seed)
        want = vllm_fn(torch.nn.Module(), *ins)
        got = fast(torch.nn.Module(), *ins)
        assert _same_bytes(got, want) == [True] * 4
    # learnt once, gathered twice; the second shape is learnt on its own
    assert g.summary() == {"gathered": 2, "vllm": 0, "learned": 1, "mismatch": 0}
    ins = _inputs(3, 64, 512, device, 2)
    assert _same_bytes(fast(torch.nn.Module(), *ins), vllm_fn(torch.nn.Module(), *ins)) == [True] * 4
    assert g.summary()["learned"] == 2 and len(g.plans) == 2


def test_vllm_side_effects_on_the_layer_stay(vllm_fn, device, bf16_default):
    """Whatever vLLM's function sets on the layer (0.26.0: a Marlin workspace) it still sets."""
    seen = {}

    def with_effect(layer, *ins):
        layer.calls = getattr(layer, "calls", 0) + 1
        seen["experts"] = ins[0].shape[0]
        return vllm_fn(layer, *ins)

    g = vllm_marlin.MarlinGather()
    layer = torch.nn.Module()
    g.wrap(with_effect)(layer, *_inputs(4, 64, 256, device, 3))
    assert g.summary()["gathered"] == 1
    assert layer.calls >= 1 and seen["experts"] == 1  # the last call: vLLM's on the first expert


def test_padded_shape_is_left_to_vllm(vllm_fn, device, bf16_default):
    # an intermediate size of 96 is no Marlin tile: vLLM pads it, so its bytes are no permutation
    ins = _inputs(4, 96, 256, device, 4)
    g = vllm_marlin.MarlinGather()
    got = g.wrap(vllm_fn)(torch.nn.Module(), *ins)
    assert _same_bytes(got, vllm_fn(torch.nn.Module(), *ins)) == [True] * 4
    assert g.summary() == {"gathered": 0, "vllm": 1, "learned": 0, "mismatch": 0, "refused": ["size:0"]}


def test_fp16_model_is_left_to_vllm(vllm_fn, device):
    """With FP16 as the default dtype vLLM's scale path rounds E8M0 through FP16: not a byte permutation."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        ins = _inputs(4, 64, 256, device, 5)
        g = vllm_marlin.MarlinGather()
        got = g.wrap(vllm_fn)(torch.nn.Module(), *ins)
        assert _same_bytes(got, vllm_fn(torch.nn.Module(), *ins)) == [True] * 4
    finally:
        torch.set_default_dtype(old)
    s = g.summary()
    assert (s["gathered"], s["vllm"]) == (0, 1)
    assert s["refused"][0].split(":")[0] in ("range", "bijection", "check")


def test_a_gather_that_stops_agreeing_is_dropped():
    """The first expert is vLLM's own every call: a function that changes after learning is caught."""
    state = {"shift": 0}

    def fn(layer, *ins):
        return tuple(t.flip(-1).roll(state["shift"], -1) for t in ins)

    ins = tuple(torch.randint(0, 256, (3, 4, 8), dtype=torch.uint8) for _ in range(4))
    g = vllm_marlin.MarlinGather()
    fast = g.wrap(fn)
    assert [torch.equal(a, b) for a, b in zip(fast(None, *ins), fn(None, *ins))] == [True] * 4
    state["shift"] = 1
    assert [torch.equal(a, b) for a, b in zip(fast(None, *ins), fn(None, *ins))] == [True] * 4
    assert g.summary() == {"gathered": 1, "vllm": 0, "learned": 1, "mismatch": 1, "refused": ["mismatch"]}
    fast(None, *ins)  # the dropped plan is not tried again
    assert g.summary()["vllm"] == 1


@pytest.mark.parametrize(
    "fn, why",
    [
        (lambda layer, t: (t.repeat(1, 2),), "size:0"),  # more bytes out than in
        (lambda layer, t: (torch.cat([t[:, :1], t[:, :-1]], 1),), "bijection:0"),  # one byte twice
        (lambda layer, t: (t * 0,), "range:0"),  # bytes from no input byte
    ],
)
def test_learner_refuses_what_is_no_permutation(fn, why):
    perms, got = vllm_marlin.learn_permutations(lambda *a: fn(None, *a), [torch.empty(1, 300, dtype=torch.uint8)])
    assert perms is None and got == why


def test_patched_replaces_and_restores_vllms_function():
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as m8

    original = m8.prepare_mxfp8_moe_layer_for_marlin
    with pytest.raises(RuntimeError), vllm_marlin.patched() as g:
        assert g is vllm_marlin.GATHER
        assert m8.prepare_mxfp8_moe_layer_for_marlin.__wrapped__ is original
        with vllm_marlin.patched() as inner:  # never wrapped twice
            assert inner is None
        raise RuntimeError
    assert m8.prepare_mxfp8_moe_layer_for_marlin is original


def test_a_function_that_refuses_a_probe_is_left_alone():
    """Where vLLM's function raises while learning (never on its own inputs here), each call is vLLM's."""
    ins = tuple(torch.randint(0, 256, (3, 4, 8), dtype=torch.uint8) for _ in range(4))

    def fn(layer, *xs):
        if xs[0].shape[0] == 1:
            raise ValueError("one expert")
        return tuple(x.flip(-1) for x in xs)

    g = vllm_marlin.MarlinGather()
    got = g.wrap(fn)(None, *ins)
    assert [torch.equal(a, b) for a, b in zip(got, fn(None, *ins))] == [True] * 4
    assert g.summary() == {"gathered": 0, "vllm": 1, "learned": 0, "mismatch": 0, "refused": ["error:ValueError"]}


def test_indices_are_int32():
    perms, why = vllm_marlin.learn_permutations(lambda t: (t.flip(-1),), [torch.empty(1, 300, dtype=torch.uint8)])
    assert why is None and perms[0].dtype == torch.int32
    assert perms[0].tolist() == list(range(299, -1, -1))
