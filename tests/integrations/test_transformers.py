"""attn_implementation="jagged" against transformers' own "eager" attention on the same weights.

The reference for every sequence of a padded or packed batch is the eager model run on that
sequence alone (no padding at all), so padding leaks, wrong causal alignment, wrong sliding-window
or softcap semantics all show up as logit, gradient or generated-token differences. Tiny
random-weight models built from configs (no downloads); initializer_range is raised so that scores
are O(1) and softcap/window choices change the numbers.
"""

import copy
import importlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    DynamicCache,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    StaticCache,
)
from transformers import masking_utils  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from jagged_sdpa.integrations import transformers as jt  # noqa: E402
from jagged_sdpa.integrations.transformers import eager as jt_eager, unpad as jt_unpad  # noqa: E402

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, pad_token_id=0,
              bos_token_id=None, eos_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),  # GQA 4:2
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=4),  # window < every test sequence but one
    "gemma2": lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=2.0, final_logit_softcapping=30.0),
    # Qwen2's own hybrid: layer 0 full, layer 1 sliding (window 5)
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1),
}
LENGTHS = (11, 3, 8)
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def models():
    """(eager, jagged) pairs with identical weights, built lazily per family."""
    name = jt.register()
    cache = {}

    def get(family):
        if family not in cache:
            torch.manual_seed(0)
            cfg = CONFIGS[family]()
            # from_config writes attn_implementation into the config itself: one copy per model
            eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
            jagged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name).eval()
            jagged.load_state_dict(eager.state_dict())
            assert jagged.config._attn_implementation == name
            cache[family] = (eager, jagged)
        return cache[family]

    return get


def _sequences(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g) for n in lengths]


def _pad(seqs, side):
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(L - len(s), L) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() computes
    return ids, mask, position_ids


def _rows(side, n, L):
    return slice(L - n, L) if side == "left" else slice(0, n)


