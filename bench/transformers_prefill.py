"""The reference a user would otherwise run: Hugging Face transformers' full prefill of the same Qwen3.5-35B-A3B
shape as `bench/prefill.py` (random bf16 weights), timed the same way (best of N after a warm-up).

The shape comes from `common.full_config`, mapped onto transformers' `Qwen3_5MoeTextConfig`, so both benchmarks
build the same model. On a GPU, transformers uses flash-linear-attention's Triton kernels for the GDN layers when
the `fla` package is importable (carry its wheels; `bash bench/h200.sh models` installs them from .whl/) and the
grouped-mm experts implementation when it exists. Run it in its own process: it and the JAX benchmark each need
most of the GPU's memory.

    python bench/transformers_prefill.py --lengths 8192 32768      # on the GPU
    python bench/transformers_prefill.py --small                    # toy shape on the CPU (script check)
"""

from __future__ import annotations

import argparse
import json
import time


def hf_config(ours, transformers):
    """transformers' Qwen3_5MoeTextConfig with the shape of our `qwen3_5.Config`."""
    return transformers.Qwen3_5MoeTextConfig(
        vocab_size=ours.vocab_size, hidden_size=ours.hidden_size, num_hidden_layers=len(ours.layer_types),
        layer_types=list(ours.layer_types), num_attention_heads=ours.num_attention_heads,
        num_key_value_heads=ours.num_key_value_heads, head_dim=ours.head_dim,
        linear_num_key_heads=ours.linear_num_key_heads, linear_num_value_heads=ours.linear_num_value_heads,
        linear_key_head_dim=ours.linear_key_head_dim, linear_value_head_dim=ours.linear_value_head_dim,
        linear_conv_kernel_dim=ours.conv_kernel, num_experts=ours.num_experts,
        num_experts_per_tok=ours.num_experts_per_tok, moe_intermediate_size=ours.moe_intermediate_size,
        shared_expert_intermediate_size=ours.shared_expert_intermediate_size, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": ours.rope_theta,
                         "partial_rotary_factor": ours.rotary_dim / ours.head_dim},
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="toy shape on the CPU (script check)")
    args = parser.parse_args(argv)

    import torch
    import transformers

    from common import full_config, small_config

    ours = small_config() if args.small else full_config(args.layers)
    device = "cpu" if args.small else "cuda"
    dtype = torch.float32 if args.small else torch.bfloat16
    lengths = args.lengths or ([64] if args.small else [8192, 32768])
    config = hf_config(ours, transformers)
    start = time.perf_counter()
    with torch.device(device):
        try:  # grouped-mm experts where this transformers has them
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                                  experts_implementation="grouped_mm")
        except (TypeError, ValueError):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    experts = getattr(model.config, "_experts_implementation", None)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: built {params / 1e9:.2f}B params "
          f"in {time.perf_counter() - start:.1f} s (experts implementation: {experts})", flush=True)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    results = []
    for length in lengths:
        tokens = torch.randint(0, ours.vocab_size, (1, length), device=device)
        times = []
        with torch.no_grad():
            for _ in range(args.repeats + 1):  # the first call compiles / autotunes the Triton kernels
                sync()
                begin = time.perf_counter()
                hidden = model.model(input_ids=tokens, use_cache=True).last_hidden_state[:, -1:]
                first = model.lm_head(hidden).argmax(-1)
                sync()
                times.append(time.perf_counter() - begin)
        del hidden, first
        if device == "cuda":
            torch.cuda.empty_cache()
        row = dict(length=length, ttft_s=round(min(times[1:]), 4), runs_s=[round(t, 4) for t in times])
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(dict(reference="transformers", layers=len(ours.layer_types), results=results)))


if __name__ == "__main__":
    main()
