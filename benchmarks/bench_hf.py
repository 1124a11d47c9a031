"""transformers benchmark (issue 12): attn_implementation="jagged" against "sdpa" and "eager".

One random-weight Llama (built from a config, no download), one ragged batch of sequences padded to
its longest (right padding for training, left padding for generation, as usual), the same weights
for every contender. Timed side by side in one process, in interleaved rounds (round r runs every
contender once, in turn; the table shows medians), so that the load of a shared machine hits all
contenders alike:

  train     one optimizer-free training step: forward + loss + backward on the padded batch.
            tokens/s counts real (non-padding) tokens only.
            "jagged packed" is the same sequences packed padding-free into one row
            (DataCollatorWithFlattening), where no layer (not only attention) spends work on padding.
  generate  batched greedy generation (DynamicCache) from the left-padded prompts; new tokens/s and
            peak RSS, "jagged" against "sdpa" (eager's tokens are the reference; --time-eager times it);
            --dtype bfloat16 runs the models in bf16 (tokens checked against sdpa's).
  static    transformers' fast-generation recipe (static cache, model.forward compiled fullgraph),
            "jagged" against "sdpa" after a warm-up call; tokens checked equal. Each contender runs in
            a process of its own (alternating), as a server runs one model; --static-in-one-process
            compiles both in one (they then share Dynamo's cache of the one forward both classes run).
  cb        continuous batching (model.generate_batch, paged cache, chunked prefill): transformers'
            "sdpa" against jagged attention in the "sdpa" entry (jt.enable_continuous_batching());
            --cb-prompts prompts of evenly spread lengths --cb-min-len..--cb-max-len (shuffled), greedy;
            new tokens/s over the whole call (generate_batch's manager start and stop included: a fixed
            cost of about 0.5 s here, mostly its gc.collect) and over the serving loop alone
            (add_requests to the last result, as in a long-running server). Tokens checked identical.

Before timing, every contender's loss is checked against eager's and its generated tokens must be
identical to eager's; the padding waste (% of the padded batch that is padding) is printed.

Threads: 1 by default. The CPU machines are shared 2-core VMs; with 2 threads, every small op's
OpenMP barrier waits for a core another process holds, which adds noise of the order of the
differences measured (a 150 KB copy took 20 us on 1 thread and 500 us on 2). --threads 2 for both.

Run: python benchmarks/bench_hf.py [--batch 8] [--max-len 512] [--rounds 7] [--new-tokens 32] [--threads 1]
     python benchmarks/bench_hf.py --sections cb --layers 4   (issue 19's continuous-batching row)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
)
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: E402

from jagged_sdpa.integrations import transformers as jt  # noqa: E402
from jagged_sdpa.integrations.transformers import continuous_batching as jt_cb  # noqa: E402

VOCAB = 512


def ragged_lengths(batch: int, max_len: int, gen: torch.Generator) -> list[int]:
    """Log-normal lengths (a few long sequences, many short ones), the longest exactly max_len."""
    raw = torch.empty(batch).log_normal_(mean=0.0, std=0.8, generator=gen)
    lengths = (raw / raw.max() * max_len).round().clamp(min=8).long().tolist()
    return [int(n) for n in lengths]


def pad(seqs: list[torch.Tensor], side: str):
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(L - len(s), L) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--prompt-max-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gen-rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--time-eager", action="store_true", help="time eager's generate too (slow)")
    parser.add_argument("--sections", default="train,generate,cb",
                        help="comma-separated subset of train,generate,cb (train and generate run together)")
    parser.add_argument("--cb-prompts", type=int, default=16)
    parser.add_argument("--cb-min-len", type=int, default=16)
    parser.add_argument("--cb-max-len", type=int, default=600)
    parser.add_argument("--cb-new-tokens", type=int, default=32)
    parser.add_argument("--cb-rounds", type=int, default=3)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=512)
    parser.add_argument("--cb-page-size", type=int, default=64)
    parser.add_argument("--static-process", default=None, help=argparse.SUPPRESS)  # one contender of "static"
    parser.add_argument("--static-in-one-process", action="store_true",
                        help="static: compile both contenders in this process (shared Dynamo caches)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    known = {"train", "generate", "static", "cb"}
    if not sections <= known:
        raise SystemExit(f"--sections: unknown {sorted(sections - known)}")
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    name = jt.register()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=max(args.max_len, args.prompt_max_len + args.new_tokens,
                                                     args.cb_max_len + args.cb_new_tokens),
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    models = {}
    for impl in ("eager", "sdpa", name):
        # from_config writes attn_implementation into the config: one copy per model
        models[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if impl != "eager":
            models[impl].load_state_dict(models["eager"].state_dict())

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; Llama hidden {args.hidden}, {args.layers} layers, 8 query / 2 kv heads, fp32")

    if "cb" in sections:
        continuous_batching(args, models["sdpa"], torch.Generator().manual_seed(args.seed + 1))
    if not sections & {"train", "generate", "static"}:
        return

    if "train" in sections:
        training(args, models, name, gen)
    if "generate" in sections:
        generation(args, models, name, torch.Generator().manual_seed(args.seed + 2))
    if "static" in sections:
        if args.static_process is not None:
            static_compiled(args, models, name, torch.Generator().manual_seed(args.seed + 2), [args.static_process])
        elif args.static_in_one_process:
            static_compiled(args, models, name, torch.Generator().manual_seed(args.seed + 2), ["sdpa", name])
        else:
            static_in_processes(args, name)


def training(args, models, name, gen: torch.Generator) -> None:
    """One training step, padded and packed, against eager and sdpa."""
    lengths = ragged_lengths(args.batch, args.max_len, gen)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    ids, mask, labels = pad(seqs, "right")
    waste = 1 - mask.sum().item() / mask.numel()
    real = int(mask.sum())
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s.tolist()} for s in seqs], return_tensors="pt")
    print(f"\ntraining batch: {args.batch} sequences, lengths {sorted(lengths, reverse=True)}, padded to "
          f"{ids.shape[1]}: {real} real tokens of {mask.numel()} ({100 * waste:.0f}% padding)")

    def train_step(impl, packed_mode=False):
        model = models[impl].train()
        model.zero_grad(set_to_none=True)
        if packed_mode:
            loss = model(**packed).loss
        else:
            loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach()

    contenders = [("eager", "eager", False), ("sdpa", "sdpa", False), (f"{name} (padded)", name, False),
                  (f"{name} (packed)", name, True)]
    ref = train_step("eager")
    for label, impl, pm in contenders[1:]:
        # the packed loss averages over the same target tokens (the collator masks each first token)
        got = train_step(impl, pm)
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"{label}: loss {got.item():.6f} differs from eager's {ref.item():.6f}")
    times = {label: [] for label, _, _ in contenders}
    for _ in range(args.rounds):
        for label, impl, pm in contenders:
            times[label].append(timed(lambda: train_step(impl, pm)))
    base = statistics.median(times["eager"])
    print(f"medians of {args.rounds} interleaved rounds; losses checked against eager")
    print(f"{'contender':<18} {'train step ms':>13} {'real tokens/s':>13} {'vs eager':>8}")
    for label, _, _ in contenders:
        t = statistics.median(times[label])
        print(f"{label:<18} {1e3 * t:>13.1f} {real / t:>13,.0f} {base / t:>7.2f}x")


def _peak_rss_reset() -> bool:
    """Reset this process's peak resident set size (Linux: clear_refs 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def generation(args, models, name, gen: torch.Generator) -> None:
    """Batched greedy generation from left-padded prompts (DynamicCache): "jagged" against "sdpa",
    tokens checked against eager's; new tokens/s and each contender's peak RSS during the call."""
    dtype = getattr(torch, args.dtype)
    p_lengths = ragged_lengths(args.batch, args.prompt_max_len, gen)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in p_lengths]
    p_ids, p_mask, _ = pad(prompts, "left")
    p_waste = 1 - p_mask.sum().item() / p_mask.numel()
    print(f"\ngeneration: {args.batch} prompts, lengths {sorted(p_lengths, reverse=True)}, left-padded to "
          f"{p_ids.shape[1]} ({100 * p_waste:.0f}% padding), {args.new_tokens} new tokens each, greedy, "
          f"DynamicCache, {args.dtype}")

    def generate(impl):
        model = models[impl].eval().to(dtype)
        with torch.no_grad():
            return model.generate(p_ids, attention_mask=p_mask, past_key_values=DynamicCache(config=model.config),
                                  max_new_tokens=args.new_tokens, do_sample=False)

    timed_impls = [("sdpa", "sdpa"), (name, name)] + ([("eager", "eager")] if args.time_eager else [])
    # float32: tokens must equal eager's. bf16: every implementation rounds its sums its own way and
    # greedy decoding of a random-weight model amplifies that, so the share of equal tokens is shown
    reference = "eager" if dtype == torch.float32 else "sdpa"
    ref_tokens = generate(reference)
    peaks, agree = {}, {}
    for label, impl in timed_impls:
        resettable = _peak_rss_reset()
        tokens = generate(impl)
        peaks[label] = _peak_rss_mb() if resettable else float("nan")
        agree[label] = (tokens[:, p_ids.shape[1]:] == ref_tokens[:, p_ids.shape[1]:]).float().mean().item()
        if dtype == torch.float32 and agree[label] < 1:
            raise SystemExit(f"{label}: generated tokens differ from {reference}'s")
    times = {label: [] for label, _ in timed_impls}
    for _ in range(args.gen_rounds):
        for label, impl in timed_impls:
            times[label].append(timed(lambda: generate(impl)))
    new_total = args.batch * args.new_tokens
    base = statistics.median(times["sdpa"])
    print(f"medians of {args.gen_rounds} interleaved rounds; new tokens compared with {reference}'s; peak RSS of the "
          "process during each contender's first call")
    print(f"{'contender':<10} {'generate ms':>11} {'new tokens/s':>12} {'vs sdpa':>8} {'peak RSS MB':>11} "
          f"{'tokens = ' + reference:>14}")
    for label, _ in timed_impls:
        g = statistics.median(times[label])
        print(f"{label:<10} {1e3 * g:>11.1f} {new_total / g:>12,.0f} {base / g:>7.2f}x {peaks[label]:>11.0f} "
              f"{100 * agree[label]:>13.0f}%")


