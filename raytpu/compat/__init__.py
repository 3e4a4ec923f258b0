"""Hugging Face compatibility: TrainingArguments flags and `raytpu launch` of Accelerate scripts."""
