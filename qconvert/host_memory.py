"""Page-locking (registering) mapped host memory with CUDA, for both sides of a staging area: the
trainer's slot mappings (``client/staging.py``) and a GPU server's kept mappings
(``engine/vllm_staged.py``). docs/reload.md#kept-mappings says why the mappings are registered.

A refused ``cudaHostRegister`` leaves its error as the calling thread's last CUDA error, and torch
reads that after its next kernel launch in the thread and raises it there, far from the cause;
torch's runtime bindings (``torch.cuda.cudart()``) have no ``cudaGetLastError`` to clear it. So
each call here runs on a short thread of its own, made current on the caller's device (so the
registration belongs to the caller's context, not device 0's), and the error ends with that
thread: the caller gets the error code as a value.
"""

from __future__ import annotations

import threading

#: ``cudaHostRegisterReadOnly`` (CUDA runtime API): page-lock memory the device only reads; refused
#: where the device does not support it (then a writable mapping is registered with flags 0)
READ_ONLY = 0x08


def _on_own_thread(device: int, call) -> int:
    import torch

    got: list = []

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            rc = call(torch.cuda.cudart())
            got.append(int(getattr(rc, "value", rc)))
        except BaseException as e:  # handed to the caller below
            got.append(e)

    t = threading.Thread(target=run, name="qconvert-host-register", daemon=True)
    t.start()
    t.join()
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def register(ptr: int, nbytes: int, flags: int, device: int) -> int:
    """``cudaHostRegister(ptr, nbytes, flags)`` for ``device``'s context; 0 when registered, else
    the CUDA error code (the error state is left behind on a thread that ended)."""
    return _on_own_thread(device, lambda rt: rt.cudaHostRegister(ptr, nbytes, flags))


def unregister(ptr: int, device: int) -> int:
    """``cudaHostUnregister(ptr)`` for ``device``'s context; 0 or the CUDA error code."""
    return _on_own_thread(device, lambda rt: rt.cudaHostUnregister(ptr))
