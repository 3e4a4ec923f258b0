"""Models, tokenizers, configs and data sets by Hugging Face Hub name, as Transformers and TRL users
type them, read offline (``HF_HUB_OFFLINE=1``) from a Hugging Face cache the test writes as a
download would have left it (``hub/models--ORG--NAME/snapshots/REV/`` and ``refs/main``): these
machines reach no Hub. What is left untested: the download itself, a gated repository and a login."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from raytpu import cli
from raytpu.config import load_config
from raytpu.corpus.index import find_sources
from raytpu.corpus.sources import documents
from raytpu.jobs.causal_lm import corpus
from tests.conftest import ROOT, run_python

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")
REVISION = "0123456789abcdef0123456789abcdef01234567"
#: a tiny GPT-2 (its output layer tied to its embeddings, as GPT-2's is)
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "vocab_size": 512}


def cached_repo(hf_home: Path, kind: str, name: str) -> Path:
    """The folder a download of ``name`` leaves in the cache (``kind``: models or datasets), made empty."""
    repo = hf_home / "hub" / f"{kind}--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    return snapshot


def texts(count: int, start: int = 0) -> list[dict[str, str]]:
    return [{"text": f"def f{i}(x):\n    return x * {i}\n"} for i in range(start, start + count)]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A Hugging Face cache holding a tiny GPT-2 with its tokenizer (``tiny-org/gpt2``) and a data set
    of JSON-lines files with a README's configs (``tiny-org/functions``). (``run_clm.py``'s
    from-scratch form, by a config's Hub name: tests/test_task_pages.py, the fine-tuning page.)"""
    from transformers import AutoModelForCausalLM, GPT2Config

    home = tmp_path_factory.mktemp("hf")
    data = home.parent / "tokenizer-data"
    corpus.synthesize(data, vocab_size=512)
    tokenizer = corpus.load_tokenizer(data)
    model = AutoModelForCausalLM.from_config(GPT2Config(**GPT2, bos_token_id=None, eos_token_id=None))
    snapshot = cached_repo(home, "models", "tiny-org/gpt2")
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    dataset = cached_repo(home, "datasets", "tiny-org/functions")
    (dataset / "data").mkdir()
    for split, rows in (("train", texts(400)), ("validation", texts(40, 1000))):
        (dataset / "data" / f"{split}-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (dataset / "README.md").write_text(
        "---\nconfigs:\n- config_name: functions\n  data_files:\n  - split: train\n    path: data/train-*.jsonl\n"
        "  - split: validation\n    path: data/validation-*.jsonl\n---\n"
    )
    return home


@pytest.fixture
def offline(hf_home, monkeypatch) -> Path:
    """This process reads the test's cache alone, as ``HF_HOME=... HF_HUB_OFFLINE=1`` would make it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    return hf_home


def test_a_data_set_by_hub_name_resolves_its_config_s_splits_from_the_cache(offline):
    cfg, _ = load_config(SMALL, ["--dataset_name", "tiny-org/functions", "--dataset_config_name", "functions"])
    sources = find_sources(cfg)
    assert [Path(u.path).name for u in sources.train] == ["train-00000-of-00001.jsonl"]
    assert [Path(u.path).name for u in sources.valid] == ["validation-00000-of-00001.jsonl"]
    assert sources.holdout == 0 and Path(sources.train[0].path).is_relative_to(offline)
    assert next(iter(documents(sources.valid[0], "text")))[0] == texts(1, 1000)[0]["text"]


@pytest.mark.parametrize(
    "words, message",
    [
        (["--dataset_name", "tiny-org/absent"], "is not in the Hugging Face cache (.*) and HF_HUB_OFFLINE=1 is set"),
        (["--dataset_name", "tiny-org/functions", "--dataset_config_name", "nope"], "BuilderConfig 'nope' not found"),
        (["--dataset_name", "tiny-org/functions", "--dataset_train_split", "all"], "has no split 'all' .*train"),
        (["--dataset_name", "tiny-org/functions", "--dataset_test_split", "dev"], "has no split 'dev'"),
    ],
)
def test_a_data_set_the_cache_lacks_or_a_split_it_lacks_is_one_line(offline, tmp_path, capsys, words, message):
    argv = ["train", SMALL, "--local", f"data.path={tmp_path / 'p'}", *words]
    assert cli.main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytpu: error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), errors


def run_offline(hf_home: Path, tmp_path: Path, *words: str):
    """``raytpu train`` in a process of its own whose Hugging Face libraries read the test's cache alone."""
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    common = ["data.global_batch_size=8", "loop.max_steps=4", "checkpoint.every_steps=4", "job.sample_tokens=4"]
    common += ["logging.progress_bar=false", "scaling.num_workers=2", "data.max_eval_samples=8", "job.seq_len=32"]
    common += [f"run.storage_path={tmp_path / 'runs'}", f"data.path={tmp_path / 'prepared'}"]
    return run_python(["-m", "raytpu.cli", "train", SMALL, "--local", *common, *words], env=env, timeout=600)


