"""Tiny random checkpoints with hand-written chat templates that support tools, one per tool-call
format (the way real templates of that family write calls, results and the tool list), a
reasoning template, and seeded random function schemas for the tool-calling tests.

A tiny random model writes gibberish, so the tests get real calls by forcing them
(`tool_choice` "required" or a named function) and test free parsing on hand-written answers.
"""

from __future__ import annotations

import os
import random
import shutil

HERMES = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Their signatures are in <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, answer <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """\
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{% if not loop.first %}; {% endif %}{"name": {{ call.function.name | tojson }}, \
"parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{% if loop.first and tools %}To call a function, answer {"name": function name, "parameters": dictionary of \
argument name and its value}. Functions: {% for t in tools %}{{ t | tojson }} {% endfor %}

{% endif %}{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """\
{%- for message in messages %}
{%- if message.role == 'user' %}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'system' %}[SYSTEM_PROMPT]{{ message.content }}[/SYSTEM_PROMPT]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][{% for call in message.tool_calls %}\
{% if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}\
{% endif %}{% if not loop.first %}, {% endif %}{"name": {{ call.function.name | tojson }}, "arguments": \
{{ call.function.arguments | tojson }}, "id": {{ call.id | tojson }}}{% endfor %}]<|im_end|>
{%- elif message.role == 'assistant' %}{{ message.content }}<|im_end|>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"call_id": {{ message.tool_call_id | tojson }}, "content": \
{{ message.content | tojson }}}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

# DeepSeek's own templates concatenate a call's arguments as text ('...' + arguments + '...')
DEEPSEEK_V3 = """\
{{ bos_token }}{% for message in messages %}{% if message.role == 'system' %}{{ message.content }}{% endif %}\
{% endfor %}
{%- if tools %}## Tools
{% for t in tools %}### {{ t.function.name }}
Parameters: {{ t.function.parameters | tojson }}
{% endfor %}{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<｜User｜>{{ message.content }}
{%- elif message.role == 'assistant' and message.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>\
{% for call in message.tool_calls %}{% if not loop.first %}{{ '\\n' }}{% endif %}\
{{ '<｜tool▁call▁begin｜>' + call.type + '<｜tool▁sep｜>' + call.function.name + '\\n```json\\n' + \
call.function.arguments + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>
{%- elif message.role == 'assistant' %}<｜Assistant｜>{{ message.content }}<｜end▁of▁sentence｜>
{%- elif message.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ message.content }}\
<｜tool▁output▁end｜><｜tool▁outputs▁end｜>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"""

# DeepSeek-R1 style: the generation prompt opens the reasoning section
REASONING = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""

TOOL_TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "deepseek_v3": DEEPSEEK_V3}
_WEIGHTS = ("config.json", "generation_config.json", "model.safetensors")


def templated_checkpoint(base: str, path: str, template: str) -> str:
    """`base` (a tiny checkpoint) under `path` with `template` as its chat template (weights linked)."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(base):
        source = os.path.join(base, name)
        if name in _WEIGHTS:
            os.symlink(source, os.path.join(path, name))
        elif name != "chat_template.jinja":
            shutil.copy(source, os.path.join(path, name))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(template)
    return path


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties: string (bounded), integer, number, boolean, enum, array
    (of strings, integers or, at the top level, objects) and, at the top level, a nested object; a
    required list of all or some of them."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth == 0 else [])
    properties = {f"{rng.choice(['name', 'count', 'score', 'tags', 'info', 'flag', 'size'])}_{i}":
                  _property(rng, rng.choice(kinds), depth) for i in range(rng.randint(1, 4))}
    names = sorted(properties)
    required = names if rng.random() < 0.6 else rng.sample(names, rng.randint(0, len(names)))
    return {"type": "object", "properties": properties, "required": sorted(required), "additionalProperties": False}


def _property(rng: random.Random, kind: str, depth: int) -> dict:
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -1, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "on", "off", "maybe"], 3)}
    if kind == "array":
        items = rng.choice([{"type": "string", "maxLength": 6}, {"type": "integer", "minimum": 0, "maximum": 9}]
                           + ([random_schema(rng, depth + 1)] if depth == 0 else []))
        return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def random_function(rng: random.Random, index: int) -> dict:
    return {"type": "function", "function": {"name": f"fn_{index}", "description": f"function {index}",
                                             "parameters": random_schema(rng)}}


def streamed_chat(client, **request) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat answer, from its deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, [delta.function.name, ""])
            entry[1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish
