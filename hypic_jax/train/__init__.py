"""Training a small hybrid model on a generated multi-document corpus, and exporting it as a Hugging Face folder.

`corpus` generates prompts (documents + question / answer pairs of five task families: `update`, a fact a later
document changes, only when asked for), `tokenizer` trains a BPE tokenizer on them and lays prompts out as tokens,
`trainer` trains the Qwen3.5 architecture with optax in resumable steps, `export` writes the Hugging Face folder.
`python -m hypic_jax.train --help` runs the steps.
"""

# Where a trained model folder is installed to ship inside the package (defined in `hypic_jax.checkpoint.embedded`, which the
# engine and the server read; see "Producing and installing the trained model" in docs/api.md)
from hypic_jax.checkpoint.embedded import EMBEDDED_MODEL  # noqa: F401
