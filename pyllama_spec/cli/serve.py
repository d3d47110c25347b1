"""`pyllama-spec serve`: the OpenAI- and llama-server-compatible HTTP server (pyllama_spec.server).

It takes llama-server's command lines: every llama-server flag is honoured or dropped with a
warning (cli/llama_server_cli.py), ``LLAMA_ARG_*`` variables set the honoured ones, and
``--models-preset FILE`` without ``-m`` makes it llama-server's router: each section of the
preset file a model served by name, in a ``serve`` process of its own (server/router/)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path

import click

from pyllama_spec.cli import llama_server_cli
from pyllama_spec.cli.options import (
    ModelCommand,
    parse_csv_row,
    _load_engine_or_exit,
    _speculative_mode,
    err_console,
    model_options,
)


#: llama-server's flags that name a model to download: without a local -m, serve stops (nothing is
#: downloaded here, and serving another model than the one asked for would be wrong).
DOWNLOAD_FLAGS = frozenset({"-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url", "-dr",
                            "--docker-repo"})


def _flags_that_stop(ctx: click.Context, args: list[str]) -> None:
    """llama-server's flags that answer and exit (--version, --list-devices), and a model named only by
    a download flag: a clear error, never the embedded pair served in its place."""
    names = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    # llama-server's LLAMA_ARG_* variables set flags too (a Docker image's usual way)
    names |= {n for f in llama_server_cli.FLAGS if f.env and f.env in os.environ for n in f.names}
    if "--version" in names:
        from importlib.metadata import PackageNotFoundError, version

        from pyllama_spec.native_build.source import PIN_VERSION

        try:
            ours = version("pyllama-spec")
        except PackageNotFoundError:
            ours = "(not installed)"
        click.echo(f"pyllama-spec {ours} serve, on llama.cpp as vendored by llama-cpp-python {PIN_VERSION}")
        ctx.exit(0)
    if "--list-devices" in names:
        from pyllama_spec.bindings.devices import local_devices

        click.echo("Available devices:")  # llama-server's listing: the devices besides the CPU
        listed = [d.info() for d in local_devices() if d.kind != "cpu"]
        for d in listed:
            click.echo(f"  {d.name}: {d.description} ({d.total // 2**20} MiB, {d.free // 2**20} MiB free)")
        if not listed:
            click.echo("  (none)")
        ctx.exit(0)
    asked = sorted(names & DOWNLOAD_FLAGS)
    if asked and not names & {"-m", "--model", "--models-preset"}:
        raise click.UsageError(f"{asked[0]} names a model to download, and nothing is downloaded here: download "
                               "its GGUF yourself and give it with -m FILE (and its projector with --mmproj FILE)")


class LlamaServerCommand(ModelCommand):
    """A click command that reads llama-server's command lines (see llama_server_cli)."""

    takes_llama_server_flags = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:  # llama-server's environment variables, for the options it shares
            if isinstance(param, click.Option) and param.envvar is None:
                flag = next((llama_server_cli.BY_NAME[n] for n in param.opts if n in llama_server_cli.BY_NAME), None)
                if flag is not None and flag.env:
                    param.envvar = flag.env

    def accepted(self, ctx: click.Context) -> dict[str, int]:
        """Every option name this command has (--help too), and how many values it takes."""
        out = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                n = 0 if (param.is_flag or param.count) else param.nargs
                for name in param.opts + param.secondary_opts:
                    out[name] = n
        return out

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        accepted = self.accepted(ctx)
        _flags_that_stop(ctx, [llama_server_cli.normalised(a) for a in args])
        args, preset, preset_warnings = _preset_mode([llama_server_cli.normalised(a) for a in args])
        args, warnings = llama_server_cli.translate(args, accepted)
        for w in [*preset_warnings, *warnings, *llama_server_cli.ignored_environment(accepted)]:
            err_console.print(f"[yellow]warning: {w}[/yellow]", soft_wrap=True)
        if preset is not None:
            path, presets = preset
            ctx.meta[_ROUTER_PLAN] = RouterPlan(presets, _for_children(args, accepted), path)
        return super().parse_args(ctx, args)


_ROUTER_PLAN = "pyllama_spec.serve.router_plan"
#: The router's own options: not passed on to its models (llama-server's unset_reserved_args).
_ROUTER_OWN = ("--host", "--port", "--api-key", "--api-key-file", "-a", "--alias", "--models-max",
               "--models-autoload", "--no-models-autoload", "-mm", "--mmproj")


