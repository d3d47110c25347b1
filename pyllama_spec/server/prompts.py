"""llama-server's ``prompt`` field on /completion, /completions and /v1/completions, read as its
``tokenize_input_prompts`` reads it (tools/server/server-common.cpp):

* a string: ``"def f("``;
* token ids: ``[12, 34, 56]``; or ids mixed with strings: ``[12, "text", 56]`` (each string
  tokenized, the first with the model's BOS when the list starts with it);
* an object ``{"prompt_string": ..., "multimodal_data": ["<base64>", ...]}``: the string (or a
  mixed list, without multimodal_data) with one media marker (``/props``' ``media_marker``) for
  each image, the images in base64;
* a list of any of those, with no token id at its top level: several prompts, each its own
  completion (llama-server answers an array, or several choices, indexed prompt by prompt).

Each prompt becomes the Engine keywords of its generation (``prompt``, ``images``). Token ids are
checked against the vocabulary and images decoded and checked (server/images.py) here, before
anything is queued; the work is linear in the request. Pure Python.

Where this differs from llama-server: an empty prompt (``""``, ``[]``) is a 400 here, where
llama-server answers an empty completion; a float among token ids is a 400 (llama-server rounds it
down); /v1/completions takes every shape when the server has a projector too (llama-server then
takes a string only).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from pyllama_spec.server.errors import bad_request
from pyllama_spec.server.images import ImageBudget, ImageLimits, check_image_bytes
from pyllama_spec.serving.chat_template import MEDIA_MARKER

#: llama-server's message for a prompt of no known shape (its clients may look for it).
_SHAPES = ('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, '
           "or a list of mixed strings & tokens.")


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_prompts(value: Any, *, n_vocab: int, images: ImageLimits, max_prompts: int) -> list[dict]:
    """The Engine keywords (``prompt``, ``images``) of each prompt ``value`` holds; a 400 APIError
    when it holds none, more than ``max_prompts``, or a prompt that is not one of the shapes."""
    if value is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(value, list) and not any(_is_id(v) for v in value):
        if not value:
            raise bad_request('"prompt" must not be empty', "prompt")
        if len(value) > max_prompts:
            raise bad_request(f"'prompt' lists {len(value)} prompts; this server takes at most {max_prompts} "
                              "per request (each waits for a slot in its queue of --max-queue requests)", "prompt")
        subprompts = value
    else:
        subprompts = [value]
    budget = ImageBudget(images)  # what the request's images may use, over all its prompts
    return [parse_prompt(p, "prompt" if len(subprompts) == 1 else f"prompt[{i}]", n_vocab, images, budget)
            for i, p in enumerate(subprompts)]


def parse_prompt(p: Any, where: str, n_vocab: int, limits: ImageLimits, budget: ImageBudget, *,
                 field: str = "prompt", to_generate: bool = True) -> dict:
    """One prompt (a string, token ids, both mixed, or a multimodal object) as Engine keywords;
    ``where`` names it in errors, ``field`` is the request's field. ``to_generate=False`` (an
    embedding's prompt): an empty string is taken (the model's special tokens may be all it holds),
    and a prompt may end with an image."""
    if isinstance(p, dict) and "prompt_string" in p:
        text = p["prompt_string"]
        if "multimodal_data" not in p:
            return {"prompt": _text_or_ids(text, where + ".prompt_string", n_vocab, field, to_generate)}
        return _multimodal(text, p["multimodal_data"], where, limits, budget, field, to_generate)
    return {"prompt": _text_or_ids(p, where, n_vocab, field, to_generate)}


def _text_or_ids(p: Any, where: str, n_vocab: int, field: str = "prompt", to_generate: bool = True) -> str | tuple:
    """A string, or token ids (optionally mixed with strings) as the engine takes them: a tuple of
    strings and int32 arrays."""
    if isinstance(p, str):
        if not p and to_generate:
            raise bad_request(f"{where} is empty (give it some text or token ids)", field)
        return p
    if not isinstance(p, list) or not all(isinstance(v, str) or _is_id(v) for v in p) \
            or (p and not any(_is_id(v) for v in p)):
        raise bad_request(f"{where}: {_SHAPES}", field)
    if not p:
        raise bad_request(f"{where} is empty (give it some text or token ids)", field)
    if all(_is_id(v) for v in p):  # the common case, a long list of ids: checked at C speed
        runs: list = [_ids(p, where, n_vocab, field)]
    else:
        runs, ids = [], []
        for v in (*p, ""):  # "" ends the last run of ids
            if isinstance(v, str):
                if ids:
                    runs.append(_ids(ids, where, n_vocab, field))
                    ids = []
                runs.append(v)
            else:
                ids.append(v)
        runs.pop()
    return tuple(runs)


def _ids(ids: list[int], where: str, n_vocab: int, field: str = "prompt") -> np.ndarray:
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        arr = None
    if arr is None or arr.min() < 0 or arr.max() >= n_vocab:
        bad = next(v for v in ids if not 0 <= v < n_vocab)
        raise bad_request(f"{where} holds token id {bad}, outside the vocabulary (0 to {n_vocab - 1})", field)
    return arr.astype(np.int32)


def _multimodal(text: Any, data: Any, where: str, limits: ImageLimits, budget: ImageBudget, field: str = "prompt",
                to_generate: bool = True) -> dict:
    if limits.max_images == 0:  # llama-server's words: the server has no projector (--mmproj)
        raise bad_request("Multimodal data provided, but model does not support multimodal requests.", field)
    if not isinstance(text, str):
        raise bad_request(f"{where}.prompt_string must be a string when multimodal_data is given", field)
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise bad_request(f"{where}.multimodal_data must be a list of base64 strings", field)
    budget.take(len(data), field)
    if text.count(MEDIA_MARKER) != len(data):  # mtmd_tokenize refuses it too
        raise bad_request(f"{where}.prompt_string holds {text.count(MEDIA_MARKER)} media markers ({MEDIA_MARKER}, "
                          f"/props' media_marker) for {len(data)} images in multimodal_data: one marker per image",
                          field, code="invalid_image")
    images = []
    for k, payload in enumerate(data):
        at = f"{where}.multimodal_data[{k}]"
        if len(payload) * 3 // 4 > limits.max_bytes:  # before decoding: the work is bounded by the limit
            raise bad_request(f"{at}: the image is larger than {limits.max_bytes} bytes", field,
                              code="invalid_image")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise bad_request(f"{at} is not valid base64 ({e})", field, code="invalid_image") from None
        images.append(check_image_bytes(raw, limits, at, budget))
    if to_generate and text.endswith(MEDIA_MARKER):
        # the engine decodes text after the last image (its logits start the answer)
        raise bad_request(f"{where}.prompt_string must end with text after its last media marker", field,
                          code="invalid_image")
    return {"prompt": text, "images": images}
