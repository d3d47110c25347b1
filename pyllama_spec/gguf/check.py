"""Validate GGUF files in pure Python, before llama.cpp sees them.

llama.cpp trusts much of what a GGUF file says: a flipped byte that makes two token
strings equal, a key stored with the wrong type, or a zero head count ends in a
``GGML_ASSERT`` (the process aborts) or a division by zero, not in an error code.
``validate_gguf`` reads the file with ``reader.read_gguf`` (never the tensor data: the data
section is only measured against the file size), then checks the few semantic rules whose
violation llama.cpp (``src/llama-vocab.cpp``, ``src/llama-model.cpp``) or libmtmd
(``tools/mtmd/clip.cpp``) asserts on, and raises ``ModelFileError`` naming the file and the problem.
"""

from __future__ import annotations

import os
from typing import Callable, NoReturn

import numpy as np

from pyllama_spec.gguf.reader import (
    GGUFInfo,
    ValueType,
    _fail_for,
    _type_name,
    read_gguf_shared,
    remember_validated,
    validation_key,
    was_validated,
)

# -- semantic checks ----------------------------------------------------------------
# Each rule below prevents a native abort, crash or hang, and its comment names what in llama.cpp
# would fire. Most were found by fuzzing (tests/test_gguf_fuzz.py: the embedded trained models;
# by hand also the tiny qwen2vl, qwen3vl and qwen35 sets); the expert-count, rope-scaling and
# token-array rules are the checks next to them in the same llama.cpp functions.

LLAMA_MAX_LAYERS = 512      # src/llama-hparams.h
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# What the graphs (src/models/<arch>.cpp) of the architectures this package serves assert about
# the head geometry, which the tensor shapes do not always pin down:
# n_embd_head_v == n_embd_head_k,
KV_HEADS_EQUAL = frozenset({"qwen2vl", "qwen3vl", "qwen3vlmoe", "hunyuan_vl", "qwen35", "qwen35moe", "qwen3",
                            "qwen3moe", "qwen3next", "qwen4exp", "llama", "minimax-01", "minimax-m2", "nemotron_h",
                            "muse-glimmer", "nanbeige", "dflash", "eagle3"})
# n_embd_head == n_rot,
ROPE_SPANS_THE_HEAD = frozenset({"llama", "qwen2vl", "qwen3vl", "qwen3vlmoe", "hunyuan_vl", "qwen3",
                                 "qwen3moe", "minimax-01", "minimax-m2"})
# and, where the Q weight is n_embd wide, a head split of exactly n_embd (ggml_reshape asserts).
Q_IS_N_EMBD = frozenset({"qwen2vl"})
# Gated-delta-net architectures: their tensors give each value head ssm.state_size dimensions,
# their graph ssm.inner_size / ssm.time_step_rank (src/models/qwen35.cpp and kin).
DELTA_NET_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next"})
# ggml types ggml-cpu has no dot product for (intermediate types, integers): a matrix of one
# of these is a null function pointer in mul_mat (SIGSEGV), not an error.
NO_MATMUL_TYPES = frozenset({9, 15, 24, 25, 26, 27, 28})  # Q8_1, Q8_K, I8, I16, I32, I64, F64


