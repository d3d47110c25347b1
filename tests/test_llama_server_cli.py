"""`pyllama-spec serve` takes llama-server's command lines, environment and preset files.

The flag table is generated from the pinned llama.cpp's common/arg.cpp; it is checked against
that source and against `llama-server --help` (when built: `python build.py --tools`). Every
flag llama-server takes is accepted: honoured, or dropped with a warning that says why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from conftest import FIELD_REPORT, LLAMA_SERVER, field_report_preset

from pyllama_spec.cli import llama_server_cli as L
from pyllama_spec.cli.serve import serve


def _source() -> Path:
    from pyllama_spec.bindings.native_info import build_record

    source = Path(build_record()["source"]["path"])
    if not (source / "common" / "arg.cpp").exists():
        pytest.skip(f"the llama.cpp source this build was made from is gone ({source})")
    return source


def _context(argv: list[str], env: dict | None = None) -> tuple[click.Context, str]:
    """serve's click context for a command line (nothing is loaded), and the warnings printed."""
    from pyllama_spec.cli import options

    old_env = dict(os.environ)
    os.environ.update(env or {})
    try:
        with options.err_console.capture() as captured:
            ctx = serve.make_context("serve", list(argv))
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    return ctx, captured.get()


def _parse(argv: list[str], env: dict | None = None) -> tuple[dict, str]:
    """serve's parameters for a command line, and the warnings printed."""
    ctx, warnings = _context(argv, env)
    return ctx.params, warnings


def _router(argv: list[str], env: dict | None = None):
    """The router a command line asks for (None: one model in this process), and the warnings."""
    from pyllama_spec.cli.serve import router_plan

    ctx, warnings = _context(argv, env)
    return router_plan(ctx), warnings


# --------------------------------------------------------------------------- the table


def test_the_committed_flag_table_is_what_the_pinned_source_declares():
    from pyllama_spec.devtools.llama_server_args import TABLE_PATH, read_flags, render_table

    source = _source()
    expected = render_table(read_flags(source), f"llama.cpp's common/arg.cpp ({source.name})")
    assert TABLE_PATH.read_text() == expected, "regenerate: python -m pyllama_spec.devtools.llama_server_args"


def _llama_server() -> Path:
    if LLAMA_SERVER is None:
        pytest.skip("llama-server is not built (python build.py --tools)")
    return LLAMA_SERVER


def test_the_table_has_every_flag_of_llama_server_help_with_its_values():
    """llama-server's own --help (built from the pin) lists the same names, each with a value
    hint exactly when the table says it takes a value."""
    text = subprocess.run([str(_llama_server()), "--help"], capture_output=True, text=True, timeout=60).stdout
    in_help = {}
    for line in text.splitlines():
        # "-c,    --ctx-size N      help": names, then (after one space) a value hint, then 2+ spaces
        m = re.match(r"(-[-\w.]+(?:,\s+-[-\w.]+)*)( (?! )(?:(?!  ).)+)?(?:\s{2,}|$)", line)
        if not m or line.startswith("-----"):  # "----- common params -----" headings
            continue
        for n in re.findall(r"-[-\w.]+", m.group(1)):
            in_help[n] = m.group(2) is not None
    flags = {n: f for f in L.FLAGS if not f.preset_only for n in f.names + f.negative}
    assert set(in_help) == set(flags)
    for name, has_value in in_help.items():
        assert has_value == (flags[name].values > 0), name