def static_in_processes(args, name) -> None:
    """The "static" section with each contender compiled in a process of its own, as a server
    runs one model: rounds alternate the contenders' processes (each warms up, then times
    ``--gen-rounds`` calls), tokens checked equal. Two models of one class compiled in one process
    share Dynamo's cache for their ``forward`` (every call checks the other's guards too):
    ``--static-in-one-process`` measures that instead."""
    rounds = 2
    argv = [a for a in sys.argv[1:] if a != "--static-in-one-process"]
    results: dict = {"sdpa": [], name: []}
    for _ in range(rounds):
        for impl in results:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--sections", "static",
                                   "--static-process", impl], capture_output=True, text=True, timeout=1800)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("STATIC ")]
            if done.returncode or not lines:
                raise SystemExit(f"static {impl}: the contender's process failed\n{done.stdout}\n{done.stderr}")
            results[impl].append(json.loads(lines[-1][len("STATIC "):]))
    tokens = {impl: runs[0]["tokens"] for impl, runs in results.items()}
    if tokens[name] != tokens["sdpa"]:
        raise SystemExit(f"{name}: generated tokens differ from sdpa's under the compiled static recipe")
    times = {impl: statistics.median(t for run in runs for t in run["times"]) for impl, runs in results.items()}
    print(f"\nstatic cache, model.forward compiled (fullgraph), each contender in its own process, {rounds} "
          f"alternating processes x {args.gen_rounds} timed calls after the warm-up (medians); tokens equal")
    for impl, g in times.items():
        print(f"{impl:<10} {1e3 * g:>11.1f} ms {args.batch * args.new_tokens / g:>10,.0f} new tokens/s "
              f"{times['sdpa'] / g:>7.2f}x")


