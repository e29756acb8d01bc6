"""Methods added to every vLLM worker (``worker_extension_cls``): in-place weight loading.

Two ways in, both ending in vLLM's own ``reload_weights`` (the engine, its KV cache and its scheduler
are not restarted):

* ``async_vapo_load_weights(path)``: a safetensors file (on /dev/shm when it exists, so the bytes never
  touch a disk). The cluster's learner broadcasts files like this to every rollout service.
* ``async_vapo_load_shared(path, nbytes, layout)``: one flat buffer in a shared-memory file that the
  engine's owner writes in place, a tensor at each ``(name, dtype, shape, offset)`` of ``layout``. The
  worker maps the file once and hands ``reload_weights`` tensors that are views of the mapping: no
  header to parse, no copy before vLLM's own, and after the first push no page to fault in on either
  side. The owner may unlink the file after the first load: the worker keeps its mapping.

Both return ``{"tensors": n, "read_s": s, "reload_s": s}``: the time to get tensors out of the file
(for the shared buffer, to make the views) and the time ``reload_weights`` took.
"""

from __future__ import annotations

import mmap
import os
import time


class WeightSyncExtension:
    def async_vapo_load_weights(self, path: str) -> dict[str, float]:
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = load_file(path, device="cpu")
        t1 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]
        return {"tensors": len(state), "read_s": t1 - t0, "reload_s": time.perf_counter() - t1}

    def async_vapo_load_shared(self, path: str, nbytes: int, layout: list[tuple[str, str, list[int], int]]
                               ) -> dict[str, float]:
        import torch

        t0 = time.perf_counter()
        maps: dict[str, torch.Tensor] = self.__dict__.setdefault("_async_vapo_shared", {})
        flat = maps.get(path)
        if flat is None or flat.numel() < nbytes:
            # Only the newest buffer is kept; an older mapping goes once reload_weights holds no view of it.
            maps.clear()
            fd = os.open(path, os.O_RDWR)
            try:
                buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            maps[path] = flat = torch.frombuffer(buf, dtype=torch.uint8)
        views = []
        for name, dtype, shape, offset in layout:
            dt = getattr(torch, dtype)
            count = 1
            for d in shape:
                count *= d
            size = count * dt.itemsize
            views.append((name, flat[offset: offset + size].view(dt).view(shape)))
        t1 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(views))  # type: ignore[attr-defined]
        return {"tensors": len(views), "read_s": t1 - t0, "reload_s": time.perf_counter() - t1}
