"""What the weight client may call on an engine: the engine's side of the weight protocol.

Declared here, beside its callers (``client.EngineWeightClient``, ``receive.load_announced``), so that naming it
never imports the rollout package. Both engines implement it through their shared ``rollout.engine.EngineWeights``:
the lock-step ``rollout.engine.VLLMEngine`` and the continuous ``rollout.continuous.ContinuousEngine``; the two
differ only in :meth:`WeightEngine.apply_weights`, which decides what "quiescent" means for the way it generates.

Invariants (each engine keeps them; ``tests/integration/test_engine_interface.py`` checks them on both):

* ``version`` changes only inside the engine: a load that completed sets the version it loaded,
  :meth:`WeightEngine.invalidate` sets -1. Callers read it and never write it (it is a read-only property).
* -1 means no whole version is loaded (the weights may be a mix of two): whatever the engine samples meanwhile is
  labelled -1, older than any version the learner accepts, until a load of a whole version completes.
* A version from the cluster comes in through :meth:`WeightEngine.apply_weights`; the load methods are called only
  inside its ``load`` (the engine quiescent around them), or by a one-process trainer between two generate calls.

A LoRA version (``model.lora``) arrives as its adapter: :meth:`WeightEngine.load_adapter`, implemented once in
``EngineWeights`` over vLLM's LoRA support, and the "adapter" branch of ``receive.load_announced``. Such an engine
keeps its base weights; the version is the adapter that new requests get.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar, runtime_checkable

from async_vapo.weights.layout import Layout

T = TypeVar("T")


@runtime_checkable
class WeightEngine(Protocol):
    """An engine the weight client drives (module docstring). Every method blocks until done, or raises; one whose
    deadline passes raises ``TimeoutError`` (the client treats that as an engine failure)."""

    @property
    def version(self) -> int:
        """The version served; -1: no whole version is loaded."""
        ...

    @property
    def weight_backend(self) -> str | None:
        """The torch.distributed groups the engine can join ("gloo" or "nccl"); None: none (it never asks for one)."""
        ...

    def apply_weights(self, version: int, load: Callable[[], T]) -> T:
        """The one entry point of a new version from the cluster, called by the weight client between its own
        polls: quiesce (nothing generating on the old weights meanwhile, as the engine's update mode says), run
        ``load`` (which calls the load methods below) and return what it returns. After it the engine serves
        ``version``. If ``load`` raises, the error propagates, and the engine is at -1 if any weights may have
        changed (a load method that raised invalidates the engine itself; a caller that finds a load torn calls
        :meth:`invalidate`); otherwise the old version is still whole. (The continuous engine goes to -1, paused,
        whatever raised.)"""
        ...

    def invalidate(self) -> None:
        """Serve nothing until a whole version is loaded: ``version`` becomes -1. Called inside ``load`` by a caller
        that knows the loaded weights may be a mix of two versions (a group receive that failed part-way, a slot
        rewritten during its load) before it tries another way or raises."""
        ...

    def load_weights_from_shared(self, path: str, nbytes: int, layout: Layout, version: int) -> None:
        """Load a flat buffer another process wrote in the shared-memory file ``path`` (the learner's slot):
        ``layout`` offsets and ``nbytes`` count from the start of the file. Leaves ``version`` = ``version``; the
        caller checks the slot still holds it afterwards (and calls :meth:`invalidate` if not). Like every load
        method, one that raises leaves ``version`` = -1."""
        ...

    def load_weights_from_file(self, path: str, version: int) -> None:
        """Load a safetensors file (HF names), already checked against its announce. Leaves ``version`` =
        ``version``."""
        ...

    def receive_buffer(self, nbytes: int) -> memoryview:
        """The engine's own shared buffer, of at least ``nbytes``, for the caller to fill (a fetch) before
        :meth:`load_received`. The caller drops its view before that load."""
        ...

    def load_received(self, layout: Layout, version: int) -> None:
        """Load what the caller wrote into :meth:`receive_buffer` (``layout`` offsets from its start). Leaves
        ``version`` = ``version``."""
        ...

    def load_adapter(self, path: str, version: int) -> None:
        """Load the LoRA adapter of ``version`` from the PEFT directory ``path`` (already checked against its
        announce) and route every request submitted after it to that adapter; a request already running keeps the
        adapter it started with. Adapters no running request uses are retired. Leaves ``version`` = ``version``;
        an engine started without LoRA raises."""
        ...

    def join_weight_group(self, init_info: dict) -> None:
        """Join the learner's torch.distributed group offered for this engine (``collective.engine_init_info``);
        blocks until the learner has joined too, bounded by the offer's timeout. A new group replaces the last."""
        ...

    def receive_weights_dist(self, update_info: dict, version: int) -> None:
        """Receive ``version`` over the joined group while the learner sends it (``collective.update_info``). Leaves
        ``version`` = ``version``; a failure part-way raises with a mix of two versions loaded (the caller
        invalidates)."""
        ...
