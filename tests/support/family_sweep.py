"""Sweep over transformers' own model families: "jagged" against "eager".

Every model type of transformers' causal-LM and seq2seq-LM auto mappings is built tiny from its
config class (sizes shrunk generically by attribute name: 2-4 layers, hidden 64, 4 heads, 2 kv
heads, head_dim 16, vocab 128, 4 experts; per-layer lists such as ``layer_types`` keep one layer
of each kind), float32, eval mode, seed-fixed, with the same weights under ``"eager"`` and under
``jagged_sdpa.integrations.transformers.register()``. A type listed in both mappings runs both
classes. Each is checked on a batch without padding, a left- and a right-padded batch (the logits
of the real tokens, relative to the logits' scale, within ``TOL``; encoder-decoders pad the encoder
and the decoder) and by greedy ``generate`` of ``NEW_TOKENS`` tokens on the left-padded batch
(token-identical), where the model can generate. Records count the jagged attention calls: a family
that passes without one has no attention layer in its tiny model or computes attention in its own code.

Classes: ``pass``; ``wrong`` (numbers or tokens differ); ``crash`` (an exception that is not a
ValueError/TypeError raised by jagged_sdpa, a hang past the timeout, or a dead child process);
``refused`` (jagged_sdpa's ValueError/TypeError, message kept); ``eager-fails`` (eager itself fails
on these inputs: not counted against jagged); ``not-buildable`` (no tiny model from the config:
listed, not counted).

Each family runs in its own child process (forked after the imports) with a timeout, so a hang or a
segfault costs only that family. Command line (from the repository root)::

    PYTHONPATH=. python tests/support/family_sweep.py [--families llama,bloom] [--jobs 2] [--out results.json]
    PYTHONPATH=. python tests/support/family_sweep.py --child bloom      # one family in this process, JSON out

The full sweep (215 model types) takes 2-3 minutes on 2 shared CPU cores (``--jobs 2``).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import time
import traceback

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
PACKAGE_DIR = os.path.join(ROOT, "jagged_sdpa")
for _path in (TESTS, ROOT):  # this checkout's jagged_sdpa, whatever is installed; tests/ for ``support``
    if _path not in sys.path:
        sys.path.insert(0, _path)
TOL = 1e-4  # max |jagged - eager| over real-token logits, relative to max(1, max |eager|)
NEW_TOKENS = 4
LENGTHS = (6, 9, 3)  # one batch of three sequences, padded to 9
VOCAB = 128
SPECIAL_BASE = 100  # special token ids are moved to 100..127; real tokens are drawn from [4, 96)
CLASSES = ("pass", "wrong", "crash", "refused", "eager-fails", "not-buildable")

# ----------------------------------------------------------------------------------- tiny configs
_SIZES = {
    64: ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "model_dim", "word_embed_proj_dim",
         "intermediate_size", "ffn_dim", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size",
         "embedding_size", "hidden_dim", "dim", "d_inner", "mamba_d_inner"),
    32: ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
         "moe_ffn_hidden_size", "kv_lora_rank", "q_lora_rank", "index_n_heads_dim"),
    16: ("head_dim", "kv_channels", "d_kv", "attention_head_dim", "attention_head_size", "v_head_dim",
         "qk_head_dim", "index_head_dim", "global_head_dim", "mamba_d_state", "ssm_state_size", "state_size",
         "linear_key_head_dim", "linear_value_head_dim", "mamba_head_dim"),
    8: ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"),
    4: ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads", "num_heads",
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "linear_num_value_heads",
        "mamba_n_heads", "index_n_heads", "num_global_key_value_heads"),
    2: ("num_experts_per_tok", "moe_k",
        "moe_topk", "top_k", "num_experts_per_token", "linear_num_key_heads", "index_topk", "mamba_n_groups",
        "n_groups"),
    1: ("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "num_expert_group"),
}
# sizes that some configs leave None by default yet need to build (Qwen4-Exp's QSA indexer, DeepSeek-V2's MoE,
# Ministral's head_dim, Nemotron's kv heads): head_dim 16 = hidden 64 / 4 heads
_FILL_NONE = {"num_experts_per_tok": 2, "head_dim": 16, "num_key_value_heads": 2, "indexer_n_heads": 2,
              "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
              "indexer_compress_ratio": 2}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers")
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx")


def _shrink(defaults: dict) -> dict:
    """Overrides that make a config (as ``to_dict()``) tiny: sizes by attribute name, per-layer lists
    cut to one layer of each kind, special token ids moved inside the small vocabulary."""
    out = {}
    for size, keys in _SIZES.items():
        for key in keys:
            if isinstance(defaults.get(key), int) and not isinstance(defaults.get(key), bool) and defaults[key] > size:
                out[key] = size
    head_key = next((k for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(defaults.get(k), int)),
                    None)
    heads = defaults[head_key] if head_key else None
    for key in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"):
        value = defaults.get(key)
        if isinstance(value, int) and not isinstance(value, bool):  # GQA stays GQA (2 of 4), MHA stays MHA, MQA MQA
            out[key] = out.get(head_key, heads) if heads is not None and value >= heads else min(value, 2)
    if isinstance(defaults.get("attn_layer_period"), int):  # Jamba: one attention layer in the first two
        out.update(attn_layer_period=2, attn_layer_offset=1)
    if "attn_layer_indices" in defaults:  # Bamba: attention at layer 1
        out["attn_layer_indices"] = [1]
    for key in ("head_dim", "qk_head_dim"):  # MLA: the rotary slice's size, kept equal when it was
        if key in out and "qk_rope_head_dim" in out and defaults[key] == defaults["qk_rope_head_dim"]:
            out[key] = out["qk_rope_head_dim"]
    out.update({k: v for k, v in _FILL_NONE.items() if k in defaults and defaults[k] is None})
    old_layers = next((defaults[k] for k in _LAYER_KEYS if isinstance(defaults.get(k), int)), None)
    per_layer = {k: v for k, v in defaults.items()  # lists, and strings named *pattern (nemotron_h's "M-M*-")
                 if old_layers and old_layers > 1
                 and (isinstance(v, list) or (isinstance(v, str) and k.endswith("pattern")))
                 and len(v) == old_layers}
    # a cycled pattern shorter than the model (recurrent_gemma's block_types) is kept whole when it has attention
    cycled = [len(v) for k, v in defaults.items() if isinstance(v, list) and old_layers and 2 < len(v) < old_layers
              and all(isinstance(x, str) for x in v) and any("attention" in x for x in v)]
    kinds = max([len(dict.fromkeys(v)) for v in per_layer.values()] + cycled + [2])
    layers = min(kinds, 4)
    for key in _LAYER_KEYS:
        if isinstance(defaults.get(key), int) and defaults[key] > layers:
            out[key] = layers
    for key, value in per_layer.items():
        distinct = list(dict.fromkeys(value))
        picked = (distinct + list(value))[:layers]
        out[key] = "".join(picked) if isinstance(value, str) else picked
    if isinstance(defaults.get("vocab_size"), int):
        out["vocab_size"] = VOCAB
        for key in ("decoder_vocab_size", "text_vocab_size"):
            if isinstance(defaults.get(key), int):
                out[key] = VOCAB
        specials = sorted({k for k, v in defaults.items() if (k.endswith("token_id") or k.endswith("token_index"))
                           and isinstance(v, int) and not isinstance(v, bool) and v >= 0})
        for i, key in enumerate(specials):
            value = defaults[key]
            out[key] = value if value < 4 else SPECIAL_BASE + i % (VOCAB - SPECIAL_BASE)
    for key in _MAX_POSITIONS:
        if isinstance(defaults.get(key), int) and defaults[key] > 128:
            out[key] = 128
    for key in ("initializer_range", "init_std"):
        if isinstance(defaults.get(key), float):
            out[key] = 0.2
    for key, value in defaults.items():  # sub-configs (text_config, encoder, decoder, ...): shrunk alike
        if isinstance(value, dict) and "model_type" in value:
            out[key] = {"model_type": value["model_type"], **_shrink(value)}
    return out


def tiny_config(family: str):
    """The family's config with ``_shrink`` applied (raises if the config class refuses it)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    defaults = cls().to_dict()
    cfg = AutoConfig.for_model(family, **_shrink(defaults))
    return cfg


