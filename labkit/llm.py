"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``.

It wires the layers together: the model runner (weights + paged KV cache), a block
allocator with exactly as many blocks as the KV cache holds, the scheduler, the engine
loop. Names and shapes follow vLLM's offline API on purpose, so code written against
labkit ports to vLLM when a user outgrows one machine.

    from labkit import LLM, SamplingParams
    llm = LLM()                                     # SmolLM2-135M-Instruct, offline
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import sys
import warnings
from typing import Iterator, Sequence as Seq

import torch

from .engine import Engine
from .executor import ModelExecutor
from .memory import BlockAllocator, prefix_cache_policy
from .kernels.kv_quant import resolve_kv_cache_dtype
from .model.kv_cache import device_memory, kv_bytes_per_token, plan_kv_cache, size_text
from .model.llama import ModelSpec
from .model.loader import load_model
from .model.runner import ModelRunner, resolve_dtype
from .openmp import warn_if_too_late
from .outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput, error_output, request_output
from .request import Request, encode_prompt, is_token_id, split_prompt
from .sampling_params import BeamSearchParams, SamplingParams
from .scheduler import POLICIES, PREEMPTION_MODES, make_scheduler
from .spec_decode import SpeculativeConfig
from .utils import progress_bar

Prompt = str | list[int]


