"""The trained model that ships inside the package: a Hugging Face folder (config.json, model.safetensors in
bfloat16, tokenizer.json) at `hypic_jax/assets/hypic-qa`, trained by `hypic_jax.train` on its generated
multi-document question-answering corpus.

`Engine.from_pretrained()` without a path, `hypic-jax serve` without a model and `make demo` use it when it is
there. This module imports nothing of the package, so that every layer can ask where the model is.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "hypic-qa"


def embedded_model() -> Path | None:
    """The embedded model's folder when one is installed (it holds a config.json), else None."""
    folder = EMBEDDED_MODEL
    return folder if (folder / "config.json").is_file() else None


def require_embedded_model() -> Path:
    """The embedded model's folder; FileNotFoundError naming it when none is installed."""
    folder = embedded_model()
    if folder is None:
        raise FileNotFoundError(
            f"no embedded model: {EMBEDDED_MODEL} holds no config.json. Pass a model folder, or install a trained "
            "one there (docs/api.md, 'Producing and installing the trained model')")
    return folder