def test_every_llama_server_flag_is_accepted_honoured_or_dropped_with_a_reason():
    ctx = click.Context(serve)
    accepted = serve.accepted(ctx)
    values = {"-m": "t.gguf", "-mm": "p.gguf", "-md": "d.gguf", "--spec-type": "draft-dflash", "-fa": "on",
              "-ctk": "q8_0", "-ctv": "q8_0", "-ctkd": "f16", "-ctvd": "f16", "-sm": "layer", "-l": "15043+1",
              "-dev": "none", "-devd": "none", "--draft-max": "7", "-ngl": "all", "-ngld": "all", "-ts": "1",
              "--samplers": "top_k;temperature", "--sampler-seq": "kt", "-np": "2", "--port": "8081",
              "--spec-draft-p-min": "0.5", "--top-p": "0.9", "--min-p": "0.1", "--typical": "1.0",
              "--xtc-probability": "0.1", "--xtc-threshold": "0.2", "--mirostat": "0", "-lm": "auto",
              "--slot-save-path": ".", "--lora-scaled": "a.gguf:0.5", "--chat-template-kwargs": '{"a": 1}',
              "--reasoning-format": "deepseek", "-rea": "on", "--pooling": "mean"}
    from pyllama_spec.cli.serve import DOWNLOAD_FLAGS

    argv, dropped = [], []
    for f in L.FLAGS:
        # (--version and --list-devices answer and exit; a download flag needs -m: tested below)
        if f.preset_only or f.names[0] in ("-h", "--models-preset", "--version", "--list-devices"):
            continue
        name = f.names[0]
        argv.append(name)
        if name in accepted:
            n = accepted[name]
        else:
            n = f.values
            dropped.append(f)
        value = next((values[n] for n in f.names if n in values), "1")
        argv.extend([value] * n)
    params, warnings = _parse(argv)
    assert params["model"] == "t.gguf" and params["n_gpu_layers"] == -1 and params["flash_attn"] == "on"
    for f in dropped:
        reason = L.reason_ignored(f)
        assert reason != "it has no effect in this server", f.names
        assert f"ignored {f.names[0]}" in warnings and reason[:30] in warnings.replace("\n", " "), f.names


def test_llama_server_spellings_and_values():
    params, warnings = _parse(["--ctx_size", "2048", "--n_predict", "-1", "--spec-draft-ngl", "all", "-ngl", "auto",
                               "--temperature", "0.7", "--top_k", "20", "-s", "7", "--presence-penalty", "0.5",
                               "--no-jinja", "--chat-template", "chatml", "-l", "15043-1", "-l", "2+inf",
                               "--threads-http", "5", "--fit-target", "2000"])
    assert params["n_ctx"] == 2048 and params["max_tokens"] == -1
    assert params["n_gpu_layers_draft"] == -1 and params["n_gpu_layers"] == -1
    assert (params["temperature"], params["top_k"], params["seed"], params["presence_penalty"]) == (0.7, 20, 7, 0.5)
    assert params["jinja"] is False and params["chat_template"] == "chatml"
    assert params["logit_bias"] == ((15043, -1.0), (2, float("inf")))
    assert "ignored --threads-http 5" in warnings and "ignored --fit-target 2000" in warnings


def test_the_chat_flags_are_honoured():
    params, warnings = _parse(["--chat_template_kwargs", '{"enable_thinking": false, "x": [1]}', "--reasoning", "off",
                               "--reasoning-format", "none", "--reasoning-budget", "64", "--reasoning-budget-message",
                               "Enough.", "--skip-chat-parsing", "--no-prefill-assistant", "--reasoning-effort", "low",
                               "--no-reasoning-preserve"])
    assert params["chat_template_kwargs"] == {"enable_thinking": False, "x": [1]} and params["reasoning"] == "off"
    assert (params["reasoning_format"], params["reasoning_budget"], params["reasoning_budget_message"]) == (
        "none", 64, "Enough.")
    assert params["skip_chat_parsing"] is True and params["prefill_assistant"] is False
    assert (params["reasoning_effort"], params["reasoning_preserve"]) == ("low", False)
    assert "ignored" not in warnings
    for bad in (["--chat-template-kwargs", "[1]"], ["--reasoning", "maybe"], ["--reasoning-budget", "-2"]):
        with pytest.raises(click.BadParameter):
            _parse(bad)


