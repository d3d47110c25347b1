"""llama-server's command lines, environment and ``--models-preset`` files, for ``pyllama-spec serve``.

Every flag llama-server takes (``llama_server_flags.FLAGS``, generated from the pinned
``common/arg.cpp``) is either honoured — ``serve`` has an option under the same names — or
accepted and dropped with one warning saying why it has no effect here. So a llama-server
command line starts ``pyllama-spec serve`` unchanged. As llama-server does, ``--foo_bar`` is
read as ``--foo-bar``, and ``LLAMA_ARG_*`` environment variables set the honoured options.

A preset file (INI: ``[section]`` per model, ``key = value`` with keys named as the long flags
without their dashes, a short flag's name, or the environment variable; ``[*]`` applies to
every section) gives each model's command-line arguments. As in llama-server, ``serve
--models-preset FILE`` without a model (``-m``) is a router (``server/router/``): each section
a model served by name, each loaded model a ``serve`` process of its own started with the
section's arguments followed by the router's own (which override them). With ``-m`` the file is
not read, as in llama-server.
"""

from __future__ import annotations

import configparser
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from pyllama_spec.cli.llama_server_flags import FLAGS as _TABLE


@dataclasses.dataclass(frozen=True)
class ServerFlag:
    names: tuple[str, ...]
    negative: tuple[str, ...]
    values: int
    env: str | None
    preset_only: bool
    summary: str

    @property
    def key(self) -> str:
        """Its name in a preset file: the longest name without dashes."""
        return max(self.names, key=len).lstrip("-")


FLAGS = tuple(ServerFlag(*row) for row in _TABLE)
BY_NAME = {name: f for f in FLAGS if not f.preset_only for name in f.names + f.negative}

# Why a llama-server flag that ``serve`` has no option for is dropped, by its first name's group
# (the first rule that matches). The reasons are what a user needs to know to trust the output.
_REASONS = (
    (("--threads-http",), "requests are served by one asynchronous event loop here"),
    (("--fit", "-fit", "--fit-target", "--fit-ctx"), "no automatic fitting here: -ngl and -c are used as given"),
    (("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token", "-mu", "--model-url", "-dr",
      "--docker-repo", "-mmu", "--mmproj-url", "--spec-draft-hf", "--offline", "--models-dir",
      "--mmproj-auto", "-cl", "--cache-list"),
     "nothing is downloaded here: give local files with -m, --mmproj, -md"),
    (("dedup-cache-models",), "there is no model cache here (nothing is downloaded)"),
    (("-cb", "--cont-batching"), "slots are always batched together here"),
    (("--metrics",), "/metrics is always served here"),
    (("--jinja",), "chat templates are always rendered with Jinja here (llama.cpp's renderer is the fallback)"),
    (("-ctxcp", "--ctx-checkpoints", "-cms", "--checkpoint-min-step", "--cache-reuse",
      "-sps", "--slot-prompt-similarity", "--keep", "--context-shift", "--kv-unified-per-slot", "--swa-full", "-dt", "--defrag-thold"),
     "this server's cache keeps each slot's own prefix (its reuse shows in cached_tokens)"),
    (("--log-", "-lv", "--verbosity", "-v", "--verbose", "--log-disable", "--perf"),
     "logging here goes through Python's logging"),
    (("-C", "-Cr", "-Cb", "-Crb", "--cpu-", "--prio", "--prio-", "--poll", "--poll-", "--numa", "--spec-draft-cpu",
      "--spec-draft-prio", "--spec-draft-prio-", "--spec-draft-poll", "--spec-draft-poll-"),
     "thread placement is left to the OS here"),
    (("--spec-draft-threads", "-td", "-tbd"), "the draft runs with the target's threads (-t, -tb) here"),
    (("--rope-", "--yarn-"), "RoPE settings come from the GGUF here"),
    (("--control-vector", "--control-vector-"), "control vectors are not loaded here (LoRA adapters are: --lora)"),
    (("-ot", "--override-tensor", "-otd", "-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe", "-ncffn", "--n-cpu-ffn",
      "--spec-draft-cpu-moe", "--spec-draft-n-cpu-moe", "--spec-draft-override-tensor", "-cmoed", "-ncmoed",
      "--override-kv", "--repack", "-nr", "--no-host", "--op-offload", "--check-tensors",
      "-lzm", "--lazy-mode", "-kvo", "--kv-offload", "-nkvo", "--list-devices"),
     "tensor placement overrides are not applied here (-ngl, -dev, -sm and -ts are)"),
    (("-mmdev", "--mmproj-device"), "the projector runs where --mmproj-offload puts it"),
    (("--image-min-tokens", "--image-max-tokens", "--mtmd-batch-max-tokens", "--video-"),
     "images use the projector's own token budget here"),
    (("--ui", "--webui", "--ui-", "--webui-", "--path", "--api-prefix", "--media-path", "--tools",
      "--tools-", "--mcp-", "-ag", "--agent"),
     "this server has its own page at /; it serves no static folder, tools or MCP"),
    (("--cors-methods", "--cors-headers", "--cors-credentials", "--no-cors-credentials"),
     "only --cors-origins is read here (a preflight allows llama-server's default methods and the headers asked)"),
    (("--ssl-",), "TLS is not terminated here: put a proxy in front"),
    (("--reuse-port", "--sse-ping-interval"), "not configurable here"),
    (("--spec-ngram-simple-",),
     "ngram-simple here is prompt lookup with keys of 2 to 4 tokens that copies a repetition past the history's "
     "end; the n-gram map types (ngram-map-k, ngram-map-k4v) take llama-server's sizes"),
    (("--spec-draft-p-split", "--spec-draft-backend-sampling", "-bs",
      "--backend-sampling", "--adaptive-"),
     "that speculative or sampling option is not implemented here"),
    (("--cache-prompt",), "prompt caching is chosen per request here (cache_prompt, on by default)"),
    (("-h", "--version", "--completion-bash"), "serve has its own --help"),
    (("--warmup", "--no-warmup", "-e", "--escape", "-sp", "--special", "-r", "--reverse-prompt"),
     "not used by the server"),
    (("--spm-infill",), "/infill lays its prompt out prefix first (the suffix-first order is not offered)"),
    (("--fim-", "--gpt-oss-", "--vision-gemma-", "--embd-gemma-", "--spec-default"),
     "built-in download presets are not available here"),
)


