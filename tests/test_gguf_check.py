"""gguf_check: a corrupt GGUF file is refused in Python, with a message naming the file
and the problem, before llama.cpp can abort on it; good files pass in milliseconds."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import N_THREADS, explain_child

from pyllama_spec.devtools import tiny
from pyllama_spec.embedded import embedded_models
from pyllama_spec.errors import ModelFileError, PyllamaError
from pyllama_spec.gguf.check import validate_gguf
from pyllama_spec.gguf.reader import GGUFInfo, ValueType, read_gguf
from pyllama_spec.gguf.writer import GGUFWriter, read_gguf_metadata

_TRAINED = embedded_models()  # the trained pair shipped in the package
TARGET, MMPROJ, DRAFT = _TRAINED.target, _TRAINED.mmproj, _TRAINED.draft


def refused(path: Path, what: str = "target model") -> str:
    """The message validate_gguf raises for ``path`` (which must be refused)."""
    with pytest.raises(ModelFileError) as info:
        validate_gguf(path, what)
    msg = str(info.value)
    assert str(path) in msg and what in msg
    assert isinstance(info.value, OSError) and isinstance(info.value, PyllamaError)
    return msg


def patched(src: Path, dst: Path, offset: int, fmt: str, value) -> Path:
    """``src`` with the field at ``offset`` overwritten with ``struct.pack(fmt, value)``."""
    data = bytearray(src.read_bytes())
    data[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    dst.write_bytes(bytes(data))
    return dst


def rewrite(src: Path, dst: Path, changes: dict | None = None, tensors: dict | None = None) -> Path:
    """Write ``src`` again (F32/F16 tensors) with key/values changed: key -> value, or
    key -> (ValueType, value) to change its type too, or key -> None to drop it; ``tensors``:
    name -> numpy array (None drops it)."""
    changes, tensors = changes or {}, tensors or {}
    info = read_gguf(src)
    raw = src.read_bytes()
    w = GGUFWriter(alignment=info.alignment)
    keys = list(info.metadata) + [k for k in changes if k not in info.metadata]
    for key in keys:
        if key == "general.alignment":
            continue
        vtype, elem = info.types.get(key, (None, None))
        value = info.metadata.get(key)
        if key in changes:
            if changes[key] is None:
                continue
            value = changes[key]
            if isinstance(value, tuple):
                vtype, value = value
                if vtype == ValueType.ARRAY:
                    elem, value = value
        if vtype == ValueType.ARRAY:
            w.add_array(key, elem, list(value))
        else:
            w.add_value(key, vtype, value)
    for t in info.tensors.values():
        if t.name in tensors:
            if tensors[t.name] is not None:
                w.add_tensor(t.name, tensors[t.name])
            continue
        dtype = {0: np.float32, 1: np.float16}[t.ggml_type]
        a = np.frombuffer(raw, dtype=dtype, count=int(np.prod(t.dims)), offset=info.data_offset + t.offset)
        w.add_tensor(t.name, a.reshape(tuple(reversed(t.dims))))
    w.write(dst)
    return dst


def small_gguf(path: Path, first_key: str = "a.first", first: tuple = (ValueType.UINT32, 7)) -> Path:
    """A small valid file whose first key/value is ``first``: its fields sit at known offsets."""
    w = GGUFWriter()
    vtype, value = first
    if vtype == ValueType.ARRAY:
        w.add_array(first_key, value[0], value[1])
    else:
        w.add_value(first_key, vtype, value)
    w.add_string("general.architecture", "llama")
    w.add_tensor("t.weight", np.ones((2, 4), np.float32))
    w.add_tensor("u.weight", np.ones(8, np.float32))
    w.write(path)
    return path


# ----------------------------------------------------------------------------- good files


@pytest.mark.parametrize("path,what,arch,n_tensors", [
    (TARGET, "target model", "hunyuan_vl", 47), (MMPROJ, "mmproj", "clip", 22), (DRAFT, "draft model", "dflash", 25)])
def test_the_embedded_models_validate(path, what, arch, n_tensors):
    info = validate_gguf(path, what)
    assert isinstance(info, GGUFInfo)
    assert info.arch == arch and len(info.tensors) == n_tensors
    assert info.data_offset % info.alignment == 0 and info.file_size == path.stat().st_size
    last = max(info.tensors.values(), key=lambda t: t.offset)
    assert info.data_offset + last.offset + last.nbytes <= info.file_size


def test_generated_tiny_models_validate(tiny_dense, tiny_hybrid, tmp_path):
    for models in (tiny_dense, tiny_hybrid):
        validate_gguf(models.target, "target model")
        validate_gguf(models.mmproj, "mmproj")
        validate_gguf(models.draft, "draft model")
    validate_gguf(tiny.write_target(tmp_path / "f16.gguf", n_embd=128, dtype="f16"), "target model")


def test_validating_the_trained_target_takes_milliseconds():
    validate_gguf(TARGET, "target model")  # warm the page cache
    best = min(_cpu_seconds(lambda: validate_gguf(TARGET, "target model")) for _ in range(5))
    assert best < 0.05, f"{best * 1e3:.1f} ms"


def _cpu_seconds(fn) -> float:
    """This thread's CPU time for ``fn()``: the work it does, which other processes on a loaded
    machine do not stretch as they stretch the wall clock."""
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def test_the_validator_itself_only_ever_raises_model_file_error(tmp_path):
    # the fuzz test's mutations, without the native loads: whatever the bytes, Python must not
    # trip over them (an IndexError here would reach the user instead of a message)
    from test_gguf_fuzz import FILES, mutations

    outcomes = {"valid": 0, "refused": 0}
    for kind, path in FILES.items():
        for i, desc, data in mutations(kind, 300, seed=7):
            p = tmp_path / f"{kind}-{i}.gguf"
            p.write_bytes(data)
            try:
                validate_gguf(p, kind)
                outcomes["valid"] += 1
            except ModelFileError:
                outcomes["refused"] += 1
            except Exception as e:  # noqa: BLE001 - the finding this test exists for
                pytest.fail(f"{kind} #{i} ({desc}): {type(e).__name__}: {e}")
            p.unlink()
    assert outcomes["refused"] > outcomes["valid"] > 0


def test_read_gguf_metadata_still_reads_lists_and_tensor_infos():
    meta = read_gguf_metadata(TARGET, with_tensors=True)
    assert meta["hunyuan_vl.rope.dimension_sections"] == [2, 3, 3, 0]
    assert len(meta["tokenizer.ggml.tokens"]) == 269 and isinstance(meta["tokenizer.ggml.tokens"][0], str)
    assert meta["__tensors__"]["output_norm.weight"] == ((64,), 0)
    assert read_gguf_metadata(DRAFT)["dflash.attention.sliding_window_pattern"] == [True, True]


# ----------------------------------------------------------------------------- structure


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is a text file, not a model, long enough for a header\n")
    assert "not a GGUF file" in refused(p)


def test_a_file_shorter_than_the_header(tmp_path):
    p = tmp_path / "short.gguf"
    p.write_bytes(TARGET.read_bytes()[:20])
    assert "20 bytes, less than a GGUF header" in refused(p)


@pytest.mark.parametrize("version,expected", [(1, "GGUF version 1"), (4, "GGUF version 4"),
                                              (0x03000000, "big-endian")])
def test_unsupported_version(tmp_path, version, expected):
    assert expected in refused(patched(TARGET, tmp_path / "v.gguf", 4, "<I", version))


def test_a_huge_key_value_count_is_refused_before_looping(tmp_path):
    msg = refused(patched(TARGET, tmp_path / "kv.gguf", 16, "<Q", 2**60))
    assert f"the header says {2**60} (~2^60) key/values but the file has only {TARGET.stat().st_size} bytes" in msg


def test_a_huge_tensor_count_is_refused(tmp_path):
    assert "the header says 4294967296 (~2^32) tensors" in refused(patched(TARGET, tmp_path / "t.gguf", 8, "<Q", 2**32))


def test_a_key_length_past_the_end_of_the_file(tmp_path):
    msg = refused(patched(TARGET, tmp_path / "k.gguf", 24, "<Q", 2**40))
    assert "the name of key/value 0" in msg and "2^40" in msg


def test_an_array_count_past_the_end_of_the_file(tmp_path):
    src = small_gguf(tmp_path / "a.gguf", "a.list", (ValueType.ARRAY, (ValueType.STRING, ["x", "y"])))
    count_at = 24 + 8 + len("a.list") + 4 + 4
    msg = refused(patched(src, tmp_path / "b.gguf", count_at, "<Q", 2**28))
    assert "array 'a.list' says 268435456 strings but only" in msg
    msg = refused(patched(src, tmp_path / "c.gguf", count_at, "<Q", 2**62))
    assert "array 'a.list' has 4611686018427387904 (~2^62) elements" in msg


def test_a_numeric_array_longer_than_the_file(tmp_path):
    src = small_gguf(tmp_path / "a.gguf", "a.nums", (ValueType.ARRAY, (ValueType.FLOAT32, [1.0, 2.0])))
    msg = refused(patched(src, tmp_path / "b.gguf", 24 + 8 + len("a.nums") + 8, "<Q", 10**6))
    assert ("array 'a.nums' (1000000 x FLOAT32) would need 4000000 bytes at offset 54, "
            "past the end of the file (288 bytes)") in msg


@pytest.mark.parametrize("vtype", [13, -1, 9999])
def test_an_invalid_value_type(tmp_path, vtype):
    msg = refused(patched(small_gguf(tmp_path / "a.gguf"), tmp_path / "b.gguf", 24 + 8 + len("a.first"), "<i", vtype))
    assert f"key 'a.first' has invalid value type {vtype}" in msg


def test_a_nested_array(tmp_path):
    src = small_gguf(tmp_path / "a.gguf", "a.list", (ValueType.ARRAY, (ValueType.INT32, [1, 2])))
    msg = refused(patched(src, tmp_path / "b.gguf", 24 + 8 + len("a.list") + 4, "<i", ValueType.ARRAY))
    assert "array 'a.list' has invalid element type 9 (nested arrays are not allowed)" in msg


def test_a_duplicate_key(tmp_path):
    src = small_gguf(tmp_path / "a.gguf", "general.architecturX", (ValueType.STRING, "x"))
    data = src.read_bytes().replace(b"general.architecturX", b"general.architecture")
    (tmp_path / "b.gguf").write_bytes(data)
    assert "key 'general.architecture' appears twice (key/value 1)" in refused(tmp_path / "b.gguf")


@pytest.mark.parametrize("value,problem", [(3, "general.alignment is 3, not a power of 2"),
                                           (0, "general.alignment is 0, not a power of 2")])
def test_a_bad_alignment(tmp_path, value, problem):
    src = small_gguf(tmp_path / "a.gguf", "general.alignment", (ValueType.UINT32, 32))
    assert problem in refused(patched(src, tmp_path / "b.gguf", 24 + 8 + len("general.alignment") + 4, "<I", value))


def test_an_alignment_of_the_wrong_type(tmp_path):
    src = small_gguf(tmp_path / "a.gguf", "general.alignment", (ValueType.UINT32, 32))
    msg = refused(patched(src, tmp_path / "b.gguf", 24 + 8 + len("general.alignment"), "<i", ValueType.INT32))
    assert "general.alignment has type INT32, expected UINT32" in msg


def _tensor_info_at(path: Path) -> int:
    """Where the first tensor info of a small_gguf file starts."""
    info = read_gguf(path)
    data = path.read_bytes()
    return data.index(struct.pack("<Q", len("t.weight")) + b"t.weight", 24, info.data_offset)


@pytest.mark.parametrize("field,fmt,value,problem", [
    ("n_dims", "<I", 5, "tensor 't.weight' has 5 dimensions (ggml allows at most 4)"),
    ("dim0", "<q", 0, "tensor 't.weight' has dimensions [0, 2] (each must be at least 1)"),
    ("dim0", "<q", -4, "tensor 't.weight' has dimensions [-4, 2] (each must be at least 1)"),
    ("dim1", "<q", 2**62, "tensor 't.weight' has dimensions [4, 4611686018427387904]: more than 2^63 elements"),
    ("type", "<i", 4, "tensor 't.weight' has unknown ggml type 4"),
    ("type", "<i", 43, "tensor 't.weight' has unknown ggml type 43"),
    ("type", "<i", 2, "tensor 't.weight' of type Q4_0 has rows of 4 elements, not a multiple of its block size 32"),
    ("offset", "<Q", 64, "tensor 't.weight' has data offset 64, expected 0"),
])
def test_bad_tensor_infos(tmp_path, field, fmt, value, problem):
    src = small_gguf(tmp_path / "a.gguf")
    at = _tensor_info_at(src) + 8 + len("t.weight")
    at += {"n_dims": 0, "dim0": 4, "dim1": 12, "type": 20, "offset": 24}[field]
    assert problem in refused(patched(src, tmp_path / "b.gguf", at, fmt, value))


def test_a_duplicate_tensor_name(tmp_path):
    src = small_gguf(tmp_path / "a.gguf")
    (tmp_path / "b.gguf").write_bytes(src.read_bytes().replace(b"u.weight", b"t.weight"))
    assert "tensor 't.weight' appears twice (tensor 1)" in refused(tmp_path / "b.gguf")


def test_a_tensor_name_too_long_for_ggml(tmp_path):
    w = GGUFWriter()
    w.add_tensor("x" * 64, np.ones(4, np.float32))
    w.write(tmp_path / "a.gguf")
    assert "tensor 0 has a name of 64 bytes (ggml allows 63)" in refused(tmp_path / "a.gguf")


def test_a_truncated_data_section_names_the_tensor_and_the_sizes(tmp_path):
    info = read_gguf(TARGET)
    last = max(info.tensors.values(), key=lambda t: t.offset)
    p = tmp_path / "cut.gguf"
    p.write_bytes(TARGET.read_bytes()[:-1000])
    msg = refused(p)
    assert (f"tensor '{last.name}' (F32 {list(last.dims)}) extends to byte {info.file_size} "
            f"but the file has {info.file_size - 1000} bytes (truncated?)") in msg


def test_a_file_truncated_in_the_header(tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(TARGET.read_bytes()[:3000])
    assert "past the end of the file (3000 bytes)" in refused(p)


# ----------------------------------------------------------------------------- semantics


def test_duplicate_token_strings_are_refused_with_both_ids(tmp_path):
    tokens = read_gguf_metadata(TARGET)["tokenizer.ggml.tokens"]
    tokens[200] = tokens[17]
    msg = refused(rewrite(TARGET, tmp_path / "dup.gguf", {"tokenizer.ggml.tokens": tokens}))
    assert f"tokenizer.ggml.tokens has duplicate token strings (ids 17 and 200: {tokens[17]!r})" in msg


def test_an_empty_token_counts_as_its_placeholder(tmp_path):
    # llama-vocab renames an empty token "[EMPTY_<id>]": that name can collide too
    tokens = read_gguf_metadata(TARGET)["tokenizer.ggml.tokens"]
    tokens[5], tokens[9] = "", "[EMPTY_5]"
    p = rewrite(TARGET, tmp_path / "e.gguf", {"tokenizer.ggml.tokens": tokens})
    assert "(ids 5 and 9: '[EMPTY_5]')" in refused(p)


def test_token_types_shorter_than_the_vocabulary(tmp_path):
    types = read_gguf_metadata(TARGET)["tokenizer.ggml.token_type"][:-3]
    p = rewrite(TARGET, tmp_path / "tt.gguf",
                {"tokenizer.ggml.token_type": (ValueType.ARRAY, (ValueType.INT32, types))})
    assert "tokenizer.ggml.token_type has 266 entries for 269 tokens" in refused(p)


@pytest.mark.parametrize("value", [0, 2**32 - 1])
@pytest.mark.parametrize("path,arch", [(TARGET, "hunyuan_vl"), (DRAFT, "dflash")])
def test_a_layer_count_llama_cpp_asserts_on(tmp_path, path, arch, value):
    p = rewrite(path, tmp_path / "n.gguf", {f"{arch}.block_count": value})
    assert f"{arch}.block_count is {value}; llama.cpp needs 1 to 512 layers" in refused(p)


@pytest.mark.parametrize("n_rot", [0, 3, 18])
def test_a_rope_width_the_rope_kernel_asserts_or_hangs_on(tmp_path, n_rot):
    p = rewrite(DRAFT, tmp_path / "r.gguf", {"dflash.rope.dimension_count": n_rot})
    assert f"dflash.rope.dimension_count is {n_rot}; rope needs an even width from 2 to the head size 16" in refused(p)


def test_a_rope_width_that_is_not_the_head_width(tmp_path):
    p = rewrite(TARGET, tmp_path / "r.gguf", {"hunyuan_vl.rope.dimension_count": 8})
    msg = refused(p)
    assert "hunyuan_vl.rope.dimension_count is 8 but the heads are 16 wide" in msg


@pytest.mark.parametrize("sections", [[4194306, 3, 3, 0], [0, 0, 0, 0], [8, -3, 3, 0]])
def test_rope_sections_the_rope_kernel_asserts_on(tmp_path, sections):
    p = rewrite(DRAFT, tmp_path / "s.gguf",
                {"dflash.rope.dimension_sections": (ValueType.ARRAY, (ValueType.INT32, sections))})
    assert f"dflash.rope.dimension_sections is {sections}: each must be >= 0 and their sum in 1..16" in refused(p)


def test_a_head_count_whose_width_overflows_32_bits(tmp_path):
    # 16 x (2^31 + 2) wraps to 32 in llama.cpp's uint32 arithmetic: the K/V shapes still match
    p = rewrite(DRAFT, tmp_path / "kv.gguf", {"dflash.attention.head_count_kv": 2**31 + 2})
    assert "dflash.attention.head_count_kv is 2147483650: heads x head size 16 overflows 32 bits" in refused(p)


@pytest.fixture(scope="module")
def qwen_family(tmp_path_factory):
    """Tiny qwen2vl, qwen3vl (deepstack) and qwen35 (gated delta net) sets: architectures with
    rules of their own."""
    d = tmp_path_factory.mktemp("qwen-family")
    return {arch: tiny.make_tiny_set(d, arch=arch) for arch in ("qwen2vl", "qwen3vl", "qwen35")}


def test_the_qwen_family_validates(qwen_family):
    for models in qwen_family.values():
        for path, what in ((models.target, "target model"), (models.mmproj, "mmproj"), (models.draft, "draft model")):
            validate_gguf(path, what)


def test_key_and_value_heads_of_different_widths(tmp_path, qwen_family):
    p = rewrite(qwen_family["qwen2vl"].target, tmp_path / "kv.gguf", {"qwen2vl.attention.key_length": 17})
    assert "the heads' keys are 17 wide and their values 16" in refused(p)


def test_heads_that_do_not_split_a_qwen2vl_width(tmp_path, qwen_family):
    p = rewrite(qwen_family["qwen2vl"].target, tmp_path / "h.gguf", {"qwen2vl.attention.head_count": 3})
    assert "qwen2vl.attention.head_count is 3: 3 heads of 16 do not make qwen2vl.embedding_length 64" in refused(p)


def test_deepstack_into_the_last_layer(tmp_path, qwen_family):
    p = rewrite(qwen_family["qwen3vl"].target, tmp_path / "ds.gguf", {"qwen3vl.n_deepstack_layers": 4})
    assert "qwen3vl.n_deepstack_layers is 4; a model of 4 layers has at most 3" in refused(p)


def test_a_deepstack_merger_without_its_second_layer(tmp_path, qwen_family):
    p = rewrite(qwen_family["qwen3vl"].mmproj, tmp_path / "m.gguf", tensors={"v.deepstack.0.fc2.weight": None})
    assert "tensor 'v.deepstack.0.fc2.weight' is missing (deepstack merger 0 has the others)" in refused(p, "mmproj")


def test_a_full_attention_interval_of_zero(tmp_path, qwen_family):
    p = rewrite(qwen_family["qwen35"].target, tmp_path / "fa.gguf", {"qwen35.full_attention_interval": 0})
    assert "qwen35.full_attention_interval is 0 (llama.cpp divides by it)" in refused(p)


def test_a_norm_that_is_not_f32(tmp_path):
    p = rewrite(TARGET, tmp_path / "n.gguf", tensors={"output_norm.weight": np.ones(64, np.float16)})
    assert "tensor 'output_norm.weight' is F16; 1-D tensors (norms, biases) must be F32" in refused(p)


@pytest.mark.parametrize("key,value", [("qwen35.ssm.inner_size", 3), ("qwen35.ssm.time_step_rank", 0),
                                       ("qwen35.ssm.group_count", 3)])
def test_delta_net_sizes_that_disagree(tmp_path, qwen_family, key, value):
    p = rewrite(qwen_family["qwen35"].target, tmp_path / "dn.gguf", {key: value})
    assert "disagree (inner size = state size x value heads, value heads a multiple of key heads)" in refused(p)


def test_an_unknown_rope_scaling_type(tmp_path):
    p = rewrite(TARGET, tmp_path / "y.gguf", {"hunyuan_vl.rope.scaling.type": (ValueType.STRING, "yarm")})
    assert "hunyuan_vl.rope.scaling.type is 'yarm', not one of none, linear, yarn, longrope" in refused(p)


def test_more_experts_used_than_there_are(tmp_path):
    p = rewrite(TARGET, tmp_path / "x.gguf", {"hunyuan_vl.expert_count": (ValueType.UINT32, 4),
                                              "hunyuan_vl.expert_used_count": (ValueType.UINT32, 8)})
    assert "hunyuan_vl.expert_used_count is 8 for 4 experts" in refused(p)


def test_a_matrix_of_a_type_ggml_cannot_multiply(tmp_path):
    info = read_gguf(TARGET)
    last = max(info.tensors.values(), key=lambda t: t.offset)  # the last tensor can change type in place
    offset_at = TARGET.read_bytes().index(last.name.encode(), 24, info.data_offset) + len(last.name) + 4 + 8 * 2
    p = patched(TARGET, tmp_path / "q.gguf", offset_at, "<i", 9)  # Q8_1
    assert f"tensor '{last.name}' is a Q8_1 matrix: ggml has no matrix product for Q8_1" in refused(p)


# ----------------------------------------------------------------------------- clip (mmproj)


@pytest.mark.parametrize("key,stored", [("clip.vision.spatial_merge_size", (ValueType.FLOAT32, 2.0)),
                                        ("clip.vision.attention.layer_norm_epsilon", (ValueType.UINT32, 1)),
                                        ("clip.vision.attention.head_count", (ValueType.INT32, 2))])
def test_a_projector_key_of_the_wrong_type(tmp_path, key, stored):
    p = rewrite(MMPROJ, tmp_path / "t.gguf", {key: stored})
    expected = "FLOAT32" if "epsilon" in key else "UINT32"
    assert f"{key} is stored as {stored[0].name}; clip.cpp reads it as {expected}" in refused(p, "mmproj")


@pytest.mark.parametrize("name", ["v.blk.0.attn_q.weight", "v.blk.0.attn_k.bias", "v.patch_embd.weight.1"])
def test_a_projector_missing_a_tensor_its_graph_uses(tmp_path, name):
    p = rewrite(MMPROJ, tmp_path / "m.gguf", tensors={name: None})
    assert f"tensor {name!r} is missing (the qwen2vl_merger projector needs it)" in refused(p, "mmproj")


@pytest.mark.parametrize("n_layer", [0, 16777217])
def test_a_projector_layer_count_other_than_its_layers(tmp_path, n_layer):
    p = rewrite(MMPROJ, tmp_path / "l.gguf", {"clip.vision.block_count": n_layer})
    assert f"clip.vision.block_count is {n_layer} but the file has tensors for 1 vision layers" in refused(p, "mmproj")


@pytest.mark.parametrize("n_head,problem", [
    (3, "clip.vision.attention.head_count is 3: 3 heads of 10 do not make clip.vision.embedding_length 32"),
    (0, "clip.vision.attention.head_count is 0 (the qwen2vl_merger graph splits its attention into heads)")])
def test_projector_heads_that_do_not_divide_the_width(tmp_path, n_head, problem):
    p = rewrite(MMPROJ, tmp_path / "h.gguf", {"clip.vision.attention.head_count": n_head})
    assert problem in refused(p, "mmproj")


@pytest.mark.parametrize("key,value,tensor", [("clip.vision.embedding_length", 16, "v.patch_embd.weight"),
                                              ("clip.vision.patch_size", 7, "v.patch_embd.weight")])
def test_projector_hyperparameters_that_do_not_fit_its_tensors(tmp_path, key, value, tensor):
    p = rewrite(MMPROJ, tmp_path / "e.gguf", {key: value})
    assert f"tensor {tensor!r} is [14, 14, 3, 32] but" in refused(p, "mmproj")


def test_a_projector_norm_of_the_wrong_length(tmp_path):
    p = rewrite(MMPROJ, tmp_path / "n.gguf", tensors={"v.blk.0.ln1.weight": np.ones(31, np.float32)})
    msg = refused(p, "mmproj")
    assert "tensor 'v.blk.0.ln1.bias' has 32 elements but 'v.blk.0.ln1.weight' [31] has 31 outputs" in msg


def test_a_bias_that_is_not_f32(tmp_path):
    p = rewrite(MMPROJ, tmp_path / "b.gguf", tensors={"mm.2.bias": np.zeros(64, np.float16)})
    assert "tensor 'mm.2.bias' is F16; 1-D tensors (norms, biases) must be F32" in refused(p, "mmproj")


def test_a_qwen_vl_projector_merges_two_by_two(tmp_path):
    p = rewrite(MMPROJ, tmp_path / "m.gguf", {"clip.vision.spatial_merge_size": 1})
    assert "clip.vision.spatial_merge_size is 1; the qwen2vl_merger graph merges 2 x 2 patches" in refused(p, "mmproj")


def test_a_projector_is_checked_as_one_whatever_its_architecture_says(tmp_path):
    # libmtmd ignores general.architecture: a flipped byte there must not switch the checks off
    p = rewrite(MMPROJ, tmp_path / "a.gguf", {"general.architecture": "slip"}, tensors={"v.blk.0.attn_k.bias": None})
    assert "tensor 'v.blk.0.attn_k.bias' is missing" in refused(p, "mmproj")


# ----------------------------------------------------------------------------- the native crashes these prevent

CRASHES = {
    # a file the validator refuses, and how llama.cpp / libmtmd dies on it without the check
    "duplicate tokens": ("target", lambda d: rewrite(TARGET, d / "dup.gguf", {"tokenizer.ggml.tokens": _dup_tokens()}),
                         "GGML_ASSERT(id_to_token.size() == token_to_id.size())"),
    "zero layers": ("draft", lambda d: rewrite(DRAFT, d / "zero.gguf", {"dflash.block_count": 0}),
                    "GGML_ASSERT(hparams.n_layer_all > 0"),
    "missing projector bias": ("mmproj", lambda d: rewrite(MMPROJ, d / "nob.gguf",
                                                           tensors={"v.blk.0.attn_q.bias": None}),
                               "Segmentation fault"),
}


def _dup_tokens() -> list[str]:
    tokens = read_gguf_metadata(TARGET)["tokenizer.ggml.tokens"]
    tokens[200] = tokens[17]
    return tokens


_LOAD_CHILD = """
import faulthandler
import sys
import numpy as np
import pyllama_spec as ps
import pyllama_spec.bindings.model
if sys.argv[3] == "off":
    pyllama_spec.bindings.model.validate_gguf = lambda path, what: None  # what llama.cpp sees without the check
