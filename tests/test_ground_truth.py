"""Ground-truth generation with a tiny random-weight Llama built offline in tmp_path:
greedy decoding, the file format, resume, tokenizer refusal, empty sets, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sssd.calibration import datasets  # noqa: E402
from sssd.calibration import ground_truth as gt  # noqa: E402
from sssd.calibration.datasets import PromptRecord  # noqa: E402
from sssd.calibration.replay import Example  # noqa: E402
from sssd.commands._generate import generate  # noqa: E402

WORDS = (
    "the a cat dog sat on mat and ran to house big small red blue one two three four five is was of in it "
    "what why how do you think"
).split()
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOT = 2  # <|im_end|>


def _tokenizer(extra_words: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + ["user", "assistant", "system"] + list(WORDS) + list(extra_words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
    ), len(vocab)


def _make_model(folder, seed: int = 0, extra_words: tuple[str, ...] = (), positions: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_tok, vocab_size = _tokenizer(extra_words)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=EOT,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random-weight 2-layer Llama with a word-level chat tokenizer, saved as a HF model folder."""
    return _make_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _records(n: int = 3) -> list[PromptRecord]:
    texts = [
        "the cat sat on the mat",
        "why do you think the dog ran",
        "one two three four five",
        "what is big and red",
        "how was the house",
    ]
    return [PromptRecord(f"p{i}", "toy", [{"role": "user", "content": texts[i % len(texts)]}], None) for i in range(n)]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _load(folder):
    from sssd.models import load_model

    model, tok, _ = load_model(str(folder))
    return model, tok


def test_greedy_generate_equals_uncached_argmax(tiny_model):
    """Against the brute-force reference: the full sequence re-run without any cache at every step."""
    model, tok = _load(tiny_model)
    ids = gt.prompt_ids(tok, [{"role": "user", "content": "the cat sat"}])
    out, finish = gt.greedy_generate(model, ids, 12)
    assert finish == "length" and len(out) == 12
    seq = list(ids)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert out == seq[len(ids) :]


def test_greedy_generate_stops_on_a_stop_token_and_keeps_it(tiny_model):
    model, tok = _load(tiny_model)
    ids = gt.prompt_ids(tok, [{"role": "user", "content": "the cat sat"}])
    free, _ = gt.greedy_generate(model, ids, 10)
    k = 2 if free[2] not in free[:2] else next(i for i, t in enumerate(free) if t not in free[:i])
    out, finish = gt.greedy_generate(model, ids, 10, stop=[free[k]])
    assert finish == "eos"
    assert out == free[: k + 1]  # the stop token is included


def test_prompt_uses_the_chat_template_with_generation_prompt(tiny_model):
    _, tok = _load(tiny_model)
    ids = gt.prompt_ids(tok, [{"role": "user", "content": "the cat"}])
    assert tok.convert_ids_to_tokens(ids) == [
        "<|im_start|>",
        "user",
        "the",
        "cat",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
    ]
    assert gt.stop_ids(tok) == [EOT, 3]  # EOS and <|endoftext|>; unknown names are not mapped to <unk>
    assert gt.end_of_turn_id(tok) == EOT


def test_generate_writes_header_and_records(tiny_model, tmp_path):
    out = tmp_path / "gt.jsonl"
    summary = generate(str(tiny_model), _records(3), out, max_new_tokens=6, progress=False)
    assert summary.new == 3 and summary.total == 3
    header, *records = _lines(out)
    assert header["format"] == "sssd-groundtruth" and header["version"] == 1
    assert header["dataset"] == "toy"
    assert header["model"]["name"] == "tiny-llama" and len(header["model"]["sha256"]) == 64
    assert len(header["tokenizer"]["sha256"]) == 64
    assert header["generation"]["mode"] == "greedy" and header["generation"]["max_new_tokens"] == 6
    assert header["generation"]["dtype"] == "float32" and EOT in header["generation"]["stop_ids"]
    assert [r["id"] for r in records] == ["p0", "p1", "p2"]
    for r in records:
        assert r["finish"] in ("eos", "length")
        stops = header["generation"]["stop_ids"]
        assert len(r["output_ids"]) == 6 or (r["finish"] == "eos" and r["output_ids"][-1] in stops)
        assert r["prompt_ids"][-2:] == [1, 5]  # ends with "<|im_start|> assistant"


