"""``sssd calibrate``: fit the drafter's parameters and calibration curves by replay."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sssd.cli import command


@command(
    "calibrate",
    help="Grid-search the drafter's parameters and fit calibration curves by replaying "
    "ground-truth outputs (paper 3.1.3); writes one parameter file + plots.",
)
def setup(p: argparse.ArgumentParser):
    from sssd import _core
    from sssd.calibration.grid import GridAxes
    from sssd.commands import _args

    axes = GridAxes()
    budget = _args.int_range(1, int(_core.MAX_BUDGET))
    p.add_argument(
        "groundtruth", nargs="+", type=_args.regular_file, help="ground-truth JSONL files (from `sssd groundtruth`)"
    )
    p.add_argument(
        "--datastore",
        default="default",
        type=_args.datastore("default"),
        help="datastore directory or .sssd.zst archive ('default': the default datastore)",
    )
    p.add_argument(
        "-o",
        "--output",
        default="calibration.json",
        type=_args.output_file,
        help="parameter file to write (plots are written beside it)",
    )
    p.add_argument(
        "--split",
        choices=("dev", "all"),
        default="dev",
        help="which part of each file to use: 'dev' keeps evaluation data out of calibration",
    )
    p.add_argument("--limit", type=_args.int_range(0), default=0, help="at most this many examples per file (0: all)")
    p.add_argument(
        "--budgets", type=budget, nargs="+", default=[4, 8, 16, 32, 64], help="draft budgets to calibrate for"
    )
    p.add_argument(
        "--default-budget",
        type=_args.int_range(0, int(_core.MAX_BUDGET)),
        default=0,
        help="budget the file uses when none is asked (0: 32 if listed, else the largest)",
    )
    p.add_argument("--workers", type=_args.int_range(0), default=0, help="replay processes (0: one per core)")
    p.add_argument(
        "--model",
        default=None,
        help="the model the ground truth came from, for the file's fingerprint (a model folder or "
        "registered name; default: the one the ground-truth files record)",
    )
    for f in GridAxes.__dataclass_fields__:
        is_int = isinstance(getattr(axes, f)[0], int)
        kind = _args.int_range(1) if is_int else _args.float_range(0.0)
        p.add_argument(
            "--" + f.replace("_", "-"),
            type=kind,
            nargs="+",
            default=list(getattr(axes, f)),
            metavar="V",
            help=f"grid values for {f}",
        )
    p.add_argument(
        "--draft",
        action="append",
        default=[],
        metavar="SOURCE",
        help="also fit the merge discount of this draft source beside retrieval (repeatable): "
        "model:NAME, a draft model (a name or folder with the target's tokenizer), or recent, the "
        "other requests' recent outputs (replayed 8 requests at a time, in the files' order, so that "
        "each request sees the outputs of the ones before it); replays the development split once with "
        "the source and scores every discount of the grid on the same steps (calibration/hybrid.py)",
    )
    p.add_argument(
        "--draft-scales",
        type=_args.float_range(0.0, lo_open=True),
        nargs="+",
        default=None,
        metavar="V",
        help="grid of the draft source's discount scale (default: 0.25 0.5 1 2 4)",
    )
    p.add_argument(
        "--draft-decays",
        type=_args.float_range(0.0, lo_open=True),
        nargs="+",
        default=None,
        metavar="V",
        help="grid of the draft source's depth decay (default: 0.8 1)",
    )
    p.add_argument(
        "--draft-limit",
        type=_args.int_range(0),
        default=32,
        help="examples the draft-model fit replays (0: all; each step runs the draft model); the "
        "recent-outputs fit replays all of them",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")

    def run(args: argparse.Namespace) -> int:
        from tqdm import tqdm

        from sssd.calibration.ground_truth import load_groundtruth
        from sssd.calibration.run import calibrate, save
        from sssd.drafter import resolve_datastore

        axes = _grid(args)  # every grid value checked before anything loads
        drafts = _draft_specs(args.draft)
        datastore = resolve_datastore(_args.default_datastore() if args.datastore == "default" else args.datastore)
        tokenizer = datastore.load_tokenizer()  # checked against the identity its manifest records
        examples, sources, models = [], [], []
        for path in args.groundtruth:
            header, items = load_groundtruth(path, tokenizer=tokenizer)
            models.append(header.get("model"))
            if args.split == "dev":
                from sssd.calibration.datasets import split

                items = split(items, "dev")
            if args.limit:
                items = items[: args.limit]
            examples += items
            sources.append(
                {
                    "path": str(Path(path).resolve()),
                    "dataset": header.get("dataset"),
                    "model": header.get("model"),
                    "examples": len(items),
                    "split": args.split,
                }
            )
        if not examples:
            raise ValueError("no examples after the split: give more ground truth (or --split all)")
        n_trials = axes.size() * len(set(args.budgets))
        print(
            f"calibrating on {len(examples)} examples ({sum(len(e.output) for e in examples):,} output tokens) "
            f"from {len(sources)} files: {n_trials} replays in the grid, then calibration",
            file=sys.stderr,
        )
        bars: dict[str, tqdm] = {}

        def progress(stage: str, done: int, total: int) -> None:
            bar = bars.get(stage) or bars.setdefault(
                stage, tqdm(total=total, desc=stage, unit="replay", file=sys.stderr)
            )
            bar.update(done - bar.n)
            if done == total:
                bar.close()

        fingerprint = _fingerprint(datastore, tokenizer, args.model, models)  # before the long run: it may warn
        needs_target = any(kind == "model" for kind, _ in drafts)
        target = _target_model(args.model, models) if needs_target else None  # before the long run: it may refuse
        result = calibrate(examples, datastore, args.budgets, axes, args.default_budget or None, args.workers, progress)
        for kind, name in drafts:
            chosen = examples[: args.draft_limit or None] if kind == "model" else examples
            fit = _fit_draft(kind, name, target, chosen, datastore, result, args)
            result.sources[fit.source] = fit.to_dict()
            print(
                f"{fit.source}: discount scale {fit.best.scale:g}, depth decay {fit.best.depth_decay:g} at budget "
                f"{fit.budget}: estimated MAT {fit.best_mat:.3f} (its default discount {fit.reference_mat:.3f}, "
                f"retrieval alone at the same steps {fit.retrieval_mat:.3f}; {fit.steps} steps, {fit.seconds:.0f} s)",
                file=sys.stderr,
            )
        from sssd.paths import portable

        provenance = portable(
            {
                "datastore": {
                    "path": str(datastore.path),
                    "fingerprint": datastore.manifest.get("fingerprint"),
                    "tokenizer": datastore.manifest.get("tokenizer"),
                },
                "groundtruth": sources,
            }
        )
        written = save(result, Path(args.output), provenance, fingerprint)
        print(f"{'budget':>6} {'default':>8} {'grid best':>9} {'+ curves':>9}  chosen")
        for b in result.budgets:
            best, cal = result.best[b].mat, result.calibrated[b].mat
            print(
                f"{b:>6} {result.baseline[b].mat:8.3f} {best:9.3f} {cal:9.3f}  {'calibrated' if cal > best else 'uncalibrated'}"
            )
        print(
            "wrote " + ", ".join(str(p) for p in written) + f" ({result.seconds:.0f} s); calibrated for datastore "
            f"{fingerprint.datastore}, tokenizer {str(fingerprint.tokenizer)[:12]}, model {fingerprint.model_name} "
            f"({fingerprint.model or 'identity unknown: not checked'})"
        )
        return 0

    return run


def _draft_specs(specs: list[str]) -> list[tuple[str, str]]:
    """The `--draft` specs as (kind, argument): ("model", name or folder) or ("recent", "")
    (ValueError for any other source)."""
    from sssd.sources import parse_spec

    out = []
    for spec in specs:
        kind = parse_spec(spec)
        if not isinstance(kind, tuple) or kind[0] not in ("model", "recent"):
            raise ValueError(
                f"argument --draft: {spec!r}: only draft models (model:<name or folder>) and the recent "
                f"outputs (recent) are fitted here; retrieval is what the rest of the run calibrates"
            )
        if kind not in out:
            out.append(kind)
    return out


def _target_model(model: str | None, headers: list):
    """The target's model folder: `--model`, else the one every ground-truth file records (ValueError if
    neither identifies one: a draft model is checked against the target's tokenizer)."""
    from sssd.models import resolve_model

    if model is None:
        recorded = {m.get("registry") or m.get("path") or m.get("name") for m in headers if isinstance(m, dict)}
        recorded.discard(None)
        if len(recorded) != 1:
            raise ValueError(
                "--draft needs the target model: give --model (the ground-truth files record "
                f"{len(recorded) or 'no'} models)"
            )
        model = recorded.pop()
    return resolve_model(str(model))


