"""llama-cpp-python's named chat formats: ``Llama(..., chat_format="chatml")`` and the others.

A named format renders the messages into a prompt in Python (not the model's template) and the chat is
answered as a completion of that prompt, as llama-cpp-python does (``chat_formatter_to_chat_completion_handler``
in its llama_chat_format.py): the format's stop strings added, ``response_format`` and a named
``tool_choice`` constrained by a grammar, the answer the completion's text (a named tool's: its arguments).
The formatters below are llama-cpp-python 0.3.36's (MIT, Copyright (c) 2023 Andrei Betlen), copied so that
the same messages make the same prompt (tests/test_llama_cpp_facade.py compares them with the real
package's); ``register_chat_format`` adds one of your own, as there.

Its handlers that are not formatters (``functionary``, ``functionary-v2``, ``chatml-function-calling``)
are not here: ``Llama`` says so and uses the model's template. ``chat_template.default`` (and
``chat_template.<name>``), the names llama-cpp-python gives the GGUF's own templates, mean the model's
template, as they do there. The Llava-style image handlers (``llama_chat_format``) answer through
``answer_as_completion`` too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from pyllama_spec.llama_cpp import llama_types
from pyllama_spec.llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ChatFormatterResponse:
    """A formatted chat: the prompt, its stop strings, and whether it carries its special tokens."""

    prompt: str
    stop: str | list[str] | None = None
    stopping_criteria: Any = None
    added_special: bool = False

ChatFormatter = Callable[..., ChatFormatterResponse]

#: The named formats, as llama-cpp-python registers them (``register_chat_format``).
CHAT_FORMATS: dict[str, ChatFormatter] = {}
#: llama-cpp-python's handler names that are not formatters: ``Llama`` renders with the model's template.
HANDLERS_NOT_HERE = ("functionary", "functionary-v1", "functionary-v2", "chatml-function-calling")


class LlamaChatCompletionHandlerNotFoundException(ValueError):
    """No chat format of that name (llama-cpp-python's exception; a ValueError here too)."""


def register_chat_format(name: str) -> Callable[[ChatFormatter], ChatFormatter]:
    """Register ``f`` as the chat format ``name``; a name taken already is a ValueError, as there."""
    def decorator(f: ChatFormatter) -> ChatFormatter:
        if name in CHAT_FORMATS:
            raise ValueError(f"Chat completion handler with name '{name}' already registered.")
        CHAT_FORMATS[name] = f
        return f
    return decorator


def get_chat_formatter(name: str) -> ChatFormatter:
    try:
        return CHAT_FORMATS[name]
    except KeyError:
        raise LlamaChatCompletionHandlerNotFoundException(
            f"Invalid chat handler: {name} (valid formats: {sorted(CHAT_FORMATS)})") from None


def uses_the_models_template(name: str | None) -> bool:
    """Whether ``chat_format=name`` means the model's own template: none given, one of llama-cpp-python's
    handlers that are not formats, or its name for a GGUF's template (``chat_template.default``)."""
    return name is None or name in HANDLERS_NOT_HERE or name.startswith("chat_template.")


def formatted_chat_completion(llama: Any, formatter: ChatFormatter, *, messages: list, functions: Any = None,
                              function_call: Any = None, tools: list | None = None, tool_choice: Any = None,
                              stop: str | list[str] | None = None, **answer: Any):
    """``llama``'s answer to a chat rendered by ``formatter``: a completion of the prompt, in the chat's
    shapes (llama-cpp-python's ``chat_formatter_to_chat_completion_handler``); ``answer`` as
    ``answer_as_completion`` takes it."""
    result = formatter(messages=messages, functions=functions, function_call=function_call, tools=tools,
                       tool_choice=tool_choice)
    prompt = llama.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True)
    if result.stop is not None:
        stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        stop += result.stop if isinstance(result.stop, list) else [result.stop]

    def complete(**options: Any):
        return llama.create_completion(prompt=prompt, stopping_criteria=result.stopping_criteria, **options)

    return answer_as_completion(complete, functions=functions, function_call=function_call, tools=tools,
                                tool_choice=tool_choice, stop=stop, **answer)


