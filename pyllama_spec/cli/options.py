"""What several commands share: the consoles, the model and sampling option table (llama.cpp's
flag names) with its custom click types, loading the engine those options describe, and the
one-line summaries (speculative mode, stats footer) that chat, generate and serve print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console

from pyllama_spec.drafters.registry import (  # names and settings only: loads nothing native
    METHODS,
    CLI_SPEC_TYPES,
    NGRAM_DRAFT_LIMIT,
    NgramSettings,
    canonical_spec_type,
)
from pyllama_spec.gguf.memory import KV_CACHE_TYPE_NAMES
from pyllama_spec.speculative.positions import DRAFT_POSITION_MODES

console = Console()
err_console = Console(stderr=True)

KV_TYPES = list(KV_CACHE_TYPE_NAMES)  # llama.cpp's -ctk names


class _DraftMax(click.ParamType):
    """--draft-max: a count, or "auto"."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)
        if n < 0:
            self.fail(f"{n} is negative", param, ctx)
        return n


DRAFT_MAX = _DraftMax()


def _default_lengths() -> str:
    """The registry's default draft lengths, for --draft-max's help: "5 for draft-dflash, 3 for ..."."""
    by_length: dict[int | None, list[str]] = {}
    for m in METHODS:
        by_length.setdefault(m.draft_max, []).append(m.name)
    return "; ".join(f"{'its own --spec-ngram-* length' if n is None else n} for {' and '.join(names)}"
                     for n, names in by_length.items())


_DEFAULT_LENGTHS = _default_lengths()


class _Layers(click.ParamType):
    """-ngl / --spec-draft-ngl: a count, or llama-server's "all" / "auto" (every layer: no
    automatic fitting here)."""

    name = "N|all|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        if value in ("all", "auto"):
            return -1
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor 'all' / 'auto'", param, ctx)
        return -1 if n < 0 else n


class _SpecType(click.ParamType):
    """--spec-type: llama-server's names, or a comma list of them (tried in llama.cpp's priority order)."""

    name = "TYPE"
    LLAMA_SERVER_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark",
                          "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

    def convert(self, value, param, ctx):
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        ours = [*CLI_SPEC_TYPES[1:], "none"]
        for n in names:  # every llama-server type is served here, and aliases of ours ("dflash")
            if n not in ours:
                self.fail(f"{n!r} is not a speculative type llama-server knows ({', '.join(self.LLAMA_SERVER_TYPES)})",
                          param, ctx)
        try:
            return canonical_spec_type(",".join(names))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _merge_spec_types(ctx, param, values):
    """--spec-type given more than once: each adds its types to the list, as llama-server's does
    (common/arg.cpp appends them, the one flag it does not warn about repeating); None when not given."""
    if not values:
        return None
    try:
        return canonical_spec_type(",".join(values))
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


class _FloatList(click.ParamType):
    """A comma-separated list of numbers, as llama-server's --spec-synth-rates: 1,0.75,0.5."""

    name = "P0,P1,..."

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return tuple(float(p) for p in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)


class _LogitBias(click.ParamType):
    """-l TOKEN_ID(+/-)BIAS, as llama-server writes it: 15043+1, 15043-1."""

    name = "TOKEN_ID(+/-)BIAS"

    def convert(self, value, param, ctx):
        import re

        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*([0-9.eE+-]+|inf)\s*", str(value))
        if not m:
            self.fail(f"{value!r} is not TOKEN_ID+BIAS or TOKEN_ID-BIAS (for example 15043+1)", param, ctx)
        bias = float(m.group(3)) * (-1 if m.group(2) == "-" else 1)
        return int(m.group(1)), bias


def parse_csv_row(value: str) -> list[str]:
    """llama.cpp's comma-separated values (common/arg.cpp parse_csv_row): a field may be quoted
    ("a,b.gguf"), "" inside quotes is one quote; empty fields are kept."""
    fields, field, quoted, i = [], "", False, 0
    while i < len(value):
        ch = value[i]
        if ch == '"' and not quoted and not field:
            quoted = True
        elif ch == '"' and quoted:
            if value[i + 1:i + 2] == '"':
                field += '"'
                i += 1
            else:
                quoted = False
        elif ch == "," and not quoted:
            fields.append(field)
            field = ""
        else:
            field += ch
        i += 1
    return [*fields, field]


