"""The hour-long benchmark drivers' settings are valid configs: every ALGOS name of benchmarks/smollm2_learning.sh and
benchmarks/tool_task_learning.sh, expanded by bash as the driver expands it and applied to the driver's config, loads
(a misspelt key or a bad value would otherwise surface only when that run starts, an hour into a queue of runs)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from async_vapo.config.loader import load_config

REPO = Path(__file__).resolve().parents[2]
_ARRAY = re.compile(r"^([a-z_0-9]+)=\((.*?)\)[ \t]*$", re.M | re.S)


def _arrays(script: str, env: str) -> dict[str, list[str]]:
    """Each top-level ``name=(...)`` array of the driver, as bash expands it (references to other arrays included)."""
    text = (REPO / script).read_text()
    defs = [m.group(0) for m in _ARRAY.finditer(text)]
    names = [m.group(1) for m in _ARRAY.finditer(text)]
    assert names, f"no arrays found in {script}"
    body = env + "\n" + "\n".join(defs) + "\n" + "\n".join(
        f'printf "@@%s\\n" {n}; printf "%s\\n" "${{{n}[@]}}"' for n in names)
    out = subprocess.run(["bash", "-euc", body], capture_output=True, text=True, check=True).stdout
    arrays: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("@@"):
            current = arrays.setdefault(line[2:], [])
        elif line:
            current.append(line)
    return arrays


SMOLLM2 = _arrays("benchmarks/smollm2_learning.sh", "MINUTES=55; EVAL_EVERY=10")
TOOL = _arrays("benchmarks/tool_task_learning.sh", "data=data/tool_task")
# the names that are shared settings or modes rather than an ALGOS entry
SMOLLM2_ALGOS = sorted(set(SMOLLM2) - {"common", "services", "critic_free", "lora"})
TOOL_ALGOS = sorted(set(TOOL) - {"tool", "no_tool"})


@pytest.mark.parametrize(("script", "algos"), [("smollm2_learning.sh", SMOLLM2_ALGOS),
                                               ("tool_task_learning.sh", TOOL_ALGOS)])
def test_the_headers_name_every_algorithm(script: str, algos: list[str]):
    header = (REPO / "benchmarks" / script).read_text().split("set -euo")[0]
    for name in algos:
        assert re.search(rf"\b{name}\b", header), f"{script}'s header does not name {name}"
    assert {"grpo", "vapo"} <= set(algos)


@pytest.mark.parametrize("algo", SMOLLM2_ALGOS)
@pytest.mark.parametrize("services", [False, True], ids=["trainer", "services"])
def test_smollm2_learning_settings_load(algo: str, services: bool):
    extra = SMOLLM2["services"] if services else []
    cfg = load_config(["configs/smollm2_cpu.toml"], [*SMOLLM2["common"], *SMOLLM2[algo], *extra, "train.seed=1"])
    assert cfg.algo.name == dict(o.split("=", 1) for o in SMOLLM2[algo])["algo.name"]
    assert cfg.train.max_minutes == 55


@pytest.mark.parametrize("algo", TOOL_ALGOS)
@pytest.mark.parametrize("tool", ["tool", "no_tool"])
def test_tool_task_learning_settings_load(algo: str, tool: str):
    cfg = load_config(["configs/smollm2_tool_cpu.toml"], [*TOOL[algo], *TOOL[tool], "train.seed=1"])
    assert (cfg.rollout.env is None) == (tool == "no_tool")
    assert cfg.task.train_path.endswith("train_no_tool.jsonl" if tool == "no_tool" else "train.jsonl")
