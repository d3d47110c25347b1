"""The `pyllama-spec` command (click + rich): doctor, build, and the commands built on the engine."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pyllama-spec")
def main() -> None:
    """Vision-language models with DFlash speculative decoding on llama.cpp."""


@main.command()
@click.option("-m", "--model", "model", type=click.Path(), default=None, help="also estimate this target's memory")
@click.option("--mmproj", type=click.Path(), default=None)
@click.option("-md", "--model-draft", "draft", type=click.Path(), default=None)
@click.option("-c", "--ctx-size", "n_ctx", default=4096, show_default=True)
@click.option("-ub", "--ubatch-size", "n_ubatch", default=512, show_default=True)
@click.option("-ctk", "--cache-type-k", default="f16", show_default=True)
@click.option("-ctv", "--cache-type-v", default="f16", show_default=True)
@click.option("--rpc", "rpc_servers", default=None, metavar="SERVERS",
              help="also list the devices of these RPC servers (comma-separated host:port) and their memory")
def doctor(model, mmproj, draft, n_ctx, n_ubatch, cache_type_k, cache_type_v, rpc_servers) -> None:
    """Show the native build: libraries, llama.cpp pin, backends, devices, DFlash entry points.

    With -m (and --mmproj, -md, -c, -ub, -ctk, -ctv): what that configuration will need, estimated
    from the files before anything is allocated. With --rpc: the remote devices, reached first."""
    from pyllama_spec import native_build as nb

    table = Table(show_header=False, box=None)
    table.add_row("pinned source", f"{nb.PIN_PACKAGE} {nb.PIN_VERSION} = llama.cpp {nb.PIN_UPSTREAM_COMMIT} "
                                   f"({nb.PIN_UPSTREAM_DATE})")
    table.add_row("build cache", str(nb.cache_root()))
    try:
        from pyllama_spec.bindings import native_info
    except ImportError as e:
        table.add_row("native part", f"[red]not loadable[/red]: {e}")
        console.print(table)
        sys.exit(1)
    record = native_info.build_record()
    table.add_row("native part", str(native_info.LIB_DIR.parent))
    libs = sorted(p.name for p in native_info.LIB_DIR.iterdir()) if native_info.LIB_DIR.exists() else []
    table.add_row("libraries", ", ".join(libs))
    src = record.get("source", {})
    table.add_row("source used", f"{src.get('origin', '?')}: {src.get('path', '?')}")
    table.add_row("patches applied", ", ".join(record.get("patches", [])) or "none")
    table.add_row("backend", record.get("backend", "?") + (f"  (cmake: {' '.join(record['cmake_args'])})"
                                                          if record.get("cmake_args") else ""))
    table.add_row("ggml backends", ", ".join(native_info.backend_names()))
    for i, d in enumerate(native_info.devices()):
        table.add_row(f"device {i}", f"{d['name']}: {d['description']} ({d['total'] / 2**30:.1f} GiB, "
                                     f"{d['free'] / 2**30:.1f} free)")
    from pyllama_spec.bindings import devices as devs

    table.add_row("GPU offload", _gpu_offload(native_info.backend_names(), devs.local_devices()))

    if devs.rpc_available():
        table.add_row("RPC", "yes (" + (f"{native_info.RPC_SERVER_PATH.name} beside the libraries; " if
                                       native_info.RPC_SERVER_PATH.exists() else "") +
                      ("a lost server is an error: patches/0003)" if devs.loss_detectable() else
                       "a lost server aborts the process: unpatched llama.cpp)"))
    else:
        table.add_row("RPC", "no (rebuild with `python build.py --rpc`)")
    from pyllama_spec.bindings.mtmd import MEDIA_MARKER

    table.add_row("mtmd", f"yes (media marker {MEDIA_MARKER})")
    table.add_row("DFlash entry points", "yes (shim ABI "
                  f"{native_info.shim_abi_version()}: layer inputs, nextn, target layer ids, bulk batch fill)")
    table.add_row("DFlash target archs", ", ".join(record.get("dflash_target_archs", [])) or "?")
    table.add_row("system", native_info.system_info())
    console.print(table)
    if rpc_servers:
        _print_remote_devices(rpc_servers)
    if model is not None:
        from pyllama_spec.errors import PyllamaError
        from pyllama_spec.gguf import memory

        try:
            est = memory.estimate(model, mmproj=mmproj, draft=draft, n_ctx=n_ctx, n_ubatch=n_ubatch,
                                  cache_type_k=cache_type_k, cache_type_v=cache_type_v)
        except (PyllamaError, ValueError, OSError) as e:
            err_console.print(f"[red]cannot estimate: {e}[/red]")
            sys.exit(1)
        mem = Table(title=f"memory estimate (n_ctx {n_ctx}, n_ubatch {n_ubatch}, KV {cache_type_k}/{cache_type_v})")
        for column in ("part", "weights", "KV cache", "compute", "total"):
            mem.add_column(column)
        for row in est.table():
            mem.add_row(*row)
        console.print(mem)


#: ggml backends that run on this machine's CPU (BLAS: CPU matrix libraries) or on others' devices (RPC).
_NOT_GPU_BACKENDS = {"CPU", "BLAS", "RPC"}


def _gpu_offload(backends: list[str], local: list) -> str:
    """doctor's GPU offload line, from the backends the build registered and the devices they found
    (not llama_supports_gpu_offload(), which is true whenever any backend could offload: RPC too)."""
    gpu_backends = [b for b in backends if b not in _NOT_GPU_BACKENDS]
    gpus = [d.name for d in local if d.kind in ("gpu", "igpu")]
    rpc = "; -ngl can offload to RPC servers' devices, --rpc" if "RPC" in backends else ""
    if gpus:
        return f"yes: {', '.join(gpus)} ({', '.join(gpu_backends) or 'GPU'} backend)"
    if gpu_backends:
        return f"no: the {', '.join(gpu_backends)} backend found no device{rpc}"
    return f"no GPU backend in this build (CPU only{rpc})"


def _print_remote_devices(rpc_servers: str) -> None:
    """doctor --rpc: every server's devices and memory; an unreachable server is named, then exit 1."""
    from pyllama_spec.bindings import devices as devs
    from pyllama_spec.errors import PyllamaError

    remote = Table(title="remote devices (RPC)")
    for column in ("server", "device", "description", "total", "free"):
        remote.add_column(column)
    failed = False
    try:
        servers = devs.parse_rpc_servers(rpc_servers)
    except ValueError as e:
        err_console.print(f"[red]{e}[/red]")
        sys.exit(2)
    for endpoint in servers:
        try:
            for d in devs.rpc_devices(endpoint):
                i = d.info()
                remote.add_row(endpoint, i.name, i.description, f"{i.total / 2**30:.1f} GiB",
                               f"{i.free / 2**30:.1f} GiB")
        except PyllamaError as e:
            remote.add_row(endpoint, "[red]unreachable[/red]", str(e), "", "")
            failed = True
    console.print(remote)
    if failed:
        sys.exit(1)


