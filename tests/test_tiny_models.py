"""Pure-Python checks of the GGUF writer and the tiny model generator (no native library)."""

import numpy as np
import pytest

from pyllama_spec import tiny
from pyllama_spec.gguf_writer import GGUFWriter, ValueType, read_gguf_metadata


def test_gguf_writer_round_trips_values_and_aligns_data(tmp_path):
    w = GGUFWriter()
    w.add_uint8("u8", 200)
    w.add_int8("i8", -5)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -300)
    w.add_uint32("u32", 4_000_000_000)
    w.add_int32("i32", -7)
    w.add_uint64("u64", 2**40)
    w.add_int64("i64", -(2**40))
    w.add_float32("f32", 0.5)
    w.add_float64("f64", 0.1)
    w.add_bool("b", True)
    w.add_string("s", "héllo")
    w.add_array("as", ValueType.STRING, ["a", "b c"])
    w.add_array("ai", ValueType.INT32, [1, -2, 3])
    w.add_array("ab", ValueType.BOOL, [True, False])
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("y", np.ones(5, dtype=np.float16))
    path = tmp_path / "t.gguf"
    w.write(path)

    meta = read_gguf_metadata(path, with_tensors=True)
    assert meta["u8"] == 200 and meta["i8"] == -5 and meta["u16"] == 60000 and meta["i16"] == -300
    assert meta["u32"] == 4_000_000_000 and meta["i32"] == -7
    assert meta["u64"] == 2**40 and meta["i64"] == -(2**40)
    assert meta["f32"] == 0.5 and meta["f64"] == 0.1 and meta["b"] is True and meta["s"] == "héllo"
    assert meta["as"] == ["a", "b c"] and meta["ai"] == [1, -2, 3] and meta["ab"] == [True, False]
    # ggml dims are the reversed numpy shape; type 0 = F32, 1 = F16
    assert meta["__tensors__"] == {"x": ((3, 2), 0), "y": ((5,), 1)}
    data = path.read_bytes()
    assert data[:4] == b"GGUF" and len(data) % 32 == 0
    # the last tensor's data sits at the end of the file, aligned
    assert data[-32:-22] == np.ones(5, dtype=np.float16).tobytes()
    with pytest.raises(KeyError):
        w.add_uint32("u8", 1)


@pytest.mark.parametrize("arch", tiny.TARGET_ARCHS)
def test_target_is_deterministic_and_has_keys(tmp_path, arch):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    tiny.write_target(a, arch=arch, seed=1, predictable=0.5)
    tiny.write_target(b, arch=arch, seed=1, predictable=0.5)
    tiny.write_target(c, arch=arch, seed=2, predictable=0.5)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()

    meta = read_gguf_metadata(a, with_tensors=True)
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.embedding_length"] == 64 and meta[f"{arch}.block_count"] == 4
    assert meta[f"{arch}.rope.dimension_sections"] == [2, 3, 3, 0]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(meta["tokenizer.ggml.tokens"]) == tiny.N_VOCAB
    assert meta["tokenizer.ggml.tokens"][tiny.MASK_TOKEN_ID] == tiny.MASK_TOKEN
    assert meta["tokenizer.ggml.eos_token_id"] == tiny.EOS_TOKEN_ID
    assert meta["tokenizer.chat_template"] == tiny.CHAT_TEMPLATE
    tensors = meta["__tensors__"]
    assert tensors["token_embd.weight"][0] == (64, tiny.N_VOCAB)
    assert tensors["output.weight"][0] == (64, tiny.N_VOCAB)
    if arch == "qwen35":
        assert meta["qwen35.full_attention_interval"] == 2
        assert "blk.0.ssm_a" in tensors and tensors["blk.1.attn_q.weight"][0] == (64, 128)
    else:
        assert tensors["blk.0.attn_k.weight"][0] == (64, 32)


def test_draft_and_mmproj_fit_the_target(tmp_path):
    models = tiny.make_tiny_set(tmp_path, window=48, predictable=0.5)
    draft = read_gguf_metadata(models.draft, with_tensors=True)
    assert draft["general.architecture"] == "dflash"
    assert draft["dflash.embedding_length"] == 64
    assert draft["dflash.target_layers"] == [1, 3]
    assert draft["dflash.block_size"] == 16
    assert draft["dflash.attention.sliding_window"] == 48
    assert draft["dflash.attention.sliding_window_pattern"] == [True]
    assert draft["tokenizer.ggml.mask_token_id"] == tiny.MASK_TOKEN_ID
    assert draft["__tensors__"]["fc.weight"][0] == (128, 64)
    assert "token_embd.weight" not in draft["__tensors__"]

    mmproj = read_gguf_metadata(models.mmproj)
    assert mmproj["clip.projector_type"] == "qwen2vl_merger"
    assert mmproj["clip.vision.projection_dim"] == 64

    with pytest.raises(ValueError):
        tiny.write_draft(tmp_path / "bad.gguf", target_layers=(4,), target_n_layer=4)


def test_make_tiny_set_reuses_files(tmp_path):
    first = tiny.make_tiny_set(tmp_path, seed=5)
    mtimes = [p.stat().st_mtime_ns for p in (first.target, first.mmproj, first.draft)]
    again = tiny.make_tiny_set(tmp_path, seed=5)
    assert again == first
    assert [p.stat().st_mtime_ns for p in (again.target, again.mmproj, again.draft)] == mtimes
    other = tiny.make_tiny_set(tmp_path, seed=5, window=None)
    assert other.draft != first.draft
    assert "dflash.attention.sliding_window" not in read_gguf_metadata(other.draft)
    assert not list(tmp_path.glob(".*.tmp"))


def test_chat_template_accepts_strings_and_parts():
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(tiny.CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": "be brief"},
        # llama-server passes image parts like this
        {"role": "user", "content": [{"type": "media_marker", "text": "<__media__>"},
                                     {"type": "text", "text": "what is this?"}]},
    ]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\n<__media__>what is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