def _weights(seqs, seed=2):
    """A fixed random linear loss per sequence (sum of weighted logits): additive over sequences."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(len(s), V, generator=g) for s in seqs]


def _reference(eager, seqs, weights):
    """Eager logits of every sequence alone, and the gradients of the summed per-sequence losses."""
    eager.zero_grad(set_to_none=True)
    logits = []
    for s, w in zip(seqs, weights):
        out = eager(s[None]).logits[0]
        (out * w).sum().backward()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in eager.named_parameters() if p.grad is not None}
    eager.zero_grad(set_to_none=True)
    return logits, grads


def _check_grads(model, ref_grads):
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref_grads.keys()
    for n, g in got.items():
        scale = max(1.0, ref_grads[n].abs().max().item())  # fp32 sums of O(10) gradients
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-3, atol=1e-5 * scale,
                                   msg=lambda m, n=n: f"grad of {n}: {m}")
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("side,positions", [("left", "generate"), ("left", "default"), ("right", "default")])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_padded_batch_logits_and_grads(models, family, side, positions):
    """positions="default": the model numbers tokens 0..L-1 itself (RoPE is relative, so scores are
    unchanged) and only the mask tells where the padding is; "generate": position ids restart at the
    first real token and padding repeats a position (as generate() builds them)."""
    eager, jagged = models(family)
    seqs = _sequences()
    weights = _weights(seqs)
    ref_logits, ref_grads = _reference(eager, seqs, weights)

    ids, mask, pos = _pad(seqs, side)
    pos = pos if positions == "generate" else None
    jagged.zero_grad(set_to_none=True)
    logits = jagged(ids, attention_mask=mask, position_ids=pos).logits
    loss = 0
    for b, (s, w) in enumerate(zip(seqs, weights)):
        rows = _rows(side, len(s), ids.shape[1])
        torch.testing.assert_close(logits[b, rows], ref_logits[b], **TOL)
        loss = loss + (logits[b, rows] * w).sum()
    loss.backward()
    _check_grads(jagged, ref_grads)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_packed_position_ids_logits_and_grads(models, family):
    """Padding-free: one row, position_ids restart at 0 for every sequence."""
    eager, jagged = models(family)
    seqs = _sequences()
    weights = _weights(seqs)
    ref_logits, ref_grads = _reference(eager, seqs, weights)

    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    jagged.zero_grad(set_to_none=True)
    logits = jagged(ids, position_ids=pos).logits[0]
    for part, ref in zip(logits.split(list(LENGTHS)), ref_logits):
        torch.testing.assert_close(part, ref, **TOL)
    (logits * torch.cat(weights)).sum().backward()
    _check_grads(jagged, ref_grads)


def test_packed_collator_kwargs_alone_define_the_sequences(models):
    """DataCollatorWithFlattening's cu_seq_lens_q/k + max_length_q/k, with no position_ids at all:
    the boundaries can only come from those kwargs (RoPE is relative, so the model's default
    0..total-1 positions do not change the per-sequence scores)."""
    eager, jagged = models("llama")
    seqs = _sequences()
    ref_logits, _ = _reference(eager, seqs, _weights(seqs))
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)
    batch = collator([{"input_ids": s.tolist()} for s in seqs], return_tensors="pt")
    assert isinstance(batch["max_length_q"], int) and "position_ids" not in batch
    batch.pop("labels")
    with torch.no_grad():
        logits = jagged(**batch).logits[0]
    for part, ref in zip(logits.split(list(LENGTHS)), ref_logits):
        torch.testing.assert_close(part, ref, **TOL)
    # and without them the row is one long sequence: the second sequence's logits change
    with torch.no_grad():
        plain = jagged(batch["input_ids"]).logits[0]
    assert not torch.allclose(plain.split(list(LENGTHS))[1], ref_logits[1], **TOL)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_generate_token_identical(models, family, cache):
    """A left-padded batch of prompts of different lengths vs eager generating each prompt alone:
    the same tokens, and the same logits at every step (tokens alone can hide a leak)."""
    eager, jagged = models(family)
    prompts = _sequences((7, 2, 5), seed=3)
    new = 8
    greedy = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        refs = [eager.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **greedy)
                for p in prompts]
        ids, mask, _ = _pad(prompts, "left")
        if cache == "static":
            past = StaticCache(config=jagged.config, max_cache_len=ids.shape[1] + new + 3)
        else:
            past = DynamicCache(config=jagged.config)
        out = jagged.generate(ids, attention_mask=mask, past_key_values=past, **greedy)
    assert type(past) is {"static": StaticCache, "dynamic": DynamicCache}[cache]
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        assert out.sequences[b, ids.shape[1]:].tolist() == ref.sequences[0, len(p):].tolist(), f"sequence {b}"
        for step, (got, want) in enumerate(zip(out.logits, ref.logits)):
            torch.testing.assert_close(got[b], want[0], rtol=1e-4, atol=1e-3,
                                       msg=lambda m, b=b, step=step: f"sequence {b}, step {step}: {m}")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_chunk_continuation_with_cache(models, family, cache):
    """Several new queries at once on top of a cache (chunked prefill, chat continuation): bottom-right
    alignment with Q > 1, padded rows, and for sliding layers a cache that already dropped keys
    (Mistral's window 4 < the 7 cached tokens) or a full static sliding layer (Gemma2)."""
    eager, jagged = models(family)
    full = _sequences((10, 4, 7), seed=5)
    with torch.no_grad():
        refs = [eager(s[None]).logits[0, -3:] for s in full]
        ids, mask, pos = _pad(full, "left")  # left padding: the last 3 columns continue every row
        if cache == "static":
            past = StaticCache(config=jagged.config, max_cache_len=ids.shape[1] + 2)
        else:
            past = DynamicCache(config=jagged.config)
        jagged(ids[:, :-3], attention_mask=mask[:, :-3], position_ids=pos[:, :-3], past_key_values=past)
        logits = jagged(ids[:, -3:], attention_mask=mask, position_ids=pos[:, -3:], past_key_values=past).logits
    for b, ref in enumerate(refs):
        torch.testing.assert_close(logits[b], ref, **TOL, msg=lambda m, b=b: f"sequence {b}: {m}")


def test_from_pretrained_with_the_registered_name(tmp_path, models):
    """The loader accepts the name for a family with SDPA disabled (Gemma2) from a local checkpoint."""
    eager, _ = models("gemma2")
    eager.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=jt.register()).eval()
    assert loaded.config._attn_implementation == "jagged"
    ids, mask, _ = _pad(_sequences(), "left")
    with torch.no_grad():
        got = loaded(ids, attention_mask=mask).logits
        want = eager(ids[1:2, -LENGTHS[1]:]).logits[0]
    torch.testing.assert_close(got[1, -LENGTHS[1]:], want, **TOL)


