"""`wcache verify`: prove that cached weights are the checkpoint's weights (tokens and content)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from wcache.errors import EXIT_DIFFERENCE, BadInputError
from wcache.integrations.registry import ENGINES

from wcache_cli import choices
from wcache_cli.output import out
from wcache_cli.params import (
    DaemonOpt,
    DeviceOpt,
    ExpectedOpt,
    JsonOpt,
    MaxNewTokensOpt,
    RankOpt,
    RunDirOpt,
    TpOpt,
    TrustDaemonOpt,
    run_dir_or_default,
)

# Here, not in params: only verify takes --engine, and the registry's imports would cost every command.
Engine = StrEnum("Engine", {name: name for name in ENGINES})  # type: ignore[misc]
DEFAULT_ENGINE = Engine(ENGINES[0])


def _read_prompts(path: Path) -> list[str]:
    from wcache.bounded_read import read_named_text, unreadable_why

    try:
        lines = read_named_text(path).splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"{path} cannot be read as a prompts file ({unreadable_why(exc)}).") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise BadInputError(f"{path} holds no prompts (one per line).")
    return prompts


ServedModelArg = Annotated[
    str,
    typer.Argument(help="Model directory, .safetensors file, Hugging Face repo id (Org/Name[@revision]) in the local "
                   "Hugging Face cache, or the URL (http://HOST:PORT) of an engine `wcache attach --serve` runs.",
                   show_default=False),
]


def verify(
    model: ServedModelArg,
    greedy: Annotated[
        bool, typer.Option("--greedy", help="Compare greedy tokens of a cached engine and a disk engine.")
    ] = False,
    content: Annotated[
        bool, typer.Option("--content", help="Re-hash the checkpoint and the daemon's arena against its record.")
    ] = False,
    provenance: Annotated[
        bool, typer.Option("--provenance", help="Check each file's SHA-256 against what the Hugging Face cache (or "
                           "--expected) says was published; reads only shards whose SHA-256 is not known yet.")
    ] = False,
    expected: ExpectedOpt = None,
    prompts: Annotated[
        Path | None, typer.Option("--prompts", help="A file of prompts, one per line.", show_default=False)
    ] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Built-in prompts to use.", min=1)] = 4,
    max_new_tokens: MaxNewTokensOpt = 16,
    tp: TpOpt = 1,
    rank: RankOpt = 0,
    dtype: choices.DtypeOpt = choices.DEFAULT_DTYPE,
    quantization: choices.QuantizationOpt = choices.DEFAULT_QUANTIZATION,
    plan: choices.PlanOpt = choices.DEFAULT_LAYOUT,
    device: DeviceOpt = "cpu",
    mode: choices.ModeOpt = choices.DEFAULT_MODE,
    trust_daemon: TrustDaemonOpt = False,
    daemon: DaemonOpt = None,
    run_dir: RunDirOpt = None,
    engine: Annotated[
        Engine,
        typer.Option("--engine", help="Whose engine runs both sides of --greedy: wcache's reference engine, vLLM "
                     "(load format wcache vs its default loader) or transformers (through wcache vs its own "
                     "from_pretrained). Engines are compared only with themselves: vLLM CPU 0.32 ignores Qwen3 "
                     "sliding windows, so its tokens may differ from the others' without any cache miss."),
    ] = DEFAULT_ENGINE,
    json: JsonOpt = False,
) -> None:
    """Check that a daemon serves this checkpoint's weights; exit 1 on any difference.

    --greedy runs the same prompts at temperature 0 through an engine attached to the daemon and the same
    engine loading from disk its own way (every TP rank for --tp N) and compares token ids, per prompt, to
    the first divergent position. --content re-hashes the checkpoint without the digest store and has the
    daemon re-hash its arena, listing every differing tensor, and judges each file's SHA-256 against what was
    published. --provenance needs no daemon: each shard's SHA-256 (from the digest store, else read) against
    the Hugging Face cache's record of it, or against --expected for a plain directory.

    Given an engine's URL, --greedy checks the running engine: its tokens through its own API against a disk
    engine of the checkpoint and key it says it serves (GET /v1/weights), under its own plan and cache settings.
    """
    if not greedy and not content and not provenance:
        raise BadInputError("choose what to verify: --greedy, --content, --provenance, or several.")
    if model.startswith(("http://", "https://")):
        _verify_served(model, content, engine, prompts, num_prompts, max_new_tokens, json)
        return
    # Imported here so that building the help (every command's signature) loads no verify machinery.
    from wcache.checkpoint.model_path import resolve_model_path

    checkpoint = resolve_model_path(model)
    where = run_dir_or_default(run_dir)
    document: dict[str, Any] = {}
    failed = False
    if provenance:
        from wcache.checkpoint.provenance import report
        from wcache.key.provenance import verdicts_of

        from wcache_cli.operands import key_of_checkpoint

        spec = choices.plan_from_options(tp, rank, dtype, quantization, plan)
        key_file = key_of_checkpoint(checkpoint, spec)
        if any(f.sha256 is None for f in key_file.files):  # receipts from before SHA-256 was recorded
            key_file = key_of_checkpoint(checkpoint, spec, rehash=True)
        provenance_report = report(verdicts_of(key_file.source, key_file.files, expected))
        document["provenance"] = provenance_report
        failed |= provenance_report["verdict"] == "differs"
        if not json:
            from wcache_cli.render import provenance_table

            out.print(provenance_table(provenance_report))
    if content:
        from wcache.verify import verify_content

        spec = choices.plan_from_options(tp, rank, dtype, quantization, plan)
        content_report = verify_content(checkpoint, spec, where, device, daemon, expected).to_json()
        document["content"] = content_report
        failed |= not content_report["ok"]
        if not json:
            from wcache_cli.verify_report import print_content

            print_content(content_report)
    if greedy:
        from wcache.attach_options import AttachOptions
        from wcache.verify import default_prompts, verify_greedy

        from wcache_cli.operands import check_tp_fits

        texts = _read_prompts(prompts) if prompts is not None else default_prompts(num_prompts)
        spec = choices.plan_from_options(tp, 0 if tp > 1 else rank, dtype, quantization, plan)
        check_tp_fits(checkpoint, spec)
        options = AttachOptions(mode=mode.value, trust_daemon=trust_daemon, daemon=daemon, run_dir=str(where))
        greedy_report = verify_greedy(checkpoint, spec, texts, max_new_tokens, engine.value, options=options,
                                      device=device).to_json()
        document["greedy"] = greedy_report
        failed |= not greedy_report["all_match"]
        if not json:
            from wcache_cli.verify_report import print_greedy

            print_greedy(greedy_report)
    if json:
        from wcache.verify import VerifyOutput

        out.json(VerifyOutput.from_wire({"ok": not failed, **document}))
    if failed:
        raise typer.Exit(EXIT_DIFFERENCE)


def _verify_served(url: str, content: bool, engine: Engine, prompts: Path | None, num_prompts: int,
                   max_new_tokens: int, json: bool) -> None:
    """`verify URL --greedy`: the running engine at URL against a disk engine of the checkpoint it claims."""
    from wcache.verify import default_prompts
    from wcache.verify_served import verify_served

    if content:
        raise BadInputError("--content checks a daemon against a checkpoint; give the checkpoint, not an engine URL.")
    if engine.value != DEFAULT_ENGINE.value:
        raise BadInputError("an engine URL names its engine itself (wcache's reference engine or vLLM); drop --engine.")
    texts = _read_prompts(prompts) if prompts is not None else default_prompts(num_prompts)
    report = verify_served(url, texts, max_new_tokens).to_json()
    if json:
        from wcache.verify import VerifyOutput

        out.json(VerifyOutput.from_wire({"ok": report["all_match"], "greedy": report}))
    else:
        from wcache_cli.verify_report import print_greedy

        print_greedy(report)
    if not report["all_match"]:
        raise typer.Exit(EXIT_DIFFERENCE)
