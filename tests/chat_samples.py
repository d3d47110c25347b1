"""Sample model outputs per chat template family, with the message llama.cpp's parser makes of
each: read from the pinned source's tests/test-chat.cpp (its peg_tester cases; the tool
definitions are that file's special_function, special_function_with_opt, python, get_time,
get_weather and empty_args), plus malformed outputs that do not parse at their end.

A case: (template file, the model's output, options, expected message). Options: ``tools`` (names
from TOOLS), ``rf`` (reasoning_format, default "none" as in test-chat.cpp), ``think``
(enable_thinking, default true), ``parallel`` (parallel_tool_calls). Expected: content,
reasoning_content, and tool calls as (name, JSON arguments, id or None). As test-chat.cpp compares
them: content and reasoning without surrounding whitespace, arguments as JSON values.
"""

from __future__ import annotations


def _fn(name: str, description: str, properties: dict, required: list | None = None) -> dict:
    params: dict = {"type": "object", "properties": properties}
    if required is not None:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = {
    "special_function": _fn("special_function", "I'm special", {"arg1": {"type": "integer", "description": "The arg."}},
                            ["arg1"]),
    "special_function_with_opt": _fn("special_function_with_opt", "I'm special but have optional stuff",
                                     {"arg1": {"type": "integer", "description": "The arg."},
                                      "arg2": {"type": "integer", "description": "The optional arg."}}, ["arg1"]),
    "python": _fn("python", "an ipython interpreter",
                  {"code": {"type": "string", "description": "Python code to execute."}}, ["code"]),
    "get_time": _fn("get_time", "Get the current time in a city", {"city": {"type": "string", "description": "City name"}},
                    ["city"]),
    "get_weather": _fn("get_weather", "Get the current weather in a city",
                       {"city": {"type": "string", "description": "City name"}}, ["city"]),
    "empty_args": _fn("empty_args", "A tool that takes no arguments", {}),
}

HELLO = "Hello, world!\nWhat's up?"
THINKING = "I'm\nthinking"
CALL = [("special_function", '{"arg1": 1}', None)]
TWO_CALLS = [("special_function", '{"arg1": 1}', None), ("special_function_with_opt", '{"arg1": 1, "arg2": 2}', None)]
SF = {"tools": ["special_function"]}
SF2 = {"tools": ["special_function", "special_function_with_opt"], "parallel": True}
AUTO = {"rf": "auto"}


def msg(content: str = "", reasoning: str = "", calls=()) -> dict:
    return {"content": content, "reasoning_content": reasoning, "tool_calls": list(calls)}


QWEN_XML_CALL = "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>"
QWEN_XML_OPT = ("<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n"
                "<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>")
HERMES_CALL = '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>'
KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0<|tool_call_argument_begin|>"
             '{"arg1": 1}<|tool_call_end|><|tool_calls_section_end|>')
DSML_CALL = ('<｜DSML｜{tag}>\n<｜DSML｜invoke name="special_function">\n'
             '<｜DSML｜parameter name="arg1" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜{tag}>')
GLM_CALL = "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>"
R7B_ACTION = ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", "parameters": '
              '{"arg1": 1}}\n]<|END_ACTION|>')