@main.command("rpc-server", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                              "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def rpc_server(args) -> None:
    """Run ggml-rpc-server from this build: offer this machine's devices to another's --rpc.

    Its own flags: -H HOST (default 127.0.0.1), -p PORT (50052), -t THREADS, -d DEV1,DEV2, -c (cache
    weights on disk), -h. It has no authentication: bind it to a trusted network only."""
    import os

    from pyllama_spec.bindings import native_info

    path = native_info.RPC_SERVER_PATH
    if not path.exists():
        err_console.print(f"[red]this build has no ggml-rpc-server[/red] ({path} is missing): rebuild with "
                          "`python build.py --rpc`")
        sys.exit(2)
    os.execv(str(path), [str(path), *args])


@main.command()
@click.option("--cuda", "backend", flag_value="cuda", help="CUDA backend (GGML_CUDA)")
@click.option("--rocm", "backend", flag_value="rocm", help="ROCm/HIP backend (GGML_HIP)")
@click.option("--vulkan", "backend", flag_value="vulkan", help="Vulkan backend")
@click.option("--metal", "backend", flag_value="metal", help="Metal backend (macOS)")
@click.option("--cuda-arch", help="CMAKE_CUDA_ARCHITECTURES, e.g. 90")
@click.option("--cublas-dir", help="folder with libcublas.so* outside the CUDA toolkit")
@click.option("--llama-cpp", envvar="LLAMA_CPP_DIR", help="your own llama.cpp checkout instead of the pin")
@click.option("--cmake-arg", multiple=True, help="extra CMake argument (repeatable; $CMAKE_ARGS is read too)")
@click.option("--tools", is_flag=True, help="also build llama-server (for benchmarks)")
@click.option("--rpc/--no-rpc", default=True, show_default=True,
              help="ggml's RPC backend (remote devices) and ggml-rpc-server")
@click.option("-j", "--jobs", type=int, help="parallel compile jobs")
def build(backend, cuda_arch, cublas_dir, llama_cpp, cmake_arg, tools, rpc, jobs) -> None:
    """Build (or rebuild) the native part in place, from a source checkout."""
    from pyllama_spec import native_build as nb

    if not (nb.PROJECT_ROOT / "CMakeLists.txt").exists():
        err_console.print("[red]build needs a source checkout[/red] (CMakeLists.txt and native/ are not installed "
                          "with the package): reinstall with e.g. `PYLLAMA_SPEC_BACKEND=cuda pip install .` "
                          "from the source tree")
        sys.exit(2)
    opts = nb.BuildOptions(backend=backend or "cpu", cuda_arch=cuda_arch, cublas_dir=cublas_dir,
                           llama_cpp=llama_cpp, cmake_args=tuple(cmake_arg), jobs=jobs, tools=tools, rpc=rpc)
    try:
        nb.build_in_place(opts)
    except nb.BuildError as e:
        err_console.print(f"[red]build failed:[/red] {e}")
        sys.exit(1)


# --------------------------------------------------------------------------- chat and generate


KV_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]  # llama.cpp's -ctk names


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
        click.option("--spec-type", type=click.Choice(["draft-dflash", "dflash", "draft-simple", "ngram-simple", "none"]),
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


class _PrefillProgress:
    """A rich progress bar for image encoding and long prefills, on a terminal only."""

    def __init__(self, con: Console, min_rows: int = 256) -> None:
        self.console = con
        self.min_rows = min_rows
        self.bar = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.console.is_terminal or total < self.min_rows:
            return
        if self.bar is None:
            from rich.progress import BarColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} rows"),
                                console=self.console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("prefill", total=total)
        self.bar.update(self.task, completed=done, description="encoding image" if stage == "encode" else "prefill")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def footer(s) -> str:
    return (f"{s.tokens_per_second:.1f} tok/s · acceptance {s.acceptance_rate:.2f} · mean accepted length "
            f"{s.mean_accepted_length:.2f} · drafted/accepted {s.drafted}/{s.accepted} · prefill "
            f"{s.prefill_seconds * 1000:.0f} ms ({s.prompt_tokens - s.prompt_reused} rows decoded, "
            f"{s.prompt_reused} reused)")