def test_spec_types_llama_server_knows_and_comma_lists_in_its_priority_order():
    from pyllama_spec.cli.options import _SpecType

    for one in _SpecType.LLAMA_SERVER_TYPES:  # every type llama-server knows is served here
        assert _parse(["--spec-type", one])[0]["spec_type"] == one
    with pytest.raises(click.BadParameter, match="not a speculative type llama-server knows"):
        _parse(["--spec-type", "draft-foo"])
    # common_speculative_init's order: the n-gram types first, whatever order they are given in
    assert _parse(["--spec-type", "draft-dflash,ngram-mod,ngram-simple"])[0]["spec_type"] == \
        "ngram-simple,ngram-mod,draft-dflash"
    # "none" in a list adds nothing (llama.cpp's set of enabled types); alone it is none
    assert _parse(["--spec-type", "ngram-mod,none"])[0]["spec_type"] == "ngram-mod"
    assert _parse(["--spec-type", "none,none"])[0]["spec_type"] == "none"
    with pytest.raises(click.BadParameter, match="one method with a draft or head at a time"):
        _parse(["--spec-type", "draft-mtp,draft-dflash"])
    assert _parse(["--spec-type", "draft-dflash,draft-dflash"])[0]["spec_type"] == "draft-dflash"
    # given again, the flag adds its types, as llama-server's does (the rest of its flags: the last wins)
    assert _parse(["--spec-type", "draft-dflash", "--spec-type", "ngram-mod,ngram-simple"])[0]["spec_type"] == \
        "ngram-simple,ngram-mod,draft-dflash"
    assert _parse(["--spec-type", "ngram-mod", "--spec-type", "none"])[0]["spec_type"] == "ngram-mod"
    assert _parse(["--spec-type", "none", "--spec-type", "none"])[0]["spec_type"] == "none"
    with pytest.raises(click.BadParameter, match="one method with a draft or head at a time"):
        _parse(["--spec-type", "draft-mtp", "--spec-type", "draft-eagle3"])
    assert _parse([])[0]["spec_type"] is None
    params, warnings = _parse(["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "8",
                               "--spec-ngram-mod-n-max", "32", "-lcs", "static.bin"])
    assert (params["ngram_map_k4v_size_n"], params["ngram_mod_n_max"]) == (8, 32)
    assert params["lookup_cache_static"] == "static.bin" and "ignored" not in warnings
    params, warnings = _parse(["--spec-ngram-simple-size-n", "8"])
    assert "ignored --spec-ngram-simple-size-n" in warnings and "keys of 2 to 4 tokens" in warnings


def test_an_unknown_flag_is_still_refused():
    with pytest.raises(click.NoSuchOption):
        _parse(["--no-such-flag"])


def test_llama_arg_environment_variables_set_the_options_they_share_and_others_warn():
    params, warnings = _parse([], env={"LLAMA_ARG_CTX_SIZE": "1234", "LLAMA_ARG_N_PARALLEL": "2",
                                       "LLAMA_ARG_THREADS_HTTP": "3"})
    assert params["n_ctx"] == 1234 and params["parallel"] == 2
    assert "ignored LLAMA_ARG_THREADS_HTTP=3" in warnings
    params, _ = _parse(["-c", "99"], env={"LLAMA_ARG_CTX_SIZE": "1234"})
    assert params["n_ctx"] == 99  # the command line wins, as in llama-server


# --------------------------------------------------------------------------- presets


