"""A learner spanning hosts: two torchrun agents (one rank each, as on two machines) meet through c10d rendezvous on
loopback (``--nnodes 2 --rdzv-backend c10d``) and make the one-process VAPO update with FSDP2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import cfg_for, updates  # noqa: E402

from async_vapo.models.base_model import ensure_base_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_with_c10d_rendezvous_make_the_one_process_update(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    cfg = cfg_for(str(cache), [])
    ensure_base_model(cfg, progress=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                endpoint, "--rdzv-id", "multihost-test",
                                str(ROOT / "tests/integration/fsdp_worker.py"), str(cache), str(out), "vapo"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for node in (0, 1)]
    logs = [a.communicate(timeout=600)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(x[-3000:] for x in logs)
    single, single_metrics, _ = updates(cfg)
    r0, m0 = torch.load(out / "vapo.0", weights_only=False)
    _, m1 = torch.load(out / "vapo.1", weights_only=False)
    for a, b, c in zip(single_metrics, m0, m1, strict=True):
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert b[key] == c[key] and abs(b[key] - a[key]) <= 1e-5 * a[key], (key, a[key], b[key])
    for k, v in single.items():
        torch.testing.assert_close(r0[k], v, rtol=0, atol=2e-5)