@dataclasses.dataclass(frozen=True)
class RouterPlan:
    """What a router serves: the preset's models, and the router's command-line arguments that
    every model's process takes after its section's (so they override it, as in llama-server);
    ``path``: the preset file, read again on GET /models?reload=1."""

    presets: list[llama_server_cli.RouterPreset]
    common_args: list[str]
    path: str = ""


def router_plan(ctx: click.Context) -> RouterPlan | None:
    """The router this command line asks for, or None (one model served in this process)."""
    return ctx.meta.get(_ROUTER_PLAN)


def _preset_mode(args: list[str]) -> tuple[list[str], tuple[str, list] | None, list[str]]:
    """``args`` without --models-preset FILE (or LLAMA_ARG_MODELS_PRESET), the file and its models
    when they make this a router (no -m: llama-server's rule, server.cpp), and warnings."""
    path, rest, i = os.environ.get("LLAMA_ARG_MODELS_PRESET"), [], 0
    while i < len(args):
        if args[i] == "--models-preset" and i + 1 < len(args):
            path, i = args[i + 1], i + 2
        elif args[i].startswith("--models-preset="):
            path, i = args[i].split("=", 1)[1], i + 1
        else:
            rest.append(args[i])
            i += 1
    if path is None:
        return args, None, []
    if os.environ.get("LLAMA_ARG_MODEL") or any(a in ("-m", "--model") or a.startswith("--model=") for a in rest):
        why = "a model is given (-m), which is served alone (as llama-server does)"
        return rest, None, [f"ignored --models-preset {path}: {why}"]
    try:
        presets = llama_server_cli.router_presets(path)
    except llama_server_cli.PresetError as e:
        raise click.UsageError(str(e)) from None
    if not presets:
        raise click.UsageError(f"the preset file {path} has no models")
    return rest, (path, presets), [w for p in presets for w in p.warnings]


