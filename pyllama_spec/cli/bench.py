"""`pyllama-spec bench`: pyllama-spec against llama-server (pyllama_spec.devtools.benchmark)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pyllama_spec.cli.options import err_console


@click.command()
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