class _Lora(click.ParamType):
    """--lora FNAME[,FNAME...]: adapters at scale 1."""

    name = "FNAME"

    def convert(self, value, param, ctx):
        return value if isinstance(value, list) else [(path, 1.0) for path in parse_csv_row(str(value))]


class _LoraScaled(click.ParamType):
    """--lora-scaled FNAME:SCALE[,...], as llama-server writes it."""

    name = "FNAME:SCALE,..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        out = []
        for item in parse_csv_row(str(value)):
            parts = item.split(":")
            if len(parts) != 2:
                self.fail(f"{item!r} is not FNAME:SCALE (lora-scaled format, as in llama-server)", param, ctx)
            try:
                out.append((parts[0], float(parts[1])))
            except ValueError:
                self.fail(f"the scale in {item!r} is not a number", param, ctx)
        return out


#: Where ModelCommand keeps the order in which --lora and --lora-scaled were given.
_LORA_ORDER = "pyllama_spec.lora_order"


class ModelCommand(click.Command):
    """A command with ``model_options``: it remembers the order of --lora and --lora-scaled on the
    command line, since llama-server numbers the adapters in that order across both flags (the
    ids GET /lora-adapters and a request's ``lora`` use)."""

    #: llama-server's flags this command has no option for are translated or ignored (serve), not refused
    takes_llama_server_flags = False

    def make_parser(self, ctx: click.Context):
        parser = super().make_parser(ctx)
        parse = parser.parse_args

        def parse_args(args):
            if not self.takes_llama_server_flags:
                self._refuse_llama_server_only_flags(ctx, args)
            opts, rest, order = parse(args=args)  # order: one entry per option given, in order
            ctx.meta[_LORA_ORDER] = [p.name for p in order if p.name in ("lora", "lora_scaled")]
            return opts, rest, order

        parser.parse_args = parse_args
        return parser

    def _refuse_llama_server_only_flags(self, ctx: click.Context, args: list[str]) -> None:
        """Name what click would misread: a llama-server flag this command lacks, and a short flag glued to
        a word (click reads ``-cd 4096`` as ``-c d`` and says 'd' is not a valid integer)."""
        from pyllama_spec.cli.llama_server_cli import BY_NAME

        options = {name: p for p in self.get_params(ctx) if isinstance(p, click.Option)
                   for name in (*p.opts, *p.secondary_opts)}
        value_next = False  # the argument is an option's value (`-p -tired`: a prompt)
        for arg in args:
            if value_next:
                value_next = False
                continue
            if arg == "--":
                break
            if not arg.startswith("-"):
                continue
            if arg in options:
                value_next = not options[arg].is_flag and options[arg].nargs == 1
                continue
            name = arg.split("=", 1)[0]
            if name in BY_NAME and name not in options:
                raise click.UsageError(f"{name} is a llama-server flag that `{ctx.info_name}` does not take "
                                       "(`pyllama-spec serve` reads llama-server's command lines)", ctx)
            glued = options.get(arg[:2]) if not arg.startswith("--") and len(arg) > 2 else None
            if glued is not None and isinstance(glued.type, (click.types.IntParamType, click.types.FloatParamType)) \
                    and arg[2:].isalpha():
                raise click.UsageError(f"no such option: {arg} ({arg[:2]} takes a number: {arg[:2]} 4096)", ctx)


def lora_adapters(o: dict) -> list[tuple[str, float]]:
    """The (path, scale) of every --lora and --lora-scaled adapter, in command-line order."""
    given = {"lora": list(o.get("lora") or ()), "lora_scaled": list(o.get("lora_scaled") or ())}
    ctx = click.get_current_context(silent=True)
    order = ctx.meta.get(_LORA_ORDER) if ctx is not None else None
    if order is None or len(order) != len(given["lora"]) + len(given["lora_scaled"]):
        order = ["lora"] * len(given["lora"]) + ["lora_scaled"] * len(given["lora_scaled"])
    return [adapter for name in order for adapter in given[name].pop(0)]


