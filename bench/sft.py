"""Fine-tuning on conversations, raytpu beside TRL's ``SFTTrainer``, side by side in one run.

A Qwen2 of ``--hidden`` x ``--layers`` (tied embeddings, the byte-level tokenizer raytpu trains on
Python's source, a ChatML template with generation marks) and ``--conversations`` made-up
conversations, assistant-only loss, packed best-fit into rows of ``--max-length`` tokens:

* **throughput:** the same rows, batch and steps through raytpu (``raytpu train --local``, one
  process of both cores, its loop compiled by ``torch.compile``) and through TRL (``SFTTrainer``,
  ``USE_TORCH_XLA=0``); each one's training time without its start (raytpu: goodput's productive
  seconds; TRL: its ``train_runtime``), as rows a second. ``ratio`` = raytpu / TRL (target >= 1.0).
* **memory:** a full fine-tune and a LoRA fine-tune (r 16, all linear layers) of the same model,
  each in a process of its own: the estimate (``raytpu doctor``) and the peak resident memory of the
  training process, side by side.

With ``--xla``, instead: on the XLA CPU device, one epoch of the same conversations packed (several
to a row, a document mask made from the rows' segments) and padded (one to a row), both in rows of
``--max-length`` (one shape): conversations a second, the compilation time and the steps of each,
side by side. ``packed_over_padded`` = packed / padded conversations a second.

    python bench/sft.py [--hidden 512] [--layers 8] [--conversations 512] [--steps 20]
    python bench/sft.py --xla [--hidden 256] [--layers 4] [--conversations 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRL = """
import json, sys, time
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
model, data, out, batch, length, steps = sys.argv[1:7]
args = SFTConfig(output_dir=out, per_device_train_batch_size=int(batch), max_steps=int(steps), logging_steps=10**6,
                 max_length=int(length), packing=True, assistant_only_loss=True, report_to=[], use_cpu=True,
                 bf16=False, save_strategy="no", learning_rate=1e-4, lr_scheduler_type="constant", seed=0)
trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa"), args=args,
                     train_dataset=load_dataset("json", data_files=data, split="train"),
                     processing_class=AutoTokenizer.from_pretrained(model))
