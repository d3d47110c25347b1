"""What several commands share: the consoles, the model and sampling option table (llama.cpp's
flag names) with its custom click types, loading the engine those options describe, and the
one-line summaries (speculative mode, stats footer) that chat, generate and serve print."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from pyllama_spec.drafters.registry import (
    SPEC_TYPES,  # names only: loads nothing native
)
from pyllama_spec.gguf.memory import KV_CACHE_TYPE_NAMES

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


def model_options(f):
    """The model and sampling flags shared by chat and generate, named as in llama.cpp."""
    options = [
        click.option("-m", "--model", "model", type=click.Path(),
                     help="target GGUF (default: the embedded trained pair: target, mmproj and draft)"),
        click.option("--mmproj", type=click.Path(), help="multimodal projector GGUF (images)"),
        click.option("-md", "--model-draft", "draft", type=click.Path(), help="DFlash draft GGUF"),
        click.option("--spec-type", type=click.Choice([*SPEC_TYPES[1:], "none"]),
                     default=None, help="speculative method, llama.cpp's names (default: draft-dflash when a "
                                        "draft is given)"),
        click.option("-c", "--ctx-size", "n_ctx", default=4096, show_default=True),
        click.option("-b", "--batch-size", "n_batch", default=512, show_default=True),
        click.option("-ub", "--ubatch-size", "n_ubatch", default=512, show_default=True),
        click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", default=0, show_default=True),
        click.option("-ngld", "--n-gpu-layers-draft", "n_gpu_layers_draft", type=int, default=None,
                     help="layers of the draft on the GPU (default: as -ngl)"),
        click.option("--rpc", "rpc_servers", default=None, metavar="SERVERS",
                     help="comma-separated RPC servers (host:port, each running `pyllama-spec rpc-server`): "
                          "-ngl layers go to their devices, first"),
        click.option("-dev", "--device", "devices", default=None, metavar="DEV1,DEV2",
                     help="devices for the target's layers (see doctor; 'none': no offload)"),
        click.option("-devd", "--device-draft", "device_draft", default=None, metavar="DEV1,DEV2",
                     help="devices for the draft (default: this machine's)"),
        click.option("-sm", "--split-mode", "split_mode", type=click.Choice(["none", "layer", "row"]),
                     default="layer", show_default=True, help="how to split the target across devices"),
        click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="N0,N1",
                     help="proportion of the offloaded layers per device, e.g. 3,1"),
        click.option("-mg", "--main-gpu", "main_gpu", type=int, default=0, show_default=True,
                     help="the device with -sm none (its index among the target's devices)"),
        click.option("-ctk", "--cache-type-k", default="f16", show_default=True, type=click.Choice(KV_TYPES)),
        click.option("-ctv", "--cache-type-v", default="f16", show_default=True, type=click.Choice(KV_TYPES),
                     help="a quantized V cache needs -fa on"),
        click.option("-ctkd", "--cache-type-k-draft", default=None, type=click.Choice(KV_TYPES)),
        click.option("-ctvd", "--cache-type-v-draft", default=None, type=click.Choice(KV_TYPES)),
        click.option("--mmproj-offload/--no-mmproj-offload", default=None,
                     help="the projector on the GPU (default: when -ngl offloads layers)"),
        click.option("--mmap/--no-mmap", "use_mmap", default=True, show_default=True),
        click.option("--mlock", "use_mlock", is_flag=True, help="keep the model in RAM"),
        click.option("--draft-max", "--spec-draft-n-max", "draft_max", default="16", show_default=True,
                     type=DRAFT_MAX, help="most tokens drafted per step, capped by a DFlash draft's block "
                                          "size minus one (15 for the embedded draft, block size 16), or 'auto': "
                                          "a length planned each step from acceptance and the measured cost "
                                          "of a row, up to that cap"),
        click.option("--draft-positions", type=click.Choice(["target", "sequential"]), default="target",
                     show_default=True),
        click.option("--draft-tree", type=click.IntRange(0, 255), default=0, show_default=True,
                     help="verify a tree of up to N drafted tokens per step instead of one chain (DFlash, "
                          "one slot, --verify match): the same tokens, more accepted at --temp > 0"),
        click.option("--verify", type=click.Choice(["match", "rejection"]), default="match", show_default=True,
                     help="acceptance at temperature > 0: rejection sampling, or llama.cpp's exact match"),
        click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="off",
                     show_default=True),
        click.option("-t", "--threads", "n_threads", type=int, default=None, help="CPU threads"),
        click.option("-tb", "--threads-batch", "n_threads_batch", type=int, default=None,
                     help="CPU threads for prompt batches (default: as -t)"),
        click.option("-n", "--max-tokens", default=512, show_default=True, help="tokens per reply"),
        click.option("--temp", "temperature", default=0.0, show_default=True),
        click.option("--top-k", default=40, show_default=True),
        click.option("--top-p", default=0.95, show_default=True),
        click.option("--min-p", default=0.05, show_default=True),
        click.option("--seed", default=0, show_default=True),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _load_engine(o: dict):
    from pyllama_spec.serving.engine import load

    flash = {"on": True, "off": False, "auto": None}[o["flash_attn"]]
    kwargs = dict(n_ctx=o["n_ctx"], n_batch=o["n_batch"], n_ubatch=min(o["n_ubatch"], o["n_batch"]),
                  n_gpu_layers=o["n_gpu_layers"], draft_max=o["draft_max"], draft_positions=o["draft_positions"],
                  verify=o["verify"], draft_tree=o["draft_tree"], flash_attn=flash, n_threads=o["n_threads"],
                  n_threads_batch=o["n_threads_batch"], draft_n_gpu_layers=o["n_gpu_layers_draft"],
                  cache_type_k=o["cache_type_k"], cache_type_v=o["cache_type_v"],
                  cache_type_k_draft=o["cache_type_k_draft"], cache_type_v_draft=o["cache_type_v_draft"],
                  mmproj_offload=o["mmproj_offload"], use_mmap=o["use_mmap"], use_mlock=o["use_mlock"],
                  rpc_servers=o["rpc_servers"] or (), devices=o["devices"], device_draft=o["device_draft"],
                  split_mode=o["split_mode"], tensor_split=o["tensor_split"] or (), main_gpu=o["main_gpu"],
                  n_parallel=o.get("n_parallel", 1))
    model, mmproj, draft = o["model"], o["mmproj"], o["draft"]
    if model is None:
        if mmproj or draft:
            # half an embedded pair with a file of the user's would not fit: refuse rather than guess
            raise ValueError("--mmproj and -md go with -m (without -m the embedded pair is used whole)")
        from pyllama_spec.embedded import embedded_models

        embedded = embedded_models()
        model, mmproj = embedded.target, embedded.mmproj
        draft = embedded.draft if o["spec_type"] != "none" else None
        err_console.print(f"[dim]no -m: using the embedded trained pair in {embedded.target.parent} (a tiny "
                          "target, mmproj and DFlash draft that write Python)[/dim]", soft_wrap=True)
    return load(model, mmproj=mmproj, draft=draft, spec_type=o["spec_type"], **kwargs)


def _load_engine_or_exit(o: dict):
    """_load_engine with a spinner; a model that cannot be loaded ends the command with a message."""
    from pyllama_spec.errors import PyllamaError

    try:
        with console.status("loading models ..."):
            return _load_engine(o)
    except (PyllamaError, ValueError, OSError) as e:
        err_console.print(f"[red]cannot load: {e}[/red]")
        sys.exit(1)


def _speculative_mode(engine, asked=None) -> str:
    """The speculative method and its draft length; with ``asked`` (chat's --draft-max), also why
    the length in use is below the one asked for (a DFlash draft drafts at most its block size - 1)."""
    tree = f", tree {engine.config.draft_tree}" if engine.config.draft_tree else ""
    if not engine.drafter:
        return engine.config.spec_type
    block = getattr(getattr(engine.drafter, "config", None), "block_size", None)
    cap = ""
    if asked == "auto" and block:
        cap = f", at most {block - 1}: the draft's block size {block} minus one"
    elif isinstance(asked, int) and asked > engine.draft_max:
        cap = (f", capped by the draft's block size {block}" if block and engine.draft_max == block - 1
               else f", capped from {asked}")
    return engine.config.spec_type + f" (draft_max {engine.draft_max}{cap}{tree})"


def _sampling(o: dict) -> dict:
    return {k: o[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")}


def footer(s) -> str:
    return (f"{s.tokens_per_second:.1f} tok/s · acceptance {s.acceptance_rate:.2f} · mean accepted length "
            f"{s.mean_accepted_length:.2f} · drafted/accepted {s.drafted}/{s.accepted} · prefill "
            f"{s.prefill_seconds * 1000:.0f} ms ({s.prompt_decoded} rows decoded, {s.prompt_reused} reused)")