#: llama-server's sampling flags: (names, SamplingParams field, type, help). Each given one is
#: a default of every request (a request's own value overrides it).
SAMPLING_FLAGS = (
    (("--top-k",), "top_k", int, "top-k sampling (0: off)"),
    (("--top-p",), "top_p", float, "top-p sampling (1.0: off)"),
    (("--min-p",), "min_p", float, "min-p sampling (0.0: off)"),
    (("--typical", "--typical-p"), "typical_p", float, "locally typical sampling (1.0: off)"),
    (("--top-nsigma", "--top-n-sigma"), "top_n_sigma", float, "top-n-sigma sampling (-1: off)"),
    (("--xtc-probability",), "xtc_probability", float, "XTC probability (0: off)"),
    (("--xtc-threshold",), "xtc_threshold", float, "XTC threshold"),
    (("--repeat-last-n",), "penalty_last_n", int, "tokens the penalties look back (-1: the context)"),
    (("--repeat-penalty",), "repeat_penalty", float, "repeat penalty (1.0: off)"),
    (("--presence-penalty",), "presence_penalty", float, "presence penalty (0.0: off)"),
    (("--frequency-penalty",), "frequency_penalty", float, "frequency penalty (0.0: off)"),
    (("--dry-multiplier",), "dry_multiplier", float, "DRY multiplier (0.0: off)"),
    (("--dry-base",), "dry_base", float, "DRY base"),
    (("--dry-allowed-length",), "dry_allowed_length", int, "DRY allowed length"),
    (("--dry-penalty-last-n",), "dry_penalty_last_n", int, "DRY look-back (-1: the context)"),
    (("--dynatemp-range",), "dynatemp_range", float, "dynamic temperature range (0.0: off)"),
    (("--dynatemp-exp",), "dynatemp_exponent", float, "dynamic temperature exponent"),
    (("--mirostat",), "mirostat", int, "mirostat 1 or 2 (0: off)"),
    (("--mirostat-lr",), "mirostat_eta", float, "mirostat learning rate (eta)"),
    (("--mirostat-ent",), "mirostat_tau", float, "mirostat target entropy (tau)"),
)


class _JsonObject(click.ParamType):
    """A JSON object given as text (llama-server's --chat-template-kwargs)."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except ValueError as e:
            self.fail(f"not JSON: {e}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail("must be a JSON object", param, ctx)
        return parsed


class _OnOffAuto(click.ParamType):
    """llama-server's on/off/auto values (is_truthy / is_falsey / is_autoy)."""

    name = "on|off|auto"

    def convert(self, value, param, ctx):
        v = str(value).strip().lower()
        if v in ("on", "enabled", "true", "1"):
            return "on"
        if v in ("off", "disabled", "false", "0"):
            return "off"
        if v == "auto":
            return "auto"
        self.fail(f"unknown value {value!r}: use on, off or auto", param, ctx)


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read the {what} file {path}: {e}") from None


