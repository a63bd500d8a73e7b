"""The chat template of synthetic checkpoints: ChatML turns, tools, tool calls, tool results.

One source of truth: `train_tokenizer` writes this string into tokenizer_config.json, and
everything else (our renderer, transformers' `apply_chat_template`) reads it from there.

Layout, written so that a conversation only ever grows at its end. The prompt of turn
i+1 starts with the prompt of turn i plus the assistant's output, token for token, which
is what lets the engine reuse the previous turn's KV cache:

- every turn is `<|im_start|>{role}\\n{body}<|im_end|>\\n`;
- tools go into the system turn, one JSON schema per line inside `<tools></tools>`;
- an assistant body is `<think>\\n{reasoning}\\n</think>\\n\\n` (only when the message has
  reasoning), then the content with leading whitespace removed (after the `\\n` of the
  header a leading newline would merge into one token with it), then one
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` per call, separated by
  `\\n`; earlier assistant turns are never re-rendered differently (no stripped thinking);
- arguments given as a string are written verbatim (the exact text the model produced),
  a dict goes through `tojson` (transformers' version: no key sorting, no HTML escaping);
- consecutive tool messages share one user turn of `<tool_response>` blocks;
- `add_generation_prompt` appends `<|im_start|>assistant\\n`.

Content may be a string or a list of OpenAI content parts (only text parts are kept).
"""

CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- content | tojson -}}
    {%- elif content is defined and content is not none -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {%- set system_text = text_of(messages[0].content) -%}
        {%- if system_text -%}
            {{- system_text + '\n\n' -}}
        {%- endif -%}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more of these functions. Their JSON schemas, one per line:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, write one block per call, each on its own lines:\n' -}}
    {{- '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and has_system -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.reasoning_content is string and message.reasoning_content.strip() -%}
            {{- '<think>\n' + message.reasoning_content.strip() + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- set content = text_of(message.content).lstrip() -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if content or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n{"name": ' + fn.name | tojson + ', "arguments": ' -}}
                {%- if fn.arguments is string and fn.arguments.strip() -%}
                    {{- fn.arguments -}}
                {%- elif fn.arguments is mapping -%}
                    {{- fn.arguments | tojson -}}
                {%- else -%}
                    {{- '{}' -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()
