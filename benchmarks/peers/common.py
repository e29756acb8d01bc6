"""What the peer benchmark's scripts share: the embedded task, base model and prompt encoder of a config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Embedded:
    cfg: object
    base: str
    tokenizer: object
    train_set: list
    eval_set: list
    encoder: object

    def engine(self):
        """A vLLM engine serving the base model, sized for this task's prompts."""
        from async_vapo.rollout.engine import EngineSpec, VLLMEngine

        longest = self.encoder.longest(self.train_set + self.eval_set)
        return VLLMEngine(EngineSpec.from_config(self.cfg, self.base, longest_prompt=longest))


def embedded(config: str, overrides: list[str] | None = None) -> Embedded:
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import load_task

    cfg = load_config([config], overrides or [])
    base = str(ensure_base_model(cfg, progress=False))
    tok = AutoTokenizer.from_pretrained(base)
    train_set, eval_set = load_task(cfg)
    return Embedded(cfg, base, tok, train_set, eval_set, PromptEncoder.from_config(cfg, tok))
