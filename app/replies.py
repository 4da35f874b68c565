"""ReplyWriter, built once at start-up: writes one chat reply from an engine stream, streamed (SSE chunks) or whole
(a ``chat.completion``), the one writer of /v1/chat/completions and of session turns; and the steps the
generating routes share before and around it (rendering the chat, the request's SamplingParams, the texts of
logprob tokens, which outputs are worth a chunk)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.chat_format import plan as chat_plan
from app.chat_format.formats import ChatFormat
from app.chat_format.plan import ChatSetup, ReplyPlan, ToolUse
from app.chat_format.reply_parser import ReplyDelta, ReplyParser
from app.errors import APIError
from app.openai_format import (
    ResponseHeader,
    chat_choice_delta,
    chat_choice_message,
    chat_logprobs,
    logprob_token_ids,
    samples_usage,
)
from app.prompts import NoTokenizer, PromptRenderer
from app.protocol.completions import ChatCompletionRequest
from app.protocol.messages import ChatMessage
from app.protocol.sampling import SamplingFields
from app.request_body import cancel_on_disconnect
from app.request_budget import check_request_tokens
from app.timed_stream import TimedStream
from app.sse import sse_response
from engine.output.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True, eq=False)
class ReplyWriter:
    prompts: PromptRenderer
    model_name: str  # the primary name
    max_model_len: int
    default_max_tokens: int  # for requests without max_tokens
    # the model's (app/generation_config.py)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_request_tokens: int = 0  # the most one request may buy (app/request_budget.py); 0: no limit
    # the model's tool-call syntax and reasoning markers (None: no tokenizer)
    chat_format: ChatFormat | None = None
    chat_template: str | None = None

    async def answer_chat(
        self,
        request: Request,
        body: SamplingFields,
        stream: TimedStream,
        headers: dict[str, str] | None = None,
    ) -> Response:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # the name the request asked for (Admission.check_model has refused any other), else the primary
        model = body.model or self.model_name
        if body.stream:
            header = ResponseHeader.new(
                "chat.completion.chunk",
                model,
                "chatcmpl",
                include_usage,
                body.return_token_ids,
            )
            return sse_response(self.chat_chunks(header, stream, include_usage), headers=headers)
        header = ResponseHeader.new(
            "chat.completion", model, "chatcmpl", return_token_ids=body.return_token_ids
        )
        finals = await cancel_on_disconnect(request, stream.collect())
        choices = []
        for out in finals:
            parser = self.reply_plan(stream).parser(f"{stream.request_id}:{out.index}")
            parser.feed(out.text, final=True)
            choice = chat_choice_message(
                out.index,
                parser,
                _finish_reason(out, parser),
                await self._chat_logprobs(out, whole=True),
                out.stop_reason,
            )
            choices.append(header.choice_ids(choice, out.token_ids))
        answer = header.wrap(choices, samples_usage([out.usage for out in finals]))
        if stream.turn_pending:
            answer["session_turn"] = "pending"
        return JSONResponse(answer, headers=headers)

    async def chat_chunks(
        self,
        header: ResponseHeader,
        stream: TimedStream,
        include_usage: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        """For each choice ``delta.role`` first (all up front, as vLLM does), then one chunk per text delta of any
        choice as they come (each chunk carries one choice, told apart by ``index``), ``finish_reason`` on each
        choice's last chunk, and with include_usage a final chunk with no choices and the usage."""
        for index in range(stream.num_samples):
            yield header.wrap([chat_choice_delta(index, {"role": "assistant", "content": ""})])
        finals: dict[int, RequestOutput] = {}
        plan, parsers = self.reply_plan(stream), {}
        async for out in stream:
            logprobs = await self._chat_logprobs(out, whole=False)
            parser = parsers.get(out.index)
            if parser is None:
                parser = parsers[out.index] = plan.parser(f"{stream.request_id}:{out.index}")
            parts = parser.feed(out.text_delta, final=out.finished)
            if parts or self.worth_a_chunk(header, out, logprobs, text=False):
                choice = chat_choice_delta(
                    out.index,
                    _delta(parts, out.finished),
                    _finish_reason(out, parser),
                    logprobs,
                    out.stop_reason,
                )
                yield header.wrap([header.choice_ids(choice, out.token_ids_delta)])
            if out.finished:
                finals[out.index] = out
        await stream.settled()
        if include_usage and finals:
            yield header.wrap([], samples_usage([finals[i].usage for i in sorted(finals)]))
        if stream.turn_pending:
            yield {**header.wrap([]), "session_turn": "pending"}

    def worth_a_chunk(
        self,
        header: ResponseHeader,
        out: RequestOutput,
        logprobs: dict[str, Any] | None,
        text: bool = True,
    ) -> bool:
        """Text (unless ``text`` is False: the caller decides on its own parts), logprobs or the end; without a
        tokenizer (dummy weights), or with ``return_token_ids``, every new token, so clients still see each one
        arrive."""
        tokens_shown = header.return_token_ids or not self.prompts.has_tokenizer
        return bool(
            (text and out.text_delta)
            or logprobs
            or out.finished
            or (out.token_ids_delta and tokens_shown)
        )

    def reply_plan(self, stream: TimedStream) -> ReplyPlan:
        """How the stream's text splits into reasoning, content and tool calls (its request's plan, or the
        model's reasoning markers alone)."""
        if stream.reply_plan is not None:
            return stream.reply_plan
        if self.chat_format is None:
            return _PLAIN
        return ReplyPlan(self.chat_format)

    async def prepare_chat(
        self, body: ChatCompletionRequest
    ) -> tuple[list[int], SamplingParams, ReplyPlan]:
        """A chat request's prompt, SamplingParams and reply plan: its tools rendered by the template (or
        described in the system message), its reasoning switches, and the grammar of its tool calls."""
        setup = self.chat_setup(body)
        messages = [m.as_template_message() for m in body.messages]
        if self.chat_format is not None:
            messages = chat_plan.calls_as_text(self.chat_format, messages)
        messages = chat_plan.with_instructions(setup, messages)
        ids = await self._render(messages, setup.kwargs)
        params, plan = await self.constrain(self.sampling_params(body, len(ids)), setup, ids)
        return ids, params, plan

    def chat_setup(self, body: ChatCompletionRequest) -> ChatSetup:
        """400 naming the field for a tool choice the tools cannot meet."""
        try:
            use = ToolUse.of(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ValueError as exc:
            raise APIError.from_value_error(exc) from None
        return chat_plan.chat_setup(
            self.chat_format,
            self.chat_template,
            use,
            body.reasoning_effort,
            body.chat_template_kwargs,
        )

    async def constrain(
        self, params: SamplingParams, setup: ChatSetup, prompt_ids: list[int]
    ) -> tuple[SamplingParams, ReplyPlan]:
        """``params`` with the grammar of the setup's tool calls, and the reply's plan (whether the prompt ends
        inside the model's reasoning: its last tokens' text says)."""
        fmt = self.chat_format
        if fmt is None:
            if setup.use.active:
                raise APIError.bad_request(
                    "tools: this model has no tokenizer (dummy weights)", "tools"
                )
            return params, _PLAIN
        tail = await self.prompts.decode(prompt_ids[-8:]) if fmt.reasoning else ""
        plan = ReplyPlan(fmt, setup.use.active, chat_plan.opens_reasoning(fmt, tail))
        if setup.use.active:
            spec = chat_plan.tool_grammar_spec(fmt, setup.use, plan.reasoning_open)
            params = dataclasses.replace(params, structured_output=spec)
            if chat_plan.needs_special_tokens(fmt, setup.use):
                params.skip_special_tokens = False
        return params, plan

    async def _chat_logprobs(self, out: RequestOutput, whole: bool) -> dict[str, Any] | None:
        entries = out.logprobs if whole else out.logprobs_delta
        if not entries:
            return None
        return chat_logprobs(entries, await self.token_texts(entries))

    async def token_texts(self, entries: list) -> dict[int, str]:
        ids = list(dict.fromkeys(logprob_token_ids(entries)))
        return dict(zip(ids, await self.prompts.convert_ids_to_tokens(ids)))

    async def render_chat(
        self, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        return await self._render([m.as_template_message() for m in messages], template_kwargs)

    async def _render(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None
    ) -> list[int]:
        try:
            return await self.prompts.chat(messages, template_kwargs)
        except NoTokenizer as exc:
            raise APIError.bad_request(
                f"messages: {exc}".replace("prompt: ", ""), "messages"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a template that refuses the conversation (jinja raise_exception)
            raise APIError.bad_request(
                f"messages: the chat template refused them: {exc}", "messages"
            ) from None

    def sampling_params(self, body: SamplingFields, num_prompt_tokens: int) -> SamplingParams:
        return self.sampling_params_each(body, [num_prompt_tokens])[0]

    def sampling_params_each(
        self, body: SamplingFields, prompt_lengths: list[int]
    ) -> list[SamplingParams]:
        """The SamplingParams of each prompt of one request; a 400 naming the field for a value the engine
        refuses, or for a request over --max-request-tokens in all (app/request_budget.py)."""
        try:
            params = [
                body.sampling_params(
                    length, self.max_model_len, self.default_max_tokens, self.sampling_defaults
                )
                for length in prompt_lengths
            ]
        except ValueError as exc:
            raise APIError.from_value_error(exc) from None
        check_request_tokens(body, prompt_lengths, params, self.max_request_tokens)
        return params


_PLAIN = ReplyPlan(ChatFormat.plain())


def _delta(parts: ReplyDelta, finished: bool) -> dict[str, Any]:
    """OpenAI's ``delta`` of a chunk: reasoning, content and tool-call fragments (an empty content while the
    reply goes on, so a client sees each chunk)."""
    delta: dict[str, Any] = {}
    if parts.reasoning:
        delta["reasoning_content"] = parts.reasoning
    if parts.content or not (finished or parts.reasoning or parts.tool_calls):
        delta["content"] = parts.content
    if parts.tool_calls:
        delta["tool_calls"] = [call.chunk() for call in parts.tool_calls]
    return delta


def _finish_reason(out: RequestOutput, parser: ReplyParser) -> str | None:
    """``tool_calls`` for a reply that ended by itself with calls (OpenAI's), else the engine's reason."""
    if out.finish_reason == "stop" and parser.calls and out.stop_reason is None:
        return "tool_calls"
    return out.finish_reason