def test_a_hub_model_fine_tunes_on_a_hub_data_set_offline_and_exports(hf_home, tmp_path):
    """``--model_name_or_path tiny-org/gpt2 --dataset_name tiny-org/functions``, as run_clm.py takes
    them, on 2 local processes: its own tokenizer, the tie kept; the export loads in Transformers."""
    from transformers import AutoModelForCausalLM

    words = ["--model_name_or_path", "tiny-org/gpt2", "--dataset_name", "tiny-org/functions", "--run_name", "hub"]
    done = run_offline(hf_home, tmp_path, *words, "--dataset_config_name", "functions", "loop.log_every=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = tmp_path / "runs" / "hub" / "checkpoint_00000004"
    assert (final / "meta.json").is_file()
    overrides = [
        "--model_name_or_path",
        str(cached_repo_path(hf_home)),
        f"data.path={tmp_path / 'prepared'}",
        "job.seq_len=32",
    ]
    out = tmp_path / "export"
    assert cli.main(["export", SMALL, *overrides, "--checkpoint", str(final), "--out", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.lm_head.weight is exported.transformer.wte.weight

    # under FSDP2 rank 1 builds the architecture empty and takes rank 0's pretrained weights: the same run
    sharded = run_offline(hf_home, tmp_path, *words[:-1], "sharded", "--dataset_config_name", "functions", "--fsdp",
                          "full_shard", "loop.log_every=1")  # fmt: skip
    assert sharded.returncode == 0, sharded.stdout[-3000:] + sharded.stderr[-3000:]
    assert losses(tmp_path / "runs" / "sharded") == pytest.approx(losses(tmp_path / "runs" / "hub"), rel=1e-5)


def losses(run_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return [event.value for event in EventAccumulator(str(run_dir / "tensorboard")).Reload().Scalars("train/loss")]


def cached_repo_path(hf_home: Path) -> Path:
    return hf_home / "hub" / "models--tiny-org--gpt2" / "snapshots" / REVISION


@pytest.mark.parametrize(
    "words, message",
    [
        (["--model_name_or_path", "tiny-org/absent"], "'tiny-org/absent' is not in the Hugging Face cache"),
        (["--model_name_or_path", "/no/such/folder"], "is no folder here, nor a Hugging Face Hub name"),
        (["--model_name_or_path", "tiny-org/gpt2", "--dtype", "int3"], "job.dtype='int3' is not one of"),
        (["--tokenizer_name", "tiny-org/absent-tokenizer"], "'tiny-org/absent-tokenizer' is not in the Hugging Face"),
    ],
)
def test_a_model_or_tokenizer_the_cache_lacks_is_one_line_before_any_worker(hf_home, tmp_path, words, message):
    done = run_offline(hf_home, tmp_path, *words, "--train_file", str(write_corpus(tmp_path)))
    errors = [line for line in done.stderr.splitlines() if line.startswith("raytpu: error:")]
    assert done.returncode == 2 and len(errors) == 1 and message in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not list(tmp_path.glob("runs/*/*"))  # no run begun


def write_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in texts(200)))
    return path
