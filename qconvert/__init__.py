"""qconvert: BF16 Hugging Face checkpoints to MXFP8 / NVFP4 / mixed checkpoints for vLLM and SGLang."""

__version__ = "0.1.0"