def model_classes(family: str) -> list:
    """The family's causal-LM class and seq2seq-LM class (one or both)."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = []
    for mapping in (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = mapping.get(family)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name and name not in names:
            names.append(name)
    return [getattr(transformers, n) for n in names]


def all_families() -> list:
    from transformers.models.auto import modeling_auto

    return sorted(set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
                  | set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES))


# ------------------------------------------------------------------------------------ one family
_CALLS = [0]  # jagged attention calls in this process
class _Stage(Exception):
    """An exception tagged with the side ("eager"/"jagged"/"build") and the step it came from."""

    def __init__(self, side, step, error):
        super().__init__(f"{side} {step}: {type(error).__name__}: {error}")
        self.side, self.step, self.error = side, step, error


def _by_jagged(error: BaseException) -> bool:
    """A ValueError/TypeError raised inside the jagged_sdpa package (a refusal that names a feature)."""
    if not isinstance(error, (ValueError, TypeError)):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep)


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} ({f.name})"


def _batch(side: str, pad_id: int, lengths=LENGTHS, seed=1):
    """Token ids and 0/1 mask of ``lengths`` padded on ``side`` ("full": every sequence as long as the longest)."""
    from support.cases import padded_tokens

    if side == "full":
        lengths = (max(lengths),) * len(lengths)
    return padded_tokens(lengths, side, pad_id, 4, 96, seed)


def _inputs(model, side):
    """Forward inputs (padded on ``side``) and the bool (B, T) mask of the rows whose logits count."""
    cfg = model.config
    pad = getattr(cfg, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < VOCAB else 0
    ids, mask = _batch(side, pad)
    inputs = dict(input_ids=ids, attention_mask=mask)
    rows = mask.bool()
    if getattr(cfg, "is_encoder_decoder", False):
        dec_ids, dec_mask = _batch(side, pad, lengths=(4, 2, 5), seed=2)
        inputs["decoder_input_ids"] = dec_ids
        if "decoder_attention_mask" in inspect.signature(model.forward).parameters:
            inputs["decoder_attention_mask"] = dec_mask
            rows = dec_mask.bool()
        else:
            rows = dec_mask.new_ones(dec_mask.shape).bool()
    return inputs, rows, pad


def _forward(model, inputs):
    import torch

    with torch.no_grad():
        out = model(**inputs, use_cache=False) if "use_cache" in inspect.signature(model.forward).parameters \
            else model(**inputs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float()


def _generate(model, inputs, pad):
    import torch

    kwargs = {k: v for k, v in inputs.items() if not k.startswith("decoder_")}
    with torch.no_grad():
        out = model.generate(**kwargs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=pad)
    return out.sequences if hasattr(out, "sequences") else out


def _step(side, step, fn, *args):
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - classified by the caller
        raise _Stage(side, step, error) from error


def check_class(cls, family: str, name: str) -> dict:
    """One model class of ``family``: build both, compare logits on both paddings, then generate."""
    import torch

    cfg = _step("build", "config", tiny_config, family)

    def build(config, attn):
        torch.manual_seed(0)
        return cls._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32).eval()

    try:
        eager = build(cfg, "eager")
    except Exception as error:  # noqa: BLE001 - a causal-LM class of a multimodal type takes the text config
        try:
            text = cfg.get_text_config()
        except Exception:  # noqa: BLE001 - several text configs (musicgen): the decoder's
            text = getattr(cfg, "decoder", cfg)
        if text is cfg:
            raise _Stage("build", "model", error) from error
        cfg = text
        eager = _step("build", "model", build, cfg, "eager")
    params = sum(p.numel() for p in eager.parameters())
    jagged = _step("jagged", "load", build, cfg, name)
    jagged.load_state_dict(eager.state_dict())
    result = {"class": cls.__name__, "params": params, "error": 0.0, "checks": []}
    calls_before = _CALLS[0]
    for side in ("full", "left", "right"):
        inputs, rows, pad = _inputs(eager, side)
        ref = _step("eager", f"forward {side}", _forward, eager, inputs)
        if not torch.isfinite(ref[rows]).all():
            raise _Stage("eager", f"forward {side}", FloatingPointError("eager logits are not finite"))
        got = _step("jagged", f"forward {side}", _forward, jagged, inputs)
        err = float((got[rows] - ref[rows]).abs().max()) / max(1.0, float(ref[rows].abs().max()))
        if not err == err:  # NaN
            err = float("inf")
        result["error"] = max(result["error"], err)
        result["checks"].append(f"logits {side}")
        if not err <= TOL:
            result["wrong"] = f"logits {side}: relative error {err:.2e} > {TOL:g}"
            return result
    result["attention_calls"] = _CALLS[0] - calls_before  # 0: no attention layer, or the family's own attention code
    if eager.can_generate():
        inputs, _, pad = _inputs(eager, "left")
        try:
            ref = _generate(eager, inputs, pad)
        except Exception as error:  # noqa: BLE001 - eager cannot generate from this tiny model: not ours
            result["generate"] = f"eager generate fails: {type(error).__name__}: {str(error)[:160]}"
            return result
        got = _step("jagged", "generate", _generate, jagged, inputs, pad)
        result["checks"].append("generate")
        if got.shape != ref.shape or not torch.equal(got, ref):
            result["wrong"] = f"generate: tokens differ (eager {ref[:, -NEW_TOKENS:].tolist()}, " \
                              f"jagged {got[:, -NEW_TOKENS:].tolist()})"
    return result


def run_family(family: str) -> dict:
    """Classify one family (in this process)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from transformers.modeling_utils import AttentionInterface

    from jagged_sdpa.integrations import transformers as jt

    name = "jagged_sweep"  # the jagged attention, counting its calls in this process
    if not getattr(AttentionInterface._global_mapping.get(name), "_sweep_counted", False):
        jt.register(name)

        def counted(*args, **kwargs):
            _CALLS[0] += 1
            return jt.jagged_attention_forward(*args, **kwargs)

        counted._sweep_counted = True
        AttentionInterface.register(name, counted)
    record = {"family": family, "status": None, "detail": "", "classes": []}
    try:
        classes = model_classes(family)
    except Exception as error:  # noqa: BLE001
        return dict(record, status="not-buildable", detail=f"model class: {type(error).__name__}: {error}")
    for cls in classes:
        try:
            result = check_class(cls, family, name)
        except _Stage as stage:
            error = stage.error
            text = f"{cls.__name__} {stage.side} {stage.step}: {type(error).__name__}: {str(error)[:300]}"
            if stage.side == "build":
                status = "not-buildable"
            elif stage.side == "eager":
                status = "eager-fails"
            elif _by_jagged(error):
                status = "refused"
            else:
                status = "crash"
                text += f" at {_where(error)}"
            record["classes"].append({"class": cls.__name__, "status": status, "detail": text})
            continue
        status = "wrong" if "wrong" in result else "pass"
        record["classes"].append(dict(result, status=status, detail=result.get("wrong", result.get("generate", ""))))
    # the family's class: the worst of its model classes (a crash outranks a refusal, which outranks a pass)
    order = ("crash", "wrong", "refused", "pass", "eager-fails", "not-buildable")
    worst = min(record["classes"], key=lambda c: order.index(c["status"]))
    record["status"], record["detail"] = worst["status"], worst["detail"]
    return record


