"""The ranks of tests/integration/test_sharded_lora_publish.py, launched by torchrun (gloo, 2 CPU ranks): the learner
service of a LoRA policy sharded over both ranks (``model.lora``, FSDP2), publishing each version as its adapter
with its own hook (``LearnerService.publish`` on rank 0, every rank gathering the adapter for it:
``Learner.publish_state``) through its ``WeightBroadcast`` and ``AdapterPublisher`` (``cluster.weights.transfer =
"shm"``, the PEFT directories under ``cluster.weights.dir``). Version 0 as the service's ``run`` publishes it, then
two updates of the step loop as the service wires it. Rank 0 saves each announced directory's adapter, the learner's
own adapter after the loop and the loop's rows to ``OUT/published.pt``; every rank its final adapter to
``OUT/adapter.<rank>``.

    torchrun --nproc_per_node 2 tests/integration/lora_publish_worker.py CACHE_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import ListSource, cfg_for  # noqa: E402

EXTRA = ["algo.name=grpo", "model.lora.rank=4", "model.lora.alpha=8", "optim.actor_lr=1e-2",
         "cluster.weights.transfer=shm", "cluster.hosts.bind_host=127.0.0.1", "cluster.hosts.learner_host=127.0.0.1",
         "algo.dynamic_sampling=true", "train.total_steps=2", "train.checkpoint_every=0"]


def main() -> None:
    from safetensors.torch import load_file

    from async_vapo.learner.loop import BroadcastSource, StepLoop
    from async_vapo.learner.sharding import is_sharded
    from async_vapo.metrics.jsonl import JsonlWriter
    from async_vapo.models import lora
    from async_vapo.services.context import make_context
    from async_vapo.services.learner import LearnerService
    from async_vapo.transport import InprocTransport
    from async_vapo.weights.adapter import check_adapter

    cache, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    cfg = cfg_for(cache, [*EXTRA, f"cluster.weights.dir={out / 'w'}"])
    ctx = make_context("learner", cfg=cfg, run_dir=out / "run", instance=rank, serve_metrics=False,
                       install_signals=False)
    transport = InprocTransport() if rank == 0 else None
    svc = LearnerService(ctx, transport)  # joins the process group (torchrun's environment)
    learner, sync = svc.learner, svc.sync
    assert is_sharded(learner.policy) and not svc.streams
    res: dict = {"announced": {}}

    def record() -> None:  # the version rank 0 announced: its directory, checked against the announce as engines do
        a = sync.latest
        check_adapter(a)
        res["announced"][a.version] = {"transfer": a.transfer,
                                       "tensors": load_file(str(Path(a.location) / lora.ADAPTER_WEIGHTS)),
                                       "files": sorted(p.name for p in Path(a.location).iterdir())}

    try:
        state = learner.publish_state()  # version 0, as LearnerService.run publishes it: a collective
        if rank == 0:
            svc.publish(0, state)
            record()

        def publish(version: int, st) -> float:  # the service's hook, and what rank 0 then finds announced
            seconds = svc.publish(version, st)
            record()
            return seconds

        source = BroadcastSource(ListSource(svc.tokenizer) if rank == 0 else None, 2)
        writer = JsonlWriter(out / "loop.jsonl") if rank == 0 else None
        loop = StepLoop(cfg, learner, source, pad_id=svc.tokenizer.pad_token_id, run_dir=out / "loop",
                        log_writer=writer, leader=rank == 0, publish=publish if rank == 0 else None)
        loop.run()
        final = learner.publish_state()
        torch.save(final, out / f"adapter.{rank}")
        if rank == 0:
            writer.close()
            res["rows"] = [json.loads(x) for x in (out / "loop.jsonl").read_text().splitlines()]
            res["final"] = final
            torch.save(res, out / "published.pt")
    finally:
        svc.close()
        if transport is not None:
            transport.close()
        ctx.close()


if __name__ == "__main__":
    main()
