"""TRL's ``SFTTrainer``, the reference of raytpu's fine-tuning: ``python -m tests.trl_reference MODEL
DATA OUT BATCH MAX_LENGTH PACKING`` prepares the rows of ``DATA`` (JSON lines) with
``assistant_only_loss`` and prints, as one JSON line, the loss of its first training batch as its
trainer computes it (``compute_loss``, unrounded: the logged loss is rounded to 4 decimals) and
the number of rows it made. Run with ``USE_TORCH_XLA=0``:
in a process with torch_xla installed, Transformers' ``Trainer`` takes the XLA device."""

from __future__ import annotations

import json
import sys


def main(model: str, data: str, out: str, batch: int, max_length: int, packing: bool) -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(
        output_dir=out,
        per_device_train_batch_size=batch,
        max_steps=1,
        logging_steps=1,
        max_length=max_length,
        packing=packing,
        assistant_only_loss=True,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        save_strategy="no",
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa"),
        args=config,
        train_dataset=load_dataset("json", data_files=data, split="train"),
        processing_class=AutoTokenizer.from_pretrained(model),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    loss = float(trainer.compute_loss(trainer.model, batch))
    print(json.dumps({"loss": loss, "rows": len(trainer.train_dataset)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "packed")
