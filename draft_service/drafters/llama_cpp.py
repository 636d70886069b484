"""A GGUF model run by llama.cpp (llama-cpp-python's low-level API) as the draft, batched: every
session is one sequence of ONE llama.cpp context, and one engine loop (:mod:`specdec.engine.engine`)
runs a ``llama_decode`` per draft position for the whole batch of sessions.

The default draft is the target's own weights quantized (a quantized self-draft, as in ML-SpecQD,
Georganas et al. 2025): the bundled Q4_1 file, re-quantized once to Q8_0 (:func:`requantized`).

llama.cpp's multi-sequence batch API, as used here (:class:`LlamaCppLM`):

- the context is created with ``n_seq_max`` = the sessions the drafter holds and a per-sequence
  KV cache (``kv_unified = false``): llama.cpp then splits the context's ``n_ctx`` evenly into
  ``n_seq_max`` streams of ``n_ctx_seq = n_ctx / n_seq_max`` cells (rounded up to a multiple of
  256), each attended on its own. We ask for ``n_ctx`` x ``n_seq_max`` cells, so every sequence
  holds ``n_ctx`` tokens whatever the others hold (with a unified cache the sequences would share
  one pool of ``n_ctx`` cells and each token would attend over all of them). The whole KV is
  allocated up front: ``n_ctx`` x ``max_num_seqs`` x the bytes per token (see
  :func:`kv_bytes_per_token`).
- a step is one ``llama_batch``: every token carries its sequence id and its position in that
  sequence (``pos``), and a ``logits`` flag on the positions whose logits are read back
  (``llama_get_logits_ith``). ``llama_decode`` splits it into micro-batches itself (with
  per-sequence streams, ones of an equal number of tokens from consecutive sequence ids, which is
  why steps are ordered by sequence id and a new sequence takes a free id next to the live ones).
- rollback of rejected draft positions is ``llama_memory_seq_rm(mem, seq, length, -1)``; freeing a
  session's sequence (prefix caching off) is ``llama_memory_seq_rm(mem, seq, -1, -1)``.

Prefix caching (``prefix_caching``; token level, no blocks): a freed session's llama.cpp sequence
keeps its cells and tokens, as a *donor* for later sessions, until a new session takes that
sequence id. A new session takes its sequence id when its prefill starts
(:meth:`LlamaCppLM.attach_prefix`), choosing among the free ones, in this order: one next to the
live sequences' ids (llama.cpp's ``split_equal`` takes only consecutive sequence ids into one
micro-batch, so a gap costs every step one more pass over the weights), the longest donor that
the context begins with whole (reused in place, nothing of it lost), an empty one, the least
recently freed donor (evicted). Then, when another sequence, live or freed, holds a longer prefix
of the context by at least :data:`MIN_COPIED_TOKENS` tokens, ``llama_memory_seq_cp`` copies it
over: with a stream per sequence llama.cpp copies the source's whole stream (``n_ctx`` x the
bytes per token; exact, done at the next ``llama_decode``);
last, the cells past the prefix found are removed. A donor lends only to a session of the same cache
salt (the tenant's partition, :meth:`LlamaCppLM.attach_prefix`): a sequence of another salt counts
as holding nothing of the context (its cells are removed when it is taken). So a donor that only
shares a beginning with
the new context (a system prompt) lends it by a copy and stays whole for its own next turn, which
later finds it in place; at batch 1 every earlier session waits as a donor in its own sequence
(up to ``max_num_seqs`` - 1 of them); the cache costs no memory beyond the context llama.cpp
allocates up front.
"""

import ctypes
import functools
import logging
import multiprocessing
import os
import threading
from collections.abc import Sequence

import gguf
import llama_cpp
import numpy as np
import torch

