"""Model loading: a transformers causal LM in eval mode from a model spec. A GGUF model's first
load saves the float copy that later loads read. Resolving a spec, where that copy lives and the
tokenizer are :mod:`specdec.engine.model_files`, which needs no torch.
"""

import copy
import logging
import os

import safetensors.torch
import torch

from specdec.engine.model_files import ModelRef, converted_dir, hf_source, resolve_model

log = logging.getLogger(__name__)


def context_window(model, default: int = 2048) -> int:
    """A transformers model's context window in tokens (``max_position_embeddings``), or
    ``default`` when its config does not say."""
    return int(getattr(model.config, "max_position_embeddings", 0) or default)


def parse_dtype(name: str) -> torch.dtype:
    """``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32``, ``bfloat16`` or ``float16``."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: use auto, float32, bfloat16 or float16") from None


def load_causal_lm(spec: str, dtype: str = "auto", device_map: str | None = None):
    """Loads a transformers causal LM in eval mode.

    Args:
        spec: see :func:`specdec.engine.model_files.resolve_model`.
        dtype: see :func:`parse_dtype`.
        device_map: accelerate device map (``auto`` spreads layers over every visible GPU);
            None puts the model on ``cuda`` when available, else on the CPU.
    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = resolve_model(spec)
    source, kwargs = hf_source(ref)
    torch_dtype = parse_dtype(dtype)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, device_map=device_map, **kwargs)
    if kwargs.get("gguf_file"):
        _save_converted(ref, model, tokenizer)
    if device_map is None and torch.cuda.is_available():
        # transformers wraps PreTrainedModel.to with functools.wraps, whose typeshed type loses the
        # method's binding: mypy reads "cuda" as the model argument
        model = model.to("cuda")  # type: ignore[arg-type]
    return model.eval(), tokenizer


def _save_converted(ref: ModelRef, model, tokenizer) -> None:
    target = converted_dir(ref)
    partial = target.with_name(target.name + f".tmp{os.getpid()}")
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)  # the weights are float now
    try:
        config.save_pretrained(partial)
        safetensors.torch.save_model(model, str(partial / "model.safetensors"))
        tokenizer.save_pretrained(partial)
        partial.rename(target)
        log.info("saved the float copy of %s to %s", ref.gguf_path, target)
    except OSError as err:  # a read-only home or a concurrent writer: loading still works
        log.warning("could not cache the float copy of %s: %s", ref.gguf_path, err)
