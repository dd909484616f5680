"""Engine side: modules imported INSIDE vLLM / SGLang processes (the worker extension, the
pre-shuffled loader and stock-loader guard, the vLLM CPU emulation plugin, the vLLM comparison
worker). This file holds only what the client side needs to name them; it imports nothing."""

#: the class vLLM servers are started with (``--worker-extension-cls``)
WORKER_EXTENSION = "qconvert.engine.vllm_worker.WorkerExtension"
EXTENSION_FLAG = f"--worker-extension-cls {WORKER_EXTENSION}"
#: the worker-extension method that loads a pre-shuffled checkpoint (``collective_rpc``)
PRESHUFFLED_RPC = "qconvert_load_preshuffled"
#: the worker-extension method that loads a shared-memory staging area in place (``collective_rpc``)
STAGED_RPC = "qconvert_load_staged"