faulthandler.enable()  # a SIGSEGV says so on stderr
kind, path, target = sys.argv[1], sys.argv[2], sys.argv[4]
kw = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=int(sys.argv[5]))
try:
    if kind == "target":
        engine = ps.load(path, **kw)
    elif kind == "draft":
        engine = ps.load(target, draft=path, draft_max=3, **kw)
    else:
        engine = ps.load(target, mmproj=path, **kw)
    with engine:
        images = [np.zeros((56, 56, 3), np.uint8)] if kind == "mmproj" else []
        engine.generate(ps.MEDIA_MARKER * len(images) + "hi", images=images, max_tokens=2)
except ps.ModelFileError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("case", sorted(CRASHES))
def test_the_check_prevents_a_native_crash(case, tmp_path, run_python):
    kind, make, native_message = CRASHES[case]
    path = make(tmp_path)
    off = run_python(_LOAD_CHILD, kind, str(path), "off", str(TARGET), str(N_THREADS))
    assert off.returncode < 0 and native_message in off.stderr, explain_child(off)
    on = run_python(_LOAD_CHILD, kind, str(path), "on", str(TARGET), str(N_THREADS))
    assert on.returncode == 0, explain_child(on)
    assert on.stdout.startswith("REFUSED") and str(path) in on.stdout and "is corrupt" in on.stdout


def test_a_file_rewritten_in_place_is_read_again_not_served_from_the_cache(tmp_path):
    from pyllama_spec.gguf.check import validate_gguf

    src = embedded_models().target.read_bytes()
    path = tmp_path / "rewritten.gguf"
    path.write_bytes(src)
    assert validate_gguf(path, "target model").arch == "hunyuan_vl"
    broken = bytearray(src)
    broken[4:8] = (99).to_bytes(4, "little")  # the version field: same size, same name, maybe same mtime
    path.write_bytes(bytes(broken))
    with pytest.raises(ModelFileError, match="rewritten.gguf"):
        validate_gguf(path, "target model")
