"""Engine outputs as OpenAI's JSON: full responses, SSE chunks, logprobs, usage, tool-call deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serval.outputs import CompletionOutput, RequestOutput
from serval.sampling_params import SamplingParams
from serval.server.protocol import now
from serval.server.tools import ToolCallParser, parse_tool_calls
from serval.tokenizer import IncrementalDetokenizer


@dataclass
class Choice:
    """One streamed choice's progress: what was sent, why it ended."""

    index: int
    sent: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0
    num_chars: int = 0  # of text sent, the echoed prompt included: where the next token's text_offset starts
    echoed: bool = False
    finish_reason: str | None = None
    filter_checked: int = 0  # the output filter passed the text up to here
    tool_calls: ToolCallParser | None = None  # when the request has tools: splits calls out of the text


@dataclass
class Rendering:
    """What every choice of one generation request is rendered with."""

    tokenizer: Any
    prompts: list  # (prompt, its text as sent, or None when it came as token ids)
    params: SamplingParams
    chat: bool
    echo: bool
    tools: bool  # the request has tools: tool calls are split out of the text
    response_id: str
    model: str


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def full_response(shape: Rendering, finals: dict[int, RequestOutput]) -> dict:
    """The non-streamed answer: every prompt's final output, its choices in order, and the usage."""
    out_choices = []
    prompt_tokens = completion_tokens = cached = 0
    for prompt_index in sorted(finals):
        output = finals[prompt_index]
        prompt_tokens += len(output.prompt_token_ids)
        cached += output.num_cached_tokens
        for c in output.outputs:
            completion_tokens += len(c.token_ids)
            index = prompt_index * shape.params.n + c.index
            out_choices.append(_chat_choice(shape, index, c) if shape.chat
                               else _completion_choice(shape, index, prompt_index, output, c))
    result = {"id": shape.response_id, "object": "chat.completion" if shape.chat else "text_completion",
              "created": now(), "model": shape.model, "choices": out_choices,
              "usage": usage(prompt_tokens, completion_tokens, cached)}
    held = [finals[i].kv_transfer_params for i in sorted(finals) if finals[i].kv_transfer_params]
    if held:  # a prefill worker's: where a decode worker fetches the prompt's KV (one prompt)
        result["kv_transfer_params"] = held[0]
    return result


def _chat_choice(shape: Rendering, index: int, c: CompletionOutput) -> dict:
    message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
    content, calls = parse_tool_calls(c.text) if shape.tools else (c.text, [])
    if calls:
        message = {"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]}
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    logprobs = chat_logprobs(shape.tokenizer, c.logprobs or []) if shape.params.logprobs is not None else None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _completion_choice(shape: Rendering, index: int, prompt_index: int, output: RequestOutput,
                       c: CompletionOutput) -> dict:
    tokenizer = shape.tokenizer
    prompt_text = echo_text(tokenizer, shape.prompts[prompt_index][1], output) if shape.echo else ""
    logprobs = None
    if shape.params.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, c.logprobs or [], len(prompt_text))
        if shape.echo:
            logprobs = join_logprobs(prompt_logprobs(tokenizer, output), logprobs)
    return {"index": index, "text": prompt_text + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}


