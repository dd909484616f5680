"""Tied embeddings in a real vLLM (CPU build, qconvert's plugin): the output head is the input
embedding (``tie_word_embeddings: true``, no ``lm_head.weight``), as in Llama 3.2 1B/3B, Qwen3
0.6B-4B, SmolLM and Gemma. vLLM still builds an ``lm_head`` module from the config and takes its
quantization from the exclusion list, then ties its weight to the BF16 embedding: with ``lm_head``
missing from the list MXFP8 served garbage and ModelOpt NVFP4 did not start (``NVFP4 weight_scale
for layer 'parallel_lm_head' was never loaded``).

Every weights-only format must give logprobs equal to a BF16 checkpoint of qconvert's dequantized
weights (the same comparison as tests/test_vllm_cpu_plugin.py, on qconvert's ``llama-tied`` demo).
"""

from __future__ import annotations

import pytest
from test_vllm_cpu_plugin import MAX_TOKENS, PROMPTS, _all_finite, convert_with_qconvert, make_dequantized

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

KEYS = ["auto", "mo_last1", "nv_a16", "ct_a16"]  # MXFP8 auto / ModelOpt, NVFP4 ModelOpt / compressed-tensors


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    from qconvert.convert.demo import build_demo_model
    from qconvert.engine.vllm_compare import run_in_vllm

    root = tmp_path_factory.mktemp("tied")
    src = build_demo_model(root / "bf16", arch="llama-tied", seed=0)
    assert not any("lm_head" in p.name for p in src.iterdir())
    ck = {k: convert_with_qconvert(src, root / k, k) for k in KEYS}
    dq = {k: make_dequantized(ck[k], root / ("dq_" + k)) for k in KEYS}
    jobs = [{"model": src}] + [{"model": dq[k]} for k in KEYS] + [{"model": ck[k], "inspect": True} for k in KEYS]
    res = run_in_vllm(jobs, PROMPTS, MAX_TOKENS, top_k=20, score_with_first=True)["jobs"]
    n = len(KEYS)
    return {"src": res[0], "dq": dict(zip(KEYS, res[1 : 1 + n])), "q": dict(zip(KEYS, res[1 + n :]))}


@pytest.mark.parametrize("key", KEYS)
def test_tied_head_equals_bf16_of_dequantized_weights(tied, key):
    from qconvert.engine.vllm_compare import compare_logprobs

    q, ref = tied["q"][key], tied["dq"][key]
    st, st_ref = q["stages"][0], ref["stages"][0]
    # finite first: compare_logprobs' max() passes over NaN logprobs (the old garbage head gave
    # NaN scores, token 0 everywhere and a max difference of 0.0)
    assert _all_finite(st_ref) and _all_finite(st), key
    m = compare_logprobs(st_ref["score"], st["score"])
    assert m["max_abs_logprob_diff"] == 0.0 and m["top1_agreement"] == 1.0, (key, m)
    assert st["tokens"] == st_ref["tokens"], key
    # and the quantized model is close to its BF16 source (garbage is not)
    assert compare_logprobs(tied["src"]["stages"][0]["score"], st["score"])["mean_kl"] < 0.5, key
    assert q["layers"]["lm_head"] in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"), key
    assert q["layers"]["model.layers.0.self_attn.qkv_proj"] != "UnquantizedLinearMethod", key
