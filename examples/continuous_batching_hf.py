"""transformers' continuous batching (``model.generate_batch``) with jagged attention.

transformers accepts only its built-in attention names in continuous batching, so jagged_sdpa goes
in under "sdpa": ``jt.enable_continuous_batching()`` makes continuous-batching calls run ragged
attention over transformers' paged cache (no dense mask, keys read in place through a block
table), and every other call transformers' own SDPA. The model is a random-weight Llama built from
a config (no download). The script runs the same prompts with transformers' SDPA and with jagged
attention, checks that the greedy tokens are identical and prints both times.

    python examples/continuous_batching_hf.py [--prompts 16] [--max-len 600] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

try:
    from jagged_sdpa.integrations import transformers as jt
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jagged_sdpa.integrations import transformers as jt
from jagged_sdpa.integrations.transformers.compat import continuous_batching_config  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=args.max_len + args.new_tokens, pad_token_id=0,
                         bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(16, args.max_len + 1, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lengths]
    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    # always size the cache (num_blocks): unset, transformers grows it to a share of the machine's memory
    # ContinuousBatchingConfig(page_size=64, ...); continuous_batching_config also spells it for transformers 5.17
    batching = continuous_batching_config(64, num_blocks=args.prompts * (args.max_len // 64 + 3), max_batch_tokens=512)

    def run():
        start = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching,
                                   progress_bar=False)
        return time.perf_counter() - start, [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]

    t_sdpa, ref = run()
    jt.enable_continuous_batching()
    try:
        t_jagged, tokens = run()
    finally:
        jt.disable_continuous_batching()
    print(f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new tokens each")
    print(f"transformers sdpa: {t_sdpa:.2f} s; jagged: {t_jagged:.2f} s ({t_sdpa / t_jagged:.2f}x); "
          f"tokens identical: {tokens == ref}")
    if tokens != ref:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
