"""`pyllama-spec chat`: the interactive chat loop, its prefill progress bar and its /commands."""

from __future__ import annotations

import click
from rich.console import Console

from pyllama_spec.cli.options import (
    ModelCommand,
    _load_engine_or_exit,
    _sampling,
    _speculative_mode,
    console,
    footer,
    model_options,
)


class _PrefillProgress:
    """A rich progress bar for image encoding and long prefills, on a terminal only."""

    def __init__(self, con: Console, min_rows: int = 256) -> None:
        self.console = con
        self.min_rows = min_rows
        self.bar = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage == "cache":  # the rows reused from the cache: not decoded, no bar
            return
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


CHAT_HELP = """[bold]commands[/bold]
  /image PATH   attach an image to the next message (or write @path/to/img.png in a message)
  /stats        this session's numbers
  /reset        clear the conversation and both caches
  /save FILE    write the transcript (JSON, images by path)
  /help         this help
  /quit         leave (Ctrl-D too); Ctrl-C stops a reply and keeps what was said"""


@click.command(cls=ModelCommand)
@model_options
@click.option("--system", default=None, help="system message")
def chat(system, **o) -> None:
    """Interactive multi-turn chat with images; the answer streams as it is accepted (no -m: the embedded pair).

    In the chat, attach an image to your next message with /image PATH or by writing @path/to/img.png in
    it (the model needs --mmproj); /help lists the other commands (/stats, /reset, /save FILE, /quit)."""
    from pyllama_spec.errors import PyllamaError
    from pyllama_spec.serving.conversation import Conversation

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
                if conv.last_turn_kept:
                    console.print("\n[yellow](reply interrupted: what was said is kept)[/yellow]")
                else:
                    console.print("\n[yellow](interrupted before the reply began)[/yellow]")
                    _say_not_kept(conv)
            except (PyllamaError, ValueError, OSError) as e:
                progress.close()
                console.print(f"\n[red]{e}[/red]")
                if not conv.last_turn_kept:
                    _say_not_kept(conv)


def _say_not_kept(conv) -> None:
    """After a turn that said nothing, the conversation is as it was before it: say so, and name the
    images the turn took with it (the next message no longer carries them)."""
    images = f", nor its image {', '.join(conv.dropped_images)}: attach it again with /image to retry" \
        if conv.dropped_images else ""
    console.print(f"[yellow](the message was not kept{images})[/yellow]")


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
        console.print(f"turns {s.generations} · generated {s.generated_tokens} tokens · {s.tokens_per_second:.1f} tok/s "
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