@pytest.mark.parametrize("family,prompt_len", [("llama", 6), ("gemma2", 2)])
def test_static_generate_without_padding(models, family, prompt_len):
    """generate() drops an all-ones mask for non-flash names: the mask function must rebuild the
    real length, or zero-filled static cache slots get attended. Gemma2 with a 2-token prompt walks
    its static sliding layers (window 4) through not-yet-full, becoming-full and rolling states."""
    eager, jagged = models(family)
    prompt = _sequences((prompt_len,), seed=4)[0][None]
    greedy = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = eager.generate(prompt, **greedy)
        past = StaticCache(config=jagged.config, max_cache_len=20)
        out = jagged.generate(prompt, past_key_values=past, **greedy)
    assert out.sequences.tolist() == ref.sequences.tolist()
    for step, (got, want) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3, msg=lambda m, step=step: f"step {step}: {m}")


def test_dropout_applied_only_in_training(models):
    """attention_dropout=1 drops every probability: eager and jagged then agree in train mode
    (attention output 0), and differ from eval mode, where no dropout applies."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**COMMON, attention_dropout=1.0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    jagged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=jt.register())
    jagged.load_state_dict(eager.state_dict())
    ids, mask, pos = _pad(_sequences(), "left")
    with torch.no_grad():
        train = jagged.train()(ids, attention_mask=mask, position_ids=pos).logits
        ref = eager.train()(ids, attention_mask=mask, position_ids=pos).logits
        evaluated = jagged.eval()(ids, attention_mask=mask, position_ids=pos).logits
    valid = mask.bool()
    torch.testing.assert_close(train[valid], ref[valid], **TOL)
    assert not torch.allclose(train[valid], evaluated[valid], **TOL)


def test_mask_function_geometry():
    """The mask function against hand-written validity: a static cache of 8 slots, 2 cached
    tokens (the first one padding), 3 new queries (the last one padding)."""
    padding = torch.tensor([[0, 1, 1, 1, 0]])
    m = jt.jagged_attention_mask(1, 3, 8, q_offset=2, kv_offset=0, attention_mask=padding)
    assert m.dtype == torch.bool and m.shape == (1, 1, 1, 11)
    assert m.view(-1).int().tolist() == [1, 1, 0] + [0, 1, 1, 1, 0, 0, 0, 0]
    # no 2-D mask (generate dropped it): the real length is q_offset + q_length
    m = jt.jagged_attention_mask(2, 1, 6, q_offset=torch.tensor(3), kv_offset=0, attention_mask=None)
    assert m.view(2, -1).int().tolist() == [[1, 1, 1, 1, 1, 0, 0]] * 2
    # sliding layer whose cache starts at absolute position 3
    m = jt.jagged_attention_mask(1, 1, 4, q_offset=6, kv_offset=3, attention_mask=torch.tensor([[0] * 4 + [1] * 3]))
    assert m.view(-1).int().tolist() == [1] + [0, 1, 1, 1]
    # nothing padded, no cache slot empty: None (dense path)
    assert jt.jagged_attention_mask(2, 4, 4, attention_mask=torch.ones(2, 4)) is None
    assert jt.jagged_attention_mask(2, 1, 5, q_offset=4, attention_mask=None) is None


def test_sliding_window_with_padding_inside_a_row_is_refused(models):
    _, jagged = models("mistral")
    ids = torch.randint(1, V, (1, 9))
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask: a row has padding between real tokens"):
        jagged(ids, attention_mask=mask)


def test_bad_masks_are_refused(models):
    _, jagged = models("llama")
    attn = jagged.model.layers[0].self_attn
    q = torch.randn(2, 4, 5, 16)
    kv = torch.randn(2, 2, 5, 16)
    with pytest.raises(ValueError, match="attention_mask: jagged attention got a torch.float32 mask"):
        jt.jagged_attention_forward(attn, q, kv, kv, torch.zeros(2, 1, 5, 5))
    with pytest.raises(TypeError, match="attention_mask: expected a tensor"):
        jt.jagged_attention_forward(attn, q, kv, kv, [[1, 1]])
    with pytest.raises(ValueError, match="attention_mask: batch size 3"):
        jt.jagged_attention_mask(2, 5, 5, attention_mask=torch.ones(3, 5))
    with pytest.raises(ValueError, match="sliding_window: must be a positive int"):
        jt.jagged_attention_forward(attn, q, kv, kv, None, sliding_window=0)
    with pytest.raises(ValueError, match="mask_function: this model adds a custom mask overlay"):
        jt.jagged_attention_mask(2, 5, 5, attention_mask=None, use_vmap=True)
    # bidirectional blocks are a prefix-LM only at the start of a sequence (tests/integrations/test_transformers_overlays.py)
    blocks = torch.tensor([[-1, 0, 0, -1, -1]] * 2)
    blockwise = masking_utils.or_masks(masking_utils.causal_mask_function, masking_utils.blockwise_overlay(blocks))
    with pytest.raises(ValueError, match="block_sequence_ids: a bidirectional block"):
        jt.jagged_attention_mask(2, 5, 5, mask_function=blockwise, attention_mask=None)
    custom = masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv == 0)
    with pytest.raises(ValueError, match="mask_function: this model adds a custom mask overlay"):
        jt.jagged_attention_mask(2, 5, 5, mask_function=custom, attention_mask=None, use_vmap=True)


def test_register_is_idempotent_and_returns_the_name():
    assert jt.register() == "jagged"
    assert jt.register() == "jagged"
    assert AttentionInterface._global_mapping["jagged"] is jt.jagged_attention_forward
    assert AttentionMaskInterface._global_mapping["jagged"] is jt.jagged_attention_mask
    assert jt.register("jagged_test_alias") == "jagged_test_alias"
    for bad in ("my_sdpa", "FlashJagged", "eager", "sdpa", ""):
        with pytest.raises(ValueError, match="name"):
            jt.register(bad)
    with pytest.raises(TypeError, match="name"):
        jt.register(3)


def test_import_error_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    monkeypatch.delitem(sys.modules, "jagged_sdpa.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install \"jagged_sdpa\[transformers\]\""):
        importlib.import_module("jagged_sdpa.integrations.transformers")


def test_padding_free_compiles_fullgraph(models):
    """docs/api.md section 8: padding-free mode compiles with fullgraph=True (Inductor), equal to eager.
    The integration passes the collator's max lengths as ints and reads no tensor data on that path."""
    _, jagged = models("llama")
    seqs = _sequences()
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in seqs],
                                                                      return_tensors="pt")
    batch.pop("labels")
    with torch.no_grad():
        ref = jagged(**batch).logits
        got = torch.compile(jagged, fullgraph=True)(**batch).logits
    torch.testing.assert_close(got, ref, **TOL)