def _for_children(args: list[str], accepted: dict[str, int]) -> list[str]:
    """The router's arguments less its own options (and their values)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out.extend(args[i:])
            break
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg
        n = 1 + (0 if "=" in arg else accepted.get(name, 0))
        if name not in _ROUTER_OWN:
            out.extend(args[i:i + n])
        i += n
    return out


@click.command(cls=LlamaServerCommand)
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="addresses to listen on, comma-separated, or UNIX socket paths ending in .sock (as llama-server)")
@click.option("--port", default=8080, show_default=True)
@click.option("--api-key", envvar="LLAMA_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' (several keys: comma-separated)")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False),
              help="a file of API keys, one per line")
@click.option("-a", "--alias", default=None,
              help="the model's names clients see, comma-separated: the first in sorted order is its id, as in "
                   "llama-server (default: the file name)")
@click.option("--tags", default=None,
              help="the model's tags, comma-separated (listed by /v1/models; informational)")
@click.option("-np", "--parallel", default=1, show_default=True, type=click.IntRange(-1, 64),
              help="sequence slots: requests generated at once, every slot's draft verified in one target "
                   "batch; each slot gets ctx-size / np of the context (-1: 1)")
@click.option("--queue", "max_queue", default=16, show_default=True, type=click.IntRange(min=1),
              help="requests that may wait for a slot; more get 503")
@click.option("--allowed-image-dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="allow image_url parts that name local files under this folder")
@click.option("--max-images", default=64, show_default=True, help="images per request (an agent's conversation "
              "holds every screenshot so far)")
@click.option("--max-image-pixels", default=4096 * 4096, show_default=True, help="pixels per image")
@click.option("--max-request-pixels", type=click.IntRange(min=1), default=None,
              help="pixels of all a request's images together (decoding costs by the pixel)  "
                   "[default: 8 x --max-image-pixels]")
@click.option("--max-body-mib", default=64, show_default=True, help="largest request body, MiB")
@click.option("-to", "--timeout", "body_timeout", default=60.0, show_default=True, type=click.FloatRange(min=0.1),
              help="seconds a request body may take to arrive (then 408); a request head must arrive "
                   "within 10 s")
@click.option("--models-max", default=4, show_default=True, type=click.IntRange(min=0),
              help="router (--models-preset without -m): models loaded at once, each in its own process "
                   "(0: no limit); one more stops the least recently used idle one")
@click.option("--models-autoload/--no-models-autoload", default=True, show_default=True,
              help="router: load a model when a request names it (a request's ?autoload=false overrides)")
@click.option("--slots/--no-slots", "endpoint_slots", default=True, show_default=True,
              help="serve GET /slots: what each slot runs, its cache and its speculative state")
@click.option("--slot-save-path", type=click.Path(file_okay=False, exists=True), default=None,
              help="a folder for POST /slots/{id}?action=save|restore|erase: a slot's cache to a file and back")
@click.option("-cram", "--cache-ram", "cache_ram_mib", type=click.IntRange(min=-1), default=8192, show_default=True,
              help="MiB of host memory for slots' caches a request would overwrite (another conversation on a "
                   "busy slot), put back when a later prompt shares more with one (-1: no limit, 0: none)")
@click.option("--cache-idle-slots/--no-cache-idle-slots", "cache_idle_slots", default=True, show_default=True,
              help="copy every idle slot's cache there whenever a request starts (needs --cache-ram)")
@click.option("-kvu/-no-kvu", "--kv-unified/--no-kv-unified", "kv_unified", default=False, show_default=True,
              help="one pool of ctx-size cache cells for every slot (a prompt may use all of it) instead of "
                   "ctx-size / np per slot; idle slots give their cells up first")
@click.option("--props", "endpoint_props", is_flag=True, default=False,
              help="accept POST /props (as in llama-server, no property can be changed yet)")
@click.option("--sleep-idle-seconds", type=int, default=-1, show_default=True,
              callback=lambda ctx, param, value: _sleep_seconds(value),
              help="unload the model after this many seconds without a request, and load it again on the next "
                   "request that needs it (/health, /props, /models and /metrics do not); -1: never")
@click.option("--cors-origins", default="localhost", show_default=True,
              help="web pages that may send requests besides this server's own page: 'localhost' (pages served "
                   "from this machine), '*' (any site: llama-server's default), or origins separated by commas "
                   "(http://example.com:3000); a browser's request from any other site gets 403")
@click.option("--lora-init-without-apply", "lora_init_without_apply", is_flag=True, default=False,
              help="load the --lora adapters at scale 0 (set their scales with POST /lora-adapters)")
@click.option("--embedding", "--embeddings", "embeddings", is_flag=True, default=False,
              help="serve /embedding, /embeddings and /v1/embeddings (generation routes are served too)")
@click.option("--rerank", "--reranking", "reranking", is_flag=True, default=False,
              help="serve /rerank, /reranking, /v1/rerank (a reranker model; sets --embeddings and --pooling rank)")
@click.option("--pooling", type=click.Choice(["none", "mean", "cls", "last", "rank"]), default=None,
              help="how /embeddings pools a prompt's rows into one vector  [default: what the model declares]")
@click.option("--embd-normalize", "embd_normalize", type=click.IntRange(min=-1), default=2, show_default=True,
              help="normalisation of pooled embeddings: -1 none, 0 max-abs to int16, 1 taxicab, 2 euclidean, "
                   ">2 p-norm (a request's embd_normalize overrides it)")
@click.option("-v", "--verbose", "--log-verbose", "log_verbose", is_flag=True, default=False,
              help="log everything: each request with its body and the response's, and llama.cpp's own log")
@click.option("-lv", "--verbosity", "--log-verbosity", "log_verbosity", type=int, default=3, show_default=True,
              help="llama.cpp's levels: 0 output, 1 errors, 2 warnings, 3 info, 4 debug (the request log and "
                   "llama.cpp's own log)")
@click.option("--log-file", type=click.Path(dir_okay=False), default=None,
              help="also write the log to this file")
@click.option("--log-disable", is_flag=True, default=False, help="no log at all")
def serve(host, port, api_key, api_key_file, alias, tags, parallel, max_queue, allowed_image_dir, max_images,
          max_image_pixels, max_request_pixels, max_body_mib, body_timeout, models_max, models_autoload, endpoint_slots, slot_save_path,
          endpoint_props, cors_origins, log_verbose, log_verbosity, log_file, log_disable, sleep_idle_seconds, **o):
    """OpenAI- and llama-server-compatible HTTP server (chat with images, speculative stats); takes
    llama-server's flags and --models-preset files. Needs the 'server' extra."""
    try:
        import uvicorn  # noqa: F401 - the server extra is there

        from pyllama_spec.server import ServerSettings, create_app
    except ImportError as e:
        err_console.print(f"[red]{e}[/red] (pip install 'pyllama-spec[server]')")
        sys.exit(2)
    if parallel == 0:
        raise click.BadParameter("must be -1 (auto) or at least 1", param_hint="'-np' / '--parallel'")
    from pyllama_spec.cli import logs

    try:
        level, undo = logs.configure(verbosity=log_verbosity, verbose=log_verbose, log_file=log_file,
                                     disable=log_disable)
    except OSError as e:
        raise click.BadParameter(f"cannot write the log there: {e}", param_hint="'--log-file'") from None
    click.get_current_context().call_on_close(undo)  # an in-process caller keeps its logging
    uvicorn_level = "debug" if level <= logging.DEBUG else "critical" if log_disable else "warning"
    parallel = max(parallel, 1)
    from pyllama_spec.server.origins import OriginPolicy

    hosts = parse_csv_row(host)  # llama-server's --host a,b (quoted fields allowed)
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise click.BadParameter("give at least one address", param_hint="'--host'")
    # the banner's address: the first TCP one (a UNIX socket has no URL a browser opens)
    host = next((h for h in hosts if not h.endswith(".sock")), hosts[0])
    try:
        origins = OriginPolicy.parse(cors_origins, listen_host=hosts)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--cors-origins'") from None
    keys = _api_keys(api_key, api_key_file)
    vertex = _vertex_settings()
    if vertex is not None and vertex.port != port:  # Vertex AI says where to listen (llama-server: the same)
        err_console.print(f"[yellow]warning: AIP_MODE=PREDICTION: listening on AIP_HTTP_PORT {vertex.port}, "
                          f"not --port {port}[/yellow]")
        port = vertex.port
    plan = router_plan(click.get_current_context())
    if plan is not None:
        _serve_router(plan, host=hosts, port=port, keys=keys, models_max=models_max, autoload=models_autoload,
                      max_body_bytes=max_body_mib * 2**20, body_timeout=body_timeout, origins=origins)
        return
    if os.environ.get("LLAMA_SERVER_ROUTER_PORT"):  # a router's model: it goes when the router goes
        from pyllama_spec.server.router.pool import follow_router

        follow_router()
    if o.pop("reranking"):  # as llama-server's --reranking: embeddings on, pooling rank
        o.update(embeddings=True, pooling="rank")
    engine = _load_engine_or_exit({**o, "n_parallel": parallel})
    # llama-server keeps the names in a set: its first, in sorted order, is the model's id
    aliases = tuple(sorted(set(_csv(alias)))) or (Path(engine.model.path).stem,)
    settings = ServerSettings(alias=aliases[0], aliases=aliases, tags=tuple(sorted(set(_csv(tags)))),
                              api_key=",".join(keys) or None,
                              max_queue=max_queue, default_max_tokens=_max_tokens(o["max_tokens"]),
                              max_images=max_images, max_image_pixels=max_image_pixels,
                              max_request_pixels=max_request_pixels, max_body_bytes=max_body_mib * 2**20,
                              allowed_image_dir=Path(allowed_image_dir) if allowed_image_dir else None,
                              body_timeout=body_timeout, endpoint_slots=endpoint_slots, endpoint_props=endpoint_props,
                              slot_save_path=Path(slot_save_path) if slot_save_path else None, cors_origins=origins,
                              sleep_idle_seconds=sleep_idle_seconds, vertex=vertex)
    mode = _speculative_mode(engine)
    slots = f"{parallel} slots of {engine.ctx.n_ctx_seq} tokens" if parallel > 1 else "1 slot"
    err_console.print(f"[bold]pyllama-spec serve[/bold] · {engine.model.path.name} as '{settings.alias}' · "
                      f"speculative: {mode} · images: {'yes' if engine.projector else 'no'} · {slots} · "
                      f"chat page http://{_shown(host)}:{port}/ · API http://{_shown(host)}:{port}/v1", soft_wrap=True)
    from pyllama_spec.server.run import serve as serve_app

    with engine:
        try:
            app = create_app(engine, settings)
        except ValueError as e:  # AIP_PREDICT_ROUTE on a route already served
            err_console.print(f"[red]error:[/red] {e}")
            sys.exit(1)
        try:
            serve_app(app, host=hosts, port=port, log_level=uvicorn_level)
        except OSError as e:  # an address that cannot be listened on (in use, not this machine's)
            err_console.print(f"[red]error:[/red] {e.strerror or e}")
            sys.exit(1)