CHAT_HELP = """[bold]commands[/bold]
  /image PATH   attach an image to the next message (or write @path/to/img.png in a message)
  /stats        this session's numbers
  /reset        clear the conversation and both caches
  /save FILE    write the transcript (JSON, images by path)
  /help         this help
  /quit         leave (Ctrl-D too); Ctrl-C stops a reply and keeps what was said"""


@main.command()
@model_options
@click.option("--system", default=None, help="system message")
def chat(system, **o) -> None:
    """Interactive multi-turn chat with images; the answer streams as it is accepted (no -m: the embedded pair)."""
    from pyllama_spec.errors import PyllamaError
    from pyllama_spec.serving.chat import Conversation

    engine = _load_engine_or_exit(o)
    conv = Conversation(engine, system=system, max_tokens=o["max_tokens"], **_sampling(o))
    mode = _speculative_mode(engine, asked=o["draft_max"])
    console.print(f"[bold]pyllama-spec chat[/bold] · {engine.model.path.name} · speculative: {mode} · "
                  f"/help for commands")
    progress = _PrefillProgress(console)
    with engine:
        while True:
            try:
                line = console.input("[bold green]> [/bold green]")
            except EOFError:
                console.print()
                break
            except KeyboardInterrupt:
                console.print("\n[dim](Ctrl-D or /quit to leave)[/dim]")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if _chat_command(line, conv):
                    break
                continue
            try:
                for _ in _stream_reply(conv, line, progress):
                    pass
            except KeyboardInterrupt:
                progress.close()
                console.print("\n[yellow](reply interrupted: what was said is kept)[/yellow]")
            except (PyllamaError, ValueError, OSError) as e:
                progress.close()
                console.print(f"\n[red]{e}[/red]")


