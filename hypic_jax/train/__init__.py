"""Training a small hybrid model on a generated multi-document corpus, and exporting it as a Hugging Face folder.

`corpus` generates prompts (documents + question / answer pairs of four task families), `tokenizer` trains a BPE
tokenizer on them and lays prompts out as tokens, `trainer` trains the Qwen3.5 architecture with optax in resumable
steps, `export` writes the Hugging Face folder. `python -m hypic_jax.train --help` runs the steps.
"""

from pathlib import Path

# Where a trained model folder is installed to ship inside the package (none is installed yet: see docs/api.md)
EMBEDDED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "hypic-qa"