def _fit_draft(kind: str, name: str, target, examples, datastore, result, args):
    """Fits one draft source's discount at the run's default budget (calibration/hybrid.py), with progress:
    a draft model (kind "model") or the recent outputs (kind "recent")."""
    from tqdm import tqdm

    from sssd.calibration.hybrid import DEFAULT_DECAYS, DEFAULT_SCALES, discount_grid, fit_source_discount

    budget = result.default_budget
    batch = 8
    if kind == "recent":
        from sssd.recent_outputs import RecentOutputs

        source, vocab_size = RecentOutputs(), None
    else:
        from sssd.serving.drafting.model_drafter import ModelDrafter

        longest = max(len(e.prompt) + len(e.output) for e in examples)
        source = ModelDrafter(name, target=target, slots=batch, capacity=longest + 2 * budget + 2, threads=None)
        vocab_size = source.backend.info.vocab_size
    grid = discount_grid(source.discount, args.draft_scales or DEFAULT_SCALES, args.draft_decays or DEFAULT_DECAYS)
    bar = tqdm(
        total=sum(len(e.output) for e in examples),
        desc=f"fitting {source.calibration_key}",
        unit="tok",
        file=sys.stderr,
    )

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    try:
        return fit_source_discount(
            examples,
            datastore,
            result.config(budget),
            source,
            budget,
            grid,
            batch_size=batch,
            key=source.calibration_key,
            vocab_size=vocab_size,
            progress=progress,
        )
    finally:
        bar.close()


