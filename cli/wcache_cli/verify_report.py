"""How `wcache verify` (and the demo, which runs it) shows its reports on a terminal."""

from __future__ import annotations

from typing import Any

from wcache_cli.output import out


def print_content(report: dict[str, Any]) -> None:
    source, arena = report["source"], report["arena"]
    if source["changed"] or source["added"] or source["removed"]:
        out.print(f"[red]SOURCE DIFFERS[/] daemon {report['daemon']} was built from other bytes than the checkpoint "
                  f"on disk: changed {source['changed']}, added {source['added']}, removed {source['removed']}")
    else:
        out.print(f"[green]SOURCE OK[/] daemon {report['daemon']} recorded the same tensor digests as a fresh hash")
    if arena["changed"]:
        out.print(f"[red]ARENA MODIFIED[/] {len(arena['changed'])} of {arena['checked']} processed tensors no "
                  f"longer match what was built: {', '.join(arena['changed'])}")
    else:
        out.print(f"[green]ARENA OK[/] all {arena['checked']} processed tensors match their build digests")
    from wcache_cli.render import provenance_table

    out.print(provenance_table(report["provenance"]))


def print_greedy(report: dict[str, Any]) -> None:
    from rich.table import Table

    attach = report["attach"]  # a GreedyAttach: its head is what every engine tells
    source = f" from {attach['daemon']}" if attach.get("daemon") else ""
    mode = f" ({attach['mode']})" if attach.get("mode") else ""
    out.print(f"cached {attach['engine']} engine: {attach['outcome']}{source}{mode}")
    table = Table(title="greedy tokens, cached vs disk", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("prompt")
    table.add_column("result")
    for r in report["prompts"]:
        verdict = "[green]match[/]" if r["match"] else f"[red]diverges at token {r['first_divergence']}[/]"
        preview = r["prompt"] if len(r["prompt"]) <= 48 else r["prompt"][:45] + "…"
        table.add_row(str(r["index"]), preview, verdict)
    out.print(table)
    if report.get("problem"):
        out.print(f"[red]MISMATCH[/] {report['problem']}")
    elif report["all_match"]:
        out.print("[green]VERIFIED[/] cached and disk weights give the same greedy tokens")
    else:
        out.print("[red]MISMATCH[/] the cached weights are not this checkpoint's weights")