def answer_as_completion(complete: Callable[..., Any], *, functions: Any = None, function_call: Any = None,
                         tools: list | None = None, tool_choice: Any = None, stop: str | list[str] | None = None,
                         response_format: Any = None, grammar: LlamaGrammar | None = None,
                         logprobs: bool | None = None, top_logprobs: int | None = None, stream: bool = False,
                         **completion: Any):
    """A chat answered by ``complete(**options)`` (a completion of its rendered prompt, whole or as
    chunks), in llama-cpp-python's chat shapes: ``response_format`` and a named ``tool_choice`` become a
    grammar (the call's arguments the answer), as its chat format and Llava-style handlers do."""
    if response_format is not None and response_format.get("type") == "json_object":
        schema = response_format.get("schema")
        grammar = _grammar_of_schema(schema) if schema is not None else LlamaGrammar.from_string(JSON_GBNF)
    if functions is not None:
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None:
        if function_call in ("none", "auto"):
            tool_choice = function_call
        elif isinstance(function_call, dict) and "name" in function_call:
            tool_choice = {"type": "function", "function": {"name": function_call["name"]}}
    tool = None
    if isinstance(tool_choice, dict) and tools is not None:
        name = tool_choice["function"]["name"]
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise ValueError(f"Tool choice '{name}' not found in tools.")
        grammar = _grammar_of_schema(tool["function"]["parameters"])
    done = complete(stop=stop, stream=stream, grammar=grammar, logprobs=top_logprobs if logprobs else None,
                    **completion)
    name = tool["function"]["name"] if tool is not None else None
    return _chat_chunks(done, name) if stream else _chat(done, name)


def _grammar_of_schema(schema: Any) -> LlamaGrammar:
    """A schema's grammar, or any JSON where it has none (as llama-cpp-python falls back)."""
    try:
        return LlamaGrammar.from_json_schema(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - as llama-cpp-python: any failure falls back to any JSON
        logger.warning("the schema has no grammar here (%s): the answer is any JSON", e)
        return LlamaGrammar.from_string(JSON_GBNF)


def _chat_logprobs(logprobs: dict | None) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [{"token": token, "bytes": None, "logprob": logprob,
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in top.items()]}
                        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                       logprobs["top_logprobs"])],
            "refusal": None}


def _call(tool_name: str, completion_id: str, arguments: str, index: int | None = None) -> dict:
    call = {"id": f"call__0_{tool_name}_{completion_id}", "type": "function",
            "function": {"name": tool_name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def _chat(completion: dict, tool_name: str | None) -> dict:
    """A completion as llama-cpp-python's chat completion: its text the content, or a named tool's arguments."""
    choice = completion["choices"][0]
    if tool_name is None:
        message = {"role": "assistant", "content": choice["text"]}
        finish = choice["finish_reason"]
    else:
        message = {"role": "assistant", "content": None,
                   "function_call": {"name": tool_name, "arguments": choice["text"]},
                   "tool_calls": [_call(tool_name, completion["id"], choice["text"])]}
        finish = "tool_calls"
    return {"id": "chat" + completion["id"], "object": "chat.completion", "created": completion["created"],
            "model": completion["model"], "choices": [{"index": 0, "message": message,
                                                       "logprobs": _chat_logprobs(choice["logprobs"]),
                                                       "finish_reason": finish}],
            "usage": completion["usage"], **_extension(completion)}


def _extension(completion: dict) -> dict:
    """This project's field of a completion (its drafting statistics), kept in the chat's answer."""
    return {"speculative": completion["speculative"]} if "speculative" in completion else {}


def _chat_chunks(chunks, tool_name: str | None):
    """A completion's chunks as llama-cpp-python's chat chunks: the role first, then a delta a chunk (a
    named tool's: its arguments, and a last chunk that finishes with ``tool_calls``)."""
    first, extension = None, {}
    for chunk in chunks:
        extension = _extension(chunk) or extension
        head = {"id": "chat" + chunk["id"], "model": chunk["model"], "created": chunk["created"],
                "object": "chat.completion.chunk"}
        choice = chunk["choices"][0]
        lp = _chat_logprobs(choice["logprobs"])
        if first is None:
            first = head
            opening = {"role": "assistant"} if tool_name is None else {
                "role": "assistant", "content": None, "function_call": None, "tool_calls": None}
            yield {**head, "choices": [{"index": 0, "delta": opening, "logprobs": None, "finish_reason": None}]}
            call_id = chunk["id"]
        if tool_name is None:
            delta = {"content": choice["text"]} if choice["finish_reason"] is None else {}
            yield {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                        "finish_reason": choice["finish_reason"]}], **_extension(chunk)}
        else:
            yield {**head, "choices": [{"index": 0, "finish_reason": None, "logprobs": lp, "delta": {
                "role": None, "content": None, "function_call": {"name": tool_name, "arguments": choice["text"]},
                "tool_calls": [_call(tool_name, call_id, choice["text"], 0)]}}]}
    if tool_name is not None and first is not None:
        yield {**first, "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "delta": {
            "role": None, "content": None, "function_call": None, "tool_calls": None}}], **extension}