def test_engine_and_plain_greedy_write_the_same_outputs(tiny_model, tmp_path):
    recs = _records(5)
    plain = generate(
        str(tiny_model), recs, tmp_path / "plain.jsonl", max_new_tokens=16, engine="transformers", progress=False
    )
    fast = generate(
        str(tiny_model), recs, tmp_path / "fast.jsonl", max_new_tokens=16, engine="sssd", batch_size=2, progress=False
    )
    (hp, *rp), (hf, *rf) = _lines(plain.path), _lines(fast.path)
    assert hp["generation"]["engine"] == "transformers" and hf["generation"]["engine"] == "sssd"
    assert hp["generation"]["stop_ids"] == hf["generation"]["stop_ids"]
    strip = lambda rs: [(r["id"], r["prompt_ids"], r["output_ids"], r["finish"]) for r in rs]  # noqa: E731
    assert strip(rp) == strip(rf)


def test_the_engine_makes_room_for_prompts_longer_than_its_default_length(tmp_path):
    # A copy-heavy set's prompts run past the engine's default 2048 tokens per request: the engine is
    # sized to the longest prompt plus the output, and writes what plain greedy decoding does.
    folder = _make_model(tmp_path / "long-llama", positions=4096)
    long = " ".join(WORDS[i % len(WORDS)] for i in range(2300))
    recs = [PromptRecord("long", "toy", [{"role": "user", "content": long}], None), *_records(2)]
    plain = generate(str(folder), recs, tmp_path / "p.jsonl", max_new_tokens=8, engine="transformers", progress=False)
    fast = generate(str(folder), recs, tmp_path / "f.jsonl", max_new_tokens=8, batch_size=2, progress=False)
    (_, *rp), (_, *rf) = _lines(plain.path), _lines(fast.path)
    assert len(rf[0]["prompt_ids"]) > 2300
    assert [(r["id"], r["output_ids"]) for r in rp] == [(r["id"], r["output_ids"]) for r in rf]


def test_the_engine_length_counts_the_answers_a_follow_up_carries(tiny_model):
    from sssd.commands._generate import TREE_ROOM, _model_len_for

    first = PromptRecord("a", "toy", [{"role": "user", "content": "the cat sat " * 300}], None)
    second = PromptRecord(
        "a#2",
        "toy",
        [first.messages[0], {"role": "assistant", "content": None}, {"role": "user", "content": "why"}],
        None,
        follows="a",
    )
    _, tok = _load(tiny_model)
    n = len(gt.prompt_ids(tok, first.messages))
    assert n > 900
    alone = _model_len_for(tiny_model, [first], True, 1500)
    assert alone >= n + 1500 + TREE_ROOM and alone % 256 == 0
    assert _model_len_for(tiny_model, [first, second], True, 1500) >= n + 2 * 1500 + TREE_ROOM
    assert _model_len_for(tiny_model, _records(2), True, 8) == 2048  # never below the engine's default


def test_interrupted_run_resumes_without_duplicates(tiny_model, tmp_path):
    full = tmp_path / "full.jsonl"
    generate(str(tiny_model), _records(4), full, max_new_tokens=5, progress=False)
    part = tmp_path / "part.jsonl"
    first = generate(str(tiny_model), _records(4)[:1], part, max_new_tokens=5, progress=False)  # "interrupted"
    assert first.total == 1
    # A run killed mid-write leaves a torn last line; the resume cuts it off.
    with open(part, "a") as f:
        f.write('{"id": "p1", "prompt_ids": [1, 2')
    again = generate(str(tiny_model), _records(4), part, max_new_tokens=5, progress=False)
    assert again.skipped == 1 and again.new == 3 and again.total == 4
    a, b = _lines(full)[1:], _lines(part)[1:]
    assert [r["id"] for r in b] == ["p0", "p1", "p2", "p3"]
    assert [(r["prompt_ids"], r["output_ids"], r["finish"]) for r in a] == [
        (r["prompt_ids"], r["output_ids"], r["finish"]) for r in b
    ]
    # A finished file: a rerun does nothing.
    assert generate(str(tiny_model), _records(4), part, max_new_tokens=5, progress=False).new == 0