def reason_ignored(flag: ServerFlag) -> str:
    if flag.summary.startswith("the argument has been removed"):
        return f"llama-server removed it too ({flag.summary.split('. ', 1)[-1]})"
    for prefixes, reason in _REASONS:
        for name in flag.names + flag.negative:
            if any(name == p or (p.endswith("-") and name.startswith(p)) for p in prefixes):
                return reason
    return "it has no effect in this server"


def normalised(arg: str) -> str:
    """llama-server reads ``--foo_bar`` as ``--foo-bar``."""
    if arg.startswith("--"):
        name, eq, value = arg.partition("=")
        return name.replace("_", "-") + eq + value
    return arg


def translate(argv: list[str], accepted: dict[str, int]) -> tuple[list[str], list[str]]:
    """``argv`` with llama-server's spelling made the command's, and the llama-server flags the
    command has no option for (``accepted``: option name -> values it takes) removed with their
    values; returns it and one warning per removed flag. An argument neither knows is left for
    the command's parser to refuse."""
    out, warnings, i = [], [], 0
    while i < len(argv):
        arg = normalised(argv[i])
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg
        i += 1
        if name in accepted or name not in BY_NAME or arg == "--":
            out.append(arg)
            take = 0 if "=" in arg else accepted.get(name, 0)
            out.extend(argv[i:i + take])
            i += take
            if arg == "--":
                out.extend(argv[i:])
                break
            continue
        flag = BY_NAME[name]
        given = [] if "=" in arg or name in flag.negative else argv[i:i + flag.values]
        i += len(given)
        shown = " ".join([arg, *given])
        warnings.append(f"ignored {shown}: {reason_ignored(flag)}")
    return out, warnings


def ignored_environment(accepted: dict[str, int], environ=None) -> list[str]:
    """One warning per ``LLAMA_ARG_*`` variable set for a flag the command has no option for."""
    environ = os.environ if environ is None else environ
    out = []
    for f in FLAGS:
        if f.env and not f.preset_only and f.env in environ and not any(n in accepted for n in f.names):
            out.append(f"ignored {f.env}={environ[f.env]}: {reason_ignored(f)}")
    return out