# ----------------------------------------------------------------------------------------- driver
def _child_main(family: str, conn) -> None:
    """Body of a forked child: classify ``family`` and send the record back."""
    try:
        record = run_family(family)
    except BaseException as error:  # noqa: BLE001 - anything that escapes the classification is a crash
        record = {"family": family, "status": "crash", "detail": f"sweep child: {type(error).__name__}: {error}"}
    conn.send(record)
    conn.close()


def sweep(families, jobs=2, timeout=240.0, progress=True) -> list:
    """Every family in its own child process, ``jobs`` at a time; records in ``families``' order.

    Children are forked from this process after torch, transformers and jagged_sdpa are imported
    (and before any of them starts a thread), so a family costs its own work, not the imports; a
    child that hangs past ``timeout`` is killed and one that dies (segfault) is reported as a crash."""
    import multiprocessing

    import torch  # noqa: F401 - imported once, before forking
    import transformers  # noqa: F401
    from transformers.models.auto import modeling_auto  # noqa: F401

    from jagged_sdpa.integrations import transformers as jt  # noqa: F401

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    ctx = multiprocessing.get_context("fork")
    pending, running, results = list(families), {}, {}

    def finish(family, record, started):
        record["seconds"] = round(time.monotonic() - started, 1)
        results[family] = record
        if progress:
            print(f"[{len(results)}/{len(families)}] {family}: {record['status']} ({record['seconds']} s)",
                  file=sys.stderr, flush=True)

    while pending or running:
        while pending and len(running) < max(1, jobs):
            family = pending.pop(0)
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child_main, args=(family, send), daemon=True)
            proc.start()
            send.close()
            running[family] = (proc, receive, time.monotonic())
        time.sleep(0.05)
        for family, (proc, receive, started) in list(running.items()):
            record = None
            if receive.poll():
                try:
                    record = receive.recv()
                except EOFError:  # the child died before sending
                    record = {"family": family, "status": "crash",
                              "detail": f"child died without a result (exit code {proc.join(5) or proc.exitcode})"}
            elif not proc.is_alive():
                record = {"family": family, "status": "crash",
                          "detail": f"child died without a result (exit code {proc.exitcode})"}
            elif time.monotonic() - started > timeout:
                proc.kill()
                record = {"family": family, "status": "crash", "detail": f"timeout: no result after {timeout:.0f} s"}
            if record is not None:
                proc.join(5)
                receive.close()
                del running[family]
                finish(family, record, started)
    return [results[f] for f in families]