def _vertex_settings():
    """Vertex AI's settings from the environment (server/vertex.py), or None outside it."""
    from pyllama_spec.server.vertex import VertexSettings

    try:
        return VertexSettings.from_environ()
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _serve_router(plan: RouterPlan, *, host: list[str], port: int, keys: list[str], models_max: int, autoload: bool,
                  max_body_bytes: int, body_timeout: float, origins) -> None:
    from pyllama_spec.server.router.app import create_router_app
    from pyllama_spec.server.router.pool import RouterSettings
    from pyllama_spec.server.run import serve as serve_app

    specs = _model_specs(plan.presets, plan.common_args)
    settings = RouterSettings(models_max=models_max, autoload=autoload, api_key=",".join(keys) or None,
                              max_body_bytes=max_body_bytes, body_timeout=body_timeout, router_port=port,
                              cors_origins=origins)
    try:
        app = create_router_app(specs, settings, read_again=functools.partial(_read_preset_again, plan))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    names = ", ".join(s.name + (" (on startup)" if s.load_on_startup else "") for s in specs)
    err_console.print(f"[bold]pyllama-spec serve[/bold] · router · {len(specs)} models: {names} · "
                      f"at most {models_max or 'any number'} loaded · autoload: {'on' if autoload else 'off'} · "
                      f"http://{_shown(next((h for h in host if not h.endswith('.sock')), host[0]))}:{port}/v1",
                      soft_wrap=True)
    try:
        serve_app(app, host=host, port=port)
    except OSError as e:  # an address that cannot be listened on (in use, not this machine's)
        err_console.print(f"[red]error:[/red] {e.strerror or e}")
        sys.exit(1)


