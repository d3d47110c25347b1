"""`pyllama-spec demo`: one turn with a large image through DFlash, checked against the target alone."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from pyllama_spec.cli.options import console, err_console
from pyllama_spec.speculative.positions import DRAFT_POSITION_MODES


@click.command()
@click.option("--image-size", default=672, show_default=True, help="side of the drawn test image, pixels")
@click.option("-ub", "--ubatch", "n_ubatch", default=64, show_default=True, help="n_batch = n_ubatch of both contexts")
@click.option("--draft-max", default=7, show_default=True)
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--draft-positions", type=click.Choice(DRAFT_POSITION_MODES), default="target", show_default=True)
@click.option("--threads", type=int, default=None, help="CPU threads (default: all cores)")
@click.option("--random-tiny", is_flag=True,
              help="random tiny models made locally instead of the embedded trained pair "
                   "(they accept, but write random bytes)")
@click.option("--window", default=32, show_default=True, help="the random tiny draft's sliding window (--random-tiny)")
@click.option("--reading", "reading_text", default=None, metavar="TEXT",
              help="the reading world instead: a picture of TEXT (up to 16 characters) read out by its target, "
                   "drafted blind and seeing, side by side")
def demo(image_size, n_ubatch, draft_max, max_tokens, draft_positions, threads, random_tiny, window,
         reading_text) -> None:
    """One turn with a large image through DFlash, on the embedded trained pair (or --random-tiny,
    or --reading TEXT)."""
    from pyllama_spec import MEDIA_MARKER
    from pyllama_spec import native_build as nb
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
    if reading_text is not None:
        if random_tiny:
            raise click.UsageError("--reading runs the reading world's files: leave out --random-tiny")
        # the reading world's drafts do best at 3 (MTP guesses from its own guesses); a given --draft-max is kept
        given = click.get_current_context().get_parameter_source("draft_max") != click.core.ParameterSource.DEFAULT
        _reading(reading_text, max_tokens=max_tokens, threads=threads, draft_max=draft_max if given else 3)
        return
    from pyllama_spec.embedded import PROMPT, draw_demo_image, embedded_models
    from pyllama_spec.serving.engine import load

    image = draw_demo_image(image_size)
    if random_tiny:
        from pyllama_spec.devtools import tiny  # a developer's option: models written here, for tests

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
    blocks = [e.pos for e in trace if e.call == "draft"]
    table = Table(title="DFlash on a vision target", show_header=False)
    table.add_row("prompt", f"{s.prompt_tokens} cache rows over {s.prompt_positions} positions (one image)")
    table.add_row("pinned image rows skipped", str(sum(e.n_rows for e in trace if e.call == "skip")))
    table.add_row("rows injected into the draft", str(sum(e.n_rows for e in trace if e.call == "inject")))
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


def _reading(text: str, *, max_tokens: int, threads: int | None, draft_max: int) -> None:
    """The reading world (``pyllama_spec.devtools.reading``): its target reads a picture of ``text``
    out and goes on; each drafting method runs blind and seeing, and every output is checked
    against the target alone's."""
    from rich.markup import escape

    from pyllama_spec.devtools import reading  # a world made for showing drafting that sees
    from pyllama_spec.serving.engine import load

    try:
        picture = reading.render(text)
        files = reading.models()
    except (ValueError, FileNotFoundError) as e:
        err_console.print(f"[red]{e}[/red]")
        sys.exit(2)
    read_len = len(text) + 1  # one byte, one token: the read-out and its newline
    common = dict(n_threads=threads, flash_attn=False)
    t, mm = files["target"], files["mmproj"]
    vlm = dict(draft=files["draft_vlm"], spec_type="draft-simple", draft_max=draft_max)
    eagle3 = dict(draft=files["eagle3"], spec_type="draft-eagle3", draft_max=draft_max)
    dflash = dict(draft=files["dflash"], spec_type="draft-dflash", draft_max=draft_max)
    methods = [
        ("target only", "", dict(spec_type="none"), None),
        ("draft model", "blind (text only)", vlm, None),
        ("draft model", "seeing (its own projector)", dict(vlm, mmproj_draft=files["draft_vlm_mmproj"]), None),
        ("MTP head", "blind (picture rows left out)", dict(spec_type="draft-mtp", draft_max=draft_max), False),
        ("MTP head", "seeing (picture rows in its cache)", dict(spec_type="draft-mtp", draft_max=draft_max), True),
        ("EAGLE3", "blind (picture rows left out)", eagle3, False),
        ("EAGLE3", "seeing (picture rows in its cache)", eagle3, True),
        ("DFlash", "blind (target positions)", dict(dflash, draft_positions="target"), None),
        ("DFlash", "seeing (sequential positions)", dict(dflash, draft_positions="sequential"), None),
    ]
    console.print(f"[bold]reading world[/bold] {t.parent}: a tiny qwen35 target that reads a picture of text "
                  f"out, then writes code; the picture: {escape(repr(text))}, {picture.width}x{picture.height}, "
                  f"draft max {draft_max}")
    table = Table(title="blind and seeing drafts on the read-out")
    for col in ("method", "draft", "read-out acceptance", "overall acceptance", "tokens/s", "same as target only"):
        table.add_column(col)
    expected = None
    for name, how, kw, rows_in_cache in methods:
        with console.status(f"{name} {how} ..."), load(t, mmproj=mm, **common, **kw) as eng:
            if rows_in_cache is not None:
                eng.drafter.writes_media = rows_in_cache
            out, texts, accepted_read, drafted_read, last = [], [], 0, 0, None
            for piece in eng.stream(reading.PROMPT, images=[picture], max_tokens=max_tokens, temperature=0.0):
                if len(out) < read_len:
                    accepted_read, drafted_read = accepted_read + piece.from_draft, drafted_read + piece.drafted
                out.extend(piece.tokens)
                texts.append(piece.text)
                last = piece
        if expected is None:
            expected = out
            console.print("[bold]the target's answer:[/bold]")
            console.print("".join(texts), markup=False, highlight=False)
        s = last.stats
        same = "" if name == "target only" else ("yes" if out == expected else "[red]NO[/red]")
        table.add_row(name, how, f"{accepted_read / drafted_read:.2f}" if drafted_read else "-",
                      f"{s.acceptance_rate:.2f}" if s.drafted else "-", f"{s.tokens_per_second:.0f}", same)
        if out != expected:
            console.print(table)
            sys.exit(1)
    console.print(table)