# ---------------------------------------------------------------- llama-cpp-python 0.3.36's formatters

def _get_system_message(
    messages: List[llama_types.ChatCompletionRequestMessage],
) -> str:
    """Get the first system message."""
    for message in messages:
        if message["role"] == "system":
            return message["content"] or ""
    return ""


def _map_roles(
    messages: List[llama_types.ChatCompletionRequestMessage],
    role_map: Dict[str, str],
) -> List[Tuple[str, Optional[str]]]:
    """Map the message roles."""
    output: List[Tuple[str, Optional[str]]] = []
    for message in messages:
        role = message["role"]
        if role in role_map:
            content: str | None = (
                message["content"] if isinstance(message["content"], str) else None
            )
            output.append((role_map[role], content))
    return output


def _format_llama2(
    system_message: str, messages: List[Tuple[str, Optional[str]]], sep: str, sep2: str
) -> str:
    """Format the prompt with the llama2 style."""
    seps = [sep, sep2]
    ret = system_message + sep
    for i, (role, message) in enumerate(messages):
        if system_message and i == 0:
            m = message or ""
            ret += m + seps[i % 2]
        elif message:
            ret += role + message + " " + seps[i % 2]
        else:
            ret += role + " "
    return ret


def _format_add_colon_single(
    system_message: str, messages: List[Tuple[str, Optional[str]]], sep: str
) -> str:
    """Format the prompt with the add-colon-single style."""
    ret = system_message + sep
    for role, message in messages:
        if message:
            ret += role + ": " + message + sep
        else:
            ret += role + ":"
    return ret


def _format_add_colon_two(
    system_message: str, messages: List[Tuple[str, Optional[str]]], sep: str, sep2: str
) -> str:
    """Format the prompt with the add-colon-two style."""
    seps = [sep, sep2]
    ret = system_message + seps[0]
    for i, (role, message) in enumerate(messages):
        if message:
            ret += role + ": " + message + seps[i % 2]
        else:
            ret += role + ":"
    return ret


def _format_no_colon_single(
    system_message: str, messages: List[Tuple[str, Optional[str]]], sep: str
) -> str:
    """Format the prompt with the no-colon-single style."""
    ret = system_message
    for role, message in messages:
        if message:
            ret += role + message + sep
        else:
            ret += role
    return ret


def _format_add_colon_space_single(
    system_message: str, messages: List[Tuple[str, Optional[str]]], sep: str
) -> str:
    """Format the prompt with the add-colon-space-single style."""
    ret = system_message + sep
    for role, message in messages:
        if message:
            ret += role + ": " + message + sep
        else:
            ret += role + ": "  # must be end with a space
    return ret