def static_compiled(args, models, name, gen: torch.Generator, impls) -> None:
    """transformers' fast-generation recipe: a static cache and ``model.forward`` compiled with
    ``fullgraph=True``; ``impls`` (one, in a contender's process, or both) timed after a warm-up
    call (which compiles), tokens checked equal."""
    dtype = getattr(torch, args.dtype)
    p_lengths = ragged_lengths(args.batch, args.prompt_max_len, gen)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in p_lengths]
    p_ids, p_mask, _ = pad(prompts, "left")
    print(f"\nstatic cache, model.forward compiled (fullgraph): {args.batch} prompts of {min(p_lengths)}-"
          f"{max(p_lengths)} tokens, left-padded, {args.new_tokens} new tokens each, greedy, {args.dtype}")
    compiled = {}
    for impl in impls:
        model = copy.deepcopy(models[impl]).eval().to(dtype)
        model.forward = torch.compile(model.forward, fullgraph=True)
        compiled[impl] = model

    def generate(impl):
        with torch.no_grad():
            return compiled[impl].generate(p_ids, attention_mask=p_mask, max_new_tokens=args.new_tokens,
                                           do_sample=False, cache_implementation="static")

    for _ in range(2):  # warm-up: compiles the prefill and decode graphs (the second call: a fresh cache's)
        tokens = {impl: generate(impl) for impl in compiled}
    times = {impl: [] for impl in compiled}
    for _ in range(args.gen_rounds):
        for impl in compiled:
            times[impl].append(timed(lambda: generate(impl)))
    if len(impls) == 1:  # a contender's process (``static_in_processes``)
        print("STATIC " + json.dumps({"tokens": tokens[impls[0]].tolist(), "times": times[impls[0]]}))
        return
    if not torch.equal(tokens[name], tokens["sdpa"]):
        raise SystemExit(f"{name}: generated tokens differ from sdpa's under the compiled static recipe")
    base = statistics.median(times["sdpa"])
    print(f"medians of {args.gen_rounds} interleaved rounds after the warm-up; tokens equal")
    for impl in compiled:
        g = statistics.median(times[impl])
        print(f"{impl:<10} {1e3 * g:>11.1f} ms {args.batch * args.new_tokens / g:>10,.0f} new tokens/s "
              f"{base / g:>7.2f}x")


