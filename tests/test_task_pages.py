"""The four task pages' commands, run as a user runs them: each page's bash blocks as one shell
session, in order, in a folder holding the clone's files (nothing the suite's own runs wrote), with
only the shortening override the page names (``tests/task_pages.py`` says, for every command, how it
is run or what these machines lack to run it). The notebook page's cells run in a real kernel
(tests/test_notebook.py); the cluster page's commands against a real head (tests/test_submit.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.stores import free_ports
from tests.task_pages import PLANS, TASK_PAGES, cells, commands, is_install_cell, outputs, sandbox, script


@pytest.mark.parametrize("page", TASK_PAGES)
def test_every_command_of_a_task_page_is_run_or_says_why_not(page: str) -> None:
    """A command added to a page, or changed, fails here until the tests run it (or say why not)."""
    shown = commands(page)
    assert shown, page
    assert set(shown) == set(PLANS[page]), {"not planned": set(shown) - set(PLANS[page]),
                                             "not on the page": set(PLANS[page]) - set(shown)}  # fmt: skip
    assert any(not step.outside for step in PLANS[page].values()), page


def test_notebook_cells_are_on_the_notebook_page_alone_and_run_there() -> None:
    """The notebook page's cells run in a kernel (tests/test_notebook.py), its install cells aside."""
    assert [page for page in TASK_PAGES if cells(page)] == ["notebook.md"]
    run = [cell for cell in cells("notebook.md") if not is_install_cell(cell)]
    assert len(run) == 4 and "raytpu.train(" in run[0] and "ray.shutdown()" in run[-1], run


def test_commands_keep_their_quotes_and_lose_their_comments() -> None:
    from tests.task_pages import without_comment

    assert without_comment("a 'x # y' \"#\" b#c # comment") == "a 'x # y' \"#\" b#c "
    assert without_comment("# all of it") == ""


def run_page(
    page: str, folder: Path, env: dict[str, str], stand_ins: dict[str, str] | None = None, timeout: int = 900
) -> dict[int, str]:
    """The page's commands as one bash session in ``folder``: what each printed, by its place."""
    done = subprocess.run(
        ["bash", "-c", script(page, stand_ins)],
        cwd=folder,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-6000:]
    return outputs(done.stdout)


def number_of(page: str, start: str) -> int:
    """The place on the page of the command that starts with ``start``."""
    return next(index for index, command in enumerate(commands(page)) if command.startswith(start))


@pytest.mark.integration
def test_the_quick_start_page(ray_session, tmp_path: Path) -> None:
    """The quick start, the curves served, the runs listed and tested, and two runs of one's own, on
    the session's Ray instance (the first call's own local instance: tests/test_notebook.py)."""
    folder = sandbox(tmp_path / "clone")
    address = ray_session.get_runtime_context().gcs_address
    port = str(free_ports(1)[0])  # the page's 6006 may be another TensorBoard's here
    said = run_page("quickstart.md", folder, {"RAY_ADDRESS": address}, {"6006": port})
    page = "quickstart.md"
    quick = said[number_of(page, "bash scripts/quickstart.sh")]
    assert "synthesizing a small mshnet data set in data/mshnet" in quick, quick[-3000:]
    assert "best checkpoint:" in quick and '"test/mIoU"' in quick.splitlines()[-1], quick[-3000:]
    assert f"served: http://127.0.0.1:{port}/data/runs" in said[number_of(page, ".venv/bin/tensorboard")]
    listed = said[number_of(page, ".venv/bin/raytpu runs")]
    assert "checkpoint_00000020" in listed and "best" in listed, listed
    assert '"test/mIoU"' in said[number_of(page, ".venv/bin/raytpu test")].splitlines()[-1]
    for name in ("mshnet-small", "lr-0.01", "batch-16"):
        summary = json.loads((folder / "results" / name / "summary.json").read_text())
        assert summary["step"] == 20, (name, summary)


def test_the_notebook_page_s_set_up(tmp_path: Path) -> None:
    """The set-up installs nothing more into a venv that has the notebook extra, and registers a
    kernel named raytpu that runs the venv's Python (its cells: tests/test_notebook.py)."""
    folder = sandbox(tmp_path / "clone")
    home = tmp_path / "home"  # where the kernel is registered
    said = run_page("notebook.md", folder, {"HOME": str(home)})
    assert "raytpu environment ready" in said[number_of("notebook.md", "bash scripts/bootstrap.sh")]
    kernel = json.loads((home / ".local/share/jupyter/kernels/raytpu/kernel.json").read_text())
    assert kernel["display_name"] == "raytpu" and kernel["argv"][0].startswith(str(folder / ".venv")), kernel