class LLM:
    """A small, real LLM server in one object: paged KV cache, continuous batching.

    Memory: give ``num_blocks`` (KV blocks of ``block_size`` tokens), or a byte budget
    ``kv_cache_memory``; asking for more than the machine has free is an error. By default
    the cache holds what ``max_num_seqs`` sequences of the full context can use, within a
    share of the free memory (``labkit.model.kv_cache.plan_kv_cache``); the load line says
    which rule chose the size.
    ``policy="static"`` runs the static-batching baseline on the same model instead.
    When memory runs out, a running sequence is preempted: ``preemption_mode="recompute"``
    drops its KV and prefills it again later; ``"swap"`` copies its blocks to a host pool of
    ``swap_space`` GiB (or ``num_host_blocks`` blocks) and back (docs/swapping.md).
    ``jump_forward``: a request with ``structured_outputs`` gets the tokens its grammar forces
    drafted and verified in one step instead of one step each; the output is the same either
    way (docs/structured_outputs.md). Switch it later with ``llm.engine.executor.jump_forward``.
    ``speculative_config`` (vLLM's dict): speculative decoding, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 5}``, ``{"method": "draft_layers",
    "num_layers": 8, "num_speculative_tokens": 3}`` or ``{"model": NAME, ...}``; the output is
    the same, fewer steps produce it (docs/speculative_decoding.md).
    ``kv_cache_dtype`` (vLLM's option): "auto" (the model's dtype), "fp8" (e4m3) or "int8":
    a quantized KV cache, one byte per number and one fp32 scale per token and KV head, so the
    same memory holds ~2x (bf16, fp16) or ~4x (fp32) the blocks (docs/kv_quantization.md).
    ``kv_offloading_size`` (vLLM's option, GiB; or ``num_offload_blocks`` blocks): a host tier
    behind the prefix cache: a cached block the KV cache evicts is copied to host memory and
    copied back on a later hit instead of being recomputed (docs/kv_offloading.md).
    """

    def __init__(self, model: str = "smollm2-135m", *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool | str = True, enable_chunked_prefill: bool = True,
                 attention_backend: str = "auto", dtype: str | torch.dtype = "auto",
                 device: str | None = None, policy: str = "continuous", watermark: float = 0.01,
                 num_threads: int | None = None, preemption_mode: str = "recompute",
                 swap_space: float = 4.0, num_host_blocks: int | None = None,
                 jump_forward: bool = True, speculative_config: dict | None = None,
                 prefix_caching: bool | str | None = None, kv_cache_dtype: str = "auto",
                 kv_offloading_size: float | None = None, num_offload_blocks: int | None = None):
        # Prefix caching: True or "hash" (vLLM's block hashes), "radix" (SGLang's radix tree),
        # False; ``prefix_caching=`` is the same option under the shorter name.
        if prefix_caching is not None:
            if enable_prefix_caching is not True and (prefix_cache_policy(enable_prefix_caching)
                                                      != prefix_cache_policy(prefix_caching)):
                raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r} and prefix_caching="
                                 f"{prefix_caching!r} disagree: give one of them")
            enable_prefix_caching = prefix_caching
        prefix_cache_policy(enable_prefix_caching)      # a bad value fails before the model loads
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not isinstance(block_size, int) or not 1 <= block_size <= 256:
            raise ValueError(f"block_size must be an integer in [1, 256], got {block_size!r}")
        if num_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_blocks or kv_cache_memory, not both")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # "auto": fp32, or fp16 on a GPU below compute capability 8.0 (Colab's T4): resolve_dtype says why.
        torch_dtype, dtype_reason = resolve_dtype(dtype, device)
        cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch_dtype)   # a bad name fails before loading
        _check_swap_args(preemption_mode, swap_space, num_host_blocks)
        _check_offload_args(kv_offloading_size, num_offload_blocks, enable_prefix_caching, policy)
        speculative_config = SpeculativeConfig.from_dict(speculative_config)   # refused before the model loads

        if kv_cache_memory is not None and (not isinstance(kv_cache_memory, int) or kv_cache_memory <= 0):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory!r}")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        loaded = load_model(model, dtype=torch_dtype, device=device)
        # Size the KV cache before allocating it, with the weights already in memory.
        context = ModelSpec.from_config(loaded.config).max_position
        self.max_model_len = min(max_model_len or context, context)
        self.kv_plan = plan_kv_cache(loaded.config, cache_dtype, block_size, max_num_seqs=max_num_seqs,
                                     max_model_len=self.max_model_len, num_blocks=num_blocks,
                                     kv_cache_memory=kv_cache_memory, device=device)
        self.runner = ModelRunner(loaded, block_size=block_size, num_blocks=self.kv_plan.num_blocks,
                                  attention_backend=attention_backend, dtype=torch_dtype, device=device,
                                  num_threads=num_threads, kv_cache_dtype=cache_dtype)
        # blocks this cache holds per block of the model's dtype, in the same memory (1 for "auto")
        self.kv_block_ratio = kv_bytes_per_token(loaded.config, torch_dtype) / kv_bytes_per_token(loaded.config,
                                                                                                   cache_dtype)
        self.tokenizer = self.runner.tokenizer
        allocator = BlockAllocator(self.runner.num_blocks, block_size, enable_prefix_caching)
        host_blocks = 0
        if preemption_mode == "swap" and policy == "continuous":   # static never preempts
            host_blocks = _host_blocks(swap_space, num_host_blocks, self.runner.kv_cache.bytes_per_block)
        offload_blocks = _offload_blocks(kv_offloading_size, num_offload_blocks, host_blocks,
                                         self.runner.kv_cache.bytes_per_block)
        scheduler = make_scheduler(policy, allocator, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                   eos_token_ids=self.runner.eos_token_ids, watermark=watermark,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_chunked_prefill=enable_chunked_prefill,
                                   preemption_mode=preemption_mode if host_blocks else "recompute",
                                   num_host_blocks=host_blocks, num_offload_blocks=offload_blocks,
                                   bytes_per_block=self.runner.kv_cache.bytes_per_block)
        pool = scheduler.host_allocator     # swapping's blocks and the host tier's, one pool
        host_cache = self.runner.kv_cache.host_pool(pool.num_blocks) if pool is not None else None
        executor = ModelExecutor(self.runner, host_cache, jump_forward=jump_forward,
                                 speculative_config=speculative_config)
        self.engine = Engine(scheduler, executor, tokenizer=self.tokenizer)
        self._ids = itertools.count()
        print(f"labkit: {self._load_line(device, dtype_reason)}; KV cache {self.runner.num_blocks} blocks x "
              f"{block_size} tokens ({size_text(self.runner.kv_cache.nbytes)}{self._kv_dtype_text()}): "
              f"{self.kv_plan.how}{self._tier_text(offload_blocks)}", file=sys.stderr)
        if self.runner.device.type == "cpu":
            warn_if_too_late(torch.get_num_threads())

    _said: set[str] = set()   # load lines already printed in this process

    def _kv_dtype_text(self) -> str:
        """The banner's words on a quantized cache: its dtype and how many more blocks it holds."""
        if not self.runner.kv_cache.quantized:
            return ""
        return (f", {self.runner.kv_cache_dtype_name} with fp32 scales per token and head: "
                f"{self.kv_block_ratio:.2f}x the blocks of {str(self.runner.dtype).removeprefix('torch.')}")

    def _tier_text(self, offload_blocks: int) -> str:
        """The banner's words on the host tier: its blocks and their bytes."""
        if not offload_blocks:
            return ""
        return (f"; host tier {offload_blocks} blocks "
                f"({size_text(offload_blocks * self.runner.kv_cache.bytes_per_block)}) behind the prefix cache")

    def _load_line(self, device, dtype: str) -> str:
        """The model and attention backend, in full the first time a process loads them;
        the same again (a benchmark's sweep, a notebook's second engine) says "as above"."""
        what = f"{self.runner.name} on {device} ({dtype}), attention backend"
        line = f"{what}: {self.runner.attention_backend_reason}"
        if line in LLM._said:
            return f"{what} {self.runner.attention_backend} as above"
        LLM._said.add(line)
        return line

    # ---- generation ---------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Serve every prompt (text or token ids) and return their outputs in input order.

        A prompt that can never be served (longer than the model allows, or than the whole
        KV cache) gets an output with ``error`` set and ``finish_reason="error"``; the
        others complete. Invalid sampling parameters raise ``ValueError`` before anything runs.
        """
        requests = self._submit(prompts, sampling_params)
        live = [r for r in requests if isinstance(r, Request)]
        bar = progress_bar(len(live), use_tqdm and len(live) > 1)
        remaining = {r.request_id for r in live}
        while remaining:
            done = self.engine.step()
            for r in done:
                remaining.discard(r.request_id)
            if bar is not None and done:
                bar.update(len(done))
            if not done and not self.engine.has_unfinished:
                break
        if bar is not None:
            bar.close()
        outputs = [self._output(r) for r in requests]
        for r in live:
            self.engine.release(r)
        return outputs

    def generate_stream(self, prompts: Prompt | Seq[Prompt],
                        sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Like ``generate``, but yields a ``RequestOutput`` each time a request gains tokens
        (``delta`` holds the new text per sample) and once more when it finishes."""
        requests = self._submit(prompts, sampling_params)
        for r in requests:
            if not isinstance(r, Request):
                yield self._output(r)
        remaining = {r.request_id: r for r in requests if isinstance(r, Request)}
        try:
            while remaining:
                finished = {r.request_id for r in self.engine.step()}
                plan = self.engine.last_plan
                touched = ({item.seq.request.request_id for item in plan.scheduled if item.num_samples}
                           if plan else set())
                for rid in list(remaining):
                    if rid in touched or rid in finished:
                        request = remaining[rid]
                        yield self._output(request, with_delta=True)
                        if request.finished:
                            self.engine.release(request)
                            del remaining[rid]
                if not self.engine.has_unfinished:
                    break
        finally:
            for rid, request in remaining.items():   # the consumer stopped early: free the
                self.engine.abort(rid)                # blocks and forget the text state
                self.engine.release(request)

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over every prompt (text or token ids), as vLLM's ``LLM.beam_search``:
        one ``BeamSearchOutput`` per prompt, in input order, its ``sequences`` best first.

        The beams of a request are sequences of the engine that share their blocks by
        reference count; every step the surviving candidates fork from their parents and
        the beams no candidate continues are freed at once. The rules are Transformers'
        (``labkit/beam_search.py``, ``docs/beam_search.md``). A prompt that can never be
        served gets an output with ``error`` set and no sequences.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"expected BeamSearchParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and is_token_id(prompts[0])):
            prompts = [prompts]
        encoded = [encode_prompt(prompt, self.tokenizer) for prompt in prompts]
        entries: list[Request | BeamSearchOutput] = []
        for prompt, (text, ids) in zip(prompts, encoded, strict=True):
            request_id = str(next(self._ids))
            try:
                entries.append(self.engine.add_request(ids, params, request_id=request_id, prompt=text,
                                                       cache_salt=split_prompt(prompt)[1]))
            except ValueError as e:
                warnings.warn(f"labkit: request rejected: {e}", stacklevel=2)
                entries.append(BeamSearchOutput(request_id, text, list(ids), [], error=str(e)))
        live = [r for r in entries if isinstance(r, Request)]
        bar = progress_bar(len(live), use_tqdm and len(live) > 1)
        while any(not r.finished for r in live):
            done = self.engine.step()
            if bar is not None and done:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        outputs = [self._beam_output(r) if isinstance(r, Request) else r for r in entries]
        for r in live:
            self.engine.release(r)
        return outputs

    def _beam_output(self, request: Request) -> BeamSearchOutput:
        prompt = request.prompt_token_ids
        sequences = [BeamSearchSequence(prompt + h.output_token_ids, list(h.output_token_ids),
                                        self.tokenizer.decode(h.output_token_ids, skip_special_tokens=True),
                                        h.cum_logprob, h.score, h.finish_reason)
                     for h in request.beam_search.outputs()]
        return BeamSearchOutput(request.request_id, request.prompt, list(prompt), sequences)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to chat conversations, formatted with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _submit(self, prompts, sampling_params) -> list[Request | RequestOutput]:
        """Check everything first, then queue: a ValueError leaves the engine untouched.
        A request the engine refuses (too long, token ids outside the vocabulary) becomes
        an error output, and the others go on."""
        prompts, params = pair_prompts_with_params(prompts, sampling_params)
        for p in params:
            p.validate()
        encoded = [encode_prompt(prompt, self.tokenizer) for prompt in prompts]
        out: list[Request | RequestOutput] = []
        for prompt, (text, ids), p in zip(prompts, encoded, params, strict=True):
            request_id = str(next(self._ids))
            try:
                out.append(self.engine.add_request(ids, p, request_id=request_id, prompt=text,
                                                   cache_salt=split_prompt(prompt)[1]))
            except ValueError as e:
                warnings.warn(f"labkit: request rejected: {e}", stacklevel=3)
                out.append(error_output(request_id, text, ids, str(e), self.engine.now))
        return out

    def _output(self, r: Request | RequestOutput, with_delta: bool = False) -> RequestOutput:
        if isinstance(r, RequestOutput):
            return r
        engine = self.engine
        delta = [engine.deltas.get(s.seq_id, "") for s in r.seqs] if with_delta else None
        return request_output(r, [engine.text_of(s) for s in r.seqs], delta)

    # ---- inspection ---------------------------------------------------------------
    def stats(self) -> dict:
        """Counters of the engine and the KV cache, as numbers; ``docs/stats.md`` defines
        every key."""
        s = self.engine.stats()
        s.update(model=self.runner.name, attention_backend=self.runner.attention_backend,
                 kv_cache_bytes=self.runner.kv_cache.nbytes, max_model_len=self.max_model_len,
                 kv_cache_dtype=self.runner.kv_cache_dtype_name, kv_cache_block_ratio=self.kv_block_ratio)
        s.update(self.engine.scheduler.swap_stats(), swap_s=self.engine.executor.swap_s)
        return s

    def reset_prefix_cache(self) -> int:
        """Forget cached prefixes that no request holds, on the device and in the host tier.
        Returns how many device blocks were freed."""
        tier = self.engine.scheduler.tier
        if tier is not None:
            tier.reset()
        return self.engine.scheduler.allocator.reset_prefix_cache()

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def allocator(self) -> BlockAllocator:
        return self.engine.scheduler.allocator


