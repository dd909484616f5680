"""The CPU pipeline runs small jobs on job threads and large ones on the calling thread; every mix
gives the same output files, and a failing job still fails the conversion with its message."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from qconvert.convert import jobs, kernels
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions
from qconvert.convert.safetensors_io import ShardWriter
from qconvert.errors import CheckpointError

READ_BACK = ShardWriter.read_back


def digests(d: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name != "qconvert.json"
    }


def run(src, dst, scheme, monkeypatch, small_bytes, workers, streams=1) -> dict[str, str]:
    monkeypatch.setattr(kernels, "SMALL_JOB_BYTES", small_bytes)
    monkeypatch.setattr(kernels, "CPU_WORKERS", workers)
    monkeypatch.setattr(kernels, "READ_STREAMS", streams)

    def read_back(self, name, chunk=0):  # the writer reads a tensor back only if it came early
        raise AssertionError(f"{self.path}: {name} reached the writer out of order")

    # one input shard at a time: outputs reach the writer in file order
    monkeypatch.setattr(ShardWriter, "read_back", read_back if streams == 1 else READ_BACK)
    convert(
        str(src),
        dst,
        scheme,
        ConvertOptions(scheme=scheme, plan=PlanOptions(scheme=scheme, last_n_bf16=1), progress=False, fsync=False),
    )
    man = json.loads((dst / "qconvert.json").read_text())
    assert man["outputs"]["sha256"] == {k: v for k, v in digests(dst).items() if k.endswith(".safetensors")}
    return digests(dst)


@pytest.mark.parametrize("scheme", ["mxfp8", "nvfp4"])
def test_every_mix_of_job_threads_writes_the_same_bytes(demo_moe, tmp_path, monkeypatch, scheme):
    base = run(demo_moe, tmp_path / "one", scheme, monkeypatch, 1 << 40, 1)  # no job threads at all
    # demo tensors: experts 64 KB, attention 128 KB, embeddings 256 KB; 100 KB mixes both paths
    for i, (small, workers) in enumerate([(1 << 40, 2), (0, 2), (1 << 40, 3), (100_000, 3), (100_000, 2)]):
        assert run(demo_moe, tmp_path / f"mix{i}", scheme, monkeypatch, small, workers) == base, (small, workers)
    # input shards read side by side (demo_moe has 3), with and without job threads
    for i, (small, workers, streams) in enumerate([(1 << 40, 2, 2), (1 << 40, 2, 3), (0, 1, 3), (100_000, 3, 4)]):
        got = run(demo_moe, tmp_path / f"streams{i}", scheme, monkeypatch, small, workers, streams)
        assert got == base, (small, workers, streams)


def test_a_failing_job_on_a_job_thread_fails_the_conversion(demo_moe, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "CPU_WORKERS", 2)
    real = jobs.mxfp8_job

    def job(tp, *a, **k):
        j = real(tp, *a, **k)
        if tp.name.endswith("layers.1.mlp.experts.3.up_proj.weight"):

            def boom(src):
                raise CheckpointError(f"tensor {tp.name!r}: injected failure")

            j.fn = boom
        return j

    monkeypatch.setattr(jobs, "mxfp8_job", job)
    dst = tmp_path / "never"
    with pytest.raises(CheckpointError, match="experts.3.up_proj.weight'.*injected failure"):
        convert(str(demo_moe), dst, "mxfp8", ConvertOptions(progress=False, fsync=False))
    assert not dst.exists()


def test_a_full_read_budget_does_not_stall_job_threads(demo_moe, tmp_path, monkeypatch):
    """With the read-ahead budget full the reader waits for the writer, which waits for the calling
    thread to hand it finished jobs: a job thread finishing must wake the calling thread. (It once
    did not, and a conversion hung for good once the budget filled.)"""
    import threading
    import time

    monkeypatch.setattr(kernels, "CPU_WORKERS", 2)
    monkeypatch.setattr(kernels, "SMALL_JOB_BYTES", 1 << 40)
    real = jobs.mxfp8_job

    def job(*a, **k):  # slow enough that no job is finished when its submitter first looks
        j = real(*a, **k)
        fn = j.fn
        j.fn = lambda src: (time.sleep(0.02), fn(src))[1]
        return j

    monkeypatch.setattr(jobs, "mxfp8_job", job)
    dst = tmp_path / "q"
    out: list = []
    t = threading.Thread(
        target=lambda: out.append(
            convert(str(demo_moe), dst, "mxfp8", ConvertOptions(progress=False, fsync=False, queue_bytes=1))
        ),
        daemon=True,
    )
    t.start()
    t.join(60)
    assert not t.is_alive(), "conversion stalled with the read budget full"
    assert out and out[0].n_quantized > 0
    ref = tmp_path / "ref"
    monkeypatch.setattr(jobs, "mxfp8_job", real)
    convert(str(demo_moe), ref, "mxfp8", ConvertOptions(progress=False, fsync=False))
    assert digests(dst) == digests(ref)
