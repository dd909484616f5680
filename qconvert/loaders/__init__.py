"""Engine-side code: vLLM/SGLang reload clients, shared-memory staging, engine plugins (vLLM CPU emulation plugin, vLLM comparison runner)."""