def model_options(f):
    """The model and sampling flags shared by chat, generate and serve, named as in llama.cpp
    (llama-server's aliases included: serve takes llama-server's command lines)."""
    options = [
        click.option("-m", "--model", "model", type=click.Path(),
                     help="target GGUF (default: the embedded trained pair: target, mmproj and draft)"),
        click.option("-mm", "--mmproj", type=click.Path(), help="multimodal projector GGUF (images)"),
        click.option("-md", "--model-draft", "--spec-draft-model", "draft", type=click.Path(),
                     help="draft GGUF (DFlash, or a small model for draft-simple)"),
        click.option("--mmproj-draft", "mmproj_draft", type=click.Path(), default=None,
                     help="the draft model's own projector GGUF: a small VLM drafts seeing the pictures too "
                          "(draft-simple, the default --spec-type with it; llama-server has no such flag)"),
        click.option("--spec-type", type=_SpecType(), multiple=True, callback=_merge_spec_types,
                     help=f"speculative method, llama.cpp's names: {', '.join([*CLI_SPEC_TYPES[1:], 'none'])}, "
                          "or a comma list (given again, its types are added, as in llama-server) "
                          "(default: draft-dflash when a draft is given)"),
        click.option("-c", "--ctx-size", "n_ctx", default=4096, show_default=True,
                     help="context size (0: the model's trained context)"),
        click.option("-b", "--batch-size", "n_batch", default=512, show_default=True),
        click.option("-ub", "--ubatch-size", "n_ubatch", default=512, show_default=True),
        click.option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", type=_Layers(), default="0",
                     show_default=True, help="layers on the GPU: a count, or all"),
        click.option("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "--spec-draft-ngl", "n_gpu_layers_draft",
                     type=_Layers(), default=None, help="layers of the draft on the GPU (default: as -ngl)"),
        click.option("--rpc", "rpc_servers", default=None, metavar="SERVERS",
                     help="comma-separated RPC servers (host:port, each running `pyllama-spec rpc-server`): "
                          "-ngl layers go to their devices, first"),
        click.option("-dev", "--device", "devices", default=None, metavar="DEV1,DEV2",
                     help="devices for the target's layers (see doctor; 'none': no offload)"),
        click.option("-devd", "--device-draft", "--spec-draft-device", "device_draft", default=None,
                     metavar="DEV1,DEV2", help="devices for the draft (default: this machine's)"),
        click.option("-sm", "--split-mode", "split_mode", type=click.Choice(["none", "layer", "row"]),
                     default="layer", show_default=True, help="how to split the target across devices"),
        click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="N0,N1",
                     help="proportion of the offloaded layers per device, e.g. 3,1"),
        click.option("-mg", "--main-gpu", "main_gpu", type=int, default=0, show_default=True,
                     help="the device with -sm none (its index among the target's devices)"),
        click.option("-ctk", "--cache-type-k", default="f16", show_default=True, type=click.Choice(KV_TYPES)),
        click.option("-ctv", "--cache-type-v", default="f16", show_default=True, type=click.Choice(KV_TYPES),
                     help="a quantized V cache needs -fa on"),
        click.option("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k", default=None, type=click.Choice(KV_TYPES)),
        click.option("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v", default=None, type=click.Choice(KV_TYPES)),
        click.option("--mmproj-offload/--no-mmproj-offload", default=None,
                     help="the projector on the GPU (default: when -ngl offloads layers)"),
        click.option("--mmap/--no-mmap", "use_mmap", default=True, show_default=True),
        click.option("--mlock", "use_mlock", is_flag=True, help="keep the model in RAM"),
        click.option("-lm", "--load-mode", "load_mode", default=None,
                     type=click.Choice(["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"]),
                     help="llama-server's loading mode (sets --mmap / --mlock; dio: read without mmap)"),
        click.option("--draft-max", "--spec-draft-n-max", "draft_max", default=None,
                     type=DRAFT_MAX, help="most tokens drafted per step (default: the method's fastest measured "
                                          f"length: {_DEFAULT_LENGTHS}; with --draft-tree, as deep as the draft goes), "
                                          "capped by a DFlash draft's block size minus one, or 'auto': "
                                          "a length planned each step from acceptance and the measured cost "
                                          "of a row, up to that cap"),
        click.option("--spec-draft-n-min", "draft_min", type=click.IntRange(min=0), default=0, show_default=True,
                     help="fewest tokens a step drafts; a shorter draft is not verified"),
        click.option("--spec-ngram-map-k-size-n", "ngram_map_k_size_n", type=click.IntRange(1, 1024), default=12,
                     show_default=True, help="ngram-map-k: the key's length (tokens looked up)"),
        click.option("--spec-ngram-map-k-size-m", "ngram_map_k_size_m", type=click.IntRange(1, NGRAM_DRAFT_LIMIT),
                     default=48, show_default=True, help="ngram-map-k: the most tokens a draft copies"),
        click.option("--spec-ngram-map-k-min-hits", "ngram_map_k_min_hits", type=click.IntRange(0, 16380), default=1,
                     show_default=True, help="ngram-map-k: read by llama.cpp's map only in its k4v mode"),
        click.option("--spec-ngram-map-k4v-size-n", "ngram_map_k4v_size_n", type=click.IntRange(1, 1024), default=12,
                     show_default=True, help="ngram-map-k4v: the key's length"),
        click.option("--spec-ngram-map-k4v-size-m", "ngram_map_k4v_size_m",
                     type=click.IntRange(1, NGRAM_DRAFT_LIMIT), default=48, show_default=True,
                     help="ngram-map-k4v: the most tokens a draft copies"),
        click.option("--spec-ngram-map-k4v-min-hits", "ngram_map_k4v_min_hits", type=click.IntRange(0, 16380),
                     default=1, show_default=True, help="ngram-map-k4v: sightings of a key before it drafts"),
        click.option("--spec-ngram-mod-n-match", "ngram_mod_n_match", type=click.IntRange(1, 1024), default=24,
                     show_default=True, help="ngram-mod: the n-gram length hashed"),
        click.option("--spec-ngram-mod-n-min", "ngram_mod_n_min", type=click.IntRange(0, NGRAM_DRAFT_LIMIT),
                     default=48, show_default=True, help="ngram-mod: a walk that ends sooner drafts nothing"),
        click.option("--spec-ngram-mod-n-max", "ngram_mod_n_max", type=click.IntRange(1, NGRAM_DRAFT_LIMIT),
                     default=64, show_default=True, help="ngram-mod: the most tokens a draft walks"),
        click.option("-lcs", "--lookup-cache-static", "lookup_cache_static", type=click.Path(), default=None,
                     help="ngram-cache: a static n-gram cache file (llama.cpp's llama-lookup-create)"),
        click.option("-lcd", "--lookup-cache-dynamic", "lookup_cache_dynamic", type=click.Path(), default=None,
                     help="ngram-cache: a dynamic n-gram cache file (read here, not written back)"),
        click.option("--spec-draft-p-min", "--draft-p-min", "draft_p_min", type=click.FloatRange(0, 1), default=0.0,
                     show_default=True, help="a draft-simple draft stops at a token below this probability"),
        click.option("--draft-positions", type=click.Choice(DRAFT_POSITION_MODES), default="target",
                     show_default=True),
        click.option("--draft-tree", type=click.IntRange(0, 255), default=0, show_default=True,
                     help="verify a tree of up to N drafted tokens per step instead of one chain (DFlash, "
                          "one slot, --verify match): the same tokens, more accepted at --temp > 0"),
        click.option("--spec-synth-rates", "synth_rates", type=_FloatList(), default=None, metavar="P0,P1,...",
                     help="benchmarks only: keep drafted position i with this unconditional rate (one per drafted "
                          "position, non-increasing) instead of verifying it; the text is not the model's"),
        click.option("--spec-synth-len", "synth_len", type=float, default=None, metavar="L",
                     help="benchmarks only: keep drafts at random for this mean accepted length, the target's own "
                          "token included; the text is not the model's"),
        click.option("--verify", type=click.Choice(["match", "rejection"]), default="match", show_default=True,
                     help="acceptance at temperature > 0: rejection sampling, or llama.cpp's exact match"),
        click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default=None,
                     help="flash attention for the model and the projector  [default: off for the model (a CPU "
                          "batch's numerics then match a one-token decode's), auto for the projector]"),
        click.option("-t", "--threads", "n_threads", type=int, default=None, help="CPU threads"),
        click.option("-tb", "--threads-batch", "n_threads_batch", type=int, default=None,
                     help="CPU threads for prompt batches (default: as -t)"),
        click.option("--chat-template", default=None, metavar="JINJA|NAME",
                     help="a chat template instead of the model's: Jinja text, or a llama.cpp built-in's name "
                          "(chatml, llama3, ...)"),
        click.option("--chat-template-file", default=None, type=click.Path(dir_okay=False),
                     help="a Jinja chat template file instead of the model's"),
        click.option("--jinja/--no-jinja", "jinja", default=True, show_default=True,
                     help="render chat templates with Jinja (--no-jinja: llama.cpp's built-in renderer)"),
        click.option("--chat-template-kwargs", "chat_template_kwargs", type=_JsonObject(), default=None,
                     metavar="JSON", help="extra variables for the chat template, a JSON object"),
        click.option("-rea", "--reasoning", "reasoning", type=_OnOffAuto(), default="auto", show_default=True,
                     help="thinking in the chat: on, off, or auto (where the template can think)"),
        click.option("--reasoning-format", "reasoning_format", default="deepseek", show_default=True,
                     type=click.Choice(["none", "auto", "deepseek", "deepseek-legacy"]),
                     help="none: thoughts stay in content; deepseek/auto: in reasoning_content; deepseek-legacy: "
                          "both"),
        click.option("--reasoning-budget", "reasoning_budget", type=click.IntRange(min=-1), default=-1,
                     show_default=True, help="most tokens of thinking (-1: no limit, 0: none)"),
        click.option("--reasoning-budget-message", "reasoning_budget_message", default="",
                     help="text written before the end-of-thinking tag when the budget runs out"),
        click.option("--reasoning-effort", "reasoning_effort", default=None, metavar="LEVEL",
                     help="reasoning_effort given to the chat template ('default': the template's own)"),
        click.option("--reasoning-preserve/--no-reasoning-preserve", "reasoning_preserve", default=None,
                     help="keep earlier turns' reasoning in the prompt where the template can (default: on)"),
        click.option("--skip-chat-parsing/--no-skip-chat-parsing", "skip_chat_parsing", default=False,
                     help="no reasoning or tool-call parsing: everything the model writes is content"),
        click.option("--prefill-assistant/--no-prefill-assistant", "prefill_assistant", default=True,
                     show_default=True, help="a chat ending with an assistant message continues it"),
        click.option("-n", "--max-tokens", "--predict", "--n-predict", "max_tokens", default=512, show_default=True,
                     help="tokens per reply (-1: up to the server's cap)"),
        click.option("--temp", "--temperature", "temperature", type=float, default=0.0, show_default=True),
        *[click.option(*names, dest, type=kind, default=None, help=text) for names, dest, kind, text in SAMPLING_FLAGS],
        click.option("--samplers", default=None, metavar="NAMES",
                     help="the samplers in order, ';'-separated (llama-server's names)"),
        click.option("--sampler-seq", "--sampling-seq", "sampler_seq", default=None, metavar="LETTERS",
                     help="the samplers in order as letters (dkypmxt...)"),
        click.option("--dry-sequence-breaker", "dry_sequence_breakers", multiple=True, metavar="STRING",
                     help="a DRY sequence breaker (repeatable; 'none': no breakers)"),
        click.option("-l", "--logit-bias", "logit_bias", multiple=True, type=_LogitBias(),
                     help="TOKEN_ID+BIAS or TOKEN_ID-BIAS (repeatable)"),
        click.option("--ignore-eos", is_flag=True, help="never end at the end-of-generation token"),
        click.option("--grammar", default=None, metavar="GBNF", help="every reply follows this grammar"),
        click.option("--grammar-file", default=None, type=click.Path(dir_okay=False)),
        click.option("-j", "--json-schema", "json_schema", default=None, metavar="SCHEMA",
                     help="every reply is JSON following this JSON schema"),
        click.option("-jf", "--json-schema-file", "json_schema_file", default=None, type=click.Path(dir_okay=False)),
        click.option("--lora", "lora", multiple=True, type=_Lora(),
                     help="a LoRA adapter of the target (repeatable, or comma-separated), at scale 1"),
        click.option("--lora-scaled", "lora_scaled", multiple=True, type=_LoraScaled(),
                     help="a LoRA adapter at a scale, FNAME:SCALE (repeatable, or comma-separated); the "
                          "adapters' ids follow the order of --lora and --lora-scaled"),
        click.option("-s", "--seed", "seed", type=int, default=0, show_default=True,
                     help="sampling seed (-1: a random one)"),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _load_engine(o: dict):
    from pyllama_spec.serving.engine import load

    # -fa sets both, as llama-server's does; unset, the model's is off and the projector's auto
    given = {"on": True, "off": False, "auto": None, None: "unset"}[o["flash_attn"]]
    flash, mmproj_flash = (False, None) if given == "unset" else (given, given)
    if o.get("load_mode"):  # llama-server's -lm: mmap and mlock in one setting
        mode = o["load_mode"]
        o = {**o, "use_mmap": mode in ("auto", "mmap", "mmap+mlock"), "use_mlock": "mlock" in mode}
    kwargs = dict(n_ctx=o["n_ctx"], n_batch=o["n_batch"], n_ubatch=min(o["n_ubatch"], o["n_batch"]),
                  n_gpu_layers=o["n_gpu_layers"], draft_max=o["draft_max"], draft_positions=o["draft_positions"],
                  verify=o["verify"], draft_tree=o["draft_tree"], synth_rates=o.get("synth_rates") or (),
                  synth_len=o.get("synth_len"), flash_attn=flash, mmproj_flash_attn=mmproj_flash,
                  n_threads=o["n_threads"],
                  n_threads_batch=o["n_threads_batch"], draft_n_gpu_layers=o["n_gpu_layers_draft"],
                  cache_type_k=o["cache_type_k"], cache_type_v=o["cache_type_v"],
                  cache_type_k_draft=o["cache_type_k_draft"], cache_type_v_draft=o["cache_type_v_draft"],
                  mmproj_offload=o["mmproj_offload"], use_mmap=o["use_mmap"], use_mlock=o["use_mlock"],
                  rpc_servers=o["rpc_servers"] or (), devices=o["devices"], device_draft=o["device_draft"],
                  split_mode=o["split_mode"], tensor_split=o["tensor_split"] or (), main_gpu=o["main_gpu"],
                  n_parallel=o.get("n_parallel", 1), cache_ram_mib=o.get("cache_ram_mib", 0),
                  cache_idle_slots=o.get("cache_idle_slots", True), kv_unified=o.get("kv_unified", False),
                  draft_min=o["draft_min"], draft_p_min=o["draft_p_min"],
                  sampling=_sampling(o), chat_template=_chat_template(o), jinja=o["jinja"],
                  chat_template_kwargs=o.get("chat_template_kwargs") or {}, reasoning=o.get("reasoning", "auto"),
                  reasoning_format=o.get("reasoning_format", "deepseek"),
                  reasoning_budget=o.get("reasoning_budget", -1),
                  reasoning_budget_message=o.get("reasoning_budget_message", ""),
                  reasoning_effort=None if o.get("reasoning_effort") in (None, "default") else o["reasoning_effort"],
                  reasoning_preserve=o.get("reasoning_preserve"), skip_chat_parsing=o.get("skip_chat_parsing", False),
                  prefill_assistant=o.get("prefill_assistant", True),
                  lora=lora_adapters(o), lora_init_without_apply=o.get("lora_init_without_apply", False),
                  embeddings=o.get("embeddings", False), pooling=o.get("pooling") or "unspecified",
                  embd_normalize=o.get("embd_normalize", 2), ngram=_ngram_settings(o))
    model, mmproj, draft = o["model"], o["mmproj"], o["draft"]
    if o.get("mmproj_draft"):
        kwargs["mmproj_draft"] = o["mmproj_draft"]
    if model is None:
        if mmproj or draft or o.get("mmproj_draft"):
            # half an embedded pair with a file of the user's would not fit: refuse rather than guess
            raise ValueError("--mmproj, -md and --mmproj-draft go with -m (without -m the embedded pair is used "
                             "whole)")
        from pyllama_spec.embedded import embedded_models

        embedded = embedded_models()
        model, mmproj = embedded.target, embedded.mmproj
        draft = embedded.draft if o["spec_type"] != "none" else None
        dry = ""
        if o.get("dry_multiplier") is None:
            # The tiny pair, greedy, writes nothing but spaces after a picture in a chat; llama.cpp's DRY
            # sampler (the same in target-only and speculative runs) makes it write Python there too.
            kwargs["sampling"] = {**kwargs["sampling"], "dry_multiplier": EMBEDDED_DRY_MULTIPLIER}
            dry = f"; DRY {EMBEDDED_DRY_MULTIPLIER}, without which it writes blanks after a picture (--dry-multiplier 0)"
        err_console.print(f"[dim]no -m: using the embedded trained pair in {embedded.target.parent} (a tiny "
                          f"target, mmproj and DFlash draft that write Python{dry})[/dim]", soft_wrap=True)
    _warn_gpu_flags_without_a_gpu(kwargs)
    return load(model, mmproj=mmproj, draft=draft, spec_type=o["spec_type"], **kwargs)


