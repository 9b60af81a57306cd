"""How much of a Gated DeltaNet state survives one document: per (document, value head, GDN layer), the decay
factor exp(sum of the gate g over the document's tokens) of a Qwen3.5-architecture model on held-out prompts of
`hypic_jax.train`'s corpus. A factor near 0 means the state entering the document is forgotten by its end, so
dropping the transfer operator (HYPIC's `addition`) changes little downstream of that document. Also each head's
median decay rate -g per token. The gates are read by `trainer.forward_with_gates` (the model's own layers).

    python -m bench.investigations.gate_decay [--model DIR] [--docs 16] [--prompts 4]
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> None:
    import jax.numpy as jnp

    import hypic_jax
    from hypic_jax.checkpoint.embedded import EMBEDDED_MODEL
    from hypic_jax.train import tokenizer as tok
    from hypic_jax.train import trainer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(EMBEDDED_MODEL))
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args(argv)
    model = hypic_jax.load(args.model, dtype="float32")
    config, params = model.config, model.params
    tokenizer = tok.load_tokenizer(args.model)
    log_decay, lengths, rates = [], [], []
    for i in range(args.prompts):
        prompt = trainer.heldout_prompt(0, args.docs, i)
        docs = [tok.encode(tokenizer, tok.document_text(d)) for d in prompt.documents]
        lengths += map(len, docs)
        tokens = jnp.asarray([sum(docs, [])], jnp.int32)
        bounds = np.cumsum([0] + [len(d) for d in docs])
        _, gates = trainer.forward_with_gates(params, config, tokens, lambda acc, g: acc + (g[0],), ())
        rates.append([np.asarray(-g, np.float64) for g in gates])  # per GDN layer [L, Hv]
        for g in gates:
            total = np.concatenate([np.zeros((1, g.shape[-1])), np.cumsum(np.asarray(g, np.float64), 0)])
            log_decay.append(total[bounds[1:]] - total[bounds[:-1]])  # [docs, Hv]
    # each (GDN layer, value head)'s median decay rate -g per token over every prompt's tokens
    head_rates = np.stack([np.median(np.concatenate([r[j] for r in rates]), axis=0) for j in range(len(rates[0]))])
    print(f"median decay rate per token of each of the {head_rates.size} (GDN layer, value head) pairs: "
          f"{np.mean(head_rates >= 1):.3f} at least 1 (the state keeps under e^-1 per token), those between "
          f"{head_rates[head_rates >= 1].min() if (head_rates >= 1).any() else float('nan'):.3g} and "
          f"{head_rates.max():.3g}; the median pair {np.median(head_rates):.3g}")
    factors = np.exp(np.concatenate([d.reshape(-1) for d in log_decay]))
    print(f"{factors.size} (document, head, layer) triples; documents of {np.mean(lengths):.1f} tokens on average")
    for bound in (0.5, 1e-1, 1e-3, 1e-6):
        print(f"  decay factor over one document below {bound:g}: {np.mean(factors < bound):.3f}")
    print(f"  median factor {np.median(factors):.3g}, largest {factors.max():.3g}")


if __name__ == "__main__":
    main()
