"""``POST /v1/chat/completions``: messages -> the model's chat template -> a reply.

What only chat has: the prompt is a conversation, rendered by the model's chat template
(a model without one is refused), so errors about the prompt name ``"messages"``; without
``max_tokens`` the reply may fill what the prompt leaves of the context; a reply is a
``message`` (``delta`` when streamed, the first chunk of each choice naming the role);
logprobs come in chat's shape (``logprobs.content``), and vLLM's ``prompt_logprobs`` sit
on the whole answer, not on each choice.
"""

from __future__ import annotations

from typing import AsyncIterator

from .protocol import Parsed, bad_request, chat_logprobs, parse_chat, sse
from .serving import Job, Serving


class ChatServing(Serving):
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def parse(self, body: dict) -> Parsed:
        parsed = parse_chat(body)
        if getattr(self.engine.tokenizer, "chat_template", None) is None:
            raise bad_request(f"model {self.name!r} has no chat template: use /v1/completions", param="messages")
        return parsed

    async def tokenize(self, messages) -> tuple[str | None, list[int]]:
        return await self.engine.tokenize(await self.engine.render_chat(messages))

    def too_long(self, limit: int, num_prompt: int, max_tokens: int | None = None) -> str:
        if max_tokens is None:
            return (f"This model's maximum context length is {limit} tokens. However, your messages "
                    f"resulted in {num_prompt} tokens. Please reduce the length of the messages.")
        return (f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.")

    def choice(self, parsed: Parsed, out, o) -> dict:
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = chat_logprobs(self.names, o.token_ids, o.logprobs or [], parsed.logprobs)
        return {"message": {"role": "assistant", "content": o.text}, "logprobs": logprobs,
                "finish_reason": o.finish_reason}

    def finish_body(self, body: dict, parsed: Parsed, final: dict) -> None:
        if parsed.prompt_logprobs is not None:         # vLLM: chat's are the response's
            body["prompt_logprobs"] = self.prompt_logprobs(final[0], parsed.prompt_logprobs)

    def stream(self, job: Job) -> AsyncIterator[str]:
        parsed = job.parsed

        def event(index, delta, finish_reason, token_ids=None, logprobs=None):
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if token_ids is not None and parsed.return_token_ids:
                choice["token_ids"] = token_ids
            return sse({"id": job.rid, "object": self.chunk_object, "created": job.created, "model": self.name,
                        "choices": [choice]})

        def chunk(index, text, finish_reason, token_ids, steps=None):
            lp = chat_logprobs(self.names, token_ids, steps, parsed.logprobs) if steps is not None else None
            return event(index, {"content": text} if text or not finish_reason else {}, finish_reason, token_ids, lp)

        # OpenAI's first chunk of each choice names the role, with empty content.
        preamble = [event(i, {"role": "assistant", "content": ""}, None, [])
                    for i in range(len(job.streams) * parsed.params.n)]
        return self.events(job, chunk, preamble)