def _model_specs(presets: list[llama_server_cli.RouterPreset], common_args: list[str]) -> list:
    """The router's models (pool.ModelSpec): each section's arguments, then the router's own."""
    from pyllama_spec.server.router.pool import ModelSpec, input_modalities

    return [ModelSpec(name=p.name, args=llama_server_cli.last_spec_type_only((*p.args, *common_args)),
                      aliases=p.aliases, tags=p.tags, load_on_startup=p.load_on_startup, stop_timeout=p.stop_timeout,
                      preset=p.ini, input_modalities=input_modalities(p.mmproj)) for p in presets]


def _read_preset_again(plan: RouterPlan) -> list:
    """The router's models as its preset file says now (GET /models?reload=1), with the same
    command-line arguments as at start; a PresetError for a file that cannot be served. Its
    warnings go to the log (the console's banner is long gone)."""
    presets = llama_server_cli.router_presets(plan.path)
    for w in (w for p in presets for w in p.warnings):
        logging.getLogger("pyllama_spec.server.router").warning(w)
    return _model_specs(presets, plan.common_args)


def _sleep_seconds(value: int) -> int:
    """--sleep-idle-seconds as llama-server takes it: -1 (never) or at least 1."""
    from pyllama_spec.server.sleep import check_seconds

    try:
        return check_seconds(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--sleep-idle-seconds'") from None


def _csv(value: str | None) -> list[str]:
    """llama-server's comma-separated names: stripped, empty ones dropped."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _shown(host: str) -> str:
    """The host as a browser reaches it: a wildcard address is this machine's loopback; IPv6 in brackets;
    a UNIX socket as curl names one."""
    if host.endswith(".sock"):
        return f"localhost (--unix-socket {host})"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _max_tokens(n: int) -> int:
    """-n as the default max_tokens of a request: llama-server's -1 (no limit) is this server's cap."""
    from pyllama_spec.server import ServerSettings

    return ServerSettings.max_tokens if n < 0 else min(n, ServerSettings.max_tokens)


def _api_keys(given: str | None, path: str | None) -> list[str]:
    keys = [k.strip() for k in (given or "").split(",") if k.strip()]
    if path:
        try:
            keys += [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise click.BadParameter(f"cannot read {path}: {e}", param_hint="--api-key-file") from None
    return keys
