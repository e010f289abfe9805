"""`LLM.chat` with tools or a reasoning parser: the same prompt, grammar and answer parsing as the
server's chat route (`chat_prompt.py`, `chat_output.py`), for prompts and SamplingParams that
`LLM.generate` runs, and the parsed parts put on each output (`CompletionOutput.tool_calls`,
`.reasoning_content`; `text` stays the whole answer). Picture parts (a PIL image, a local path, a
data URL; `pictures.picture_parts`) are loaded and processed as the server does, any local path allowed.
"""

from __future__ import annotations

import copy

from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.serving.chat.output import ChatOutputPlan
from deepinfer.serving.chat.prompt import ChatSetup, TemplateRefused, prepare_chat
from deepinfer.serving.chat.reasoning import make_reasoning_parser
from deepinfer.serving.chat.tool_parsers import make_tool_parser
from deepinfer.serving.chat.tools import tool_plan
from deepinfer.serving.pictures import OFFLINE, has_pictures


def prepare_offline_chat(tokenizer, conversations: list[list[dict]], params: list[SamplingParams], *,
                         tools=None, tool_choice=None, parallel_tool_calls=None, tool_call_parser: str = "auto",
                         reasoning_parser: str | None = None, chat_template_kwargs: dict | None = None,
                         add_generation_prompt: bool = True, vision=None
                         ) -> tuple[list[list[int]], list[SamplingParams], list[ChatOutputPlan], list[tuple]]:
    """(prompt ids, params, reading plan, pictures) per conversation; ValueError naming the field (and the
    conversation's index when there are several) for anything refused. `vision`: the model's
    VisionProcessor (None: a text model)."""
    setup = ChatSetup(make_tool_parser(tool_call_parser, tokenizer), make_reasoning_parser(reasoning_parser, tokenizer),
                      vision, OFFLINE)
    plan_of_tools = tool_plan(tools, tool_choice, parallel_tool_calls)
    prompts, prepared, plans, pictures = [], [], [], []
    for i, (messages, p) in enumerate(zip(conversations, params, strict=True)):
        try:
            chat = prepare_chat(tokenizer, setup, messages, plan_of_tools, p.structured_output,
                                template_kwargs=chat_template_kwargs, add_generation_prompt=add_generation_prompt)
        except TemplateRefused as exc:
            raise ValueError(f"messages[{i}]: the chat template refused them ({exc})") from None
        p = copy.copy(p)
        p.structured_output = chat.structured_output
        p.skip_special_tokens = p.skip_special_tokens and not chat.keep_special_tokens
        prompts.append(chat.prompt_ids)
        prepared.append(p.validate())
        plans.append(chat.plan)
        pictures.append(chat.pictures)
    return prompts, prepared, plans, pictures


def attach_parsed(outputs: list[RequestOutput], plans: list[ChatOutputPlan]) -> None:
    """Each output's tool calls and reasoning, parsed from its text."""
    for out, plan in zip(outputs, plans, strict=True):
        for c in out.outputs:
            parsed = plan.read(c)
            if plan.tool_parser is not None:
                c.tool_calls = parsed.tool_calls
            c.reasoning_content = parsed.reasoning_content


def with_pictures(conversations: list[list[dict]]) -> bool:
    """Whether any message of any conversation carries a picture part."""
    return any(has_pictures(messages) for messages in conversations)