def _ngram_settings(o: dict) -> NgramSettings:
    """The n-gram types' flags (llama-server's --spec-ngram-*, -lcs, -lcd)."""
    return NgramSettings(
        map_k=(o["ngram_map_k_size_n"], o["ngram_map_k_size_m"], o["ngram_map_k_min_hits"]),
        map_k4v=(o["ngram_map_k4v_size_n"], o["ngram_map_k4v_size_m"], o["ngram_map_k4v_min_hits"]),
        mod_n_match=o["ngram_mod_n_match"], mod_n_min=o["ngram_mod_n_min"], mod_n_max=o["ngram_mod_n_max"],
        lookup_cache_static=o["lookup_cache_static"], lookup_cache_dynamic=o["lookup_cache_dynamic"])


def _warn_gpu_flags_without_a_gpu(kwargs: dict) -> None:
    """One warning when GPU flags (-ngl, -sm row, -ts, -mg) are given where there is no device but the
    CPU (a CPU-only build, no RPC server): they change nothing, and a user should know."""
    given = [name for name, flag, unset in (("n_gpu_layers", "-ngl", (0,)), ("split_mode", "-sm", ("layer", "none")),
                                            ("tensor_split", "-ts", ((),)), ("main_gpu", "-mg", (0,)))
             if kwargs.get(name, unset[0]) not in (*unset, None)]
    if not given or kwargs.get("rpc_servers"):
        return
    from pyllama_spec.bindings.devices import local_devices

    if any(d.kind != "cpu" for d in local_devices()):
        return
    flags = ", ".join(f for name, f, _ in (("n_gpu_layers", "-ngl", 0), ("split_mode", "-sm", 0),
                                           ("tensor_split", "-ts", 0), ("main_gpu", "-mg", 0)) if name in given)
    err_console.print(f"[yellow]warning: {flags}: this build has no GPU device here (the CPU backend only): "
                      "everything runs on the CPU (python build.py --cuda or --rocm builds one)[/yellow]",
                      soft_wrap=True)


