"""Generation: the vLLM engine, version-tagged samples, in-place weight loading."""