def validate_gguf(path: str | os.PathLike, what: str = "model") -> GGUFInfo:
    """Check that llama.cpp / libmtmd can load ``path`` without aborting the process.

    ``what`` names the file's role in messages ("target model", "draft model", "mmproj").
    Reads only the header, the key/values and the tensor infos (milliseconds, whatever the
    size of the tensor data). Checks the structure (``read_gguf``), then what llama.cpp
    asserts on instead of returning an error: unique token strings, the layer count, the head
    and rope geometry, the deepstack and gated-delta-net sizes, tensor types ggml can compute
    with, and for a ``clip`` projector the key types, layer count, tensor shapes and the tensors
    its graph uses unconditionally. Raises
    ``ModelFileError`` ("<what> file <path> is corrupt: <problem>"); returns what it read, shared
    and read-only (see ``read_gguf_shared``): a file that passed before and is unchanged is not
    checked again.

    >>> validate_gguf("pyllama_spec/models/trained-target.gguf", "target model").arch   # doctest: +SKIP
    'hunyuan_vl'
    """
    info = read_gguf_shared(path, what)
    key = validation_key(path, info)
    if was_validated(key):
        return info
    fail = _fail_for(info.path, what)
    _check_tensor_types(info, fail)
    # libmtmd never looks at general.architecture: a file with clip keys is a projector to it
    if info.arch == "clip" or any(k.startswith("clip.") for k in info.metadata):
        _check_clip(info, fail)
    if info.arch != "clip":
        _check_vocab(info, fail)
        _check_hparams(info, fail)
    if info.arch == "eagle3":
        _check_eagle3(info, fail)
    remember_validated(key)
    return info


def _scalar(info: GGUFInfo, key: str, vtype: ValueType = ValueType.UINT32):
    """The value of ``key`` if it is a scalar of ``vtype`` (llama.cpp's get_key throws a clean
    error on any other type, so only values of the type it reads need checking)."""
    return info.metadata[key] if info.types.get(key) == (vtype, None) else None


def _u32s(info: GGUFInfo, key: str):
    """A u32 key llama.cpp reads as one value or one per layer (get_key_or_arr), as an array."""
    if info.types.get(key) in ((ValueType.UINT32, None), (ValueType.ARRAY, ValueType.UINT32)):
        return np.atleast_1d(info.metadata[key])
    return np.zeros(0, np.uint32)