def _stream_reply(conv, line: str, progress: "_PrefillProgress"):
    first = True
    conv.sampling["progress"] = progress
    for piece in conv.send(line):
        if first:
            progress.close()
            first = False
        console.print(piece.text, end="", markup=False, highlight=False, soft_wrap=True)
        if piece.stats is not None:
            console.print()
            console.print(f"[dim]{footer(piece.stats)}[/dim]")
        yield piece


def _chat_command(line: str, conv) -> bool:
    """Run a /command; True means leave."""
    from pyllama_spec.errors import PyllamaError

    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    if cmd in ("/quit", "/exit"):
        return True
    if cmd == "/help":
        console.print(CHAT_HELP)
    elif cmd == "/image":
        if not arg:
            console.print("[red]usage: /image PATH[/red]")
        else:
            try:
                p = conv.attach(arg)
                console.print(f"[dim]attached {p} (goes with your next message)[/dim]")
            except PyllamaError as e:
                console.print(f"[red]{e}[/red]")
    elif cmd == "/stats":
        s = conv.session
        console.print(f"turns {s.turns} · generated {s.generated_tokens} tokens · {s.tokens_per_second:.1f} tok/s "
                      f"· drafted/accepted {s.drafted}/{s.accepted} (acceptance {s.acceptance_rate:.2f}) · prompt "
                      f"rows decoded {s.prompt_rows_decoded}, reused {s.prompt_rows_reused}")
    elif cmd == "/reset":
        conv.reset()
        console.print("[dim]conversation and caches cleared[/dim]")
    elif cmd == "/save":
        if not arg:
            console.print("[red]usage: /save FILE[/red]")
        else:
            try:
                console.print(f"[dim]saved {conv.save(arg)}[/dim]")
            except OSError as e:
                console.print(f"[red]cannot save: {e}[/red]")
    else:
        console.print(f"[red]unknown command {cmd}[/red] (/help lists them)")
    return False


@main.command()
@model_options
@click.option("-p", "--prompt", required=True,
              help="the prompt, sent as one user message through the model's chat template (--raw: as is)")
@click.option("--image", "images", multiple=True, type=click.Path(), help="image to attach (repeatable)")
@click.option("--raw", is_flag=True, help="send the prompt as is, without the chat template")
@click.option("--json", "as_json", is_flag=True, help="print text and stats as one JSON object")
def generate(prompt, images, raw, as_json, **o) -> None:
    """One-shot generation, scriptable."""
    import json

    from pyllama_spec.errors import PyllamaError

    try:
        with _load_engine(o) as engine:
            kwargs = dict(images=list(images), max_tokens=o["max_tokens"], **_sampling(o))
            if raw:
                stream = engine.stream(prompt, **kwargs)
            else:
                content = ([{"type": "image", "image": p} for p in images] + [{"type": "text", "text": prompt}]
                           if images else prompt)
                kwargs["images"] = []
                stream = engine.stream(messages=[{"role": "user", "content": content}], **kwargs)
            text, tokens, last = [], [], None
            for piece in stream:
                text.append(piece.text)
                tokens.extend(piece.tokens)
                last = piece
                if not as_json:
                    click.echo(piece.text, nl=False)
    except (PyllamaError, ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({"text": "".join(text), "tokens": tokens, "finish_reason": last.finish_reason,
                               "stats": last.stats.as_dict()}))
    else:
        click.echo()
        err_console.print(f"[dim]{footer(last.stats)}[/dim]")


