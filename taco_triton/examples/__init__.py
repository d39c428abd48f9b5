"""Runnable examples: `python -m taco_triton.examples.train_gpt --help`."""
