"""Kernel-ready expert layouts. ``trtllm``: FlashInfer TRT-LLM MoE (vLLM, SGLang)."""