# --------------------------------------------------------------------------- bench


@main.command()
@click.option("-m", "--model", "model", type=click.Path(), help="target GGUF (default: the tiny models)")
@click.option("--mmproj", type=click.Path())
@click.option("-md", "--model-draft", "draft", type=click.Path())
@click.option("--server", type=click.Path(), help="llama-server binary (default: the one `build.py --tools` built)")
@click.option("-b", "--batch-size", "n_batch", default=64, show_default=True)
@click.option("-ub", "--ubatch-size", "n_ubatch", default=64, show_default=True)
@click.option("--draft-max", default=7, show_default=True)
@click.option("-t", "--threads", default=2, show_default=True)
@click.option("-n", "--max-tokens", default=64, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--large", is_flag=True, help="use the ~142M-parameter f16 random bench models (made once, cached)")
@click.option("--widened", is_flag=True,
              help="use the embedded trained pair zero-padded to the same 142M f16 shapes: its acceptance at "
                   "the cost of a 142M model (pyllama_spec.devtools.widen; made once, cached)")
@click.option("--json-out", type=click.Path(), help="write every sample and the summary as JSON")
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", default=0, show_default=True,
              help="layers on the GPU, target and draft, both engines")
def bench(model, mmproj, draft, server, n_batch, n_ubatch, draft_max, threads, max_tokens, repeats, large, widened,
          json_out, n_gpu_layers):
    """pyllama-spec vs llama-server on the same files and settings, alternating, medians and ratios."""
    import json

    from pyllama_spec import native_build as nb
    from pyllama_spec.devtools import tiny
    from pyllama_spec.devtools.benchmark import BenchSettings, run, to_markdown

    server = server or nb.find_llama_server()
    if server is None:
        err_console.print("[red]no llama-server found[/red]: build it with `python build.py --tools` "
                          "(or pass --server PATH)")
        sys.exit(2)
    if large and widened:
        err_console.print("[red]--large and --widened are two model sets: pick one[/red]")
        sys.exit(2)
    if model is None:
        folder = nb.cache_root() / "tiny-models"
        if widened:
            from pyllama_spec.devtools.widen import widen_trained_pair

            models = widen_trained_pair(folder)
        else:
            models = tiny.make_bench_set(folder) if large else tiny.make_tiny_set(folder, predictable=0.5)
        model, mmproj, draft = str(models.target), str(models.mmproj), str(models.draft)
    if mmproj is None:
        err_console.print("[red]--mmproj is needed (the benchmark has an image prompt)[/red]")
        sys.exit(2)
    settings = BenchSettings(model=model, mmproj=mmproj, draft=draft, n_batch=n_batch, n_ubatch=n_ubatch,
                             draft_max=draft_max, threads=threads, max_tokens=max_tokens, repeats=repeats,
                             n_gpu_layers=n_gpu_layers)
    try:
        result = run(settings, server, log=lambda m: err_console.print(f"[dim]{m}[/dim]"))
    except (RuntimeError, OSError) as e:
        err_console.print(f"[red]benchmark failed:[/red] {e}")
        sys.exit(1)
    click.echo(to_markdown(result))
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2))


# --------------------------------------------------------------------------- demo


