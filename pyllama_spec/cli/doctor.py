"""`pyllama-spec doctor`: the native build, its devices, RPC servers' devices, a memory estimate."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from pyllama_spec.cli.options import console, err_console


@click.command()
@click.option("-m", "--model", "model", type=click.Path(), default=None, help="also estimate this target's memory")
@click.option("--mmproj", type=click.Path(), default=None)
@click.option("-md", "--model-draft", "draft", type=click.Path(), default=None)
@click.option("--mmproj-draft", "mmproj_draft", type=click.Path(), default=None,
              help="the draft model's own projector (draft-simple)")
@click.option("-c", "--ctx-size", "n_ctx", default=4096, show_default=True)
@click.option("-b", "--batch-size", "n_batch", default=512, show_default=True)
@click.option("-ub", "--ubatch-size", "n_ubatch", default=512, show_default=True)
@click.option("-np", "--parallel", "n_parallel", default=1, show_default=True)
@click.option("-ctk", "--cache-type-k", default="f16", show_default=True)
@click.option("-ctv", "--cache-type-v", default="f16", show_default=True)
@click.option("-ctkd", "--cache-type-k-draft", default=None)
@click.option("-ctvd", "--cache-type-v-draft", default=None)
@click.option("--spec-type", default=None, metavar="TYPE",
              help="the drafting method to estimate for (default: as load() picks it from -md and --mmproj-draft); "
                   "each adds its own parts: a draft's weights and caches, a draft's projector, draft-mtp's head")
@click.option("--rpc", "rpc_servers", default=None, metavar="SERVERS",
              help="also list the devices of these RPC servers (comma-separated host:port) and their memory")
def doctor(model, mmproj, draft, mmproj_draft, n_ctx, n_batch, n_ubatch, n_parallel, cache_type_k, cache_type_v,
           cache_type_k_draft, cache_type_v_draft, spec_type, rpc_servers) -> None:
    """Show the native build: libraries, llama.cpp pin, backends, devices, DFlash entry points.

    With -m (and --mmproj, -md, --mmproj-draft, --spec-type, -c, -b, -ub, -np, -ctk, -ctv, -ctkd, -ctvd): what
    that configuration will need, estimated from the files before anything is allocated, as load() checks it.
    With --rpc: the remote devices, reached first."""
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
        from pyllama_spec.drafters.registry import method
        from pyllama_spec.errors import PyllamaError
        from pyllama_spec.serving.config import EngineConfig
        from pyllama_spec.serving.load_plan import estimate_memory

        try:
            config = EngineConfig(model=model, mmproj=mmproj, draft=draft, mmproj_draft=mmproj_draft,
                                  spec_type=spec_type, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch),
                                  n_parallel=n_parallel, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                                  cache_type_k_draft=cache_type_k_draft, cache_type_v_draft=cache_type_v_draft).checked()
            est = estimate_memory(config, method(config.spec_type))
        except (PyllamaError, ValueError, OSError) as e:
            err_console.print(f"[red]cannot estimate: {e}[/red]")
            sys.exit(1)
        mem = Table(title=f"memory estimate (spec_type {config.spec_type}, n_ctx {n_ctx}, n_ubatch {config.n_ubatch}, "
                          f"KV {cache_type_k}/{cache_type_v})")
        for column in ("part", "weights", "KV cache", "compute", "total"):
            mem.add_column(column)
        for row in est.table():
            mem.add_row(*row)
        console.print(mem)
        if config.spec_type != "none" and mmproj is not None:
            m = method(config.spec_type)
            blind = not m.sees_picture or (m.draft_projector and mmproj_draft is None)
            console.print(f"pictures: {config.spec_type} drafts " + (
                f"blind to them ({m.sees_picture})" if blind and m.sees_picture else "blind to them" if blind
                else f"seeing them through {m.sees_picture}"), markup=False, highlight=False)


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