def test_resume_refuses_other_generation_settings(tiny_model, tmp_path):
    out = tmp_path / "gt.jsonl"
    generate(str(tiny_model), _records(1), out, max_new_tokens=5, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(str(tiny_model), _records(2), out, max_new_tokens=7, progress=False)
    summary = generate(str(tiny_model), _records(2), out, max_new_tokens=7, overwrite=True, progress=False)
    assert summary.new == 2 and summary.skipped == 0


def test_empty_prompt_set_is_a_clear_error(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="empty prompt set"):
        generate(str(tiny_model), [], tmp_path / "x.jsonl", progress=False)
    with pytest.raises(ValueError, match="empty prompt set"):
        gt.record(str(tiny_model), [], tmp_path / "y.jsonl", progress=False)
    assert not (tmp_path / "x.jsonl").exists()


def test_duplicate_ids_are_refused(tiny_model, tmp_path):
    recs = _records(2)
    with pytest.raises(ValueError, match="duplicate"):
        generate(str(tiny_model), [recs[0], recs[0]], tmp_path / "x.jsonl", progress=False)


def test_load_groundtruth_gives_examples_with_ids(tiny_model, tmp_path):
    out = tmp_path / "gt.jsonl"
    generate(str(tiny_model), _records(5), out, max_new_tokens=4, progress=False)
    header, examples = gt.load_groundtruth(out, tokenizer=str(tiny_model))
    assert header["dataset"] == "toy"
    assert [e.id for e in examples] == [f"p{i}" for i in range(5)]
    assert all(isinstance(e, Example) for e in examples)
    assert examples[0].prompt.dtype == np.int32 and len(examples[0].output) >= 1
    dev, ev = datasets.split(examples, "dev"), datasets.split(examples, "eval")
    assert len(dev) + len(ev) == 5 and not {e.id for e in dev} & {e.id for e in ev}


def test_groundtruth_from_another_tokenizer_is_refused(tiny_model, tmp_path):
    out = tmp_path / "gt.jsonl"
    generate(str(tiny_model), _records(1), out, max_new_tokens=3, progress=False)
    other = _make_model(tmp_path / "other-llama", extra_words=("zebra",))
    with pytest.raises(ValueError, match=r"tokenizer mismatch.*tiny-llama.*other-llama"):
        gt.load_groundtruth(out, tokenizer=str(other))
    # A datastore recording another tokenizer is refused too.
    import sssd

    ds = sssd.Datastore.build(
        np.array([4, 5, 6, sssd.SEPARATOR], dtype=np.uint32),
        tmp_path / "ds",
        metadata={"tokenizer": {"name": "other", "sha256": "0" * 64, "vocab_size": 9}},
    )
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        gt.load_groundtruth(out, tokenizer=ds)


def test_not_a_groundtruth_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="not an sssd-groundtruth file"):
        gt.load_groundtruth(bad)


def test_record_writes_recorded_answers_with_end_of_turn(tiny_model, tmp_path):
    recs = [
        PromptRecord("c1", "chat", [{"role": "user", "content": "the cat"}], "a dog sat on it"),
        PromptRecord(
            "c2",
            "chat",
            [
                {"role": "user", "content": "what"},
                {"role": "assistant", "content": "it"},
                {"role": "user", "content": "why"},
            ],
            "one two three",
        ),
    ]
    out = tmp_path / "rec.jsonl"
    summary = gt.record(str(tiny_model), recs, out, progress=False)
    assert summary.total == 2 and summary.finish == {"eos": 2}
    header, r1, r2 = _lines(out)
    assert header["generation"]["mode"] == "recorded" and header["generation"]["stop_ids"] == [EOT]
    _, tok = _load(tiny_model)
    assert r1["output_ids"] == tok("a dog sat on it", add_special_tokens=False)["input_ids"] + [EOT]
    assert r2["prompt_ids"] == gt.prompt_ids(tok, recs[1].messages)
    capped = gt.record(str(tiny_model), recs, tmp_path / "cap.jsonl", max_new_tokens=2, progress=False)
    assert capped.finish == {"length": 2}


