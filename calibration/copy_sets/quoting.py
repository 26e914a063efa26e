"""The ``quoting`` set, one of the copy-heavy prompt sets.

``quoting()``: RAG-style: several numbered passages (docstrings of standard
library modules, functions and classes of this Python, ``inspect.cleandoc``
of their own ``__doc__``), a question, and a reference that quotes one or
two passages or one sentence verbatim with a short framing sentence
("According to passage 3: ..."). Ids: ``quoting/<target title>#<kind>``.
The standard library's docstrings are those of the running interpreter
(Python 3.11 here): another Python version gives other text.
"""

from __future__ import annotations

import inspect
import random
import re
from functools import lru_cache

from sssd.calibration.copy_sets.constants import MAX_LONG_PROMPT_CHARS, MAX_PROMPT_CHARS, SEED
from sssd.calibration.datasets import PromptRecord

#: Standard-library modules whose docstrings are the passages.
QUOTE_MODULES = (
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "difflib",
    "dis",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "getpass",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "locale",
    "logging",
    "mimetypes",
    "numbers",
    "optparse",
    "pathlib",
    "pickle",
    "platform",
    "poplib",
    "pprint",
    "queue",
    "random",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "sysconfig",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "zipapp",
    "zipfile",
)

PASSAGE_MIN, PASSAGE_MAX = 200, 1800


def _clip(doc: str) -> str | None:
    """A docstring cut to whole paragraphs of at most PASSAGE_MAX characters, or None if too short."""
    paras = doc.split("\n\n")
    out = paras[0]
    for p in paras[1:]:
        if len(out) + 2 + len(p) > PASSAGE_MAX:
            break
        out += "\n\n" + p
    return out if PASSAGE_MIN <= len(out) <= PASSAGE_MAX else None


@lru_cache(maxsize=1)
def passages() -> tuple[tuple[str, str], ...]:
    """((title, text)) of standard-library docstrings (their own __doc__, cleaned), sorted by title."""
    import importlib
    import warnings

    found: dict[str, str] = {}
    for mod_name in QUOTE_MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(mod_name)
        items = [(mod_name, mod)]
        for name in sorted(vars(mod)):
            obj = vars(mod)[name]
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                items.append((f"{mod_name}.{name}", obj))
        for title, obj in items:
            raw = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
            if not raw:
                continue
            text = _clip(inspect.cleandoc(raw).strip())
            if text and "\t" not in text and text not in found.values():
                found[title] = text
    return tuple(sorted(found.items()))


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(])")


def _sentences(text: str) -> list[str]:
    out = []
    for para in text.split("\n\n"):
        out += [s for s in _SENTENCE.split(para) if s]
    return out


def _render(chosen: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"[Passage {i}] {title}\n{text}" for i, (title, text) in enumerate(chosen, start=1))


QUOTE_SYSTEMS = (
    "You answer questions using only the passages the user gives you. Quote them verbatim and cite them by number.",
    "You are a documentation assistant. Ground every answer in the numbered passages; when asked to "
    "quote, copy the text exactly.",
)


def quoting(n: int = 180) -> list[PromptRecord]:
    """RAG-style quoting questions over standard-library docstrings (see the module docstring):
    ``n`` records, a third each of one-passage, two-passage and keyword-sentence questions; every 8th
    record is a long one (20-32 passages, up to MAX_LONG_PROMPT_CHARS)."""
    pool = list(passages())
    by_title = dict(pool)
    titles = [t for t, _ in pool]
    rng = random.Random(f"{SEED}:quoting")
    used: set[str] = set()
    out: list[PromptRecord] = []
    kinds = ("passage", "two-passages", "sentence")
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        attempts += 1
        k = len(out)
        kind = kinds[k % 3]
        long = k % 8 == 7
        limit = MAX_LONG_PROMPT_CHARS if long else MAX_PROMPT_CHARS
        target = rng.choice(titles)
        if target in used:
            continue
        targets = [target]
        if kind == "two-passages":
            mod = target.rsplit(".", 1)[0] if target not in QUOTE_MODULES else target
            siblings = [
                t
                for t in titles
                if t != target
                and t.startswith(mod + ".")
                and t not in used
                and len(by_title[t]) + len(by_title[target]) <= 2400
            ]
            if not siblings:
                continue
            targets.append(rng.choice(siblings))
        n_pass = rng.randint(20, 32) if long else rng.randint(4, 8)
        others = rng.sample([t for t in titles if t not in targets], n_pass - len(targets))
        chosen_titles = others + targets
        rng.shuffle(chosen_titles)
        chosen = [(t, by_title[t]) for t in chosen_titles]
        while len(_render(chosen)) > limit - 600 and len(chosen) > len(targets) + 2:  # drop non-targets until it fits
            drop = next(i for i in range(len(chosen) - 1, -1, -1) if chosen[i][0] not in targets)
            chosen.pop(drop)
        if len(_render(chosen)) > limit - 600:
            continue
        pos = {t: i for i, (t, _) in enumerate(chosen, start=1)}
        if kind == "passage":
            i = pos[target]
            question = rng.choice(
                [
                    f"What does the documentation of `{target}` say? Quote the passage in full.",
                    f"Quote, word for word, the passage that documents `{target}`.",
                    f"Find the documentation of `{target}` among the passages and repeat it verbatim.",
                ]
            )
            ref = f'According to passage {i}: "{by_title[target]}"'
        elif kind == "two-passages":
            a, b = targets
            question = rng.choice(
                [
                    f"How do `{a}` and `{b}` differ? Answer by quoting the documentation of each, verbatim.",
                    f"Quote the passages that document `{a}` and `{b}`, in that order, word for word.",
                ]
            )
            ref = f'According to passage {pos[a]}: "{by_title[a]}"\n\nAccording to passage {pos[b]}: "{by_title[b]}"'
        else:
            words: dict[str, set[str]] = {}
            for t, text in chosen:
                for w in set(re.findall(r"\b[a-z][a-z]{6,}\b", text)):
                    words.setdefault(w, set()).add(t)
            sents = _sentences(by_title[target])
            picks = []
            for w in sorted(w for w, ts in words.items() if ts == {target}):
                hit = [s for s in sents if re.search(rf"\b{w}\b", s)]
                if len(hit) == 1 and 40 <= len(hit[0].strip()) <= 500:
                    picks.append((w, hit[0].strip()))
            if not picks:
                continue
            word, sentence = rng.choice(picks)
            question = rng.choice(
                [
                    f'Which passage mentions "{word}"? Quote the sentence that contains it.',
                    f'Find the sentence that uses the word "{word}" and quote it exactly, '
                    "saying which passage it is from.",
                ]
            )
            ref = f'Passage {pos[target]} ({target}) mentions it: "{sentence}"'
        user = (
            f"Here are {len(chosen)} passages from the Python standard library's documentation.\n\n"
            f"{_render(chosen)}\n\nQuestion: {question}"
        )
        used.update(targets)
        msgs = [{"role": "system", "content": rng.choice(QUOTE_SYSTEMS)}, {"role": "user", "content": user}]
        out.append(PromptRecord(f"quoting/{target}#{kind}", "quoting", msgs, ref))
    return out