def test_compiled_packed_training_step_has_no_graph_break(models):
    """A padding-free training step (loss and every parameter gradient) compiled with
    fullgraph=True equals eager, and Dynamo finds no graph break in it."""
    _, jagged = models("llama")
    seqs = _sequences()
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in seqs],
                                                                      return_tensors="pt")

    def loss_of(**kw):
        return jagged(**kw).loss

    explained = torch._dynamo.explain(loss_of)(**batch)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    torch._dynamo.reset()
    params = [p for p in jagged.parameters() if p.requires_grad]
    want_loss = loss_of(**batch)
    want = torch.autograd.grad(want_loss, params)
    got_loss = torch.compile(loss_of, fullgraph=True, backend="aot_eager")(**batch)
    got = torch.autograd.grad(got_loss, params)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("family, masks", [("llama", 1), ("qwen2", 2)])
def test_one_batch_validation_per_forward_not_per_layer(models, family, masks, monkeypatch):
    """The mask function unpads once per forward and mask kind, and every layer's call finds that
    batch again: at most one batch made per mask per forward (``batch.build`` over a host read, or
    ``batch.from_ranges`` over the hook's own host ranges, which reads nothing), prefill and every
    decode step, whatever the number of layers (qwen2 mixes full and sliding layers: transformers
    builds a mask for each kind)."""
    from jagged_sdpa import batch, layout

    _, jagged = models(family)
    reads, made = [], []
    real_read, real_build, real_ranges = layout.read_host, batch.build, batch.from_ranges
    monkeypatch.setattr(layout, "read_host", lambda *t: reads.append(len(t)) or real_read(*t))
    monkeypatch.setattr(batch, "build", lambda *a, **k: made.append("build") or real_build(*a, **k))
    monkeypatch.setattr(batch, "from_ranges", lambda *a, **k: made.append("ranges") or real_ranges(*a, **k))
    ids, mask, _ = _pad(_sequences((7, 2, 5), seed=3), "left")
    with torch.no_grad():
        past = DynamicCache(config=jagged.config)
        out = jagged(ids, attention_mask=mask, past_key_values=past, use_cache=True)
        assert len(made) == masks and len(reads) == made.count("build"), (made, reads)
        for step in range(3):
            made.clear(), reads.clear()
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = jagged(nxt, attention_mask=mask, past_key_values=past, use_cache=True)
            # at most: a batch of decode rows without padding (sliding layers) may be found again from
            # an earlier forward of the same shape, cache read in place
            assert len(made) <= masks and len(reads) == made.count("build"), (step, made, reads)


