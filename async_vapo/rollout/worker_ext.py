"""Methods added to every vLLM worker (``worker_extension_cls``): in-place weight loading.

The learner writes a version's weights to a safetensors file (on /dev/shm when it exists, so the bytes
never touch a disk) and each worker loads them into the running model with vLLM's own
``reload_weights`` path — the engine, its KV cache and its scheduler are not restarted.
"""

from __future__ import annotations


class WeightSyncExtension:
    def async_vapo_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]
        return len(state)

