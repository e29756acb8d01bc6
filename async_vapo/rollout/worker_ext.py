"""Methods added to every vLLM worker (``worker_extension_cls``): in-place weight loading.

Two ways in, both ending in vLLM's own ``reload_weights`` (the engine, its KV cache and its scheduler
are not restarted):

* ``async_vapo_load_weights(path)``: a safetensors file (on /dev/shm when it exists, so the bytes never
  touch a disk). The cluster's learner broadcasts files like this to every rollout service.
* ``async_vapo_load_shared(path, nbytes, layout)``: one flat buffer in a shared-memory file that the
  engine's owner writes in place, a tensor at each ``(name, dtype, shape, offset)`` of ``layout``. The
  worker maps the file once and hands ``reload_weights`` tensors that are views of the mapping: no
  header to parse, no copy before vLLM's own, and after the first push no page to fault in on either
  side. The owner may unlink the file after the first load: the worker keeps its mapping. The cluster's
  learner writes its versions into a few such files (slots, ``async_vapo.weights``) that the
  workers of every engine on its host map once each.

Importing this module also registers our weight-transfer engines with vLLM (``async_vapo.weights.collective``: gloo, and
vLLM's NCCL engine with a receive watchdog), the third way in, which vLLM drives itself; ``async_vapo_dist_stats()``
reports the gloo engine's last receive.

Both return ``{"tensors": n, "read_s": s, "reload_s": s, "quiet_layers": n, "not_loaded": [names]}``: the time to
get tensors out of the file (for the shared buffer, to make the views), the time ``reload_weights`` took, and what
vLLM's reload reported as layers it loaded nothing into (below).

vLLM's in-place reload (``model_loader/reload/layerwise.py``) moves every layer's parameters and buffers to the meta
device, loads what the weights hold, and at the end warns "<Layer>: Failed to load weights" for each layer that holds
tensors of which nothing was loaded, putting its old tensors back. A rotary embedding holds one tensor, the
``cos_sin_cache`` buffer (non-persistent: computed at start from the head size, the base and the maximum position;
no checkpoint holds it, HF's ``inv_freq`` is non-persistent too), so it was warned about at every load, although it
keeps its cache, which no weight changes. Those layers, each of whose tensors is a non-persistent buffer
(:func:`computed_only_layers`), are quiet here (``quiet_layers`` counts the warnings dropped); a warning about any
other layer (weights missing from a load, which keeps its old ones) still shows and is named in ``not_loaded``.
"""

from __future__ import annotations

import logging
import mmap
import os
import time

from async_vapo.weights.collective import register as _register_engines

_register_engines()  # the torch.distributed way in (async_vapo.weights.collective), before vLLM creates its engine

MAX_MAPPINGS = 8
"""Shared weight files a worker keeps mapped (the engine's own buffer plus the learner's slots)."""


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's in-place reload, which warns about layers it loaded nothing into."""
NOT_LOADED = "%s: Failed to load weights"
"""That warning's format, its argument the layer's class name."""


def computed_only_layers(model) -> set[str]:
    """Class names of ``model``'s layers whose every tensor, in every instance, is a non-persistent buffer (a rotary
    embedding's ``cos_sin_cache``): computed at start, in no checkpoint, never loaded by a reload (module docstring)."""
    computed, loaded = set(), set()
    for layer in model.modules():
        params = [p for p in layer._parameters.values() if p is not None]
        buffers = {n for n, b in layer._buffers.items() if b is not None}
        if params or buffers:
            only = not params and buffers <= layer._non_persistent_buffers_set
            (computed if only else loaded).add(type(layer).__name__)
    return computed - loaded


class _NothingLoaded(logging.Filter):
    """On :data:`RELOAD_LOGGER`: drops :data:`NOT_LOADED` for the ``quiet`` layers (counted in ``dropped``) and keeps
    the names of the others it lets through (``not_loaded``) for the load's result."""

    def __init__(self, quiet: set[str]):
        super().__init__()
        self.quiet, self.dropped, self.not_loaded = quiet, 0, []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != NOT_LOADED or not record.args:
            return True
        name = str(record.args[0])
        if name in self.quiet:
            self.dropped += 1
            return False
        self.not_loaded.append(name)
        return True


