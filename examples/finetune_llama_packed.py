"""Fine-tune a tiny Llama on packed ragged data with ``attn_implementation="jagged"``.

A batch of documents of very different lengths is packed padding-free into one row by
transformers' ``DataCollatorWithFlattening`` (``position_ids`` restarting at 0 for every document,
plus the ``cu_seq_lens_q/k``/``max_length_q/k`` kwargs); jagged_sdpa attends within each
document only, so no token is wasted on padding and no document sees another. The model is
random-weight, built from a config (no download); the documents follow a learnable rule (each
token is the previous one plus a per-document step, modulo the vocabulary), so the loss goes down
within a few dozen steps. Before training, the packed loss is checked against the eager
attention run on each document alone.

    python examples/finetune_llama_packed.py [--steps 30] [--batch 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    from jagged_sdpa.integrations import transformers as jt
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jagged_sdpa.integrations import transformers as jt

from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

VOCAB = 128


def make_documents(n: int, gen: torch.Generator) -> list[dict]:
    """Ragged documents (8 to 96 tokens): token t+1 = token t + step (mod VOCAB)."""
    docs = []
    for _ in range(n):
        length = int(torch.randint(8, 97, (), generator=gen))
        start = int(torch.randint(0, VOCAB, (), generator=gen))
        step = int(torch.randint(1, 4, (), generator=gen))
        docs.append({"input_ids": [(start + step * i) % VOCAB for i in range(length)]})
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="documents per packed batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    name = jt.register()  # "jagged"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    # Check: the packed loss equals the eager model's loss averaged over the same target tokens.
    docs = make_documents(args.batch, gen)
    eager = AutoModelForCausalLM.from_config(LlamaConfig(**config.to_dict()), attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        packed = model(**collator(docs, return_tensors="pt")).loss
        per_doc = [(eager(torch.tensor([d["input_ids"]]), labels=torch.tensor([d["input_ids"]])).loss,
                    len(d["input_ids"]) - 1) for d in docs]
        alone = sum(loss * n for loss, n in per_doc) / sum(n for _, n in per_doc)
    print(f"packed loss {packed.item():.6f} vs eager per document {alone.item():.6f} "
          f"(|diff| {abs(packed - alone).item():.1e})")
    if not torch.allclose(packed, alone, rtol=1e-4, atol=1e-5):
        raise SystemExit("packed loss differs from the per-document eager loss")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    tokens, start = 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        docs = make_documents(args.batch, gen)
        batch = collator(docs, return_tensors="pt")  # input_ids (1, total), labels, position_ids, cu_seq_lens_*
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens += batch["input_ids"].shape[1]
        if step == 1 or step % 5 == 0 or step == args.steps:
            lengths = batch["cu_seq_lens_q"].diff().tolist()
            print(f"step {step:3d}  loss {loss.item():.4f}  docs {lengths}  "
                  f"{tokens / (time.perf_counter() - start):,.0f} tokens/s")


if __name__ == "__main__":
    main()