def _fingerprint(datastore, tokenizer, model: str | None, headers: list):
    """What the parameter file is calibrated for: the datastore's content fingerprint, the tokenizer's
    sha256, and the model (`--model`, else the one every ground-truth file records: its registered name
    or folder). A model that cannot be identified is left out of the fingerprint (not checked), with a note."""
    from sssd.calibration_file import Fingerprint, datastore_identity, model_fingerprint

    ds_fp, tok = datastore_identity(datastore)
    tok = tok or (tokenizer.sha256 if tokenizer is not None else None)
    if model is not None:
        name, model_fp = model_fingerprint(model)
        if model_fp is None:
            raise ValueError(f"--model {model}: not a model folder (with config.json) nor a registered model")
        return Fingerprint(ds_fp, tok, model_fp, name)
    recorded = (m.get("registry") or m.get("path") or m.get("name") for m in headers if isinstance(m, dict))
    named = {m for m in recorded if isinstance(m, str)}
    if len(named) != 1:
        print(
            f"note: the ground-truth files record {len(named) or 'no'} models ({', '.join(sorted(named)) or '-'}); "
            "the fingerprint leaves the model out (give --model to record it)",
            file=sys.stderr,
        )
        return Fingerprint(ds_fp, tok)
    model = named.pop()
    name, model_fp = model_fingerprint(model)
    if model_fp is None:
        print(
            f"note: cannot identify the ground truth's model {model} (no such folder or registered model); "
            "the fingerprint leaves the model out (give --model to record it)",
            file=sys.stderr,
        )
    return Fingerprint(ds_fp, tok, model_fp, name)


def _grid(args: argparse.Namespace):
    """The GridAxes of the arguments, each value checked by building a drafter config with it.

    Raises:
        ValueError: "argument --FLAG: ..." for the first value the drafter refuses.
    """
    from sssd.calibration.grid import GridAxes
    from sssd.config import DrafterConfig

    values = {f: tuple(dict.fromkeys(getattr(args, f))) for f in GridAxes.__dataclass_fields__}
    first = {f: v[:1] for f, v in GridAxes().__dict__.items()}  # known good: each value is tried alone
    for f, vs in values.items():
        for v in vs:
            try:
                one = GridAxes(**dict(first, **{f: (v,)}))
                (
                    one.query_points(DrafterConfig())
                    + one.discount_points(DrafterConfig())
                    + one.copy_points(DrafterConfig())
                )
            except ValueError as e:
                raise ValueError(f"argument --{f.replace('_', '-')}: {v} is refused: {e}") from None
    return GridAxes(**values)