from draft_service.drafters.contract import Drafter
from draft_service.drafters.grammar_vocabulary import GrammarVocabulary
from draft_service.drafters.model_drafting import ModelDraftSession
from draft_service.settings import DraftSettings
from specdec.engine.batching import BatchedLM, SequenceStep
from specdec.engine.engine import Engine
from specdec.engine.kv import SequenceKV
from specdec.engine.model_files import derived_path, load_tokenizer, resolve_model
from specdec.engine.vocab import vocab_fingerprint
from specdec.rpc.errors import ResourceExhausted
from specdec.sampling.sampling_params import SamplingParams
from specdec.token_ids import common_prefix_length

log = logging.getLogger(__name__)
# the settings that size its context, as its errors name them
N_CTX, MAX_NUM_SEQS = DraftSettings.named("llama_cpp_n_ctx"), DraftSettings.named("llama_cpp_max_num_seqs")
_backend_lock = threading.Lock()
_backend_ready = False

# The shortest gain in prefix, in tokens, for which a new sequence copies another's stream rather
# than prefilling those tokens: a stream's copy costs less than a 16-token prefill chunk
# (docs/architecture.md#prefix-caching).
MIN_COPIED_TOKENS = 16


def _init_backend() -> None:
    """``llama_backend_init`` once per process; llama.cpp's own logging only from errors up unless
    the ``llama-cpp-python`` logger was configured (as ``Llama(verbose=False)`` does)."""
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            logger = logging.getLogger("llama-cpp-python")
            if logger.level == logging.NOTSET:
                logger.setLevel(logging.ERROR)
            llama_cpp.llama_backend_init()
            _backend_ready = True


# llama.cpp file types a GGUF can be re-quantized to (``--llama-cpp-requantize``)
REQUANTIZE_TYPES = {
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
}