def continuous_batching(args, model, gen: torch.Generator) -> None:
    """generate_batch with transformers' "sdpa" against jagged attention in the "sdpa" entry."""
    import logging

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # psutil / eos notices
    n = args.cb_prompts
    lengths = torch.linspace(args.cb_min_len, args.cb_max_len, n).round().long()
    lengths = lengths[torch.randperm(n, generator=gen)].tolist()
    prompts = [torch.randint(1, VOCAB, (int(L),), generator=gen).tolist() for L in lengths]
    gconf = GenerationConfig(max_new_tokens=args.cb_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    blocks = n * ((args.cb_max_len + args.cb_new_tokens) // args.cb_page_size + 2)
    print(f"\ncontinuous batching: {n} prompts of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all), "
          f"{args.cb_new_tokens} new tokens each, greedy, page {args.cb_page_size}, max_batch_tokens "
          f"{args.cb_max_batch_tokens} (chunked prefill), {blocks} blocks")
    model.eval()

    hints = WorkloadHints(max_prompt_length=max(lengths), max_generated_length=args.cb_new_tokens, num_requests=n)

    def run(jagged: bool):
        """What generate_batch does, timed twice: the whole call (manager start and stop included) and
        the serving loop alone (add_requests to the last result, as in a long-running server)."""
        (jt.enable_continuous_batching if jagged else jt.disable_continuous_batching)()
        cbc = ContinuousBatchingConfig(page_size=args.cb_page_size, num_blocks=blocks,
                                       max_batch_tokens=args.cb_max_batch_tokens)
        start = time.perf_counter()
        with torch.no_grad(), model.continuous_batching_context_manager(
                generation_config=gconf, continuous_batching_config=cbc, block=True, timeout=5, warmup=False,
                workload_hints=hints) as manager:
            loop_start = time.perf_counter()
            ids = manager.add_requests(inputs=prompts, max_new_tokens=args.cb_new_tokens)
            results = {}
            while len(results) < n:
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise SystemExit("continuous batching: the generation thread stopped")
            loop = time.perf_counter() - loop_start
        elapsed = time.perf_counter() - start
        jt.disable_continuous_batching()
        return (elapsed, loop), [results[i].generated_tokens for i in ids]

    contenders = [("sdpa (transformers)", False), ("jagged (in sdpa)", True)]
    ref = run(False)[1]
    before = dict(jt_cb.stats)
    if run(True)[1] != ref:
        raise SystemExit("continuous batching: jagged tokens differ from transformers' sdpa")
    modes = {k: jt_cb.stats[k] - before[k] for k in before}
    times = {label: [] for label, _ in contenders}
    for _ in range(args.cb_rounds):
        for label, jagged in contenders:
            t, tokens = run(jagged)
            if tokens != ref:
                raise SystemExit(f"continuous batching: {label} tokens differ")
            times[label].append(t)
    total = n * args.cb_new_tokens
    med = {label: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for label, ts in times.items()}
    base = med["sdpa (transformers)"]
    print(f"medians of {args.cb_rounds} interleaved rounds, tokens identical; jagged layer calls per run: {modes}")
    print(f"{'contender':<20} {'whole call s':>12} {'tokens/s':>9} {'vs sdpa':>8}   {'serving loop s':>14} "
          f"{'tokens/s':>9} {'vs sdpa':>8}   loop runs (s)")
    for label, _ in contenders:
        whole, loop = med[label]
        runs = " ".join(f"{x[1]:.2f}" for x in times[label])
        print(f"{label:<20} {whole:>12.2f} {total / whole:>9.1f} {base[0] / whole:>7.2f}x   {loop:>14.2f} "
              f"{total / loop:>9.1f} {base[1] / loop:>7.2f}x   {runs}")

if __name__ == "__main__":
    main()
