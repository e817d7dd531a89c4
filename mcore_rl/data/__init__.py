"""Prompt data for RL: verl-schema parquet datasets, a resumable batch loader, the tiny offline tokenizer and the
synthetic task of the default CPU job.

- `dataset.py`: `PromptDataset` (read, validate, chat-template, length-filter) and `PromptLoader` (batches, resume)
- `synthetic.py`: `write_synthetic_dataset` (copy_digit / copy_digits / successor tasks, verl schema)
- `arithmetic.py`: addition questions for a real chat model (arith_add, the real-model recipe)
- `tokenizer.py`: `build_tiny_tokenizer` (63-token ChatML tokenizer, saved with save_pretrained)
"""
