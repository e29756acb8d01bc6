"""Models: the tiny Qwen2-architecture base and its training, the policy and critic wrappers (``rl``), the reward-like
critic, GGUF import and the shipped models."""
