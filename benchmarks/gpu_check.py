"""The prepared device run: is the verifier lossless on a GPU, and what does verification cost there?

One command on a machine with a GPU (benchmarks/gpu_check.sh builds and installs SSSD first):

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json

1. lossless: small models of real architectures (SmolLM2-135M's Llama shape, Qwen2.5-0.5B's Qwen2
   shape) with random weights, in float32, through the engine: SSSD against plain decoding at
   batch 1 and 16 (serial and async drafting), token-identical; a seeded sampled run too; the
   batch allocation (budget None) and a batch mixing greedy and seeded sampled requests. Each
   difference is explained (plain's logit margin, or the sampled draw's distance to a CDF edge).
2. profile: the forward time of a large shape (Llama-3.1-8B's config, random bf16 weights built
   on the GPU) by batch rows (1-256) and tokens per row (1-65) through our backend and attention,
   and cost(B, 1+b) / cost(B, 1) for b in {4, 16, 64}; the two grouped-query attention modes side
   by side; how long `launch` holds the CPU against the whole pass.
3. projection: the speedup per batch size predicted from the measured profile and the packaged
   calibration's replayed MAT, beside `sssd plan`'s roofline projection for the same GPU, the
   roofline's cost over the measured cost at every point, and the roofline fitted to the
   measurement.

Everything printed is also in the JSON file. `--device cpu --small` runs the same code on tiny
shapes in seconds (the test suite does, so the script cannot rot between device runs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

#: Real architectures' configs (public config.json values), built with random weights.
SMOLLM2_135M = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
QWEN25_05B = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
LLAMA31_8B = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_scaling={
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    bos_token_id=128000,
    eos_token_id=128001,
)
#: --small: the same code on shapes a CPU runs in seconds.
TINY_LLAMA = dict(
    SMOLLM2_135M,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=93,
    max_position_embeddings=512,
)
TINY_QWEN = dict(
    QWEN25_05B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=93,
    max_position_embeddings=512,
)
TINY_PROFILE = dict(
    LLAMA31_8B,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=16384,
    bos_token_id=2,
    eos_token_id=1,
)


class Report:
    """Prints as it goes and keeps everything for the JSON file."""

    def __init__(self, path: Path):
        self.path, self.data, self.t0 = path, {}, time.perf_counter()

    def say(self, msg: str = "") -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)
        self.data.setdefault("log", []).append(msg)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def environment(device: torch.device) -> dict:
    import sssd
    from sssd.serving.planning.profile import cpu_model

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("SSSD_COMMIT"),
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "sssd": sssd.build_info(),
    }
    import transformers

    env["transformers"] = transformers.__version__
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(
            gpu=p.name,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            sms=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
        )
    return env


# -- 1. lossless -----------------------------------------------------------------------------------


def model_folder(config: dict, folder: Path, seed: int = 0) -> Path:
    """A model folder of `config`'s architecture with random weights (sharpened: ties in greedy
    decoding would make token equality depend on rounding) and a word-level tokenizer."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import tokenizer_files
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg_obj, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer_files(folder, config["vocab_size"])
    return folder