def test_the_field_reports_preset_is_read_as_llama_server_reads_it(tmp_path):
    if not FIELD_REPORT.exists():
        pytest.skip(f"the team's field report is not here ({FIELD_REPORT})")
    preset = tmp_path / "models.ini"
    preset.write_text(field_report_preset())
    plan, _ = _router(["--models-preset", str(preset)])  # no -m: llama-server's router, one model
    (model,) = plan.presets
    assert model.name == "Qwen3.8-27B Q5"  # the section's name is the model's
    params, warnings = _parse(model.args)  # what the model's own `serve` process is started with
    assert params["model"] == "/mnt/nvme/models/Qwen3.8-27B-UD-Q5_K_S.gguf"
    assert params["draft"] == "/mnt/nvme/models/DFLASH2/Qwen3.8-27B-DFlash2-Q8_0.gguf"
    assert params["mmproj"] == "/mnt/nvme/models/mmproj-qwen3.8-27b-F16.gguf"
    assert (params["spec_type"], params["draft_max"], params["n_gpu_layers_draft"]) == ("draft-dflash", 7, -1)
    assert (params["device_draft"], params["devices"], params["n_gpu_layers"]) == ("CUDA0", "CUDA0", 99)
    assert (params["jinja"], params["flash_attn"], params["parallel"], params["n_ctx"]) == (True, "on", 1, 262144)
    assert (params["cache_type_k"], params["cache_type_v"], params["n_batch"], params["n_ubatch"]) == \
        ("q8_0", "q8_0", 2048, 512)
    assert (params["temperature"], params["top_p"], params["top_k"], params["min_p"], params["presence_penalty"]) == \
        (1.0, 0.95, 20, 0.0, 0.0)
    for dropped in ("--fit-target 2000", "--mmproj-device CUDA1", "--threads-http 5"):
        assert f"ignored {dropped}" in warnings
    # the same as flags, as a user writes them
    flags = ["-m", "/mnt/nvme/models/Qwen3.8-27B-UD-Q5_K_S.gguf", "--spec-draft-n-max", "7", "--spec-draft-ngl", "all",
             "--fit-target", "2000", "--jinja", "-fa", "on", "--threads-http", "5", "--presence-penalty", "0.0"]
    params2, _ = _parse(flags)
    for key in ("model", "draft_max", "n_gpu_layers_draft", "jinja", "flash_attn", "presence_penalty"):
        assert params2[key] == params[key], key


def test_preset_sections_globals_booleans_and_the_command_line_override(tmp_path):
    preset = tmp_path / "p.ini"
    preset.write_text("version = 1\n[*]\nctx-size = 1024\nload-mode = none\n; a comment\n"
                      "[small]\nmodel = a.gguf\nc = 2048\nno-mmproj-offload = true\n"
                      "[big]\nmodel = b.gguf\nLLAMA_ARG_N_PARALLEL = 2\nload-on-startup = true\n")
    plan, _ = _router(["--models-preset", str(preset), "-c", "512", "--port", "9000", "--models-max", "1"])
    big, small = plan.presets  # by name; the keys before the first section ("version") are no model
    assert (big.name, big.load_on_startup, small.name, small.load_on_startup) == ("big", True, "small", False)
    params, _ = _parse(big.args)
    assert params["model"] == "b.gguf" and params["parallel"] == 2 and params["n_ctx"] == 1024
    assert params["load_mode"] == "none"
    # the router's own command line follows each section (it overrides it), less the router's options
    assert plan.common_args == ["-c", "512"]
    params, _ = _parse([*small.args, *plan.common_args])
    assert (params["model"], params["n_ctx"], params["mmproj_offload"]) == ("a.gguf", 512, False)


def test_a_presets_spec_type_overrides_as_its_other_keys_do(tmp_path):
    """In a preset each key overrides [*]'s and the router's command line overrides both, --spec-type
    too (llama-server merges presets by key): only the last one reaches the model's server, where a
    command line's repeated --spec-type adds its types."""
    from pyllama_spec.cli.llama_server_cli import last_spec_type_only

    preset = tmp_path / "p.ini"
    preset.write_text("[*]\nspec-type = draft-eagle3\n[mtp]\nmodel = a.gguf\nspec-type = draft-mtp\n"
                      "[plain]\nmodel = b.gguf\n")
    plan, _ = _router(["--models-preset", str(preset)])
    mtp, plain = plan.presets
    assert _parse(last_spec_type_only((*mtp.args, *plan.common_args)))[0]["spec_type"] == "draft-mtp"
    assert _parse(last_spec_type_only((*plain.args, *plan.common_args)))[0]["spec_type"] == "draft-eagle3"
    plan, _ = _router(["--models-preset", str(preset), "--spec-type", "ngram-mod"])
    assert _parse(last_spec_type_only((*plan.presets[0].args, *plan.common_args)))[0]["spec_type"] == "ngram-mod"
    assert last_spec_type_only(["-m", "a", "--spec-type=x", "--spec-type", "y", "-c", "1"]) == (
        "-m", "a", "--spec-type", "y", "-c", "1")


