"""``POST /v1/completions``: a prompt (text, token ids, or a batch of either) -> text.

What only completions have: ``echo`` (the prompt comes back as each choice's first
chunk, and with ``logprobs`` its tokens' logprobs, the first null), the legacy logprobs
shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), and vLLM's
``prompt_logprobs`` on each choice. The invariant: a choice's ``text_offset`` counts the
characters of everything sent before its token, echoed prompt included, across chunks.
"""

from __future__ import annotations

from typing import AsyncIterator

from .protocol import Parsed, completion_logprobs, parse_completion, sse
from .serving import Job, Serving


class CompletionServing(Serving):
    id_prefix = "cmpl"
    prompt_param = "prompt"
    object = chunk_object = "text_completion"

    def parse(self, body: dict) -> Parsed:
        return parse_completion(body)

    def too_long(self, limit: int, num_prompt: int, max_tokens: int | None = None) -> str:
        if max_tokens is None:
            return (f"This model's maximum context length is {limit} tokens, however your prompt "
                    f"has {num_prompt} tokens. Please reduce your prompt.")
        return (f"This model's maximum context length is {limit} tokens, however you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in your prompt; {max_tokens} for the "
                "completion). Please reduce your prompt; or completion length.")

    def choice(self, parsed: Parsed, out, o) -> dict:
        echoed = parsed.echo
        logprobs = None
        if parsed.logprobs is not None:
            prompt_ids, prompt_steps = (out.prompt_token_ids, out.prompt_logprobs) if echoed else ([], [])
            logprobs = completion_logprobs(self.names, prompt_ids + o.token_ids,
                                           list(prompt_steps or []) + list(o.logprobs or []), top=parsed.logprobs)
        choice = {"text": (self.prompt_text(out) if echoed else "") + o.text, "logprobs": logprobs,
                  "finish_reason": o.finish_reason}
        if parsed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out, parsed.prompt_logprobs)
        return choice

    def stream(self, job: Job) -> AsyncIterator[str]:
        parsed = job.parsed
        offsets: dict[int, int] = {}          # choice -> text_offset of its next token

        def logprobs_of(index, token_ids, steps):
            lp = completion_logprobs(self.names, token_ids, steps, offsets.get(index, 0), parsed.logprobs)
            offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if token_ids else offsets.get(index, 0)
            return lp

        def chunk(index, text, finish_reason, token_ids, steps=None, scored=None):
            """``steps``: the logprobs of ``scored`` (default: ``token_ids``), or None."""
            lp = logprobs_of(index, token_ids if scored is None else scored, steps) if steps is not None else None
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            if parsed.return_token_ids:
                choice["token_ids"] = token_ids
            return sse({"id": job.rid, "object": self.chunk_object, "created": job.created, "model": self.name,
                        "choices": [choice]})

        def echo(index, out):
            """The prompt, as the choice's first chunk (once its logprobs are all there)."""
            if parsed.logprobs is None:
                return chunk(index, self.prompt_text(out), None, [])
            steps = out.prompt_logprobs or []
            if len(steps) < len(out.prompt_token_ids) and not out.finished:
                return None
            return chunk(index, self.prompt_text(out), None, [], list(steps), out.prompt_token_ids[:len(steps)])

        return self.events(job, chunk, [], echo if parsed.echo else None)