# ----------------------------------------------------------------------------- presets

_TRUE, _FALSE = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")
_BY_KEY = {}
for _f in FLAGS:
    for _n in _f.names + _f.negative:
        _BY_KEY[_n.lstrip("-")] = _f
    if _f.env:
        _BY_KEY[_f.env] = _f
del _f, _n


class PresetError(ValueError):
    """A --models-preset file that cannot be read or served."""


@dataclasses.dataclass(frozen=True)
class RouterPreset:
    """One model of a preset file, as the router serves it."""

    name: str  # the section: the model name clients use
    args: list[str]  # the model's `serve` arguments ([*] first, the section after: it overrides)
    aliases: tuple[str, ...]  # other names for it (its alias key, comma-separated)
    tags: tuple[str, ...]  # its tags key, comma-separated (shown by GET /models)
    load_on_startup: bool
    stop_timeout: int  # seconds a stopping model may take before it is killed
    ini: str  # the section as llama-server's GET /models shows it (status.preset)
    mmproj: str | None  # its projector file, for the modalities GET /models lists
    warnings: list[str]


def read_presets(path: str | os.PathLike) -> dict[str, list[tuple[str, str]]]:
    """The file's sections as (key, value) pairs, ``[*]`` merged into each; keys as written."""
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",), comment_prefixes=("#", ";"),
                                       inline_comment_prefixes=("#", ";"), strict=False, default_section="\0")
    parser.optionxform = str  # keys keep their case (environment variable names)
    try:
        text = Path(path).read_text(encoding="utf-8")
        # keys before the first section belong to llama-server's "default" preset
        parser.read_string("[default]\n" + text, source=str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise PresetError(f"cannot read the preset file {path}: {e}") from None
    except configparser.Error as e:
        raise PresetError(f"the preset file {path} is not an INI file llama-server reads: {e}") from None
    common = list(parser["*"].items()) if parser.has_section("*") else []
    sections = {}
    for name in parser.sections():
        if name != "*" and (name != "default" or any(k != "version" for k in parser[name])):
            sections[name] = common + list(parser[name].items())
    if not sections and common:
        sections["default"] = common
    return sections


def preset_args(pairs: list[tuple[str, str]], source: str) -> tuple[list[str], list[str]]:
    """A section's keys as command-line arguments (bool flags as their positive or negative
    name); unknown keys are a PresetError, as in llama-server."""
    args, warnings = [], []
    for key, value in pairs:
        if key == "version":
            continue  # reserved by llama-server
        flag = _BY_KEY.get(key)
        if flag is None:
            raise PresetError(f"option '{key}' in {source} is not one llama-server knows")
        if flag.preset_only:
            warnings.append(f"ignored {key} = {value} in {source}: {reason_ignored(flag)}")
            continue
        long = max(flag.names, key=len)
        v = value.strip().lower()
        if flag.values == 0:
            if v not in _TRUE + _FALSE:
                raise PresetError(f"'{key}' in {source} takes true or false, got {value!r}")
            on = (v in _TRUE) != (key in (n.lstrip("-") for n in flag.negative))
            if on:
                args.append(long)
            elif flag.negative:
                args.append(max(flag.negative, key=len))
        else:
            args.extend([long, *value.split(None, flag.values - 1)] if flag.values > 1 else [long, value])
    return args, warnings


def last_spec_type_only(args: Sequence[str]) -> tuple[str, ...]:
    """A router model's arguments (its section's, [*]'s and the router's command line, in that
    order) with only the last ``--spec-type``: llama-server merges presets key by key, the later
    overriding, where its command line (and serve's) adds the types of a repeated ``--spec-type``."""
    args = list(args)
    spans = [(i, 2 if a == "--spec-type" else 1) for i, a in enumerate(args)
             if a == "--spec-type" or a.startswith("--spec-type=")]
    for i, n in reversed(spans[:-1]):
        del args[i:i + n]
    return tuple(args)


#: Keys the router reads itself (by llama-server's environment names): never a child's arguments.
_ROUTER_KEYS = ("LLAMA_ARG_ALIAS", "LLAMA_ARG_TAGS", "__PRESET_LOAD_ON_STARTUP", "__PRESET_STOP_TIMEOUT")
#: Keys llama-server's router drops from a section (unset_reserved_args, and the address it
#: gives each child itself).
_RESERVED_KEYS = ("LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE",
                  "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_MODELS_MAX", "LLAMA_ARG_MODELS_PRESET",
                  "LLAMA_ARG_MODELS_AUTOLOAD", "LLAMA_ARG_HOST", "LLAMA_ARG_PORT")
DEFAULT_STOP_TIMEOUT = 10  # seconds, llama-server's


def _names(value: str) -> tuple[str, ...]:
    """Comma-separated names, sorted and each once (llama-server keeps them in a std::set)."""
    return tuple(sorted({v.strip() for v in value.split(",") if v.strip()}))


#: Keys that name a model to download (by llama-server's environment names).
_DOWNLOAD_KEYS = ("LLAMA_ARG_HF_REPO", "LLAMA_ARG_MODEL_URL", "LLAMA_ARG_DOCKER_REPO")


def _download_only(source: str, final: dict) -> str:
    """The warning for a section with no model file: one that names a model to download is listed
    (llama-server lists it before it is downloaded) and its load fails saying why; one that names
    no model at all is a PresetError."""
    key = next((k for f, (k, _) in final.items() if f.env in _DOWNLOAD_KEYS), None)
    if key is None:
        raise PresetError(f"{source} gives no model file (model = PATH): this server loads local files only")
    return (f"{source} names a model to download ({key}) and no model file: it is listed, but loading it fails "
            "(nothing is downloaded here; give model = PATH)")


def router_presets(path: str | os.PathLike) -> list[RouterPreset]:
    """Every model of a preset file, by name, as llama-server's router reads it: the section's
    keys ([*] merged) as ``serve`` arguments, less the ones the router keeps (alias, tags,
    load-on-startup, stop-timeout) or drops (address, keys, router options)."""
    sections = read_presets(path)
    out = []
    for name in sorted(sections):
        source = f"[{name}] of {path}"
        kept, final, warnings = [], {}, []
        for key, value in sections[name]:
            flag = _BY_KEY.get(key)
            env = flag.env if flag is not None else None
            if env in _RESERVED_KEYS:
                warnings.append(f"ignored {key} = {value} in {source}: the router sets it for each model")
                continue
            if flag is not None:
                final[flag] = (key, value)  # the section's value overrides [*]'s
            if env not in _ROUTER_KEYS:
                kept.append((key, value))
        args, more = preset_args(kept, source)
        given = {f.env: v for f, (_, v) in final.items() if f.env}  # by environment name
        if given.get("LLAMA_ARG_MODEL") is None:
            warnings.append(_download_only(source, final))
        timeout = given.get("__PRESET_STOP_TIMEOUT")
        try:
            stop_timeout = DEFAULT_STOP_TIMEOUT if timeout is None else int(timeout)
        except ValueError:
            warnings.append(f"stop-timeout = {timeout} in {source} is not a number of seconds: "
                            f"{DEFAULT_STOP_TIMEOUT} s instead (as llama-server)")
            stop_timeout = DEFAULT_STOP_TIMEOUT
        ini = [f"[{name}]"]
        for flag, (key, value) in final.items():
            if flag.env in ("LLAMA_ARG_ALIAS", "LLAMA_ARG_TAGS"):
                continue
            if flag.values == 0 and flag.negative and key in (n.lstrip("-") for n in flag.negative):
                value = "false" if value.strip().lower() in _TRUE else "true"  # the positive flag's value
            ini.append(f"{flag.names[-1].lstrip('-')} = " + value.replace("\n", "\\\n"))
        out.append(RouterPreset(
            name=name, args=args, aliases=_names(given.get("LLAMA_ARG_ALIAS") or ""),
            tags=_names(given.get("LLAMA_ARG_TAGS") or ""),
            load_on_startup=(given.get("__PRESET_LOAD_ON_STARTUP") or "").strip().lower() in _TRUE,
            stop_timeout=stop_timeout, ini="\n".join(ini) + "\n\n", mmproj=given.get("LLAMA_ARG_MMPROJ"),
            warnings=warnings + more))
    return out