class WeightSyncExtension:
    def _async_vapo_reload(self, weights) -> dict:
        """vLLM's ``reload_weights`` over ``weights`` (name, tensor) with its warnings about computed-only layers
        dropped (module docstring): its seconds and what it reported."""
        quiet = self.__dict__.get("_async_vapo_reload_filter")
        if quiet is None:
            quiet = _NothingLoaded(computed_only_layers(self.model_runner.get_model()))  # type: ignore[attr-defined]
            logging.getLogger(RELOAD_LOGGER).addFilter(quiet)
            self._async_vapo_reload_filter = quiet
        quiet.dropped, quiet.not_loaded = 0, []
        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        return {"reload_s": time.perf_counter() - t0, "quiet_layers": quiet.dropped, "not_loaded": quiet.not_loaded}

    def async_vapo_threads(self, n: int) -> int:
        """The OpenMP threads of this worker's forwards from its next step on, when ``n`` > 0; returns the count in
        force. The engine takes the learner's cores while the learner waits for a batch (``cluster.deploy.lend_cpus``;
        the engine's process may run on every core, its places span them). vLLM's CPU worker replaces
        ``torch.set_num_threads`` with a no-op once it has bound its threads; ``torch._C``'s is the original. The
        thread count is the calling thread's, and this thread runs the forwards: RPCs are served between two steps in
        the worker's own loop."""
        import torch

        if n > 0:
            torch._C.set_num_threads(n)
        return torch.get_num_threads()

    def async_vapo_forward_threads(self) -> tuple[int, int] | None:
        """Of the model's last forward since the first call (which installs the hook that records it, and returns
        None): (1 if it ran in this RPC's thread, else 0; its OpenMP threads). For the tests of
        :meth:`async_vapo_threads`."""
        import threading

        import torch

        seen = self.__dict__.get("_async_vapo_fwd")
        if seen is None:
            seen = self._async_vapo_fwd = {}

            def record(*_):
                seen["last"] = (threading.get_ident(), torch.get_num_threads())

            self.model_runner.get_model().register_forward_pre_hook(record)  # type: ignore[attr-defined]
            return None
        if "last" not in seen:
            return None
        ident, threads = seen["last"]
        return int(ident == threading.get_ident()), threads

    def async_vapo_dist_stats(self) -> dict[str, float]:
        """Stages of the last version received over torch.distributed (``async_vapo.weights.collective``)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "stats", {}))

    def async_vapo_receive_dist(self, update_info: dict) -> dict[str, float]:
        """One version over torch.distributed: vLLM's worker-side ``start_weight_update``, ``update_weights`` and
        ``finish_weight_update`` in one RPC instead of three (what ``LLM``'s methods of those names each send), then
        the stages of the receive."""
        self.start_weight_update()  # type: ignore[attr-defined]
        self.update_weights(update_info)  # type: ignore[attr-defined]
        self.finish_weight_update()  # type: ignore[attr-defined]
        return self.async_vapo_dist_stats()

    def async_vapo_load_weights(self, path: str) -> dict:
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = load_file(path, device="cpu")
        t1 = time.perf_counter()
        return {"tensors": len(state), "read_s": t1 - t0, **self._async_vapo_reload(iter(state.items()))}

    def async_vapo_load_shared(self, path: str, nbytes: int, layout: list[tuple[str, str, list[int], int]]
                               ) -> dict:
        import torch

        t0 = time.perf_counter()
        # Mappings are kept per file (the engine's own buffer, the cluster learner's slots), newest last;
        # a file replaced under the same name (another inode) is mapped again.
        maps: dict[str, tuple[int, torch.Tensor]] = self.__dict__.setdefault("_async_vapo_shared", {})
        kept = maps.pop(path, None)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            # the engine's own buffer is unlinked once mapped: its mapping is the only way in
            if kept is None or kept[1].numel() < nbytes:
                raise
        else:
            try:
                ino = os.fstat(fd).st_ino
                if kept is None or kept[0] != ino or kept[1].numel() < nbytes:
                    buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                    kept = (ino, torch.frombuffer(buf, dtype=torch.uint8))
            finally:
                os.close(fd)
        maps[path] = kept
        while len(maps) > MAX_MAPPINGS:  # the oldest goes once reload_weights holds no view of it
            maps.pop(next(iter(maps)))
        flat = kept[1]
        views = []
        for name, dtype, shape, offset in layout:
            dt = getattr(torch, dtype)
            count = 1
            for d in shape:
                count *= d
            size = count * dt.itemsize
            views.append((name, flat[offset: offset + size].view(dt).view(shape)))
        t1 = time.perf_counter()
        return {"tensors": len(views), "read_s": t1 - t0, **self._async_vapo_reload(iter(views))}
