"""The OpenAI-compatible server (``manylora serve``), shaped like vLLM's."""