def test_a_preset_with_a_model_on_the_command_line_is_not_read_as_in_llama_server(tmp_path):
    preset = tmp_path / "p.ini"
    preset.write_text("[a]\nmodel = a.gguf\n[b]\nmodel = b.gguf\n")
    plan, warnings = _router(["--models-preset", str(preset), "-m", "x.gguf"])
    assert plan is None and "ignored --models-preset" in warnings
    assert _parse(["--models-preset", str(preset), "-m", "x.gguf"])[0]["model"] == "x.gguf"


def test_router_keys_of_a_section_aliases_tags_and_stop_timeout(tmp_path):
    preset = tmp_path / "p.ini"
    preset.write_text("[*]\nstop-timeout = 3\n[m]\nmodel = m.gguf\nalias = x, b,x\ntags = t2,t1\n"
                      "LLAMA_ARG_PORT = 1\ndedup-cache-models = true\n[n]\nmodel = n.gguf\nstop-timeout = soon\n")
    plan, warnings = _router(["--models-preset", str(preset)])
    m, n = plan.presets
    assert (m.aliases, m.tags, m.stop_timeout, n.stop_timeout) == (("b", "x"), ("t1", "t2"), 3, 10)
    assert "--alias" not in m.args and "--tags" not in m.args and "--port" not in m.args
    assert m.ini == "[m]\nstop-timeout = 3\nmodel = m.gguf\ndedup-cache-models = true\n\n"
    assert "the router sets it" in warnings and "no model cache here" in warnings
    assert "not a number of seconds" in warnings


def test_bad_preset_files_are_clear_errors(tmp_path):
    cases = {"missing.ini": None, "nomodel.ini": "[a]\nc = 1\n",
             "unknown.ini": "[a]\nno-such-key = 1\n", "bool.ini": "[a]\nno-mmproj-offload = maybe\n", "bad.ini": "[a\nx"}
    expected = {"missing.ini": "cannot read", "nomodel.ini": "gives no model file", "unknown.ini": "no-such-key",
                "bool.ini": "true or false", "bad.ini": "not an INI file"}
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(click.UsageError, match=expected[name]):
            _parse(["--models-preset", str(tmp_path / name)])


# --------------------------------------------------------------------------- the real thing