def test_gpt_oss_sinks_equal_eager():
    """Issue 20: gpt-oss passes learned per-head sinks as ``s_aux``; "jagged" runs them (docs/api.md section 11,
    on MATH until a kernel takes sinks) with its sliding-window layers: logits, the sinks' gradient
    and greedy generation equal "eager" on each sequence alone."""
    from transformers import GptOssConfig

    name = jt.register()
    cfg = GptOssConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                       max_position_embeddings=256, pad_token_id=0, initializer_range=0.3)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    jagged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name).eval()
    jagged.load_state_dict(eager.state_dict())
    seqs = _sequences((9, 3, 6), seed=5)
    weights = _weights(seqs)
    ref_logits, ref_grads = _reference(eager, seqs, weights)
    ids, mask, _ = _pad(seqs, "left")
    jagged.zero_grad(set_to_none=True)
    logits = jagged(ids, attention_mask=mask).logits
    loss = sum((logits[b, _rows("left", len(s), ids.shape[1])] * w).sum() for b, (s, w) in enumerate(zip(seqs, weights)))
    loss.backward()
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b, _rows("left", len(s), ids.shape[1])].detach(), ref_logits[b], **TOL)
    sinks = [n for n in ref_grads if n.endswith("sinks")]
    assert len(sinks) == 2
    got = dict(jagged.named_parameters())
    for n in sinks:
        torch.testing.assert_close(got[n].grad, ref_grads[n], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        out = jagged.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        for b, s in enumerate(seqs):
            want = eager.generate(s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), max_new_tokens=6,
                                  do_sample=False)
            assert out[b, ids.shape[1]:].tolist() == want[0, len(s):].tolist()


def test_eager_mask_without_a_mask_function_is_causal():
    """The mask hook's fallback when transformers passes no mask_function: its own causal mask."""
    mask = jt_eager.eager_mask(2, 3, 5, 2, 0, None, None, False, None)
    expected = masking_utils.eager_mask(batch_size=2, q_length=3, kv_length=5, q_offset=2, kv_offset=0,
                                        mask_function=masking_utils.causal_mask_function, attention_mask=None,
                                        use_vmap=False, device="cpu")
    assert torch.equal(mask, expected)


class _NoCopyOfTheCache(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that makes a tensor with as many elements as the layer's used K/V (a copy
    of the cache: a gather of its valid rows, a transpose-and-reshape)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit and t.untyped_storage().data_ptr() not in given:
                raise AssertionError(f"{func} made a tensor of {t.numel()} elements (the used K has {self.limit})")
        return result


_IN_PLACE_CHECK = {"on": False, "calls": []}


def _checked_attention(module, query, key, value, attention_mask, **kwargs):
    """The jagged attention, with every decode step run under ``_NoCopyOfTheCache``."""
    if query.shape[2] == 1 and _IN_PLACE_CHECK["on"]:
        info = getattr(attention_mask, jt_unpad.UNPAD_ATTR, None) if attention_mask is not None else None
        used = int(info.seqused_k.sum()) if info is not None and info.seqused_k is not None else \
            key.shape[0] * key.shape[2]
        _IN_PLACE_CHECK["calls"].append(used)
        with _NoCopyOfTheCache(used * key.shape[1] * key.shape[3]):
            return jt.jagged_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return jt.jagged_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _in_place_check_name() -> str:
    name = "jagged_in_place_check"
    if AttentionInterface._global_mapping.get(name) is not _checked_attention:
        jt.register(name)
        AttentionInterface.register(name, _checked_attention)
    return name