def _check_tensor_types(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    for t in info.tensors.values():
        if t.ggml_type in NO_MATMUL_TYPES and len(t.dims) >= 2 and max(t.dims[1:]) > 1:
            fail(f"tensor {t.name!r} is a {t.type_name} matrix: ggml has no matrix product for {t.type_name}")
        # 1-D tensors (norms, biases, ssm_a ...) are added or multiplied onto F32 activations, and
        # ggml-cpu's binary ops take an F32 second operand only (binary-ops.cpp GGML_ABORT); the
        # converter and llama-quantize always keep them F32
        if len(t.dims) == 1 and t.ggml_type != 0 and not (info.arch == "eagle3" and t.name == "d2t"):
            fail(f"tensor {t.name!r} is {t.type_name}; 1-D tensors (norms, biases) must be F32")


def _check_eagle3(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    """What src/models/eagle3.cpp asserts instead of refusing: one decoder layer, and a d2t
    (draft -> target ids) that is an I64 vector as long as the draft's own output head."""
    if _scalar(info, "eagle3.block_count") not in (None, 1):
        fail(f"eagle3.block_count is {info.metadata['eagle3.block_count']}; the eagle3 graph has one decoder layer")
    d2t, head = info.tensors.get("d2t"), info.tensors.get("output.weight")
    if d2t is None:
        return
    if d2t.ggml_type != 27 or len(d2t.dims) != 1:
        fail(f"tensor 'd2t' is a {len(d2t.dims)}-D {d2t.type_name} tensor; eagle3 needs a 1-D I64 vector")
    if head is None or len(head.dims) != 2 or head.dims[1] != d2t.dims[0]:
        fail(f"tensor 'd2t' maps {d2t.dims[0]} draft tokens, but the draft has no output head of that many rows "
             "(output.weight)")


def _check_vocab(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    if info.types.get("tokenizer.ggml.tokens") != (ValueType.ARRAY, ValueType.STRING):
        return  # missing or mistyped: llama-vocab throws (a clean error), nothing aborts
    # llama-vocab.cpp fills token_to_id from the list (an empty token becomes "[EMPTY_<id>]")
    # and then GGML_ASSERTs that no two ids share a string
    words = [w or f"[EMPTY_{i}]" for i, w in enumerate(tokens)] if "" in tokens else tokens
    if len(set(words)) != len(words):
        first: dict[str, int] = {}
        for i, w in enumerate(words):
            if w in first:
                fail(f"tokenizer.ggml.tokens has duplicate token strings (ids {first[w]} and {i}: {w!r})")
            first[w] = i
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        arr = info.metadata.get(key)
        if arr is not None and info.types[key][0] == ValueType.ARRAY and len(arr) < len(words):
            fail(f"{key} has {len(arr)} entries for {len(words)} tokens")


def _check_hparams(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    arch = info.arch
    if arch is None:
        return  # llama.cpp refuses a file without an architecture cleanly
    meta = info.metadata

    def key(name: str) -> str:
        return f"{arch}.{name}"

    # llama-model.cpp load_hparams: GGML_ASSERT(n_layer > 0 && n_layer <= LLAMA_MAX_LAYERS) and the
    # expert-count asserts that follow it
    n_layer = _scalar(info, key("block_count"))
    if n_layer is not None and not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        fail(f"{key('block_count')} is {n_layer}; llama.cpp needs 1 to {LLAMA_MAX_LAYERS} layers")
    nextn = _scalar(info, key("nextn_predict_layers"))
    if nextn is not None and n_layer is not None and nextn > n_layer:
        fail(f"{key('nextn_predict_layers')} is {nextn}, more than the {n_layer} layers")
    n_expert = _scalar(info, key("expert_count")) or 0
    if arch in ("hunyuan_vl", "hunyuan-dense") and n_expert <= 1:
        n_expert = 0  # llama.cpp ignores the experts of these dense models
    else:
        used = _u32s(info, key("expert_used_count"))
        n_used = int(used.max()) if used.size else 0
        if n_expert > LLAMA_MAX_EXPERTS:
            fail(f"{key('expert_count')} is {n_expert}, over llama.cpp's {LLAMA_MAX_EXPERTS}")
        if n_used > n_expert or (n_expert > 0 and n_used == 0):
            fail(f"{key('expert_used_count')} is {n_used} for {n_expert} experts")

    # qwen3vl.cpp adds deepstack slice i to layer i's output; the last layer keeps only the output
    # rows, so a slice there cannot broadcast (ggml_add asserts ggml_can_repeat)
    n_deepstack = _scalar(info, key("n_deepstack_layers"))
    if n_deepstack and n_layer is not None and n_deepstack >= n_layer:
        fail(f"{key('n_deepstack_layers')} is {n_deepstack}; a model of {n_layer} layers has at most {n_layer - 1}")
    # qwen35.cpp and kin: a layer is recurrent unless (il + 1) % full_attention_interval == 0
    if _scalar(info, key("full_attention_interval")) == 0:
        fail(f"{key('full_attention_interval')} is 0 (llama.cpp divides by it)")
    if arch in DELTA_NET_ARCHS:
        d_inner, d_state = _scalar(info, key("ssm.inner_size")), _scalar(info, key("ssm.state_size"))
        n_v_heads, n_k_heads = _scalar(info, key("ssm.time_step_rank")), _scalar(info, key("ssm.group_count"))
        if None not in (d_inner, d_state, n_v_heads, n_k_heads) and (
                not n_v_heads or not n_k_heads or d_inner != d_state * n_v_heads or n_v_heads % n_k_heads):
            # the graph divides by both head counts and GGML_ASSERTs their ratio; reshapes assert the sizes
            fail(f"{key('ssm.inner_size')} {d_inner}, {key('ssm.state_size')} {d_state}, "
                 f"{key('ssm.time_step_rank')} {n_v_heads} and {key('ssm.group_count')} {n_k_heads} disagree "
                 f"(inner size = state size x value heads, value heads a multiple of key heads)")

    # llama-model.cpp: GGML_ASSERT(rope_scaling_type != UNSPECIFIED) for an unknown name
    scaling = _scalar(info, key("rope.scaling.type"), ValueType.STRING)
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        fail(f"{key('rope.scaling.type')} is {scaling!r}, not one of {', '.join(ROPE_SCALING_TYPES)}")

    # head geometry, computed as load_hparams does
    n_embd = _scalar(info, key("embedding_length"))
    heads = _u32s(info, key("attention.head_count"))
    n_head = int(heads[0]) if heads.size else None  # hparams.n_head() is layer 0's
    if not n_embd or not n_head:
        return  # no heads: llama.cpp skips the head geometry, and the tensor shapes catch the rest
    head_k = _scalar(info, key("attention.key_length")) or n_embd // n_head
    head_v = _scalar(info, key("attention.value_length")) or n_embd // n_head
    # llama.cpp multiplies heads by head size in uint32: a wrapped product can match the tensor
    # shapes while the graph reshapes with the real head count (ggml_reshape asserts)
    for name in ("attention.head_count", "attention.head_count_kv"):
        heads = _u32s(info, key(name))
        if heads.size and int(heads.max()) * max(head_k, head_v) >= 1 << 32:
            fail(f"{key(name)} is {int(heads.max())}: heads x head size {max(head_k, head_v)} overflows 32 bits")
    n_rot = _scalar(info, key("rope.dimension_count"))
    # ggml-cpu rope: GGML_ASSERT(n_dims <= ne0) and GGML_ASSERT(n_dims % 2 == 0); with n_dims 0
    # it never returns
    if n_rot is not None and (not 0 < n_rot <= head_k or n_rot % 2):
        fail(f"{key('rope.dimension_count')} is {n_rot}; rope needs an even width from 2 to the head size {head_k}")
    n_rot = head_k if n_rot is None else n_rot
    if arch in KV_HEADS_EQUAL and head_k != head_v:
        fail(f"the heads' keys are {head_k} wide and their values {head_v} (key_length / value_length; "
             f"llama.cpp's {arch} graph asserts they are equal)")
    if arch in Q_IS_N_EMBD and n_head * head_v != n_embd:
        fail(f"{key('attention.head_count')} is {n_head}: {n_head} heads of {head_v} do not make "
             f"{key('embedding_length')} {n_embd}")
    if arch in ROPE_SPANS_THE_HEAD and n_rot != head_v:
        fail(f"{key('rope.dimension_count')} is {n_rot} but the heads are {head_v} wide "
             f"(llama.cpp's {arch} graph asserts they are equal)")
    # ggml-cpu rope (ggml_mrope_cache_init): GGML_ASSERT(sum(sections) <= head size), and the
    # sum is a divisor
    sections = meta.get(key("rope.dimension_sections"))
    if info.types.get(key("rope.dimension_sections")) == (ValueType.ARRAY, ValueType.INT32) and len(sections) >= 4:
        s4 = [int(v) for v in sections[:4]]
        if min(s4) < 0 or not 0 < sum(s4) <= head_k:
            fail(f"{key('rope.dimension_sections')} is {s4}: each must be >= 0 and their sum in 1..{head_k} "
                 f"(the head size)")


# -- clip (mmproj) ---------------------------------------------------------------------

# The type clip.cpp reads each key as (tools/mtmd/clip.cpp get_u32/get_i32/get_f32/get_bool/
# get_string): gguf_get_val_<type> GGML_ASSERTs the stored type, so a flipped type byte aborts.
def _clip_key_types() -> dict[str, ValueType]:
    u32, i32, f32, b, s = ValueType.UINT32, ValueType.INT32, ValueType.FLOAT32, ValueType.BOOL, ValueType.STRING
    types = {
        "general.name": s, "general.description": s, "clip.projector_type": s,
        "clip.vision.projector_type": s, "clip.audio.projector_type": s, "clip.gen.audio.projector_type": s,
        "clip.gen.audio.model_variant": s, "clip.vision.mm_patch_merge_type": s,
        "clip.has_vision_encoder": b, "clip.has_audio_encoder": b, "clip.has_gen_audio_encoder": b,
        "clip.use_gelu": b, "clip.use_silu": b, "clip.minicpmv_version": i32, "clip.minicpmv_query_num": u32,
        "clip.vision.swiglu_clamp": f32,
    }
    for prefix in ("vision", "audio", "gen.audio"):
        for name in ("embedding_length", "feed_forward_length", "block_count", "projection_dim",
                     "attention.head_count", "attention.head_count_kv", "attention.head_dim"):
            types[f"clip.{prefix}.{name}"] = u32
        types[f"clip.{prefix}.attention.layer_norm_epsilon"] = f32
    for name in ("image_size", "patch_size", "image_min_pixels", "image_max_pixels", "preproc_min_tiles",
                 "preproc_max_tiles", "preproc_image_size", "projector.scale_factor", "projector.query_side",
                 "projector.window_side", "spatial_merge_size", "n_wa_pattern", "window_size", "sam.head_count",
                 "sam.block_count", "sam.embedding_length", "expert_used_count"):
        types[f"clip.vision.{name}"] = u32
    for name in ("num_mel_bins", "projector.stack_factor", "chunk_size", "conv_kernel_size", "max_pos_emb",
                 "projector.window_size", "projector.downsample_rate", "projector.head_count",
                 "rvq.num_quantizers", "window_size", "local_block_count", "local_group_size", "subsampling_factor"):
        types[f"clip.audio.{name}"] = u32
    return types


CLIP_KEY_TYPES = _clip_key_types()

# Tensors clip.cpp loads as optional but the Qwen-VL graphs (tools/mtmd/models/qwen2vl.cpp,
# qwen3vl.cpp) use unconditionally: a missing one is a null tensor in ggml_mul_mat / ggml_add
# (SIGSEGV) or a GGML_ASSERT. (model-wide names, per-layer suffixes)
_QWEN2VL_TENSORS = (("v.patch_embd.weight", "v.patch_embd.weight.1"),
                    ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight", "attn_v.bias"))
QWEN_VL_PROJECTORS = {
    "qwen2vl_merger": _QWEN2VL_TENSORS,
    "qwen2.5vl_merger": _QWEN2VL_TENSORS,
    "qwen3vl_merger": (("v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight"),
                       ("attn_qkv.weight", "attn_qkv.bias")),
}


def _check_clip(info: GGUFInfo, fail: Callable[[str], NoReturn]) -> None:
    for key, vtype in CLIP_KEY_TYPES.items():
        if key in info.types and info.types[key] != (vtype, None):
            fail(f"{key} is stored as {_type_name(info.types[key])}; clip.cpp reads it as {vtype.name}")
    tensors = info.tensors
    for t in tensors.values():
        # a bias is added to its weight's output (ggml_add asserts ggml_can_repeat)
        if t.name.endswith(".bias") and len(t.dims) == 1:
            w = tensors.get(t.name[:-len("bias")] + "weight")
            if w is not None and len(w.dims) in (1, 2, 4) and w.dims[-1] != t.dims[0]:
                fail(f"tensor {t.name!r} has {t.dims[0]} elements but {w.name!r} {list(w.dims)} has "
                     f"{w.dims[-1]} outputs")
    for modality, prefix in (("vision", "v"), ("audio", "a")):
        if info.metadata.get(f"clip.has_{modality}_encoder") is True:
            _check_clip_tower(info, fail, modality, prefix)


def _check_clip_tower(info: GGUFInfo, fail: Callable[[str], NoReturn], modality: str, prefix: str) -> None:
    def key(name: str) -> str:
        return f"clip.{modality}.{name}"

    tensors = info.tensors
    layers = sorted({int(n.split(".")[2]) for n in tensors
                     if n.startswith(f"{prefix}.blk.") and n.split(".")[2].isdigit()})
    n_layer = _scalar(info, key("block_count"))
    # clip.cpp sizes its layer table with block_count before it looks for the tensors: a huge
    # count allocates for minutes (or runs out of memory)
    # (and a graph without layers never uses its position input: GGML_ABORT "Failed to get tensor")
    if n_layer is not None and layers and not 1 <= n_layer <= len(layers):
        fail(f"{key('block_count')} is {n_layer} but the file has tensors for {len(layers)} {modality} layers")
    projector = _scalar(info, "clip.vision.projector_type", ValueType.STRING) \
        or _scalar(info, "clip.projector_type", ValueType.STRING)
    if modality != "vision" or projector not in QWEN_VL_PROJECTORS or not n_layer:
        return
    # the Qwen-VL graphs merge 2 x 2 patches whatever the key says, while the image is sized for
    # spatial_merge_size: any other value writes past the position buffers (heap corruption)
    merge = _scalar(info, "clip.vision.spatial_merge_size")
    if merge is not None and merge != 2:
        fail(f"clip.vision.spatial_merge_size is {merge}; the {projector} graph merges 2 x 2 patches")
    global_names, layer_suffixes = QWEN_VL_PROJECTORS[projector]
    for name in global_names:
        if name not in tensors:
            fail(f"tensor {name!r} is missing (the {projector} projector needs it)")
    for i in range(n_layer):
        for suffix in layer_suffixes:
            if f"v.blk.{i}.{suffix}" not in tensors:
                fail(f"tensor 'v.blk.{i}.{suffix}' is missing (the {projector} projector needs it)")
        # qwen3vl: a deepstack merger runs when its fc1 is there; without its fc2 its output is the
        # wrong width and the encoder writes past mtmd's buffer (GGML_ABORT)
        deepstack = {n for n in tensors if n.startswith(f"v.deepstack.{i}.")}
        for part in ("fc1.weight", "fc2.weight"):
            if deepstack and f"v.deepstack.{i}.{part}" not in deepstack:
                fail(f"tensor 'v.deepstack.{i}.{part}' is missing (deepstack merger {i} has the others)")
    # the Qwen-VL graphs reshape the activations with these hyperparameters (ggml_reshape asserts
    # the element count): they must match the tensors
    n_embd, n_head = _scalar(info, key("embedding_length")), _scalar(info, key("attention.head_count"))
    patch = _scalar(info, "clip.vision.patch_size")
    if n_head == 0:
        fail(f"{key('attention.head_count')} is 0 (the {projector} graph splits its attention into heads)")
    if not n_embd or not n_head or not patch:
        return  # clip.cpp refuses a missing or zero width or patch size itself
    d_head = _scalar(info, key("attention.head_dim")) or n_embd // n_head
    if d_head * n_head != n_embd:
        fail(f"{key('attention.head_count')} is {n_head}: {n_head} heads of {d_head} do not make "
             f"{key('embedding_length')} {n_embd}")
    expected = {"v.patch_embd.weight": (patch, patch, 3, n_embd), "v.patch_embd.weight.1": (patch, patch, 3, n_embd)}
    for i in range(n_layer):
        for suffix, dims in (("ln1.weight", (n_embd,)), ("ln2.weight", (n_embd,)), ("attn_q.weight", (n_embd, n_embd)),
                             ("attn_k.weight", (n_embd, n_embd)), ("attn_v.weight", (n_embd, n_embd)),
                             ("attn_qkv.weight", (n_embd, 3 * n_embd)), ("attn_out.weight", (n_embd, n_embd))):
            expected[f"v.blk.{i}.{suffix}"] = dims
    for name, dims in expected.items():
        t = tensors.get(name)
        if t is not None and t.dims != dims:
            fail(f"tensor {name!r} is {list(t.dims)} but embedding_length {n_embd}, patch_size {patch} "
                 f"make it {list(dims)}")