def test_second_turn_follows_the_models_first_answer(tiny_model, tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 7, "category": "x", "turns": ["the cat sat", "why"]}) + "\n")
    recs = datasets.mtbench(both_turns=True, path=q)
    out = tmp_path / "mt.jsonl"
    generate(str(tiny_model), recs, out, max_new_tokens=4, progress=False)
    _, t1, t2 = _lines(out)
    assert (t1["id"], t2["id"]) == ("mtbench/7", "mtbench/7#2")
    _, tok = _load(tiny_model)
    answer = tok.decode([t for t in t1["output_ids"] if t not in (EOT, 3)], skip_special_tokens=True)
    msgs = [
        {"role": "user", "content": "the cat sat"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "why"},
    ]
    assert t2["prompt_ids"] == gt.prompt_ids(tok, msgs)


def test_default_path_is_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path))
    assert gt.default_path("smollm2", "mtbench") == tmp_path / "groundtruth" / "smollm2-135m-instruct" / "mtbench.jsonl"
    assert gt.default_path(tmp_path / "my-model", "gsm8k").parent.name == "my-model"


def test_contamination_sidecar(tiny_model, tmp_path):
    import sssd
    from sssd.tokenizer import load_tokenizer

    recs = [
        PromptRecord("c1", "chat", [{"role": "user", "content": "the cat"}], "a dog sat on it"),
        PromptRecord("c2", "chat", [{"role": "user", "content": "what"}], "one two three"),
    ]
    out = tmp_path / "rec.jsonl"
    gt.record(str(tiny_model), recs, out, progress=False)
    tok = load_tokenizer(str(tiny_model))
    stream = tok.encode("big red a dog sat on it blue") + [sssd.SEPARATOR] + tok.encode("one two") + [sssd.SEPARATOR]
    ds = sssd.Datastore.build(
        np.array(stream, dtype=np.uint32), tmp_path / "ds", metadata={"tokenizer": tok.identity()}
    )
    report, sidecar = gt.write_contamination(out, str(ds.path), window=3)
    fr = gt.load_contamination(out)
    assert fr == {"c1": 1.0, "c2": 0.0}  # "one two three": its only 3-window is not in the datastore
    assert report.at_least[0.9] == 1
    assert json.loads(sidecar.read_text())["contaminated"] == ["c1"]


def test_cli_groundtruth(tiny_model, tmp_path, capsys):
    from sssd.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"id": f"q{i}", "prompt": t}) for i, t in enumerate(["the cat", "a dog ran"])) + "\n"
    )
    out = tmp_path / "cli.jsonl"
    rc = main(
        [
            "groundtruth",
            "--prompts",
            str(prompts),
            "--model",
            str(tiny_model),
            "-o",
            str(out),
            "--max-new-tokens",
            "3",
            "-q",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == 2 and summary["new"] == 2
    assert [r["id"] for r in _lines(out)[1:]] == ["q0", "q1"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert (
        main(
            ["groundtruth", "--prompts", str(empty), "--model", str(tiny_model), "-o", str(tmp_path / "e.jsonl"), "-q"]
        )
        == 1
    )
    assert "empty prompt set" in capsys.readouterr().err
    assert main(["groundtruth", "--prompts", str(prompts), "--model", str(tmp_path / "nope"), "-q"]) == 1
    assert "unknown model" in capsys.readouterr().err


def test_cli_groundtruth_takes_one_side_of_the_split_before_the_limit(tiny_model, tmp_path, capsys):
    from sssd.calibration.datasets import split_of
    from sssd.cli import main

    ids = [f"q{i}" for i in range(40)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": "the cat"}) for i in ids) + "\n")
    for part in ("dev", "eval"):
        out = tmp_path / f"{part}.jsonl"
        assert (
            main(
                [
                    "groundtruth",
                    "--prompts",
                    str(prompts),
                    "--model",
                    str(tiny_model),
                    "-o",
                    str(out),
                    "--max-new-tokens",
                    "1",
                    "--split",
                    part,
                    "--limit",
                    "3",
                    "-q",
                ]
            )
            == 0
        )
        capsys.readouterr()
        want = [i for i in ids if split_of(i) == part][:3]
        assert len(want) == 3 and [r["id"] for r in _lines(out)[1:]] == want