def _format_chatml(
    system_message: str, messages: List[Tuple[str, Optional[str]]], sep: str
) -> str:
    """Format the prompt with the chatml style."""
    ret = "" if system_message == "" else system_message + sep + "\n"
    for role, message in messages:
        if message:
            ret += role + "\n" + message + sep + "\n"
        else:
            ret += role + "\n"
    return ret


def _format_chatglm3(
    system_message: str, messages: List[Tuple[str, Optional[str]]], sep: str
) -> str:
    """Format the prompt with the chatglm3 style."""
    ret = ""
    if system_message:
        ret += system_message
    for role, message in messages:
        if message:
            ret += role + "\n" + " " + message
        else:
            ret += role
    return ret



# see https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama/tokenization_llama.py
# system prompt is "embedded" in the first message
@register_chat_format("llama-2")
def format_llama2(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _system_template = "[INST] <<SYS>>\n{system_message}\n<</SYS>>"
    _roles = dict(user="<s>[INST]", assistant="[/INST]")
    _messages = _map_roles(messages, _roles)
    system_message = _get_system_message(messages)
    if system_message:
        system_message = _system_template.format(system_message=system_message)
    _prompt = _format_llama2(system_message, _messages, " ", "</s>") + "[/INST]"
    return ChatFormatterResponse(prompt=_prompt)


# Chat format for Llama-3 models, see more details at:
# https://github.com/meta-llama/llama3/blob/main/llama/tokenizer.py#L202-L229
@register_chat_format("llama-3")
def format_llama3(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _roles = dict(
        system="<|start_header_id|>system<|end_header_id|>\n\n",
        user="<|start_header_id|>user<|end_header_id|>\n\n",
        assistant="<|start_header_id|>assistant<|end_header_id|>\n\n",
    )
    _sep = "<|eot_id|>"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_no_colon_single("", _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_sep)


@register_chat_format("alpaca")
def format_alpaca(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _roles = dict(user="### Instruction", assistant="### Response")
    _sep = "\n\n"
    _sep2 = "</s>"
    system_message = _get_system_message(messages)
    _messages = _map_roles(messages, _roles)
    _prompt = _format_add_colon_two(system_message, _messages, _sep, _sep2)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("qwen")
def format_qwen(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _roles = dict(user="<|im_start|>user", assistant="<|im_start|>assistant")
    system_message = _get_system_message(messages) or "You are a helpful assistant."
    system_template = "<|im_start|>system\n{system_message}"
    system_message = system_template.format(system_message=system_message)
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _sep = "<|im_end|>"
    _prompt = _format_chatml(system_message, _messages, _sep)
    _sep2 = "<|endoftext|>"
    return ChatFormatterResponse(prompt=_prompt, stop=_sep2)


@register_chat_format("vicuna")
def format(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _system_message = "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, detailed, and polite answers to the user's questions."
    _roles = dict(user="USER", assistant="ASSISTANT")
    _sep = " "
    _sep2 = "</s>"
    system_message = _system_message
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_add_colon_two(system_message, _messages, _sep, _sep2)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("oasst_llama")
def format_oasst_llama(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _system_template = "[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n"
    _roles = dict(user="<|prompter|>", assistant="<|assistant|>")
    _sep = "</s>"
    system_message = _get_system_message(messages)
    system_message = _system_template.format(system_message=system_message)
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_no_colon_single(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("baichuan-2")
def format_baichuan2(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _system_template = "{system_message}"
    _roles = dict(user="<reserved_106>", assistant="<reserved_107>")
    _sep = ""
    system_message = _get_system_message(messages)
    system_message = _system_template.format(system_message=system_message)
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_no_colon_single(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("baichuan")
def format_baichuan(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _system_template = "{system_message}"
    _roles = dict(user="<reserved_102>", assistant="<reserved_103>")
    _sep = ""
    system_message = _get_system_message(messages)
    system_message = _system_template.format(system_message=system_message)
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_no_colon_single(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("openbuddy")
def format_openbuddy(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _system_message = """You are a helpful, respectful and honest INTP-T AI Assistant named Buddy. You are talking to a human User.
Always answer as helpfully and logically as possible, while being safe. Your answers should not include any harmful, political, religious, unethical, racist, sexist, toxic, dangerous, or illegal content. Please ensure that your responses are socially unbiased and positive in nature.
If a question does not make any sense, or is not factually coherent, explain why instead of answering something not correct. If you don't know the answer to a question, please don't share false information.
You can speak fluently in many languages, for example: English, Chinese.
You cannot access the internet, but you have vast knowledge, cutoff: 2021-09.
You are trained by OpenBuddy team, (https://openbuddy.ai, https://github.com/OpenBuddy/OpenBuddy), you are based on LLaMA and Falcon transformers model, not related to GPT or OpenAI.

"""
    _roles = dict(user="User", assistant="Assistant")
    _sep = "\n"
    system_message = _system_message
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_add_colon_single(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("redpajama-incite")
def format_redpajama_incite(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _system_message = _get_system_message(messages)
    _roles = dict(user="<human>", assistant="<bot>")
    _sep = "\n"
    _stop = "<human>"
    system_message = _system_message
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_add_colon_single(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_stop)


@register_chat_format("snoozy")
def format_snoozy(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_template = "### Instruction:\n{system_message}"
    default_system_message = "The prompt below is a question to answer, a task to complete, or a conversation to respond to; decide which and write an appropriate response."
    _system_message = _get_system_message(messages)
    _system_message = (
        _system_message if _system_message != "" else default_system_message
    )
    system_message = system_template.format(system_message=_system_message)
    _roles = dict(user="### Prompt", assistant="### Response")
    _sep = "\n"
    _stop = "###"
    system_message = _system_message
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_add_colon_single(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_stop)


@register_chat_format("phind")
def format_phind(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _roles = dict(user="### User Message", assistant="### Assistant")
    _sep = "\n\n"
    _system_message = "### System Prompt\nYou are an intelligent programming assistant."
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_add_colon_single(_system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("intel")
def format_intel(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _roles = dict(user="### User:", assistant="### Assistant:")
    _sep = "\n"
    _system_message = "### System:\n{system_message}"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_add_colon_single(_system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("open-orca")
def format_open_orca(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_template = "{system_message}"
    system_message = (
        "You are a helpful assistant. Please answer truthfully and write out your "
        "thinking step by step to be sure you get the right answer. If you make a mistake or encounter "
        "an error in your thinking, say so out loud and attempt to correct it. If you don't know or "
        "aren't sure about something, say so clearly. You will act as a professional logician, mathematician, "
        "and physicist. You will also act as the most appropriate type of expert to answer any particular "
        "question or solve the relevant problem; state which expert type your are, if so. Also think of "
        "any particular named expert that would be ideal to answer the relevant question or solve the "
        "relevant problem; name and act as them, if appropriate."
    )
    roles = ("User", "Assistant")
    sep = "<|end_of_turn|>\n"
    # stop_token_ids=[32000, 32001],  # "<|end_of_turn|>"
    stop_str = "User"
    system_message = system_template.format(system_message=system_message)
    _messages = _map_roles(messages, dict(zip(roles, roles)))
    _messages.append((roles[1], None))
    _prompt = _format_add_colon_space_single(system_message, _messages, sep)
    return ChatFormatterResponse(prompt=_prompt, stop=stop_str)


@register_chat_format("mistrallite")
def format_mistrallite(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _roles = dict(user="<|prompter|>", assistant="</s>\n<|assistant|>")
    _sep = " "
    system_template = """<|system|>{system_message}</s>"""
    system_message = _get_system_message(messages)
    system_message = system_template.format(system_message=system_message)
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_no_colon_single(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt)


@register_chat_format("zephyr")
def format_zephyr(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_template = """<|system|>
{system_message}"""
    system_message = _get_system_message(messages)
    system_message = system_template.format(system_message=system_message)
    _roles = dict(user="<|user|>\n", assistant="<|assistant|>\n")
    _sep = "</s>"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_chatml(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_sep)


@register_chat_format("pygmalion")
def format_pygmalion(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_template = """<|system|>{system_message}"""
    system_message = _get_system_message(messages)
    system_message = system_template.format(system_message=system_message)
    _roles = dict(user="<|user|>", assistant="<|model|>")
    _sep = "\n"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_chatml(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_sep)


@register_chat_format("chatml")
def format_chatml(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_template = """<|im_start|>system
{system_message}"""
    system_message = _get_system_message(messages)
    system_message = system_template.format(system_message=system_message)
    _roles = dict(user="<|im_start|>user", assistant="<|im_start|>assistant")
    _sep = "<|im_end|>"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_chatml(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_sep)


@register_chat_format("mistral-instruct")
def format_mistral_instruct(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    eos = "</s>"
    stop = eos
    prompt = ""
    for message in messages:
        if (
            message["role"] == "user"
            and message["content"] is not None
            and isinstance(message["content"], str)
        ):
            prompt += "[INST] " + message["content"]
        elif message["role"] == "assistant" and message["content"] is not None:
            prompt += " [/INST]" + message["content"] + eos
    prompt += " [/INST]"
    return ChatFormatterResponse(prompt=prompt, stop=stop)


@register_chat_format("chatglm3")
def format_chatglm3(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_template = """<|system|>
{system_message}"""
    system_message = _get_system_message(messages)
    system_message = system_template.format(system_message=system_message)
    _roles = dict(user="<|user|>", assistant="<|assistant|>")
    _sep = "</s>"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_chatglm3(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_sep)


@register_chat_format("openchat")
def format_openchat(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_template = "{system_message}<|end_of_turn|>"
    system_message = _get_system_message(messages)
    system_message = system_template.format(system_message=system_message)
    _roles = dict(
        user="GPT4 Correct User: ", assistant="<|end_of_turn|>GPT4 Correct Assistant: "
    )
    _sep = "<|end_of_turn|>"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_chatml(system_message, _messages, _sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_sep)


# Chat format for Saiga models, see more details and available models:
# https://huggingface.co/collections/IlyaGusev/saiga2-saigamistral-6505d4ccc3d1e53166b636cd
@register_chat_format("saiga")
def format_saiga(
    messages: list[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    _message_template = "<s>{role}\n{content}</s>"
    _roles = dict(user="user", bot="bot", system="system")
    _messages = _map_roles(messages, _roles)

    _prompt = ""
    for role, content in _messages:
        if content:
            _prompt += _message_template.format(role=role, content=content)
        else:
            _prompt += f"<s>{role}\n"
    # Response template
    _prompt += "<s>bot"
    return ChatFormatterResponse(prompt=_prompt.strip())


# Chat format for Google's Gemma models, see more details and available models:
# https://huggingface.co/collections/google/gemma-release-65d5efbccdbb8c4202ec078b
@register_chat_format("gemma")
def format_gemma(
    messages: List[llama_types.ChatCompletionRequestMessage],
    **kwargs: Any,
) -> ChatFormatterResponse:
    system_message = _get_system_message(messages)
    if system_message != "":
        logger.debug("`role='system'` messages are not allowed on Google's Gemma models.")
    _roles = dict(user="<start_of_turn>user\n", assistant="<start_of_turn>model\n")
    _sep = "<end_of_turn>\n"
    _messages = _map_roles(messages, _roles)
    _messages.append((_roles["assistant"], None))
    _prompt = _format_no_colon_single(system_message="", messages=_messages, sep=_sep)
    return ChatFormatterResponse(prompt=_prompt, stop=_sep)


# Tricky chat formats that require custom chat handlers