#: The embedded pair's default --dry-multiplier (given no -m and no --dry-multiplier).
EMBEDDED_DRY_MULTIPLIER = 0.8


def _chat_template(o: dict) -> str | None:
    if o.get("chat_template_file"):
        return _read_text(o["chat_template_file"], "chat template")
    return o.get("chat_template")


def _load_engine_or_exit(o: dict):
    """_load_engine with a spinner; a model that cannot be loaded ends the command with a message."""
    from pyllama_spec.errors import PyllamaError

    try:
        with console.status("loading models ..."):
            return _load_engine(o)
    except click.ClickException:
        raise
    except (PyllamaError, ValueError, OSError) as e:
        err_console.print(f"[red]cannot load: {e}[/red]")
        sys.exit(1)


def _speculative_mode(engine, asked=None) -> str:
    """The speculative method and its draft length; with ``asked`` (chat's --draft-max), also why
    the length in use is below the one asked for (what the drafter says bounds it)."""
    tree = f", tree {engine.config.draft_tree}" if engine.config.draft_tree else ""
    d = engine.drafter
    if not d:
        return engine.config.spec_type
    cap = ""
    if asked == "auto":
        cap = f", at most {d.n_max_limit}" + (f": {d.limit_reason}" if d.limit_reason else "")
    elif isinstance(asked, int) and asked > engine.draft_max:
        cap = (f", capped by {d.limit_reason}" if d.limit_reason and engine.draft_max == d.n_max_limit
               else f", capped from {asked}")
    return engine.config.spec_type + f" (draft_max {engine.draft_max}{cap}{tree})"