@main.command()
@click.option("--image-size", default=672, show_default=True, help="side of the drawn test image, pixels")
@click.option("-ub", "--ubatch", "n_ubatch", default=64, show_default=True, help="n_batch = n_ubatch of both contexts")
@click.option("--draft-max", default=7, show_default=True)
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--draft-positions", type=click.Choice(["target", "sequential"]), default="target", show_default=True)
@click.option("--threads", type=int, default=None, help="CPU threads (default: all cores)")
@click.option("--random-tiny", is_flag=True,
              help="random tiny models made locally instead of the embedded trained pair "
                   "(they accept, but write random bytes)")
@click.option("--window", default=32, show_default=True, help="the random tiny draft's sliding window (--random-tiny)")
def demo(image_size, n_ubatch, draft_max, max_tokens, draft_positions, threads, random_tiny, window) -> None:
    """One turn with a large image through DFlash, on the embedded trained pair (or --random-tiny)."""
    from pyllama_spec import MEDIA_MARKER
    from pyllama_spec import native_build as nb
    from pyllama_spec.devtools import tiny
    from pyllama_spec.errors import ModelFileError, NativeLibraryError

    try:
        from pyllama_spec.bindings import native_info  # noqa: F401 - loads the native part
    except NativeLibraryError:
        if not (nb.PROJECT_ROOT / "CMakeLists.txt").exists():
            raise
        console.print("[bold]building the native part first[/bold] (cached for next time) ...")
        try:
            nb.build_in_place(nb.BuildOptions())
        except nb.BuildError as e:
            err_console.print(f"[red]build failed:[/red] {e}")
            sys.exit(1)
    from pyllama_spec.embedded import PROMPT, embedded_models
    from pyllama_spec.serving.engine import load

    image = tiny.draw_demo_image(image_size)
    if random_tiny:
        models = tiny.make_tiny_set(nb.cache_root() / "tiny-models", window=window, predictable=0.5)
        # random weights: the target writes arbitrary bytes, so only the numbers below mean something
        request = dict(messages=[{"role": "user", "content": [{"type": "image", "image": image},
                                                              {"type": "text", "text": "What is in this picture?"}]}])
        console.print(f"[bold]random tiny models[/bold] {models.target.parent}: draft window {window}, "
                      f"image {image_size}x{image_size}, ubatch {n_ubatch}")
    else:
        try:
            models = embedded_models()
        except ModelFileError as e:
            err_console.print(f"[red]{e}[/red] (or run `pyllama-spec demo --random-tiny`)")
            sys.exit(1)
        # the pair was trained on Python source, pictures before some of it: a code prefix after an image
        request = dict(prompt=f"{MEDIA_MARKER}\n{PROMPT}", images=[image])
        console.print(f"[bold]embedded trained pair[/bold] {models.target.parent}: a tiny hunyuan_vl target and "
                      "its DFlash draft, trained on Python source")
        console.print(f"[bold]prompt[/bold]: a {image_size}x{image_size} test card (ubatch {n_ubatch}), then this "
                      "code; the DFlash continuation follows it")
        console.print(PROMPT, end="", style="dim", markup=False, highlight=False)
    common = dict(n_ctx=4096, n_batch=n_ubatch, n_ubatch=n_ubatch, n_threads=threads, flash_attn=False)
    with console.status("target only ..."):
        with load(models.target, mmproj=models.mmproj, spec_type="none", **common) as plain:
            expected = plain.generate(**request, max_tokens=max_tokens)
    with load(models.target, mmproj=models.mmproj, draft=models.draft, draft_max=draft_max,
              draft_positions=draft_positions, **common) as engine:
        engine.drafter.trace = []
        if random_tiny:
            console.print("[bold]answer (DFlash):[/bold] ", end="")
        text, last = [], None
        for piece in engine.stream(**request, max_tokens=max_tokens):
            console.print(piece.text, end="", markup=False, highlight=False)
            text.append(piece.text)
            last = piece
        console.print()
        trace = engine.drafter.trace
    s = last.stats
    blocks = [pos for call, pos, _ in trace if call == "draft"]
    table = Table(title="DFlash on a vision target", show_header=False)
    table.add_row("prompt", f"{s.prompt_tokens} cache rows over {s.prompt_positions} positions (one image)")
    table.add_row("pinned image rows skipped", str(sum(n for call, _, n in trace if call == "skip")))
    table.add_row("rows injected into the draft", str(sum(n for call, _, n in trace if call == "inject")))
    table.add_row("first draft block at", f"position {blocks[0] if blocks else '-'} (pos_next "
                                          f"{s.prompt_positions}, not the row count {s.prompt_tokens})")
    table.add_row("drafted / accepted", f"{s.drafted} / {s.accepted} (acceptance {s.acceptance_rate:.2f}, "
                                        f"mean accepted length {s.mean_accepted_length:.2f})")
    table.add_row("prefill / decode", f"{s.prefill_seconds * 1000:.0f} ms / {s.decode_seconds * 1000:.0f} ms "
                                      f"({s.tokens_per_second:.0f} tokens/s)")
    table.add_row("same output as target-only", "yes" if "".join(text) == expected.text else "[red]NO[/red]")
    console.print(table)
    if "".join(text) != expected.text:
        sys.exit(1)


