"""Rich renderings of keys and key differences, shared by key, diff and demo."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from wcache_cli.cells import human_bytes
from wcache_cli.output import printable

if TYPE_CHECKING:  # renderings take what the key machinery made; they never need to import it
    from wcache.checkpoint.manifest import TensorDigest
    from wcache.key.cache_key import KeyFile
    from wcache.key.diff import KeyDiff
    from wcache.key.fingerprint import FingerprintStats

DIGEST_CHARS = 16


def short(digest: str) -> str:
    return digest[:DIGEST_CHARS] if len(digest) > DIGEST_CHARS else digest


def plan_summary(plan: dict[str, Any]) -> str:
    quant = "no quantization" if plan["quantization"] == "none" else f"{plan['quantization']} weights"
    return f"tp {plan['tp_size']} rank {plan['tp_rank']} · {plan['dtype']} · {quant} · {plan['layout']} layout"


def stats_line(stats: FingerprintStats) -> str:
    hashed = stats.shards_hashed
    rate = ""
    if stats.bytes_hashed and stats.seconds > 0:
        rate = f" at {stats.bytes_hashed / stats.seconds / 1e9:.2f} GB/s"
    return (
        f"{stats.num_shards} shard(s): {stats.shards_from_store} from the digest store, {hashed} hashed "
        f"({human_bytes(stats.bytes_hashed)}{rate}) in {stats.seconds * 1000:.0f} ms"
    )


def key_table(key_file: KeyFile) -> RenderableType:
    table = Table(title=f"key {key_file.key.short_id}  {escape(printable(key_file.source))}", title_justify="left",
                  show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(style="cyan")
    table.add_column(style="dim")
    table.add_row("checkpoint", short(key_file.key.checkpoint),
                  f"Merkle root of {len(key_file.manifest)} tensors, {human_bytes(key_file.total_bytes)}")
    table.add_row("config", short(key_file.key.config), "config.json without name and dtype fields")
    named = [f.name for f in key_file.companions if f.name != "config.json"]
    table.add_row("tokenizer", short(key_file.key.tokenizer),
                  escape(printable(", ".join(named))) if named else "no tokenizer or generation config file")
    table.add_row("plan", short(key_file.key.plan), plan_summary(key_file.plan.to_json()))
    table.add_row("format", str(key_file.key.format), "processing code version")
    parts: list[RenderableType] = [table]
    if key_file.stats is not None:
        parts.append(Text(stats_line(key_file.stats), style="dim"))
    return Group(*parts)


VERDICT_STYLE = {"matches": "green", "differs": "red", "unknown": "yellow"}


def provenance_table(report: dict[str, Any]) -> RenderableType:
    """Each file's verdict (a provenance report's JSON form) and a line for the whole checkpoint."""
    table = Table(title="provenance", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column()
    table.add_column()
    table.add_column(style="dim")
    for f in report["files"]:
        detail = f"sha256 {short(f['sha256'])}" if f["verdict"] == "matches" and f["sha256"] else f["why"]
        if f["verdict"] == "differs":
            detail = f"sha256 {short(f['sha256'])}, expected {short(f['expected'])}"
        style = VERDICT_STYLE[f["verdict"]]
        table.add_row(escape(printable(f["name"])), f"[{style}]{f['verdict']}[/]", escape(detail))
    counts = report["counts"]
    summary = Text(f"{report['verdict']}: {counts['matches']} match, {counts['differs']} differ, "
                   f"{counts['unknown']} unknown", style=VERDICT_STYLE[report["verdict"]])
    return Group(table, summary)


def tensors_table(entries: tuple[TensorDigest, ...], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("tensor")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("bytes", justify="right")
    table.add_column("digest", style="cyan")
    for e in entries:
        table.add_row(escape(e.name), e.dtype, str(list(e.shape)), f"{e.nbytes:,}", short(e.digest))
    return table


def diff_renderable(diff: KeyDiff, a: KeyFile, b: KeyFile) -> RenderableType:
    if diff.identical:
        return Text(f"Same key {a.key.short_id}: both hold the same processed weights.", style="green")
    parts: list[RenderableType] = [
        Text(f"Keys differ: {a.key.short_id} (A) vs {b.key.short_id} (B)", style="bold red"),
        Text(f"A: {printable(a.source)}\nB: {printable(b.source)}", style="dim"),
    ]
    fields = Table(title="differing fields", title_justify="left")
    fields.add_column("field")
    fields.add_column("A", style="cyan")
    fields.add_column("B", style="magenta")
    for change in diff.fields:
        fields.add_row(change.name, short(str(change.a)), short(str(change.b)))
    parts.append(fields)
    for title, changes in (("plan", diff.plan), ("config", diff.config), ("tokenizer file", diff.tokenizer)):
        if changes:
            table = Table(title=f"{title} entries that differ", title_justify="left")
            table.add_column("entry")
            table.add_column("A", style="cyan")
            table.add_column("B", style="magenta")
            for c in changes:
                table.add_row(escape(c.name), escape(repr(c.a)), escape(repr(c.b)))
            parts.append(table)
    if diff.changed:
        table = Table(title=f"changed tensors ({len(diff.changed)})", title_justify="left")
        table.add_column("tensor")
        table.add_column("what")
        table.add_column("A dtype/shape")
        table.add_column("B dtype/shape")
        for t in diff.changed:
            table.add_row(escape(t.name), t.what, f"{t.a.dtype} {list(t.a.shape)}", f"{t.b.dtype} {list(t.b.shape)}")
        parts.append(table)
    if diff.added:
        parts.append(tensors_table(diff.added, f"tensors only in B ({len(diff.added)})"))
    if diff.removed:
        parts.append(tensors_table(diff.removed, f"tensors only in A ({len(diff.removed)})"))
    return Group(*parts)


def diff_json(diff: KeyDiff, a: KeyFile, b: KeyFile) -> dict[str, Any]:
    def values(changes: tuple[Any, ...]) -> list[dict[str, Any]]:
        return [{"name": c.name, "a": c.a, "b": c.b} for c in changes]

    return {
        "identical": diff.identical,
        "a": {"id": a.key.short_id, "source": a.source},
        "b": {"id": b.key.short_id, "source": b.source},
        "fields": values(diff.fields),
        "plan": values(diff.plan),
        "config": values(diff.config),
        "tokenizer": values(diff.tokenizer),
        "tensors": {
            "changed": [
                {"name": c.name, "what": c.what.split(", "), "a": c.a.to_wire(), "b": c.b.to_wire()}
                for c in diff.changed
            ],
            "added": [e.to_wire() for e in diff.added],
            "removed": [e.to_wire() for e in diff.removed],
        },
    }
