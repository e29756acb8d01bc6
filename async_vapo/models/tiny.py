"""The embedded default's tokenizer and tiny Qwen2-architecture model.

The tokenizer is character-level (HF ``tokenizers`` WordLevel over printable ASCII, saved as
tokenizer.json), so that a model of a few hundred thousand parameters can do the chain-arithmetic task;
the model is a real ``Qwen2ForCausalLM``, saved in HF format (safetensors) that both transformers and
vLLM load. Larger runs use any HF causal LM and its own tokenizer through the same code.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS = "<pad>", "<eos>"
CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")  # printable ASCII + space + \n


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {PAD: 0, EOS: 1}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="right")


def build_tiny_qwen2(vocab_size: int, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                     intermediate_size: int, max_position_embeddings: int, pad_token_id: int,
                     eos_token_id: int, seed: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_hf(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