# --------------------------------------------------------------------------- serve


@main.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", default=8080, show_default=True)
@click.option("--api-key", envvar="LLAMA_API_KEY", default=None, help="require 'Authorization: Bearer KEY'")
@click.option("-a", "--alias", default=None, help="model name clients see (default: the file name)")
@click.option("-np", "--parallel", default=1, show_default=True, type=click.IntRange(1, 64),
              help="sequence slots: requests generated at once, every slot's draft verified in one target "
                   "batch; each slot gets ctx-size / np of the context")
@click.option("--queue", "max_queue", default=16, show_default=True,
              help="requests that may wait for a slot; more get 503")
@click.option("--allowed-image-dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="allow image_url parts that name local files under this folder")
@click.option("--max-images", default=8, show_default=True, help="images per request")
@click.option("--max-image-pixels", default=4096 * 4096, show_default=True, help="pixels per image")
@click.option("--max-body-mib", default=64, show_default=True, help="largest request body, MiB")
@click.option("-to", "--timeout", "body_timeout", default=60.0, show_default=True, type=click.FloatRange(min=0.1),
              help="seconds a request body may take to arrive (then 408); a request head must arrive "
                   "within 10 s")
def serve(host, port, api_key, alias, parallel, max_queue, allowed_image_dir, max_images, max_image_pixels,
          max_body_mib, body_timeout, **o):
    """OpenAI-compatible HTTP server (chat with images, speculative stats); needs the 'server' extra."""
    try:
        import uvicorn  # noqa: F401 - the server extra is there

        from pyllama_spec.server import ServerSettings, create_app
    except ImportError as e:
        err_console.print(f"[red]{e}[/red] (pip install 'pyllama-spec[server]')")
        sys.exit(2)
    engine = _load_engine_or_exit({**o, "n_parallel": parallel})
    settings = ServerSettings(alias=alias or Path(engine.model.path).stem, api_key=api_key, max_queue=max_queue,
                              default_max_tokens=o["max_tokens"], max_images=max_images,
                              max_image_pixels=max_image_pixels, max_body_bytes=max_body_mib * 2**20,
                              allowed_image_dir=Path(allowed_image_dir) if allowed_image_dir else None,
                              body_timeout=body_timeout)
    mode = _speculative_mode(engine)
    slots = f"{parallel} slots of {engine.ctx.n_ctx_seq} tokens" if parallel > 1 else "1 slot"
    err_console.print(f"[bold]pyllama-spec serve[/bold] · {engine.model.path.name} as '{settings.alias}' · "
                      f"speculative: {mode} · images: {'yes' if engine.projector else 'no'} · {slots} · "
                      f"http://{host}:{port}/v1")
    from pyllama_spec.server.run import serve as serve_app

    with engine:
        serve_app(create_app(engine, settings), host=host, port=port)


if __name__ == "__main__":  # python -m pyllama_spec.cli
    main()