class StreamRenderer:
    """A streamed answer's SSE chunks, an output at a time; counts the usage the last chunk reports."""

    def __init__(self, shape: Rendering, include_usage: bool) -> None:
        self.shape, self.include_usage = shape, include_usage
        self.choices: dict[int, Choice] = {}  # shared with the observer, which creates them
        self.prompt_tokens = self.completion_tokens = self.cached = 0
        obj = "chat.completion.chunk" if shape.chat else "text_completion"
        # Every chunk starts with the same fields: encoded once, not once a token.
        self.head = json.dumps({"id": shape.response_id, "object": obj, "created": now(), "model": shape.model},
                               ensure_ascii=False)[:-1]

    def chunk(self, choice_list: list, counts: dict | None = None) -> str:
        body = f'{self.head}, "choices": {json.dumps(choice_list, ensure_ascii=False)}'
        if self.include_usage:
            body += f', "usage": {json.dumps(counts)}'
        return f"data: {body}}}\n\n"

    def role_chunk(self) -> str:
        """A chat stream's first chunk: every choice's assistant role."""
        n = len(self.shape.prompts) * self.shape.params.n
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(n)])

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached)

    def add(self, prompt_index: int, output: RequestOutput) -> str | None:
        """The chunk for what ``output`` brings past what was sent (None when nothing is ready to send)."""
        pieces = []
        for c in output.outputs:
            piece = self._piece(self.choices[prompt_index * self.shape.params.n + c.index], prompt_index, output, c)
            if piece is not None:
                pieces.append(piece)
        if output.finished:
            self.prompt_tokens += len(output.prompt_token_ids)
            self.cached += output.num_cached_tokens
            self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        return self.chunk(pieces) if pieces else None

    def _piece(self, choice: Choice, prompt_index: int, output: RequestOutput, c: CompletionOutput) -> dict | None:
        shape, tokenizer = self.shape, self.shape.tokenizer
        if choice.finish_reason is not None:
            return None
        delta = c.text[len(choice.sent):]
        new_logprobs = (c.logprobs or [])[choice.num_logprobs:]
        choice.num_tokens = len(c.token_ids)
        echo_now = shape.echo and not choice.echoed  # the first chunk carries the prompt
        if not delta and not c.finish_reason and not echo_now:
            return None  # held back: these tokens' logprobs go with the text that completes them
        prompt_text = echo_text(tokenizer, shape.prompts[prompt_index][1], output) if echo_now else ""
        delta = prompt_text + delta
        choice.echoed = choice.echoed or echo_now
        choice.num_logprobs += len(new_logprobs)
        choice.sent = c.text
        choice.finish_reason = c.finish_reason
        lp = None
        if shape.params.logprobs is not None and shape.chat and new_logprobs:
            lp = chat_logprobs(tokenizer, new_logprobs)
        elif shape.params.logprobs is not None and (new_logprobs or echo_now):
            lp = completion_logprobs(tokenizer, new_logprobs, choice.num_chars + len(prompt_text))
            if echo_now:
                lp = join_logprobs(prompt_logprobs(tokenizer, output), lp)
        choice.num_chars += len(delta)
        if shape.chat and shape.tools:
            return tool_delta(choice, delta, c.finish_reason, lp)
        if shape.chat:
            return {"index": choice.index, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        return {"index": choice.index, "text": delta, "logprobs": lp, "finish_reason": c.finish_reason}


def tool_delta(choice: Choice, text: str, finish_reason: str | None, logprobs) -> dict | None:
    """A streamed chat delta when the request has tools: content as it becomes final, each call whole once its
    closing tag arrives (index, id, name and all its arguments in one delta); None when there is nothing yet."""
    parser = choice.tool_calls = choice.tool_calls or ToolCallParser()
    first = len(parser.calls)
    content, calls = parser.feed(text)
    if finish_reason is not None:
        content += parser.finish()
        if parser.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
    delta: dict = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [call.to_openai(first + i) for i, call in enumerate(calls)]
    if not delta and finish_reason is None and logprobs is None:
        return None
    return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, logprobs, text_offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top.append({token_text(tokenizer, t): v for t, v in lp.top.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_text(tokenizer, prompt_text: str | None, output: RequestOutput) -> str:
    """The prompt as echoed: as sent, or decoded when it came as token ids."""
    return prompt_text if prompt_text is not None else tokenizer.decode(output.prompt_token_ids)


def prompt_logprobs(tokenizer, output: RequestOutput) -> dict:
    """Completions logprobs of the echoed prompt's tokens. The first has none (nothing precedes it): its
    token_logprob and top_logprobs are null, as in OpenAI's and vLLM's responses."""
    ids = output.prompt_token_ids
    entries = list(output.prompt_logprobs or [])
    entries += [None] * (len(ids) - len(entries))  # none at all, or an output cut short in its prompt
    tokens, token_logprobs, top, offsets = [], [], [], []
    # Offsets follow the decoded prompt, so a character split over several tokens starts at its first token.
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    for token_id, lp in zip(ids, entries, strict=True):
        offsets.append(len(detokenizer.text))
        detokenizer.add(token_id)
        tokens.append(token_text(tokenizer, token_id))
        token_logprobs.append(lp.logprob if lp is not None else None)
        top.append({token_text(tokenizer, t): v for t, v in lp.top.items()} if lp is not None else None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokenizer, logprobs) -> dict:
    content = []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tops = [(token_text(tokenizer, t), v) for t, v in lp.top.items()]
        content.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in tops]})
    return {"content": content}