def _sampling(o: dict) -> dict:
    """The sampling flags given, as SamplingParams settings (the engine's defaults for every request)."""
    import json

    out = {"temperature": o["temperature"], "seed": o["seed"] & 0xFFFFFFFF}
    out.update({dest: o[dest] for _, dest, _, _ in SAMPLING_FLAGS if o.get(dest) is not None})
    if o.get("samplers"):
        out["samplers"] = [n for n in o["samplers"].split(";") if n]
    if o.get("sampler_seq"):
        out["samplers"] = o["sampler_seq"]
    breakers = o.get("dry_sequence_breakers") or ()
    if breakers:
        out["dry_sequence_breakers"] = [] if list(breakers) == ["none"] else list(breakers)
    if o.get("logit_bias"):
        out["logit_bias"] = list(o["logit_bias"])
    if o.get("ignore_eos"):
        out["ignore_eos"] = True
    grammar = o.get("grammar") or (_read_text(o["grammar_file"], "grammar") if o.get("grammar_file") else None)
    if grammar:
        out["grammar"] = grammar
    schema = o.get("json_schema") or (_read_text(o["json_schema_file"], "JSON schema")
                                      if o.get("json_schema_file") else None)
    if schema:
        try:
            out["json_schema"] = json.loads(schema)
        except ValueError as e:
            raise click.BadParameter(f"the JSON schema is not JSON: {e}") from None
    return out


def footer(s) -> str:
    return (f"{s.tokens_per_second:.1f} tok/s · acceptance {s.acceptance_rate:.2f} · mean accepted length "
            f"{s.mean_accepted_length:.2f} · drafted/accepted {s.drafted}/{s.accepted} · prefill "
            f"{s.prefill_seconds * 1000:.0f} ms ({s.prompt_decoded} rows decoded, {s.prompt_reused} reused)")