SAMPLES = [
    # Qwen3.5 / Nemotron 3 / Qwen3-Coder / StepFun: XML <function=...><parameter=...> calls
    ("Qwen3.5-4B.jinja", f"{THINKING}\n</think>\n\n{HELLO}", {**AUTO}, msg(HELLO, THINKING)),
    ("Qwen3.5-4B.jinja", f"{THINKING}\n</think>\n\n{HELLO}", {}, msg(f"<think>\n{THINKING}\n</think>\n\n{HELLO}")),
    ("Qwen3.5-4B.jinja", QWEN_XML_CALL, {**AUTO, **SF, "think": False}, msg(calls=CALL)),
    ("Qwen3.5-4B.jinja", f"{THINKING}\n</think>\n\n{QWEN_XML_CALL}", {**AUTO, **SF}, msg("", THINKING, CALL)),
    ("Qwen3.5-4B.jinja", QWEN_XML_CALL + "\n" + QWEN_XML_OPT, {**AUTO, **SF2, "think": False}, msg(calls=TWO_CALLS)),
    ("Qwen3.5-4B.jinja", "<tool_call>\n<function=python>\n<parameter=code>\ndef hello():\n    print(\"Hello, world!\")\n"
     "\nhello()\n</parameter>\n</function>\n</tool_call>", {**AUTO, "tools": ["python"], "think": False},
     msg(calls=[("python", '{"code": "def hello():\\n    print(\\"Hello, world!\\")\\n\\nhello()"}', None)])),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", f"{THINKING}\n</think>\n{HELLO}", {**AUTO}, msg(HELLO, THINKING)),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", f"{THINKING}\n</think>\n{QWEN_XML_CALL}\n", {**AUTO, **SF},
     msg("", THINKING, CALL)),
    ("Qwen3-Coder.jinja", HELLO, {}, msg(HELLO)),
    ("Qwen3-Coder.jinja", QWEN_XML_CALL, SF, msg(calls=CALL)),
    ("Qwen3-Coder.jinja", QWEN_XML_CALL + "\n" + QWEN_XML_OPT, SF2, msg(calls=TWO_CALLS)),
    ("StepFun3.5-Flash.jinja", "Let me call the special function\n</think>\n<tool_call>\n<function=special_function>\n"
     "<parameter=arg1>\n42555916\n</parameter>\n</function>\n</tool_call>", {**AUTO, **SF},
     msg("", "Let me call the special function", [("special_function", '{"arg1": 42555916}', None)])),
    # Hermes-style JSON in <tool_call> (Hermes 2 Pro / 3, Qwen2.5, MiMo-VL, Granite 4, Reka)
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", HERMES_CALL, SF, msg(calls=CALL)),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", HELLO + HERMES_CALL, SF,
     msg(HELLO, calls=[("special_function", '{"arg1":1}', None)])),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", HERMES_CALL, SF, msg(calls=CALL)),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", HERMES_CALL, SF, msg(calls=CALL)),
    ("MiMo-VL.jinja", HERMES_CALL, SF, msg(calls=CALL)),
    ("ibm-granite-granite-4.0.jinja", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
     SF, msg(calls=CALL)),
    ("ibm-granite-granite-4.1.jinja", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
     SF, msg(calls=CALL)),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", f"<think>{THINKING}</think>{HELLO}", {"rf": "deepseek"},
     msg(HELLO, THINKING)),
    ("Reka-Edge.jinja", HERMES_CALL, {**SF, "think": False}, msg(calls=CALL)),
    ("Reka-Edge.jinja", f"{THINKING}\n</think>\n\n{HERMES_CALL}", {**AUTO, **SF}, msg("", THINKING, CALL)),
    # Qwen3 / QwQ reasoning (QwQ's thinking is opened by the prompt)
    ("Qwen-QwQ-32B.jinja", "Let me think about this...\n</think>\nThe answer is 42.", {**AUTO},
     msg("The answer is 42.", "Let me think about this...")),
    ("Qwen-QwQ-32B.jinja", "</think>Hello, world!", {**AUTO}, msg("Hello, world!")),
    # Mistral family: [TOOL_CALLS] name[ARGS]json ; Nemo's JSON list with ids
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", f"[THINK]{THINKING}[/THINK]{HELLO}", {**AUTO},
     msg(HELLO, THINKING)),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', {**AUTO, **SF},
     msg(calls=CALL)),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]', SF,
     msg(calls=[("special_function", '{"arg1":1}', "123456789")])),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', SF,
     msg(calls=[("special_function", '{"arg1": 1}', "123456789")])),
    ("unsloth-mistral-Devstral-Small-2507.jinja", HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', SF,
     msg(HELLO, calls=CALL)),
    # Gemma 4: <|tool_call>call:name{key:value}<tool_call|>
    ("google-gemma-4-31B-it.jinja", f"<|channel>thought\n{THINKING}<channel|>{HELLO}", {**AUTO}, msg(HELLO, THINKING)),
    ("google-gemma-4-31B-it.jinja", "<|tool_call>call:empty_args{}<tool_call|>", {"tools": ["empty_args"]},
     msg(calls=[("empty_args", "{}", None)])),
    ("google-gemma-4-31B-it.jinja", '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>'
     '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
     {"tools": ["get_time", "get_weather"], "parallel": True},
     msg(calls=[("get_time", '{"city": "London"}', None), ("get_weather", '{"city": "Paris"}', None)])),
    ("google-gemma-2-2b-it.jinja", "Line 1\nLine 2\nLine 3", {}, msg("Line 1\nLine 2\nLine 3")),
    # Cohere Command R7B / Cohere2 MoE: actions as a JSON list, with their own ids
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
     f"<|START_THINKING|>{THINKING}<|END_THINKING|><|START_RESPONSE|>{HELLO}<|END_RESPONSE|>", {"rf": "deepseek"},
     msg(HELLO, THINKING)),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", f"<|START_THINKING|>{THINKING}<|END_THINKING|>{R7B_ACTION}",
     {"rf": "deepseek", **SF}, msg("", THINKING, [("special_function", '{"arg1": 1}', "0")])),
    ("Cohere2MoE.jinja", f"{THINKING}<|END_THINKING|>{R7B_ACTION}", {"rf": "deepseek", **SF},
     msg("", THINKING, [("special_function", '{"arg1": 1}', "0")])),
    ("CohereForAI-c4ai-command-r-plus-tool_use.jinja",
     'Action:\n```json\n[{"tool_name": "special_function", "parameters": {"arg1": 1}}]\n```', SF, msg(calls=CALL)),
    # ByteDance Seed-OSS
    ("ByteDance-Seed-OSS.jinja", "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!",
     {"rf": "deepseek"}, msg("Hello, world!", "I'm thinking about the answer")),
    ("ByteDance-Seed-OSS.jinja", "<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n"
     "</function>\n</seed:tool_call>", SF, msg(calls=CALL)),
    # DeepSeek V3.1 / V3.2 / V4 / R1
    ("deepseek-ai-DeepSeek-V3.1.jinja", "REASONING</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time"
     '<｜tool▁sep｜>{"city": "Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', {"rf": "deepseek", "tools": ["get_time"]},
     msg("", "REASONING", [("get_time", '{"city":"Tokyo"}', None)])),
    ("deepseek-ai-DeepSeek-V3.2.jinja", f"{THINKING}</think>{HELLO}", {"rf": "deepseek"}, msg(HELLO, THINKING)),
    ("deepseek-ai-DeepSeek-V3.2.jinja", DSML_CALL.format(tag="function_calls"), {"rf": "deepseek", "think": False, **SF},
     msg(calls=CALL)),
    ("deepseek-ai-DeepSeek-V4.jinja", DSML_CALL.format(tag="tool_calls"), {"rf": "deepseek", "think": False, **SF},
     msg(calls=CALL)),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", f"{THINKING}</think>{HELLO}", {"rf": "deepseek"},
     msg(HELLO, THINKING)),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'special_function\n```json\n{"arg1": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     {**SF, "think": False, "rf": "deepseek"}, msg(calls=CALL)),
    ("llama-cpp-deepseek-r1.jinja", f"{THINKING}</think>{HELLO}", {"rf": "deepseek"}, msg(HELLO, THINKING)),
    # GLM / Spark: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
    ("GLM-4.6.jinja", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
     {**SF, "rf": "deepseek"}, msg(calls=CALL)),
    ("GLM-4.7-Flash.jinja", f"{THINKING}</think>{GLM_CALL}", {"rf": "deepseek", **SF}, msg("", THINKING, CALL)),
    ("Spark2.5.jinja", f"{THINKING}</think>{GLM_CALL}", {"rf": "deepseek", **SF}, msg("", THINKING, CALL)),
    # Kimi K2: functions.name:index ids
    ("moonshotai-Kimi-K2.jinja", KIMI_CALL, SF, msg(calls=[("special_function", '{"arg1": 1}', "functions.special_function:0")])),
    ("Kimi-K2-Instruct.jinja", KIMI_CALL, SF, msg(calls=[("special_function", '{"arg1": 1}', "functions.special_function:0")])),
    ("Kimi-K2-Thinking.jinja", "<think>I'm thinking about this</think>" + KIMI_CALL, {**AUTO, **SF},
     msg("", "I'm thinking about this", [("special_function", '{"arg1": 1}', "functions.special_function:0")])),
    # LFM2.5: pythonic calls
    ("LFM2.5-8B-A1B.jinja", f"<think>{THINKING}</think><|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>",
     {**AUTO, **SF}, msg("", THINKING, CALL)),
    # MiniMax M2 / M3
    ("MiniMax-M2.jinja", '\n</think>\n\n<minimax:tool_call>\n<invoke name="special_function">\n<parameter '
     'name="arg1">1</parameter>\n</invoke>\n</minimax:tool_call>', {**SF, "rf": "deepseek"}, msg(calls=CALL)),
    ("MiniMax-M3.jinja", "</mm:think>]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"special_function\">"
     "]<]minimax[>[<arg1>1]<]minimax[>[</arg1>]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>", {**AUTO, **SF},
     msg(calls=CALL)),
    # Others with one format each
    ("Apertus-8B-Instruct.jinja", '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>', SF,
     msg(calls=CALL)),
    ("NVIDIA-Nemotron-Nano-v2.jinja",
     f'{THINKING}\n</think>\n<TOOLCALL>[{{"name": "special_function", "arguments": {{"arg1": 1}}}}]</TOOLCALL>',
     {**SF, "rf": "deepseek"}, msg("", THINKING, CALL)),
    ("meetkai-functionary-medium-v3.1.jinja", '<function=special_function>{"arg1": 1}</function>', SF, msg(calls=CALL)),
    ("meetkai-functionary-medium-v3.2.jinja", 'special_function\n{"arg1": 1}', SF, msg(calls=CALL)),
    ("meetkai-functionary-medium-v3.2.jinja", f"all\n{HELLO}", {}, msg(HELLO)),
    ("fireworks-ai-llama-3-firefunction-v2.jinja", ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]',
     SF, msg(calls=CALL)),
    ("unsloth-Apriel-1.5.jinja", '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>', SF,
     msg(calls=CALL)),
    # (its generation prompt opens the reasoning with a line of its own)
    ("Apriel-1.6-15b-Thinker-fixed.jinja", f"{THINKING}\n[BEGIN FINAL RESPONSE]\n{HELLO}", {**AUTO},
     msg(HELLO, "Here are my reasoning steps:\n" + THINKING)),
    ("GigaChat3-10B-A1.8B.jinja", HELLO + '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "special_function", '
     '"arguments": {"arg1": 1}}', SF, msg(HELLO, calls=CALL)),
    ("GigaChat3.1-10B-A1.8B.jinja", '<|function_call|>{"name": "special_function", "arguments": {"arg1": 1}}', SF,
     msg(calls=CALL)),
    ("openbmb-MiniCPM5-1B.jinja", "<function name=\"python\"><param name=\"code\">print('Hello, World!')</param></function>",
     {**AUTO, "tools": ["python"], "think": False}, msg(calls=[("python", '{"code": "print(\'Hello, World!\')"}', None)])),
    ("openai-gpt-oss-120b.jinja", f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final"
     f"<|message|>{HELLO}", {**AUTO}, msg(HELLO, THINKING)),
    ("openai-gpt-oss-120b.jinja", '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}',
     {**AUTO, **SF}, msg(calls=CALL)),
    ("muse-glimmer.jinja", f" to=user<|message|>{HELLO}<|eot|>", {**AUTO}, msg(HELLO)),
    ("Kimi-K3.jinja", "I'm thinking about this<|close|>think<|sep|><|open|>response<|sep|>" + HELLO +
     "<|close|>response<|sep|><|close|>message<|sep|>", {**AUTO}, msg(HELLO, "I'm thinking about this")),
    ("Kimi-K3.jinja", '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call '
     'tool="special_function" index="1"<|sep|><|open|>argument key="arg1" type="number"<|sep|>1<|close|>argument<|sep|>'
     "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>", SF, msg(calls=CALL)),
    ("inclusionai-ling-3.0-flash.jinja", "</think>\n<tool_call>get_time<arg_key>city</arg_key><arg_value>Paris"
     "</arg_value></tool_call>", {"rf": "deepseek", "tools": ["get_time"]},
     msg(calls=[("get_time", '{"city": "Paris"}', None)])),
    ("deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "\n\n" + DSML_CALL.format(tag="tool_calls"),
     {"rf": "deepseek", "think": False, **SF}, msg(calls=CALL)),
]