def _wait_for(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("serve did not come up")


@pytest.mark.parametrize("style", ["flags", "preset"])
def test_serve_starts_on_a_llama_server_command_line_and_answers_the_openai_client(tiny_dense, tmp_path, style):
    """The field report's setup on local stand-ins (the tiny pair; a context this machine holds;
    a bf16 cache: q8_0 blocks of 32 do not divide the tiny target's head width of 16): started as
    a process, spoken to with the openai client."""
    openai = pytest.importorskip("openai")
    from pyllama_spec.devtools.rpc_server import free_port

    port = free_port()
    settings = {"model": tiny_dense.target, "model-draft": tiny_dense.draft, "mmproj": tiny_dense.mmproj,
                "spec-type": "draft-dflash", "spec-draft-n-max": "7", "spec-draft-ngl": "all", "fit-target": "2000",
                "mmproj-device": "CUDA1", "n-gpu-layers": "99", "jinja": "true", "flash-attn": "on", "parallel": "1",
                "threads-http": "5", "ctx-size": "2048", "cache-type-k": "bf16", "cache-type-v": "bf16",
                "batch-size": "512", "ubatch-size": "512", "temp": "0.0", "top-p": "0.95", "top-k": "20",
                "min-p": "0.0", "presence-penalty": "0.0"}
    if style == "preset":
        preset = tmp_path / "models.ini"
        preset.write_text("[tiny-vl]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
        argv = ["--models-preset", str(preset)]
    else:
        argv = []
        for k, v in settings.items():
            argv += [f"--{k}"] if v == "true" else [f"--{k}", str(v)]
        argv += ["-a", "tiny-vl"]
    exe = shutil.which("pyllama-spec") or sys.executable
    cmd = ([exe] if exe != sys.executable else [exe, "-m", "pyllama_spec.cli"]) + ["serve", *argv, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(f"http://127.0.0.1:{port}/health", proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny-vl", max_tokens=8,
                                               messages=[{"role": "user", "content": "hello"}])
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens > 0
        assert [m.id for m in client.models.list()] == ["tiny-vl"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "ignored --fit-target 2000" in err and "ignored --threads-http 5" in err
    assert "ignored --mmproj-device CUDA1" in err


def test_flags_that_answer_and_exit_and_a_model_to_download_without_m(run_python):
    """--version and --list-devices answer and exit 0, as llama-server's; -hf and the other download
    flags without -m stop with an error saying to give the local file (never the embedded pair in its
    place); with -m they are dropped with a warning."""
    for flag, out in (("--version", "llama-cpp-python 0.3.36"), ("--list-devices", "Available devices:")):
        res = run_python("import sys; from pyllama_spec.cli import main; sys.argv = ['pyllama-spec', 'serve', "
                         f"{flag!r}]; main()")
        assert res.returncode == 0 and out in res.stdout, res.stderr
    for args in (["-hf", "ggml-org/gemma-3-4b-it-GGUF"], ["--hf-repo=a/b"], ["-mu", "https://x/m.gguf"]):
        res = run_python(f"import sys; from pyllama_spec.cli import main; sys.argv = ['pyllama-spec', 'serve', "
                         f"*{args!r}]; main()")
        assert res.returncode == 2 and "nothing is downloaded here" in res.stderr and "-m FILE" in res.stderr
    params, warnings = _parse(["-m", "t.gguf", "-hf", "a/b"])
    assert params["model"] == "t.gguf" and "ignored -hf a/b" in warnings
    # llama-server's LLAMA_ARG_* variables name them too (a Docker image's way)
    with pytest.raises(click.UsageError, match="nothing is downloaded here"):
        _parse([], {"LLAMA_ARG_HF_REPO": "a/b"})
    params, _ = _parse(["-hf", "a/b"], {"LLAMA_ARG_MODEL": "t.gguf"})
    assert params["model"] == "t.gguf"


def test_gpu_flags_on_a_build_without_a_gpu_warn_once(capsys):
    from pyllama_spec.bindings.devices import local_devices
    from pyllama_spec.cli.options import _warn_gpu_flags_without_a_gpu

    if any(d.kind != "cpu" for d in local_devices()):
        pytest.skip("this build has a GPU device here: the flags apply")
    _warn_gpu_flags_without_a_gpu({"n_gpu_layers": 99, "split_mode": "row", "tensor_split": (), "main_gpu": 0})
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "-ngl, -sm: this build has no GPU device here" in err
    _warn_gpu_flags_without_a_gpu({"n_gpu_layers": 0, "split_mode": "layer", "tensor_split": (), "main_gpu": 0})
    _warn_gpu_flags_without_a_gpu({"n_gpu_layers": 0, "split_mode": "none", "tensor_split": (), "main_gpu": 0})
    _warn_gpu_flags_without_a_gpu({"n_gpu_layers": 99, "rpc_servers": ("127.0.0.1:50052",)})  # a remote device
    assert capsys.readouterr().err == ""