def prompts(vocab: int, n: int, rng: np.random.Generator) -> list[list[int]]:
    """Prompts of words with repeated phrases (so the request's own text drafts something)."""
    out = []
    for _ in range(n):
        phrases = [rng.integers(3, vocab, int(rng.integers(3, 9))).tolist() for _ in range(4)]
        p: list[int] = []
        while len(p) < int(rng.integers(24, 72)):
            p += phrases[int(rng.integers(len(phrases)))]
        out.append(p)
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def last_logits(folder: Path, device: torch.device, prefix: list[int]) -> tuple[torch.Tensor, float]:
    """Plain transformers' float32 logits after `prefix` (one pass of the prefix alone), and the
    largest change of any of them when the same prefix is row 0 of a 16-row pass (the other rows
    random tokens): how much this device's kernels of another shape round the same logits apart."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    ids = torch.tensor([prefix], device=device)
    others = torch.randint(0, model.config.vocab_size, (15, len(prefix)), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        alone = model(ids).logits[0, -1].float()
        wide = model(torch.cat([ids, others.to(device)])).logits[0, -1].float()
    return alone, float((alone - wide).abs().max())


def margin_at(folder: Path, device: torch.device, prefix: list[int], chosen: int | None = None) -> dict:
    """How close to a tie a divergence was: after `prefix`, plain transformers' (float32) top-1 minus
    top-2 logit, the rank of the token SSSD chose and its gap to the top, beside the logits' scale
    (max |logit|), so a rounding tie (a gap ~1e-6 of the scale) reads apart from a wrong token."""
    logits, shape_delta = last_logits(folder, device, prefix)
    top = logits.topk(2)
    out = {
        "plain_margin": float(top.values[0] - top.values[1]),
        "top2": [int(t) for t in top.indices],
        "logit_scale": float(logits.abs().max()),
        "shape_delta": shape_delta,
    }
    if chosen is not None:
        out["chosen"] = int(chosen)
        out["chosen_rank"] = int((logits > logits[chosen]).sum())
        out["chosen_gap"] = float(top.values[0] - logits[chosen])
        out["relative_gap"] = out["chosen_gap"] / max(out["logit_scale"], 1e-30)
    return out


def sampled_margin_at(folder: Path, device: torch.device, prefix: list[int], index: int, params, chosen: int) -> dict:
    """How close to a tie a sampled divergence was. Plain decoding draws output token `index` of a
    seeded request by inverse CDF with the `index`-th uniform u of the request's generator
    (serving/verify/acceptance.py): the token whose CDF interval holds u. Recomputed here from plain
    transformers' float32 logits after `prefix`: the token that draw gives (it must be plain's),
    the CDF mass between u and SSSD's token's interval, and the most that mass could move if every
    logit moved by half the greedy tie rule's gap (TIE_RELATIVE_GAP of the logits' scale): a draw
    that close to the edge is a rounding tie; one farther is a wrong distribution."""
    from sssd.serving.verify.acceptance import processed_probs

    logits, shape_delta = last_logits(folder, device, prefix)
    one = torch.ones(1, device=device)
    probs = processed_probs(
        logits[None], one * params.temperature, torch.full((1,), params.top_k, device=device), one * params.top_p
    )[0]
    cdf = torch.cumsum(probs.double(), dim=-1).cpu()
    gen = torch.Generator(device="cpu").manual_seed(params.seed % 2**64)
    u = [float(torch.rand(1, generator=gen, dtype=torch.float64)) for _ in range(index + 1)][-1]
    x = u * float(cdf[-1])
    token = int(torch.searchsorted(cdf, torch.tensor([x], dtype=torch.float64))[0])
    lo, hi = (float(cdf[chosen - 1]) if chosen > 0 else 0.0), float(cdf[chosen])
    to_chosen = max(lo - x, x - hi, 0.0)  # CDF mass between the draw and SSSD's token
    edge = lo if x < lo else hi  # the CDF value at the edge the draw would have to cross
    scale = float(logits.abs().max())
    # moving every logit by at most d moves a CDF value C by at most about C (1 - C) 2 d / T
    reach = edge * (1 - edge) * TIE_RELATIVE_GAP * scale / params.temperature
    return {
        "sampled": True,
        "uniform": u,
        "redrawn": token,
        "chosen": int(chosen),
        "p_redrawn": float(probs[token]),
        "p_chosen": float(probs[chosen]),
        "mass_to_chosen": to_chosen,
        "tie_reach": reach,
        "logit_scale": scale,
        "shape_delta": shape_delta,
    }


TIE_RELATIVE_GAP = 1e-4
#: Batch sizes the profile measures and section 3 projects (up to the profile's largest).
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def is_rounding_tie(diff: dict) -> bool:
    """A divergence at a near tie: SSSD took plain's runner-up, and the two logits differ by less
    than 1e-4 of the logits' scale (float32 kernels of other shapes, a tree pass against a one-token
    pass, round sums differently by about that much). A sampled one: the seeded draw lies closer to
    SSSD's token's CDF interval than logits moved by half that gap could take it
    (sampled_margin_at). Reported as such, never hidden."""
    if diff.get("sampled"):
        return diff["mass_to_chosen"] < diff["tie_reach"]
    return diff.get("chosen_rank") == 1 and diff.get("relative_gap", 1.0) < TIE_RELATIVE_GAP


def lossless(report: Report, device: torch.device, small: bool, work: Path) -> dict:
    import sssd
    from sssd.serving.engine import EngineConfig, LLMEngine
    from sssd.serving.engine.params import SamplingParams

    archs = {
        "llama (SmolLM2-135M shape)": TINY_LLAMA if small else SMOLLM2_135M,
        "qwen2 (Qwen2.5-0.5B shape)": TINY_QWEN if small else QWEN25_05B,
    }
    n, max_tokens, budget = (8, 24, 16) if small else (16, 48, 16)
    batch_sizes = (1, 4) if small else (1, 16)
    results = {}
    for name, cfg in archs.items():
        folder = model_folder(cfg, work / cfg["model_type"])
        rng = np.random.default_rng(1)
        ps = prompts(cfg["vocab_size"], n, rng)
        greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        res: dict = {"prompts": n, "max_tokens": max_tokens, "budget": budget, "runs": {}}

        def run(label: str, draft, batch: int, params=greedy, datastore=None, **cfg_kw):
            cfg_kw.setdefault("budget", budget)
            config = EngineConfig(max_running=batch, max_model_len=256, dtype="float32", device=str(device), **cfg_kw)
            eng = LLMEngine(folder, datastore=datastore, draft=draft, config=config)
            t0 = time.perf_counter()
            outs = eng.generate(ps, params) if batch > 1 else [eng.generate([p], params)[0] for p in ps]
            secs = time.perf_counter() - t0
            toks = [o.token_ids for o in outs]
            steps = sum(o.stats.get("steps", 0) if isinstance(o.stats, dict) else 0 for o in outs)
            acc = sum(len(t) for t in toks)
            res["runs"][label] = {
                "seconds": round(secs, 2),
                "tokens": acc,
                "steps": steps,
                "accepted_by_source": dict(eng.metrics.accepted_by_source),
                "draft_tokens": eng.metrics.num_draft_tokens,
                "budget": config.budget,
            }
            report.say(
                f"  {name} {label}: {acc} tokens in {secs:.1f} s"
                + (f", {steps} steps ({acc / max(steps, 1):.2f} tokens/step)" if steps else "")
                + (f", {eng.metrics.num_draft_tokens / max(steps, 1):.1f} draft tokens a row a step" if draft else "")
            )
            del eng
            return toks

        # a datastore from half the prompts' plain continuations: deep accepted paths, compaction
        plain = {b: run(f"plain batch {b}", [], b) for b in batch_sizes}
        corpus = []
        for p, t in zip(ps[::2], plain[batch_sizes[0]][::2]):
            corpus += p + t + [sssd.SEPARATOR]
        ds = sssd.Datastore.build(np.asarray(corpus, dtype=np.uint32), work / f"ds-{cfg['model_type']}", overwrite=True)
        checks = {}
        # the fixed budget at every batch size, then (budget None) the batch allocation with the
        # forward profile measured on this device: one budget shared across the batch by expected
        # acceptance, trees cut to each row's share, rows with none
        top = batch_sizes[-1]
        variants = [
            (b, mode, {}) for b in batch_sizes for mode in ("serial", "async") if not (mode == "async" and b == 1)
        ]
        variants += [(top, f"{mode} allocation", {"budget": None, "measure": "now"}) for mode in ("serial", "async")]

        def compare(label: str, got: list, want: list, params) -> None:
            """checks[label]: identical to plain, else every differing prompt's first difference
            explained (greedy: plain's logit margin there; sampled: the draw's CDF edge)."""
            per = params if isinstance(params, list) else [params] * len(want)
            diffs = [i for i, (x, y) in enumerate(zip(got, want)) if x != y]
            check = {"identical": not diffs, "prompts_differing": diffs}
            firsts = []
            for i in diffs:
                at = first_difference(got[i], want[i])
                chosen = got[i][at] if at < len(got[i]) else None
                prefix = ps[i] + want[i][:at]
                if per[i].temperature > 0 and chosen is not None:
                    why = sampled_margin_at(folder, device, prefix, at, per[i], chosen)
                    why["redraw_is_plains"] = why["redrawn"] == want[i][at]  # the recomputed draw holds
                else:
                    why = margin_at(folder, device, prefix, chosen)
                firsts.append({"prompt": i, "token": at, **why})
            if firsts:
                check["first"] = firsts[0]
                check["differences"] = firsts
                check["rounding_ties"] = all(is_rounding_tie(f) for f in firsts)
            checks[label] = check
            verdict = "IDENTICAL"
            if diffs:
                verdict = f"DIFFERENT in {len(diffs)} of {len(want)} prompts" + (
                    " at rounding ties only" if check["rounding_ties"] else ""
                )
                for f in firsts:
                    verdict += "\n      " + json.dumps(f)
            report.say(f"  {name} {label} vs plain: {verdict}")

        for b, mode, extra in variants:
            label = f"sssd batch {b} {mode}"
            got = run(label, ["retrieval"], b, datastore=ds, draft_mode=mode.split()[0], **extra)
            compare(label, got, plain[b], greedy)
        seeded = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=7)
        b = batch_sizes[-1]
        want = run(f"plain sampled batch {b}", [], b, params=seeded)
        got = run(f"sssd sampled batch {b}", ["retrieval"], b, params=seeded, datastore=ds)
        compare(f"sssd sampled batch {b} (seeded)", got, want, seeded)
        # greedy and seeded sampled requests in one batch, under the allocation (it scores sampled
        # rows by their measured acceptance): each request as plain decoding gives it
        mixed = [
            greedy if i % 2 == 0 else SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=i)
            for i in range(n)
        ]
        want = run(f"plain mixed batch {b}", [], b, params=mixed)
        got = run(f"sssd mixed batch {b} allocation", ["retrieval"], b, params=mixed, datastore=ds, budget=None)
        compare(f"sssd mixed greedy and sampled batch {b} allocation", got, want, mixed)
        checks["plain batch 1 vs batch 16"] = {
            "identical": plain[batch_sizes[0]] == plain[batch_sizes[-1]],
            "note": "information only: batched float32 kernels may round apart",
        }
        res["checks"] = checks
        results[name] = res
    return results


# -- 2. the verification cost profile --------------------------------------------------------------


def build_backend(config: dict, device: torch.device, slots: int, capacity: int, dtype: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sssd.serving.backends.torch_backend import TorchBackend

    cfg = dict(config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg_obj, dtype=getattr(torch, dtype))
    be = TorchBackend(model, slots=slots, capacity=capacity, dtype=dtype, device=str(device))
    with torch.no_grad():
        be.pool.kv.normal_()  # keys and values to read that are not zeros
    return be


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pass(be, rows: int, tokens: int, context: int, repeats: int, rng) -> dict:
    """Median wall seconds of one verification pass (launch + collect) over `rows` chains of
    `tokens` tokens after `context` cached ones, and how long launch alone held the CPU."""
    from sssd.serving.planning.profile import _chains
    from sssd.serving.verify.tree_batch import pack

    dev = be.device
    batch = pack(rng.integers(0, be.info.vocab_size, rows), np.full(rows, context), _chains(rows, tokens - 1))
    batch.tokens[:] = rng.integers(0, be.info.vocab_size, batch.tokens.shape)
    greedy = np.ones(rows, dtype=bool)
    be.collect(be.launch(slice(0, rows), batch, greedy))  # warm-up (kernel choice, allocations)
    walls, launches = [], []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        h = be.launch(slice(0, rows), batch, greedy)
        t1 = time.perf_counter()
        be.collect(h)
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        launches.append(t1 - t0)
    return {
        "seconds": statistics.median(walls),
        "launch_seconds": statistics.median(launches),
        "spread": (max(walls) - min(walls)) / statistics.median(walls),
    }


@contextlib.contextmanager
def callers_of_warnings(frames: int = 4):
    """Inside it, every warning shown is recorded with where it was raised and the innermost
    `frames` frames of SSSD's own code on the stack then (of the whole stack where none is ours):
    a warning names the innermost Python line, often torch's own; the callers say which of our
    lines caused it. Use inside warnings.catch_warnings(); yields the list it fills."""
    import traceback

    found: list[dict] = []
    before = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if "sssd" in Path(f.filename).parts or "serving" in Path(f.filename).parts]
        ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}: {(f.line or '').strip()}" for f in ours or stack]
        found.append(
            {"warned_at": f"{Path(filename).name}:{lineno}", "message": str(message)[:200], "callers": ours[-frames:]}
        )

    warnings.showwarning = record
    try:
        yield found
    finally:
        warnings.showwarning = before


#: What torch's set_sync_debug_mode warns as it is switched on (torch/__init__.py): not a sync.
SYNC_MODE_NOTICE = "Synchronization debug mode is a prototype feature"


def device_side(be, rows: int, tokens: int, context: int, rng) -> dict:
    """What one pass costs the GPU itself, apart from the CPU launching it: the synchronising calls
    in launch (sync debug mode), the sum of its kernels' times (torch.profiler) and the wall time of
    the pass replayed as one CUDA graph (launch costs gone). Each part reports its failure instead
    of ending the run."""
    from sssd.serving.backends import attention
    from sssd.serving.backends.torch_backend import _Sent, tree_mask
    from sssd.serving.planning.profile import _chains
    from sssd.serving.verify.tree_batch import pack

    dev = be.device
    batch = pack(rng.integers(0, be.info.vocab_size, rows), np.full(rows, context), _chains(rows, tokens - 1))
    greedy = np.ones(rows, dtype=bool)
    out: dict = {"rows": rows, "tokens": tokens}
    be.collect(be.launch(slice(0, rows), batch, greedy))
    try:
        with warnings.catch_warnings(), callers_of_warnings() as callers:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                h = be.launch(slice(0, rows), batch, greedy)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        be.collect(h)
        # enabling the mode warns once that it is a prototype: a notice from torch, no sync of ours
        syncs = [c for c in callers if SYNC_MODE_NOTICE not in c["message"]]
        out["syncs_in_launch"] = sorted({c["warned_at"] for c in syncs})
        out["syncs_in_launch_callers"] = syncs
    except Exception as e:  # noqa: BLE001
        out["syncs_in_launch"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    try:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            be.collect(be.launch(slice(0, rows), batch, greedy))
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernel_ms"] = round(sum(e.device_time for e in kernels) / 1e3, 3)
        out["kernels"] = len(kernels)
        out["kernel_ms_by_op"] = round(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3, 3)
    except Exception as e:  # noqa: BLE001
        out["kernel_ms"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    try:  # the model's forward and the argmax as one graph, over inputs already on the device
        S = batch.kv_length
        tok, pos, writes, cached, valid, anc = _Sent.send(
            dev, batch.tokens, batch.positions, batch.writes, batch.cached, batch.valid, batch.ancestors
        )
        torch.cuda.synchronize()

        def forward():
            mask = tree_mask(cached, valid, anc, S)[:, None]
            step = attention.PoolStep(be.pool, slice(0, rows), writes, S)
            hid = be.model.model(
                input_ids=tok, position_ids=pos, attention_mask=mask, use_cache=False, **{attention.STEP_KWARG: step}
            ).last_hidden_state
            return be._argmax_topk(hid.reshape(-1, hid.shape[-1]), 0)[0]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            forward()
        walls = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        out["graph_ms"] = round(statistics.median(walls[1:]) * 1e3, 3)
        del graph
    except Exception as e:  # noqa: BLE001
        out["graph_ms"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    return out


def profile(report: Report, device: torch.device, small: bool, only_rows=None) -> dict:
    from sssd.serving.backends import attention
    from sssd.serving.planning.profile import ForwardProfile

    cfg = TINY_PROFILE if small else LLAMA31_8B
    dtype = "float32" if small else "bfloat16"
    rows = tuple(only_rows) if only_rows else (1, 2, 4) if small else BATCHES
    tokens = (1, 5, 17) if small else (1, 2, 3, 5, 9, 17, 33, 65)
    context, repeats = (64, 2) if small else (512, 5)
    capacity = context + max(tokens) + 8
    t0 = time.perf_counter()
    be = build_backend(cfg, device, max(rows), capacity, dtype)
    shape = be.info.shape
    report.say(
        f"profile model: Llama-3.1-8B shape{' (tiny)' if small else ''}, {shape['params'] / 1e9:.2f}B params, "
        f"{dtype}, KV pool {be.pool.kv.numel() * be.pool.kv.element_size() / 2**30:.1f} GiB "
        f"({max(rows)} slots x {capacity}), built in {time.perf_counter() - t0:.1f} s"
    )
    rng = np.random.default_rng(0)
    grid, launch = [], []
    for r in rows:
        line = []
        for t in tokens:
            m = time_pass(be, r, t, context, repeats, rng)
            line.append(m["seconds"])
            launch.append({"rows": r, "tokens": t, **m})
        grid.append(line)
        report.say(f"  {r:>3} rows: " + "  ".join(f"{t}:{s * 1e3:.2f}" for t, s in zip(tokens, line)) + " ms")
    prof = ForwardProfile(list(rows), list(tokens), grid, context, {"kind": "measured", "model": "Llama-3.1-8B shape"})
    ratios = {}
    for r in rows:
        ratios[r] = {b: round(prof.time(r, 1 + b) / prof.time(r, 1), 3) for b in (4, 16, 64) if 1 + b <= max(tokens)}
    report.say(
        "cost(B, 1+b) / cost(B, 1): "
        + "; ".join(
            f"B={r}: " + ", ".join(f"b={b} {v:.2f}x" for b, v in ratios[r].items())
            for r in rows
            if r in (1, 16, 64, 256) or small
        )
    )
    # the grouped-query attention modes side by side (CUDA only: the CPU has one)
    modes = {}
    if device.type == "cuda":
        for r, t in ((16, 17), (64, 65), (256, 17), (256, 65)):
            if r > max(rows):
                continue
            modes[f"{r}x{t}"] = {}
            for mode in attention.CUDA_MODES:
                os.environ["SSSD_CUDA_ATTENTION"] = mode
                try:
                    modes[f"{r}x{t}"][mode] = round(time_pass(be, r, t, context, 3, rng)["seconds"] * 1e3, 3)
                except Exception as e:  # noqa: BLE001 - a mode that fails is a finding, not the end of the run
                    modes[f"{r}x{t}"][mode] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            os.environ.pop("SSSD_CUDA_ATTENTION", None)
            report.say(f"  attention modes at {r} rows x {t} tokens (ms): {modes[f'{r}x{t}']}")
    side = []
    if device.type == "cuda":  # what the GPU itself spends, apart from launching
        for r in (x for x in (1, 16, 64, 256) if x <= be.slots):  # --rows may make the pool smaller
            for t in (1, 5, 17, 65):
                side.append(device_side(be, r, t, context, rng))
                d = side[-1]
                report.say(
                    f"  {r} rows x {t} tokens: eager {prof_time(grid, rows, tokens, r, t):.2f} ms, kernels "
                    f"{d.get('kernel_ms')} ms ({d.get('kernels')}), CUDA graph {d.get('graph_ms')} ms"
                )
        syncs = {}  # each synchronising call's callers -> the points it synchronised at
        for d in side:
            for c in d.get("syncs_in_launch_callers", []):
                where = f"{c['warned_at']} from " + " <- ".join(reversed(c["callers"]))
                syncs.setdefault(where, []).append(f"{d['rows']}x{d['tokens']}")
        failed = [d["syncs_in_launch"] for d in side if isinstance(d.get("syncs_in_launch"), str)]
        report.say(
            f"  synchronising calls inside launch (sync debug mode, {len(side)} points): {len(syncs) or 'none'}"
            + (f"; the check failed at {len(failed)}: {failed[0]}" if failed else "")
        )
        for where, points in syncs.items():
            report.say(f"    {where} (at {', '.join(points)})")
    mid = next(x for x in launch if x["rows"] == rows[len(rows) // 2] and x["tokens"] == tokens[len(tokens) // 2])
    report.say(
        f"launch returns after {mid['launch_seconds'] * 1e3:.2f} ms of a {mid['seconds'] * 1e3:.2f} ms pass "
        f"({mid['rows']} rows x {mid['tokens']} tokens): the rest is the device's, for drafting to overlap"
    )
    out = {
        "model": "Llama-3.1-8B shape" + (" (tiny)" if small else ""),
        "shape": shape,
        "dtype": dtype,
        "context": context,
        "repeats": repeats,
        "profile": prof.to_dict(),
        "points": launch,
        "cost_ratio": {str(r): v for r, v in ratios.items()},
        "attention_modes": modes,
        "device_side": side,
    }
    del be
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def prof_time(grid, rows, tokens, r: int, t: int) -> float:
    return grid[list(rows).index(r)][list(tokens).index(t)] * 1e3 if r in rows and t in tokens else float("nan")


# -- 3. projection ---------------------------------------------------------------------------------


def graph_profile(measured: dict):
    """The forward-time profile of the passes replayed as CUDA graphs (what the GPU costs once
    launching is free), where the run measured them; else None."""
    from sssd.serving.planning.profile import ForwardProfile

    side = [d for d in measured.get("device_side", []) if isinstance(d.get("graph_ms"), (int, float))]
    rows = sorted({d["rows"] for d in side})
    tokens = sorted({d["tokens"] for d in side})
    if len(side) != len(rows) * len(tokens) or len(rows) < 2 or len(tokens) < 2:
        return None
    at = {(d["rows"], d["tokens"]): d["graph_ms"] / 1e3 for d in side}
    return ForwardProfile(
        rows,
        tokens,
        [[at[r, t] for t in tokens] for r in rows],
        measured["context"],
        {"kind": "measured, CUDA graph replay"},
    )


def projection(report: Report, gpu: str, measured: dict, groundtruth=None, limit: int = 20) -> dict:
    """Section 3 for the eager profile and, where measured, the CUDA-graph one; with ground-truth
    files, the batch allocation on each too."""
    from sssd.serving.planning.profile import ForwardProfile

    steps = replayed(report, groundtruth, limit) if groundtruth else None
    profiles = {"eager": (ForwardProfile.from_dict(measured["profile"]), "eager passes")}
    graph = graph_profile(measured)
    if graph is not None:
        profiles["cuda_graph"] = (graph, "passes replayed as CUDA graphs")
    out = {}
    for key, (prof, label) in profiles.items():
        out[key] = project(report, gpu, measured, prof, label)
        if key == "cuda_graph":
            out[key]["profile"] = prof.to_dict()
        if steps is not None:
            out[key]["allocation"] = allocation_projection(report, prof, steps)
    return out


def replayed(report: Report, paths, limit: int):
    """Steps of decoding recorded outputs with trees of 64 (sssd.Drafter("default")), as `sssd plan
    --groundtruth` replays them: the first `limit` examples of each file."""
    import sssd
    from sssd.calibration.allocation_replay import replay_groundtruth

    steps = replay_groundtruth(sssd.Drafter("default", budget=64), paths, limit)
    report.say(f"replayed {len(steps)} decoding steps from {', '.join(Path(p).name for p in paths)}")
    return steps


def allocation_projection(report: Report, prof, steps) -> list[dict]:
    """The batch allocation (planning/projection.py's project) priced by a measured profile: per
    batch size, its speedup over plain decoding beside one best budget for every row."""
    from sssd.serving.planning.projection import project as project_allocation

    batches = [b for b in BATCHES if b <= max(prof.rows)]
    rows = project_allocation(steps, prof, batches)
    report.say("the batch allocation on these costs (each row verifies what its own tree is worth):")
    report.say(f"{'batch':>6} {'allocation':>10} {'nodes/row':>9} {'tokens/row':>10} {'one budget':>10} {'b':>3}")
    for r in rows:
        report.say(
            f"{r['batch']:>6} {r['speedup']:>9.2f}x {r['nodes_per_row']:>9.2f} {r['tokens_per_row_step']:>10.2f} "
            f"{r['per_size_speedup']:>9.2f}x {r['per_size_budget']:>3}"
        )
    return rows


def project(report: Report, gpu: str, measured: dict, prof, label: str) -> dict:
    from sssd.paths import packaged_calibration_file
    from sssd.serving.planning import roofline
    from sssd.serving.planning.planner import BudgetPlanner, mat_from_calibration

    mat = mat_from_calibration(packaged_calibration_file())
    hw = roofline.HARDWARE["h200" if "H200" in gpu else "h100"]
    s = measured["shape"]
    shape = roofline.ModelShape(
        "measured shape",
        s["layers"],
        s["hidden"],
        s["heads"],
        s["kv_heads"],
        s["head_dim"],
        s["intermediate"],
        s["vocab"],
        s["dtype_bytes"],
    )
    ctx = prof.context
    report.say(f"-- {label}")
    roof = roofline.roofline_profile(shape, hw, ctx, max_tokens=max(prof.tokens))
    fitted_hw, fit_eff = roofline.fit(shape, hw, prof)
    fitted = roofline.roofline_profile(shape, fitted_hw, ctx, fit_eff, max_tokens=max(prof.tokens))
    points = []
    for r in prof.rows:
        for t in prof.tokens:
            m = prof.time(r, t)
            points.append(
                {
                    "rows": r,
                    "tokens": t,
                    "measured_ms": round(m * 1e3, 3),
                    "roofline_ms": round(roof.time(r, t) * 1e3, 3),
                    "roofline_over_measured": round(roof.time(r, t) / m, 3),
                    "fitted_over_measured": round(fitted.time(r, t) / m, 3),
                }
            )
    worst = max(points, key=lambda p: abs(np.log(p["roofline_over_measured"])))
    worst_fit = max(points, key=lambda p: abs(np.log(p["fitted_over_measured"])))
    report.say(
        f"roofline ({hw.name}) over measured: {min(p['roofline_over_measured'] for p in points):.2f}-"
        f"{max(p['roofline_over_measured'] for p in points):.2f} (worst at {worst['rows']}x{worst['tokens']}); "
        f"fitted ({fit_eff:.0%} of peak FLOP/s, {fitted_hw.bandwidth / 1e12:.2f} TB/s, "
        f"{fitted_hw.overhead_s * 1e3:.2f} ms per pass): {min(p['fitted_over_measured'] for p in points):.2f}-"
        f"{max(p['fitted_over_measured'] for p in points):.2f} (worst at {worst_fit['rows']}x{worst_fit['tokens']})"
    )
    batches = [b for b in BATCHES if b <= max(prof.rows)]
    planner = BudgetPlanner(None, mat, prof, adaptive=False)
    rows = []
    plan = {r["batch"]: r for r in roofline.projection(shape, hw, mat, tuple(batches), ctx)}
    for B in batches:
        b = planner.budget(B)
        cost = prof.time(B, b + 1) / prof.time(B, 1)
        row = {
            "batch": B,
            "budget": b,
            "mat": round(planner.mat[b], 3),
            "cost_ratio": round(cost, 3),
            "speedup": round(planner.mat[b] / cost, 3),
            "plain_tokens_per_s": round(B / prof.time(B, 1), 1),
            "roofline_budget": plan[B]["budget"],
            "roofline_speedup": plan[B]["speedup"],
        }
        row["speedup_over_roofline"] = round(row["speedup"] / plan[B]["speedup"], 3)
        parts = roofline.breakdown(shape, fitted_hw, B, b + 1, ctx, fit_eff)
        total = sum(p["seconds"] for p in parts.values())
        top = max(parts, key=lambda k: parts[k]["seconds"])
        row["dominant"] = f"{top} ({parts[top]['bound']}, {parts[top]['seconds'] / total:.0%})"
        row["fitted_parts_ms"] = {k: round(p["seconds"] * 1e3, 3) for k, p in parts.items()}
        rows.append(row)
    report.say(
        f"predicted from these costs and the packaged calibration's replayed MAT, beside `sssd plan "
        f"--hardware {'h200' if hw is roofline.HARDWARE['h200'] else 'h100'}` (the SSSD paper: 1.37-1.80x at "
        f"batch 64, Llama2-7B on an Ascend 910B4):"
    )
    report.say(
        f"{'batch':>6} {'budget':>6} {'MAT':>5} {'cost':>5} {'speedup':>8} {'plain tok/s':>11} "
        f"{'roofline b':>10} {'roofline x':>10} {'ratio':>6}  dominant cost at the budget (fitted roofline)"
    )
    for r in rows:
        report.say(
            f"{r['batch']:>6} {r['budget']:>6} {r['mat']:>5.2f} {r['cost_ratio']:>5.2f} {r['speedup']:>7.2f}x "
            f"{r['plain_tokens_per_s']:>11,.0f} {r['roofline_budget']:>10} {r['roofline_speedup']:>9.2f}x "
            f"{r['speedup_over_roofline']:>6.2f}  {r['dominant']}"
        )
    return {
        "hardware": hw.name,
        "mat": {str(k): v for k, v in sorted(mat.items())},
        "points": points,
        "fitted": {"efficiency": fit_eff, "bandwidth": fitted_hw.bandwidth, "overhead_s": fitted_hw.overhead_s},
        "speedup": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (the CPU test of this script)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", REPO / "benchmarks" / "out")) / "gpu_check.json",
        help="the JSON file everything goes to (default: $OUT/gpu_check.json)",
    )
    p.add_argument("--skip", nargs="*", default=[], choices=["lossless", "profile"], help="parts to leave out")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="batch rows to profile (default 1-256)")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="recompute section 3 from a finished run's JSON file (no device needed)",
    )
    p.add_argument(
        "--groundtruth",
        type=Path,
        nargs="+",
        default=None,
        help="`sssd groundtruth` files: section 3 adds the batch allocation priced by the measured costs, "
        "from trees drafted along these recorded outputs (as `sssd plan --groundtruth`)",
    )
    p.add_argument("--limit", type=int, default=20, help="examples replayed per ground-truth file (default: 20)")
    args = p.parse_args(argv)
    if args.from_json is not None:
        done = json.loads(args.from_json.read_text())
        report = Report(args.out)
        report.put("source", str(args.from_json))
        report.put(
            "projection",
            projection(report, done["environment"].get("gpu", ""), done["profile"], args.groundtruth, args.limit),
        )
        return 0
    from sssd.serving.backends.devices import resolve

    device = resolve(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (the lossless check)
    report = Report(args.out)
    report.put("environment", environment(device))
    report.say(f"environment: {json.dumps(report.data['environment'])}")
    ok = True
    if "lossless" not in args.skip:
        report.say("== 1. lossless: SSSD vs plain decoding through the engine, float32, random weights")
        with tempfile.TemporaryDirectory() as work:
            res = lossless(report, device, args.small, Path(work))
        report.put("lossless", res)
        differing = [
            (f"{m}: {c}", v.get("rounding_ties", False))
            for m, r in res.items()
            for c, v in r["checks"].items()
            if not v["identical"] and not c.startswith("plain")
        ]
        bad = [c for c, tie in differing if not tie]
        ties = [c for c, tie in differing if tie]
        ok = not bad
        if not differing:
            report.say("lossless: ALL IDENTICAL")
        elif ok:
            report.say("lossless: identical except at float32 rounding ties in " + "; ".join(ties))
        else:
            report.say("lossless: DIFFERENCES in " + "; ".join(bad))
    if "profile" not in args.skip:
        report.say("== 2. the verification cost profile")
        measured = profile(report, device, args.small, args.rows)
        report.put("profile", measured)
        report.say("== 3. predicted speedup from the measured costs, beside the roofline projection")
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        report.put("projection", projection(report, gpu, measured, args.groundtruth, args.limit))
    report.put("ok", ok)
    report.say(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