def requantized(path: str, type_name: str) -> str:
    """The GGUF at ``path`` re-quantized to ``type_name`` (a key of :data:`REQUANTIZE_TYPES`; ""
    keeps ``path``), converted once by llama.cpp's ``llama_model_quantize`` and cached (see
    :func:`specdec.engine.model_files.derived_path`); ``path`` itself when it already has that type.

    Why: llama.cpp runs some types far faster than others on a CPU; Q4_1, the type of the bundled
    SmolLM2, has no repacked (interleaved) CPU kernels, and Q8_0 is faster with as good an argmax
    agreement with the target (docs/benchmark.md#the-drafts-quantization---llama-cpp-requantize).

    Raises ValueError for an unknown type or a failed conversion.
    """
    if not type_name:
        return path
    if type_name not in REQUANTIZE_TYPES:
        raise ValueError(f"llama_cpp_requantize {type_name!r}: use one of {', '.join(REQUANTIZE_TYPES)} or '' (off)")
    file_type = REQUANTIZE_TYPES[type_name]
    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is not None and int(field.parts[field.data[0]][0]) == file_type:
        return path
    target = derived_path(path, f"gguf-{type_name}").with_suffix(".gguf")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.tmp{os.getpid()}")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = int(file_type), True
        _init_backend()
        if llama_cpp.llama_model_quantize(path.encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            partial.unlink(missing_ok=True)
            raise ValueError(f"llama.cpp could not re-quantize {path} to {type_name}")
        os.replace(partial, target)
    return str(target)


def build_has_amx() -> bool:
    """Whether this llama.cpp build runs its AMX kernels (compiled for a CPU with AMX-INT8, as
    ``-march=native`` does on Intel's Sapphire Rapids and later). They crash there in batched
    decodes (a segmentation fault in ``ggml_backend_amx_mul_mat``: llama.cpp #20824, with a fix
    proposed in llama.cpp #26954: worker threads lack the AMX tile-data permission), so
    :class:`LlamaCppLM` keeps the weights out of the AMX buffer type where the build has them;
    ``scripts/setup.sh`` builds llama.cpp without them (``-mno-amx-*``)."""
    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()


@functools.cache
def _log_amx_avoided() -> None:
    """Says once per process that the weights skip llama.cpp's extra buffer types."""
    log.warning(
        "this llama.cpp build has AMX kernels, which crash in batched decodes (llama.cpp #20824): the draft's "
        "weights stay in plain CPU buffers (no AMX, no repacked kernels; slower). Rebuild llama-cpp-python "
        "without them: CMAKE_ARGS='-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8' pip install "
        "--force-reinstall --no-cache-dir --no-deps llama-cpp-python (scripts/setup.sh does that on a fresh .venv)"
    )


def kv_bytes_per_token(model) -> int:
    """KV bytes of one cached token of a llama.cpp model (``llama_model_p``): layers x (key + value)
    x KV heads x head size (hidden size / heads) x 2 bytes (llama.cpp's default f16 cache). An
    estimate from the model's shape: models whose head size differs from hidden / heads, or with
    sliding-window layers, allocate otherwise."""
    head_size = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
    return llama_cpp.llama_model_n_layer(model) * 2 * llama_cpp.llama_model_n_head_kv(model) * head_size * 2


class LlamaCppLM(BatchedLM):
    """One llama.cpp model and context holding up to ``max_num_seqs`` sequences of ``n_ctx``
    tokens each (see the module docstring).

    Args:
        path: the .gguf file.
        n_ctx: tokens one sequence holds.
        max_num_seqs: sequences at once (llama.cpp's ``n_seq_max``, at most 256).
        max_num_batched_tokens: the largest step the engine schedules (llama.cpp's ``n_ubatch``:
            it sizes the compute buffers). ``n_batch`` (the largest ``llama_decode``) is the larger
            of it and ``n_ctx``, since a step too big for the budget still runs alone.
        n_threads: CPU threads (0: half the cores for one-token steps, all for larger ones, as
            ``llama_cpp.Llama`` does).
        n_gpu_layers: layers offloaded to the GPU (-1 = all) in a CUDA build.
        prefix_caching: freed sequences stay as donors of their prefixes (module docstring).

    Sequence ids are handles: each :meth:`allocate` returns a new one, mapped to a free llama.cpp
    sequence when its prefill (:meth:`attach_prefix`) or first step starts, so a step still
    queued for a freed session cannot write into the session that reuses its llama.cpp sequence;
    such a late step gets NaN logits and decodes nothing. All llama.cpp calls hold one lock, so
    :meth:`free` and :meth:`attach_prefix` are safe while a step runs.
    """

    def __init__(
        self,
        path: str,
        n_ctx: int,
        max_num_seqs: int,
        max_num_batched_tokens: int = 512,
        n_threads: int = 0,
        n_gpu_layers: int = 0,
        prefix_caching: bool = False,
    ):
        if not 1 <= max_num_seqs <= llama_cpp.llama_max_parallel_sequences():
            raise ValueError(
                f"max_num_seqs is {max_num_seqs}: llama.cpp holds 1 to {llama_cpp.llama_max_parallel_sequences()} "
                f"sequences; set {MAX_NUM_SEQS} within them"
            )
        if n_ctx < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"{N_CTX} and {DraftSettings.named('max_num_batched_tokens')} must be at least 1 (they are {n_ctx} "
                f"and {max_num_batched_tokens})"
            )
        _init_backend()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        if build_has_amx():  # the extra buffer types are AMX's and the repacked kernels': both off
            model_params.use_extra_bufts = False
            _log_amx_avoided()
        self._model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path}")
        self.ctx = None
        self._batch = None
        self._lock = threading.Lock()
        self.n_batch = max(max_num_batched_tokens, n_ctx)
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = max_num_seqs
        params.kv_unified = False  # a stream of n_ctx / n_seq_max cells per sequence
        params.n_ctx = n_ctx * max_num_seqs
        params.n_batch = self.n_batch
        params.n_ubatch = min(max_num_batched_tokens, self.n_batch)
        params.n_threads = n_threads or max(multiprocessing.cpu_count() // 2, 1)
        params.n_threads_batch = n_threads or multiprocessing.cpu_count()
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self.ctx:
            self.close()
            raise ValueError(
                f"llama.cpp could not create a context of {max_num_seqs} sequences x {n_ctx} tokens, "
                f"{max_num_seqs * n_ctx} tokens of KV allocated up front (llama.cpp's log above says why): lower "
                f"{N_CTX}, the tokens one session holds, or {MAX_NUM_SEQS}"
            )
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self.ctx)
        if self.n_ctx_seq < n_ctx:  # llama.cpp rounds it up to a multiple of 256; guard a change
            self.close()
            raise ValueError(
                f"llama.cpp gives each sequence {self.n_ctx_seq} tokens, fewer than {N_CTX} = {n_ctx}: lower it to "
                f"{self.n_ctx_seq}"
            )
        self.n_ctx, self.max_num_seqs = n_ctx, max_num_seqs
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.bytes_per_token = kv_bytes_per_token(self._model)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.prefix_caching = prefix_caching
        self._seqs: dict[int, int] = {}  # handle -> llama.cpp sequence id
        self._unplaced: set[int] = set()  # handles without a llama.cpp sequence yet
        self._tokens: list[list[int]] = [[] for _ in range(max_num_seqs)]  # the tokens each sequence's cells hold
        self._salts = [""] * max_num_seqs  # the cache salt of the session each sequence holds or held last
        self._freed_at = [0] * max_num_seqs  # when each free sequence was freed (a count of frees): LRU
        self._num_frees = 0
        self._free_seqs = set(range(max_num_seqs))
        self._next_handle = 0

    def token_texts(self) -> list[str]:
        """Every token's text in id order (for the vocabulary fingerprint)."""
        return [llama_cpp.llama_vocab_get_text(self._vocab, i).decode("utf-8") for i in range(self.vocab_size)]

    def allocate(self, owner: str = "") -> int:  # llama.cpp's KV is allocated up front: nothing is preempted
        with self._lock:
            if len(self._seqs) + len(self._unplaced) >= self.max_num_seqs:
                raise ResourceExhausted(
                    f"the llama-cpp drafter holds {self.max_num_seqs} sessions at once, all in use: retry later, or "
                    f"raise {MAX_NUM_SEQS} (llama.cpp's n_seq_max; each holds {N_CTX} tokens of KV up front)"
                )
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            self._unplaced.add(handle)
        return handle

    def free(self, seq_id: int) -> None:
        with self._lock:
            self._unplaced.discard(seq_id)
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                return
            self._free_seqs.add(seq)
            self._num_frees += 1
            self._freed_at[seq] = self._num_frees
            if not self.prefix_caching:
                llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)
                self._tokens[seq] = []

    def truncate(self, seq_id: int, length: int) -> None:
        with self._lock:
            if seq_id in self._unplaced or length >= self.length(seq_id):
                return
            seq = self._seqs[seq_id]
            if not llama_cpp.llama_memory_seq_rm(self.memory, seq, length, -1):
                raise RuntimeError(f"llama.cpp cannot roll sequence {seq_id} back to {length} tokens")
            del self._tokens[seq][length:]

    def length(self, seq_id: int) -> int:
        """The sequence's cached positions."""
        return 0 if seq_id in self._unplaced else len(self._tokens[self._seqs[seq_id]])

    def llama_seq(self, seq_id: int) -> int:
        """The llama.cpp sequence id behind a handle (once its prefill or first step started)."""
        return self._seqs[seq_id]

    def cache_bytes(self, seq_id: int) -> int:
        return self.length(seq_id) * self.bytes_per_token if seq_id in self._seqs else 0

    def attach_prefix(self, seq_id: int, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Places the new sequence (see the module docstring), taking a prefix only from sequences
        of ``cache_salt``; returns the tokens it starts with."""
        with self._lock:
            if seq_id not in self._unplaced:
                raise ValueError(f"sequence {seq_id} is not new: a prefix attaches to a new one")
            return self._place(seq_id, token_ids if self.prefix_caching else (), cache_salt)

    def prefix_cache_tokens(self) -> int:
        return sum(len(self._tokens[seq]) for seq in list(self._free_seqs))

    def _place(self, seq_id: int, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """Gives a new handle its llama.cpp sequence, holding the longest prefix of ``token_ids``
        that a donor of ``cache_salt`` offers (module docstring); returns that prefix's length
        (lock held)."""
        live = set(self._seqs.values())

        def shared(seq: int) -> int:
            """The tokens of the context that sequence ``seq`` may lend."""
            return common_prefix_length(self._tokens[seq], token_ids) if self._salts[seq] == cache_salt else 0

        def preference(seq: int) -> tuple:
            isolated = 1 - ((seq - 1) in live) - ((seq + 1) in live)
            held = len(self._tokens[seq])
            whole = held > 0 and shared(seq) == held  # nothing of it dropped
            evicts = self._freed_at[seq] if held else -1  # empty first, then the least recently freed
            return isolated, not whole, -held if whole else 0, evicts, seq

        seq = min(self._free_seqs, key=preference)
        self._free_seqs.remove(seq)
        self._unplaced.remove(seq_id)
        self._seqs[seq_id] = seq
        found = shared(seq)
        self._salts[seq] = cache_salt
        donors = [(shared(other), other) for other in range(self.max_num_seqs)]
        longest, donor = max((d for d in donors if d[1] != seq), default=(0, seq))
        if longest >= found + MIN_COPIED_TOKENS:
            llama_cpp.llama_memory_seq_cp(self.memory, donor, seq, -1, -1)  # the whole stream, at the next decode
            self._tokens[seq], found = list(self._tokens[donor]), longest
        if len(self._tokens[seq]) > found:
            llama_cpp.llama_memory_seq_rm(self.memory, seq, found, -1)
            del self._tokens[seq][found:]
        return found

    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        out: dict[int, torch.Tensor] = {}  # by step
        with self._lock:
            if self._batch is None:
                raise RuntimeError("the llama.cpp model is closed (the draft service is stopping)")
            live = []
            for i, step in enumerate(steps):
                if step.seq_id in self._unplaced:  # a first step without a prefill before it
                    self._place(step.seq_id, ())
                if step.seq_id in self._seqs:
                    live.append(i)
                elif 0 <= step.seq_id < self._next_handle:  # freed while its work was queued
                    out[i] = torch.full((step.num_logits, self.vocab_size), float("nan"))
                else:
                    raise KeyError(f"unknown sequence {step.seq_id}")
            live.sort(key=lambda i: self._seqs[steps[i].seq_id])  # consecutive ids share micro-batches
            total = sum(len(steps[i].token_ids) for i in live)
            if total > self.n_batch:
                raise ValueError(f"a step of {total} tokens exceeds llama.cpp's n_batch ({self.n_batch})")
            for i in live:
                length, count = self.length(steps[i].seq_id), len(steps[i].token_ids)
                if length + count > self.n_ctx_seq:
                    raise ValueError(
                        f"sequence {steps[i].seq_id} would hold {length + count} tokens, more than the "
                        f"{self.n_ctx_seq} llama.cpp holds per sequence ({N_CTX} is {self.n_ctx})"
                    )
            if total:
                rows = self._decode([steps[i] for i in live], total)
                for i, logits in zip(live, rows, strict=True):
                    out[i] = logits
            else:
                for i in live:
                    out[i] = torch.empty(0, self.vocab_size)
        return [out[i] for i in range(len(steps))]

    def _decode(self, steps: list[SequenceStep], total: int) -> list[torch.Tensor]:
        """Fills the batch, runs one ``llama_decode`` and copies the flagged logits (lock held)."""
        batch = self._batch
        assert batch is not None, "the LM is closed"
        n = 0
        flagged: list[list[int]] = []
        for step in steps:
            seq, start, count = self._seqs[step.seq_id], self.length(step.seq_id), len(step.token_ids)
            first_logit = count - step.num_logits
            indices = []
            for j, token in enumerate(step.token_ids):
                batch.token[n] = token
                batch.pos[n] = start + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = j >= first_logit
                if j >= first_logit:
                    indices.append(n)
                n += 1
            flagged.append(indices)
        batch.n_tokens = total
        code = llama_cpp.llama_decode(self.ctx, batch)
        if code != 0:
            for step in steps:  # a failed decode may leave some micro-batches cached: drop them
                llama_cpp.llama_memory_seq_rm(self.memory, self._seqs[step.seq_id], self.length(step.seq_id), -1)
            raise RuntimeError(
                f"llama_decode failed with code {code} (a step of {total} tokens over {len(steps)} sequences)"
            )
        for step in steps:
            self._tokens[self._seqs[step.seq_id]] += step.token_ids
        rows = []
        for indices in flagged:
            logits = np.empty((len(indices), self.vocab_size), dtype=np.float32)
            for r, index in enumerate(indices):
                logits[r] = np.ctypeslib.as_array(
                    llama_cpp.llama_get_logits_ith(self.ctx, index), shape=(self.vocab_size,)
                )
            rows.append(torch.from_numpy(logits))
        return rows

    def close(self) -> None:
        """Frees the llama.cpp batch, context and model once a step still running has ended (the
        object is unusable after: a later :meth:`forward` raises RuntimeError)."""
        with self._lock:
            if self._batch is not None:
                llama_cpp.llama_batch_free(self._batch)
                self._batch = None
            if self.ctx:
                llama_cpp.llama_free(self.ctx)
                self.ctx = None
            if self._model:
                llama_cpp.llama_model_free(self._model)
                self._model = None


class LlamaCppDrafter(Drafter):
    """Args: ``spec`` a .gguf path or ``smollm2``; ``requantize`` the type it is re-quantized to
    first (see :func:`requantized`; "" loads it as it is); ``n_ctx`` the context window in tokens per
    session; ``n_threads`` CPU threads (0 = llama.cpp's default); ``n_gpu_layers`` layers
    offloaded to the GPU (-1 = all) when llama-cpp-python was built with CUDA; ``max_num_seqs``
    the sessions it holds at once (one llama.cpp sequence each, their KV allocated up front; more
    raise ResourceExhausted), which is also the most a step batches; ``max_num_batched_tokens`` the
    new tokens a step takes at most (prefill is chunked to it); ``prefix_caching`` whether freed
    sessions' sequences serve later ones' prefixes (see :class:`LlamaCppLM`)."""

    name = "llama-cpp"
    engine: Engine  # a model drafter always has one

    def __init__(
        self,
        spec: str,
        n_ctx: int = 4096,
        n_threads: int = 0,
        n_gpu_layers: int = 0,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        requantize: str = "",
        prefix_caching: bool = True,
    ):
        self.model = spec
        self.path = requantized(resolve_model(spec).gguf_path, requantize)
        self.n_ctx = n_ctx
        self.lm = LlamaCppLM(
            self.path, n_ctx, max_num_seqs, max_num_batched_tokens, n_threads, n_gpu_layers, prefix_caching
        )
        self.vocab_fingerprint = vocab_fingerprint(self.lm.token_texts())
        self.engine = Engine(self.lm, max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, name=self.name)
        # the grammar's view of the vocabulary: transformers' tokenizer of the same GGUF (the
        # fingerprint check makes it the target's)
        tokenizer = load_tokenizer(spec)
        self.vocabulary = GrammarVocabulary(tokenizer, self.lm.vocab_size, [tokenizer.eos_token_id])

    def new_session(self, sampling: SamplingParams, cache_salt: str = "", owner: str = "") -> ModelDraftSession:
        kv_cache = SequenceKV(self.lm, cache_salt, owner)  # llama.cpp allocates its KV up front: it never preempts
        return ModelDraftSession(sampling, kv_cache, self.n_ctx, self.engine, self.vocabulary)