def pair_prompts_with_params(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """``generate``'s arguments as vLLM takes them: one prompt (text, token ids, or a prompt
    dict ``{"prompt": text}``/``{"prompt_token_ids": ids}`` with an optional ``"cache_salt"``:
    ``request.split_prompt``) or a list of them, and one SamplingParams for all (None: the
    defaults) or one each. Returns two lists of equal length; a count or type mismatch is a
    ValueError."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and is_token_id(prompts[0])):
        prompts = [prompts]
    prompts = list(prompts)
    sampling_params = SamplingParams() if sampling_params is None else sampling_params
    params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(p).__name__}")
    return prompts, params


def _check_swap_args(mode, swap_space, num_host_blocks) -> None:
    """Refuse a preemption mode or host pool that cannot work, before anything is loaded."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
    if isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or not swap_space >= 0:
        raise ValueError(f"swap_space must be a non-negative number of GiB, got {swap_space!r}")
    if num_host_blocks is not None and (isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int)
                                        or num_host_blocks < 1):
        raise ValueError(f"num_host_blocks must be a positive integer, got {num_host_blocks!r}")


def _check_offload_args(size, num_blocks, enable_prefix_caching, policy: str) -> None:
    """Refuse a host tier that cannot work, before anything is loaded."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
        raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_offload_blocks must be a positive integer, got {num_blocks!r}")
    if size is not None and num_blocks is not None:
        raise ValueError("give kv_offloading_size or num_offload_blocks, not both")
    if (size is not None or num_blocks is not None) and prefix_cache_policy(enable_prefix_caching) is None:
        raise ValueError("kv_offloading_size: the host tier keeps the blocks the prefix cache evicts; "
                         "turn prefix caching on (enable_prefix_caching=True, 'hash' or 'radix')")
    if (size is not None or num_blocks is not None) and policy == "static":
        raise ValueError("kv_offloading_size: the static baseline never reuses cached prefixes, so a host tier "
                         "behind it would only copy blocks; serve with policy='continuous'")


def _offload_blocks(size: float | None, num_blocks: int | None, swap_blocks: int, bytes_per_block: int) -> int:
    """Host blocks for the host tier: ``num_blocks`` if given, else as many as ``size`` GiB
    holds (0: no tier); refused when the host has not that much memory besides the swap pool."""
    if size is None and num_blocks is None:
        return 0
    blocks = num_blocks if num_blocks is not None else int(size * 2**30 // bytes_per_block)
    if blocks < 1:
        raise ValueError(f"kv_offloading_size={size} GiB holds no KV block of {bytes_per_block} bytes: "
                         "raise it")
    available = device_memory("cpu")
    need = (blocks + swap_blocks) * bytes_per_block
    if available is not None and need > available.nbytes:
        raise ValueError(f"the host pool (host tier{' and swapping' if swap_blocks else ''}) would take "
                         f"{need / 2**30:.2f} GiB but only {available.nbytes / 2**30:.2f} GiB of host memory is "
                         f"{available.what}; lower kv_offloading_size (GiB) or num_offload_blocks")
    return blocks


def _host_blocks(swap_space: float, num_host_blocks: int | None, bytes_per_block: int) -> int:
    """Host blocks for swapping: ``num_host_blocks`` if given, else as many as ``swap_space``
    GiB holds; refused when the host has not that much memory available."""
    blocks = num_host_blocks if num_host_blocks is not None else int(swap_space * 2**30 // bytes_per_block)
    if blocks < 1:
        raise ValueError(f"swap_space={swap_space} GiB holds no KV block of {bytes_per_block} bytes: "
                         "preemption_mode='swap' needs a host pool (raise swap_space)")
    available = device_memory("cpu")
    if available is not None and blocks * bytes_per_block > available.nbytes:
        raise ValueError(f"the host pool for swapping would take {blocks * bytes_per_block / 2**30:.2f} GiB "
                         f"but only {available.nbytes / 2**30:.2f} GiB of host memory is {available.what}; "
                         "lower swap_space (GiB) or num_host_blocks")
    return blocks