def page_hub_cache(home: Path) -> None:
    """What a download of the page's Hub names leaves in the Hugging Face cache at ``home``: tiny
    models of each one's architecture (tied embeddings, as theirs are), a tokenizer with a chat
    template, GPT-2's config, and wikitext's config ``wikitext-2-raw-v1`` as parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    from raytpu.jobs.causal_lm import corpus
    from tests.test_hub import cached_repo
    from tests.test_sft import TEMPLATE

    corpus.synthesize(home / "tokenizer-data", vocab_size=512)
    tokenizer = corpus.load_tokenizer(home / "tokenizer-data")
    tokenizer.chat_template = TEMPLATE  # ChatML, as SmolLM2's is, its assistant turns marked
    small = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
             "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    models = {"HuggingFaceTB/SmolLM2-135M": LlamaConfig(**small), "HuggingFaceTB/SmolLM2-135M-Instruct":
              LlamaConfig(**small), "Qwen/Qwen2.5-0.5B": Qwen2Config(**small)}  # fmt: skip
    for name, config in models.items():
        torch.manual_seed(0)
        snapshot = cached_repo(home, "models", name)
        AutoModelForCausalLM.from_config(config).save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
    gpt2 = cached_repo(home, "models", "openai-community/gpt2")
    GPT2Config(vocab_size=512, n_positions=1024, bos_token_id=None, eos_token_id=None).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    wikitext = cached_repo(home, "datasets", "Salesforce/wikitext")
    (wikitext / "wikitext-2-raw-v1").mkdir()
    for split, count in (("train", 2000), ("validation", 300), ("test", 300)):
        rows = [f" = Section {i} = \n def f{i}(x): return x * {i}\n" for i in range(count)]
        pq.write_table(pa.table({"text": rows}), wikitext / "wikitext-2-raw-v1" / f"{split}-00000-of-00001.parquet")
    splits = "".join(f"  - split: {s}\n    path: wikitext-2-raw-v1/{s}-*\n" for s in ("train", "validation", "test"))
    readme = f"---\nconfigs:\n- config_name: wikitext-2-raw-v1\n  data_files:\n{splits}---\n"
    (wikitext / "README.md").write_text(readme)


def page_data(folder: Path) -> None:
    """The files the page names as the user's own: text rows, conversation rows, a corpus."""

    def write(name: str, rows: list[dict]) -> None:
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))

    write("train.jsonl", [{"text": f"def f{i}(x):\n    return x * {i}\n"} for i in range(2000)])
    write("valid.jsonl", [{"text": f"def g{i}(x):\n    return x + {i}\n"} for i in range(300)])
    write("corpus.jsonl", [{"text": f"class C{i}:\n    size = {i}\n"} for i in range(2000)])
    chats = [{"messages": [{"role": "user", "content": f"what is {i} times 2?"},
                           {"role": "assistant", "content": f"{2 * i}."}]} for i in range(1500)]  # fmt: skip
    write("chats.jsonl", chats)


@pytest.mark.integration
def test_the_your_model_page(ray_session, tmp_path: Path) -> None:
    """Fine-tune from Hub names (read offline from a cache the test writes: these machines reach no
    Hub) on text, a Hub data set and conversations; LoRA, its exports and a search over its rank;
    pretraining from a config; the export read by Transformers' pipeline."""
    page = "your-model.md"
    folder = sandbox(tmp_path / "clone")
    page_hub_cache(tmp_path / "hf")
    page_data(folder)
    env = {"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address, "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", "USE_TORCH_XLA": "0"}  # fmt: skip
    said = run_page(page, folder, env, timeout=1500)
    runs = folder / "results"
    for name in ("finetune", "qwen-wikitext", "chat", "lora", "gpt2-scratch"):
        assert json.loads((runs / name / "summary.json").read_text())["step"] == 5, name
    scratch = json.loads((runs / "gpt2-scratch" / "checkpoint_00000005" / "meta.json").read_text())["config"]["job"]
    assert scratch["config_name"] == "openai-community/gpt2" and scratch["model_type"] == "gpt2", scratch
    assert (folder / "adapter" / "adapter_config.json").exists() and (folder / "merged" / "config.json").exists()
    assert "generated_text" in said[number_of(page, "python -c")]
    tuned = said[number_of(page, "raytpu tune")]
    assert "done" in tuned and "best config" in tuned, tuned[-3000:]  # one trial: sweeps are test_tune.py's