#: Families test-chat.cpp has no sample output for, written here in each template's own tool-call
#: format (as its system prompt describes it to the model).
OWN_SAMPLES = [
    ("Qwen-Qwen3-0.6B.jinja", f"<think>\n{THINKING}\n</think>\n\n" + HERMES_CALL, {"rf": "deepseek", **SF},
     msg("", THINKING, CALL)),
    ("Bielik-11B-v3.0-Instruct.jinja", HERMES_CALL, {**SF, "think": False, "rf": "deepseek"}, msg(calls=CALL)),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", '{"name": "special_function", "parameters": {"arg1": 1}}', SF,
     msg(calls=CALL)),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", '{"name": "special_function", "parameters": {"arg1": 1}}', SF,
     msg(calls=CALL)),
    ("MiniMax-M1.jinja", '<tool_calls>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_calls>', SF,
     msg(calls=CALL)),
    ("poolside-Laguna-XS.2.jinja", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n"
     "</tool_call>", {**SF, "think": False, "rf": "deepseek"}, msg(calls=CALL)),
    ("upstage-Solar-Open-100B.jinja", HELLO, {}, msg(HELLO)),
    ("microsoft-Phi-3.5-mini-instruct.jinja", HELLO, {}, msg(HELLO)),
]
SAMPLES += OWN_SAMPLES

#: Outputs whose end does not parse as the template's format (llama-server answers them with a 500):
#: a call to a function not offered, text after the calls, text where tool_choice required a call.
MALFORMED = [
    ("Qwen-Qwen3-0.6B.jinja", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', {**SF, "rf": "deepseek"}),
    ("Qwen-Qwen3-0.6B.jinja", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call> and more',
     {**SF, "rf": "deepseek", "choice": "required"}),
    ("google-gemma-4-31B-it.jinja", "plain words", {"tools": ["get_time"], "choice": "required"}),
]
