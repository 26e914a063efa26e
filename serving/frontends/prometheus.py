"""Prometheus exposition of the engine's counters (text format 0.0.4).

Speculative decoding uses vLLM's metric names, so dashboards built for
vLLM read SSSD unchanged; SSSD adds per-source acceptance, the budgets the
planner chose, and drafting / step time histograms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from sssd.serving.frontends.async_engine import AsyncEngine


def _counter(name: str, help_: str, value, labels: dict | None = None) -> list[str]:
    lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    return [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name}{lab} {value}"]


def _family(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> list[str]:
    out = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        out.append(f"{name}{lab} {value}")
    return out


def render_metrics(engine: AsyncEngine) -> str:
    m = engine.engine.metrics
    lines: list[str] = []
    lines += _counter(
        "vllm:spec_decode_num_drafts_total", "Draft trees verified (one per request per step).", m.num_drafts
    )
    lines += _counter("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified.", m.num_draft_tokens)
    lines += _counter("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", m.num_accepted_tokens)
    lines += _family(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Accepted draft tokens by position along the accepted path.",
        [({"position": p}, c) for p, c in sorted(m.accepted_per_pos.items())],
    )
    lines += _family(
        "sssd:accepted_tokens_by_source_total",
        "counter",
        "Accepted draft tokens by drafting source.",
        [({"source": s}, c) for s, c in sorted(m.accepted_by_source.items())],
    )
    lines += _family(
        "sssd:budget_steps_total",
        "counter",
        "Decode steps by the draft budget used (0: no speculation).",
        [({"budget": b}, c) for b, c in sorted(m.budgets.items())],
    )
    lines += _counter("sssd:generation_tokens_total", "Output tokens generated.", m.decode_tokens)
    lines += _counter("sssd:prompt_tokens_total", "Prompt tokens prefilled.", m.prefill_tokens)
    lines += _counter("sssd:decode_steps_total", "Decode steps (forward passes that verify trees).", m.steps)
    lines += _family(
        "sssd:requests_finished_total",
        "counter",
        "Finished requests by reason.",
        [({"reason": r}, c) for r, c in sorted(m.finish_reasons.items())],
    )
    lines += _counter(
        "sssd:engine_errors_total", "Engine steps that failed (their requests were aborted).", engine.errors
    )
    lines += _family("sssd:num_requests_running", "gauge", "Requests holding a KV slot.", [({}, engine.num_running)])
    lines += _family("sssd:num_requests_waiting", "gauge", "Requests queued for a slot.", [({}, engine.num_waiting)])
    lines += m.draft_time.lines("sssd:draft_seconds", "Time to draft a batch's trees (one call per step).")
    lines += m.step_time.lines("sssd:step_seconds", "Time of a decode step (drafting + forward + verification).")
    return "\n".join(lines) + "\n"