def summary(records) -> str:
    lines = [f"{'family':28s} {'status':14s} detail"]
    for r in records:
        lines.append(f"{r['family']:28s} {r['status']:14s} {r['detail'][:150]}")
    counts = {c: [r["family"] for r in records if r["status"] == c] for c in CLASSES}
    lines.append("")
    counted = sum(len(v) for c, v in counts.items() if c != "not-buildable")
    lines.append(f"{counted} buildable families: " + ", ".join(f"{len(counts[c])} {c}" for c in CLASSES[:-1])
                 + f"; {len(counts['not-buildable'])} not buildable (not counted)")
    for c in CLASSES:
        if counts[c]:
            lines.append(f"{c} ({len(counts[c])}): {', '.join(counts[c])}")
    silent = [r["family"] for r in records if r["status"] == "pass"
              and not any(c.get("attention_calls") for c in r.get("classes", ()))]
    if silent:
        lines.append(f"passing without any jagged attention call (no attention layer in the tiny model, or the "
                     f"family's own attention code) ({len(silent)}): {', '.join(silent)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated model types (default: every causal-LM and seq2seq-LM type)")
    parser.add_argument("--jobs", type=int, default=2, help="child processes at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per family before it counts as a hang")
    parser.add_argument("--out", help="write the records as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one family in this process (debugging): its record as JSON
        print(json.dumps(run_family(args.child), indent=1), flush=True)
        return 0
    families = args.families.split(",") if args.families else all_families()
    start = time.monotonic()
    records = sweep(families, jobs=args.jobs, timeout=args.timeout)
    print(summary(records))
    print(f"\n{len(records)} families in {time.monotonic() - start:.0f} s with --jobs {args.jobs}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