done = trainer.train()
print(json.dumps({"seconds": done.metrics["train_runtime"], "rows": int(batch) * int(steps)}))
"""


def conversation(i: int) -> dict:
    question = f"what is {i} times {i + 1}, and why? " * (1 + i % 4)
    answer = f"it is {i * (i + 1)}: {i} taken {i + 1} times. " * (1 + i % 3)
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write_model(folder: Path, hidden: int, layers: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from raytpu.jobs.causal_lm import corpus

    corpus.synthesize(folder.parent / "tokenizer", vocab_size=4096)
    tokenizer = corpus.load_tokenizer(folder.parent / "tokenizer")
    tokenizer.chat_template = TEMPLATE
    config = Qwen2Config(vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1),
                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


#: runs a command and prints the peak resident memory (kB) of the processes it waited for
PEAK = "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; " \
       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"  # fmt: skip


def raytpu_run(work: Path, words: list[str], name: str, env: dict[str, str] | None = None) -> dict:
    """``raytpu train --local`` in a process of its own; its goodput record and the peak resident
    memory of its processes (the largest: the training process)."""
    command = [str(BIN / "raytpu"), "train", "jobs/causal_lm/finetune.yaml", "--local", *words, f"run.name={name}"]
    done = subprocess.run([sys.executable, "-c", PEAK, *command], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})  # fmt: skip
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    record = json.loads((work / "runs" / name / "goodput.json").read_text())
    return {"record": record, "peak_mb": int(done.stdout.strip().splitlines()[-1]) / 1024}


def estimated_gb(words: list[str]) -> float:
    """``raytpu doctor``'s estimate of one device's memory for the run (fp32 on the cpu runtime)."""
    from raytpu.config import load_config
    from raytpu.config.memory import estimate_run
    from raytpu.config.plan import resolve_config

    cfg, job = load_config(ROOT / "jobs" / "causal_lm" / "finetune.yaml", words)
    return estimate_run(resolve_config(cfg, "cpu", "fp32"), job, "fp32").total / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--xla", action="store_true", help="packed against padded rows on the XLA CPU device")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as scratch:
        (packed_or_padded if args.xla else compare)(Path(scratch), args)


def bench_words(work: Path, args: argparse.Namespace) -> list[str]:
    """The model and conversations of ``args`` written in ``work``; the flags both sides train with."""
    model = work / "model"
    write_model(model, args.hidden, args.layers)
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(args.conversations)))
    return ["--model_name_or_path", str(model), "--train_file", str(data), "--validation_file", str(data),
            "--assistant_only_loss", "--max_length", str(args.max_length), "scaling.num_workers=1",
            "scaling.cpus_per_worker=2", "scaling.precision=fp32", "job.sample_tokens=0",
            f"data.global_batch_size={args.batch}", "logging.progress_bar=false", "--learning_rate", "1e-4",
            "--lr_scheduler_type", "constant", f"run.storage_path={work / 'runs'}", "loop.eval_every_steps=0",
            "checkpoint.every_steps=0", "data.max_eval_samples=8"]  # fmt: skip


def packed_or_padded(work: Path, args: argparse.Namespace) -> None:
    """One epoch of the conversations on the XLA CPU device, packed and padded, side by side."""
    words = [*bench_words(work, args), "scaling.runtime=xla", "loop.epochs=1"]
    rates = {}
    for name, extra in (("packed", ["--packing"]), ("padded", [])):
        run = raytpu_run(work, [*words, *extra, f"data.path={work / name}"], name, env={"PJRT_DEVICE": "CPU"})
        attempt = run["record"]["commands"][-1]["attempts"][-1]
        spent = run["record"]["categories"]
        rates[name] = args.conversations / spent["productive"]
        print(f"{name}: {rates[name]:.2f} conversations/s ({attempt['steps']} steps of {args.batch} rows in "
              f"{spent['productive']:.1f} s), compilation {spent['compilation']:.1f} s")  # fmt: skip
    print(f"packed_over_padded={rates['packed'] / rates['padded']:.3f}")


def compare(work: Path, args: argparse.Namespace) -> None:
    words = [*bench_words(work, args), "--packing", "scaling.runtime=cpu", f"loop.max_steps={args.steps}",
             f"data.path={work / 'prepared'}"]  # fmt: skip
    ours = raytpu_run(work, [*words, "loop.compile=true"], "compiled")
    productive = ours["record"]["categories"]["productive"]
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": ""}
    model, data = work / "model", work / "chats.jsonl"
    trl = subprocess.run([sys.executable, "-c", TRL, str(model), str(data), str(work / "trl"), str(args.batch),
                          str(args.max_length), str(args.steps)], capture_output=True, text=True, env=env)  # fmt: skip
    if trl.returncode:
        raise SystemExit(trl.stderr[-3000:])
    theirs = json.loads(trl.stdout.strip().splitlines()[-1])
    rows = args.batch * args.steps
    print(f"raytpu (compiled): {rows / productive:.2f} rows/s ({productive:.1f} s of {args.steps} steps)")
    spent = {name: round(seconds, 1) for name, seconds in ours["record"]["categories"].items() if seconds >= 0.05}
    print(f"  raytpu's command, seconds by goodput category: {spent}")
    print(f"TRL SFTTrainer:    {theirs['rows'] / theirs['seconds']:.2f} rows/s ({theirs['seconds']:.1f} s)")
    ratio = (rows / productive) / (theirs["rows"] / theirs["seconds"])

    full = raytpu_run(work, words, "full")
    lora = raytpu_run(work, [*words, "--use_peft", "--lora_target_modules", "all-linear"], "lora")
    estimates = {"full": estimated_gb(words), "lora": estimated_gb([*words, "--use_peft", "--lora_target_modules",
                                                                    "all-linear"])}  # fmt: skip
    for name, run in (("full", full), ("lora", lora)):
        eager = run["record"]["categories"]["productive"]
        print(f"raytpu {name} fine-tune, eager (loop.compile=false): {rows / eager:.2f} rows/s")
        print(f"{name:>4} fine-tune: estimate {estimates[name]:.3f} GB of the step, "
              f"measured peak {run['peak_mb'] / 1024:.3f} GB of the process (its imports included)")  # fmt: skip
    print(f"ratio={ratio:.3f} lora_over_full_measured={lora['peak_mb'] / full['peak_mb']:.3f}")


if __name__ == "__main__":
    main()
