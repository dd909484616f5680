"""Client side: code in the user's or trainer's process that talks to running servers (vLLM and
SGLang reload clients, their HTTP layer), stages checkpoints in shared memory and checks reload
compatibility."""
