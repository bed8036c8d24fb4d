"""Where streamed weights go: a module in this process, rollout processes, vLLM, SGLang."""