@pytest.mark.parametrize("padding", ["left", "none", "right"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_decode_reads_the_cache_in_place(models, family, cache, padding):
    """docs/api.md section 12 in transformers: every decode step reads each layer's cache where it lies
    (no gather of K/V, no scatter of the output), left-padded or not, dynamic or static cache, full
    and sliding layers; tokens equal eager's on each prompt alone. Right padding leaves padding
    between the prompt and the new tokens (holes), which the in-place form cannot express: it falls
    back to the packed path, with the same tokens."""
    eager, jagged = models(family)
    name = _in_place_check_name()
    cfg = copy.deepcopy(jagged.config)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name).eval()
    model.load_state_dict(jagged.state_dict())
    decode_calls = _IN_PLACE_CHECK["calls"] = []
    _IN_PLACE_CHECK["on"] = padding != "right"
    lengths = {"left": (9, 6, 8), "none": (8, 8, 8), "right": (9, 6, 8)}[padding]
    prompts = _sequences(lengths, seed=6)
    new = 5
    ids, mask, _ = _pad(prompts, "left" if padding != "right" else "right")

    def cache_of(c):
        return StaticCache(config=c, max_cache_len=ids.shape[1] + new + 1) if cache == "static" else DynamicCache(
            config=c)

    with torch.no_grad():
        if padding == "right":
            # generate() would continue each row from its padding; decode steps fed the same tokens
            # attend past the padding (holes), and must equal eager on the same batch
            steps = torch.randint(1, V, (len(prompts), new), generator=torch.Generator().manual_seed(7))
            logits = []
            for m in (eager, model):
                past = cache_of(m.config)
                m(ids, attention_mask=mask, past_key_values=past)
                step_mask = mask
                for t in range(new):
                    step_mask = torch.cat([step_mask, torch.ones(len(prompts), 1, dtype=torch.long)], 1)
                    out = m(steps[:, t:t + 1], attention_mask=step_mask, past_key_values=past)
                logits.append(out.logits)
            torch.testing.assert_close(logits[1], logits[0], **TOL)
            return
        refs = [eager.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=new,
                               do_sample=False)[0, len(p):] for p in prompts]
        out = model.generate(ids, attention_mask=mask, past_key_values=cache_of(cfg), max_new_tokens=new,
                             do_sample=False)
    for b, ref in enumerate(refs):
        assert out[b, ids.shape[1]:].tolist() == ref.tolist(), f"sequence {b}"
    if padding != "right":
        assert len(decode_calls) == (new - 1) * cfg.num_hidden_layers


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_static_cache_compiled_generate(models, family):
    """transformers' fast-generation recipe (static cache, ``model.forward = torch.compile(...,
    fullgraph=True)``) with "jagged": tokens equal "sdpa"'s under the same recipe, no graph break
    (fullgraph), and one graph for the prefill and one for every decode step: the per-row ranges are
    tensors and the cache length bounds ``max_seqlen_k``, so nothing recompiles as the rows grow, nor
    at the next ``generate``."""
    import torch._dynamo

    eager, jagged = models(family)
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(eager.config), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    model = AutoModelForCausalLM.from_config(copy.deepcopy(jagged.config), attn_implementation=jt.register()).eval()
    model.load_state_dict(eager.state_dict())
    ids, mask, _ = _pad(_sequences((9, 6, 8), seed=8), "left")
    tokens, graphs = {}, {}
    for label, m in (("sdpa", sdpa), ("jagged", model)):
        torch._dynamo.reset()
        compiled = []

        def backend(gm, example_inputs, compiled=compiled):
            compiled.append(gm)
            return gm.forward

        m.forward = torch.compile(m.forward, fullgraph=True, backend=backend)
        with torch.no_grad():  # twice: a second call (a fresh cache, caches of ours filled) compiles nothing
            for _ in range(2):
                tokens[label] = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                           cache_implementation="static")
        graphs[label] = len(compiled)
    torch._dynamo.reset()
    assert torch.equal(tokens["jagged"], tokens["sdpa"])
    assert graphs["jagged"] == graphs["sdpa"] == 2, graphs
