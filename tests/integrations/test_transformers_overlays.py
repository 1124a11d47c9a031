"""Mask overlays of transformers families through attn_implementation="jagged" (issue 20, item 3).

Llama 4's chunked layers (``chunk_size``), PaliGemma's prefix-LM and Gemma3's image blocks at the start
of a sequence (``prefix_lens``), Gemma3's ``use_bidirectional_attention`` (non-causal, with its exclusive
bidirectional sliding window) and Gemma3 given ``token_type_ids`` without images (an overlay that
changes nothing). Each runs a left- and a right-padded batch against transformers' "eager" on each
sequence alone (logits and every parameter gradient) and greedy ``generate`` on a left-padded batch
(token-identical, and the logits of every step). Each test also checks that its overlay matters
(eager without it differs), so that a jagged run that ignored it could not pass. What jagged attention
cannot express exactly is refused with a ValueError naming the feature.

Tiny random-weight models from configs (no downloads), initializer_range raised so scores are O(1).
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DataCollatorWithFlattening,
    DynamicCache,
    Gemma3Config,
    Gemma3TextConfig,
    GemmaConfig,
    Llama4TextConfig,
    PaliGemmaConfig,
    SiglipVisionConfig,
    StaticCache,
)
from transformers import masking_utils  # noqa: E402

from jagged_sdpa.integrations import transformers as jt  # noqa: E402
from jagged_sdpa.integrations.transformers import compat as jt_compat  # noqa: E402
from jagged_sdpa.integrations.transformers import unpad as jt_unpad  # noqa: E402

V, IMG, N_IMG = 128, 127, 4  # vocabulary, image placeholder id, image tokens per image (8x8 pixels, 4x4 patches)
TOL = dict(rtol=1e-4, atol=1e-4)
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3, pad_token_id=0,
            bos_token_id=None, eos_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=4, num_channels=3)


def llama4(chunk=3):
    """Layer 0 chunked (chunk 3: every test sequence but one spans several chunks), layer 1 full."""
    return Llama4TextConfig(**TEXT, intermediate_size_mlp=128, attention_chunk_size=chunk, num_local_experts=2,
                            num_experts_per_tok=1, no_rope_layers=[1, 0], interleave_moe_layer_step=1)


def paligemma(text=None):
    return PaliGemmaConfig(vision_config=SiglipVisionConfig(**VISION), text_config=text or GemmaConfig(**TEXT),
                           image_token_index=IMG, vocab_size=V, projection_dim=64, hidden_size=64, pad_token_id=0)


def gemma3_text(**kw):
    return Gemma3TextConfig(**TEXT, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                            **kw)


def gemma3(sliding_window=5):
    return Gemma3Config(vision_config=SiglipVisionConfig(**VISION),
                        text_config=gemma3_text(sliding_window=sliding_window),
                        image_token_index=IMG, mm_tokens_per_image=N_IMG, boi_token_index=125, eoi_token_index=126,
                        pad_token_id=0, initializer_range=0.3)


def _pair(cfg, auto=AutoModelForCausalLM):
    """(eager, jagged) with identical weights."""
    torch.manual_seed(0)
    eager = auto.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    projection = getattr(getattr(eager, "model", None), "multi_modal_projector", None)
    if projection is not None and hasattr(projection, "mm_input_projection_weight"):
        with torch.no_grad():  # Gemma3 initialises it to zeros: images would all look the same
            projection.mm_input_projection_weight.normal_()
    jagged = auto.from_config(copy.deepcopy(cfg), attn_implementation=jt.register()).eval()
    jagged.load_state_dict(eager.state_dict())
    return eager, jagged


def _sample(n_text, image=None, suffix=0, seed=0):
    """One sequence: input_ids, token_type_ids and pixel_values. image=None: text only; "paligemma":
    image tokens then n_text prompt tokens (type 0: the prefix) then ``suffix`` tokens (type 1);
    "gemma3": image tokens (type 1) then text (type 0)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 120, (n_text + suffix,), generator=g)
    if image is None:
        return dict(input_ids=text, token_type_ids=torch.zeros(len(text), dtype=torch.long))
    ids = torch.cat([torch.full((N_IMG,), IMG), text])
    tt = torch.zeros(len(ids), dtype=torch.long)
    if image == "paligemma":
        tt[N_IMG + n_text:] = 1
    else:
        tt[:N_IMG] = 1
    return dict(input_ids=ids, token_type_ids=tt, pixel_values=torch.randn(1, 3, 8, 8, generator=g))


def _batch(samples, side, token_types=True):
    L = max(len(s["input_ids"]) for s in samples)
    B = len(samples)
    ids, mask, tt = (torch.zeros(B, L, dtype=torch.long) for _ in range(3))
    for b, s in enumerate(samples):
        rows = _rows(side, len(s["input_ids"]), L)
        ids[b, rows], mask[b, rows], tt[b, rows] = s["input_ids"], 1, s["token_type_ids"]
    batch = dict(input_ids=ids, attention_mask=mask)
    if token_types:
        batch["token_type_ids"] = tt
    images = [s["pixel_values"] for s in samples if "pixel_values" in s]
    if images:
        batch["pixel_values"] = torch.cat(images)
    return batch


def _rows(side, n, L):
    return slice(L - n, L) if side == "left" else slice(0, n)


def _alone(sample, token_types=True):
    out = {k: (v if k == "pixel_values" else v[None]) for k, v in sample.items()}
    if not token_types:
        out.pop("token_type_ids")
    return out


def _check_padded_batch(eager, jagged, samples, side, token_types=True, overlay_off=None):
    """Logits of every sequence and every parameter gradient of a per-sequence linear loss: the padded
    batch under jagged vs eager on each sequence alone. ``overlay_off``: an eager model (or inputs) that
    lacks the overlay, whose logits must differ (the overlay matters here)."""
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(len(s["input_ids"]), V, generator=g) for s in samples]
    eager.zero_grad(set_to_none=True)
    refs = []
    for s, w in zip(samples, weights):
        logits = eager(**_alone(s, token_types)).logits[0]
        (logits * w).sum().backward()
        refs.append(logits.detach())
    ref_grads = {n: p.grad.clone() for n, p in eager.named_parameters() if p.grad is not None}
    eager.zero_grad(set_to_none=True)
    if overlay_off is not None:
        with torch.no_grad():
            plain = overlay_off(samples[0])
        assert not torch.allclose(plain, refs[0], **TOL), "the overlay changes nothing here: the test is blind"

    batch = _batch(samples, side, token_types)
    L = batch["input_ids"].shape[1]
    jagged.zero_grad(set_to_none=True)
    logits = jagged(**batch).logits
    loss = 0
    for b, (s, w, ref) in enumerate(zip(samples, weights, refs)):
        rows = _rows(side, len(s["input_ids"]), L)
        torch.testing.assert_close(logits[b, rows], ref, **TOL, msg=lambda m, b=b: f"sequence {b}: {m}")
        loss = loss + (logits[b, rows] * w).sum()
    loss.backward()
    got = {n: p.grad for n, p in jagged.named_parameters() if p.grad is not None}
    assert got.keys() == ref_grads.keys()
    for n, grad in got.items():
        # fp32 sums of O(10) gradients; 5e-5: the vision tower's key biases, whose exact gradient is 0, get noise
        scale = max(1.0, ref_grads[n].abs().max().item())
        torch.testing.assert_close(grad, ref_grads[n], rtol=1e-3, atol=5e-5 * scale,
                                   msg=lambda m, n=n: f"grad of {n}: {m}")
    jagged.zero_grad(set_to_none=True)


def _check_generate(eager, jagged, samples, cache="dynamic", new=8, token_types=True):
    """Greedy generation from a left-padded batch vs eager on each prompt alone: the same tokens and
    the same logits at every step."""
    greedy = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    batch = _batch(samples, "left", token_types)
    L = batch["input_ids"].shape[1]
    with torch.no_grad():
        if cache == "static":
            batch["past_key_values"] = StaticCache(config=jagged.config, max_cache_len=L + new + 3)
        out = jagged.generate(**batch, **greedy)
        for b, s in enumerate(samples):
            alone = _alone(s, token_types)
            ref = eager.generate(**alone, attention_mask=torch.ones_like(alone["input_ids"]), **greedy)
            n = len(s["input_ids"])
            assert out.sequences[b, L:].tolist() == ref.sequences[0, n:].tolist(), f"sequence {b}"
            for step, (got, want) in enumerate(zip(out.logits, ref.logits)):
                torch.testing.assert_close(got[b], want[0], rtol=1e-4, atol=1e-3,
                                           msg=lambda m, b=b, step=step: f"sequence {b}, step {step}: {m}")


# --- Llama 4: chunked attention ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama4_models():
    return _pair(llama4())


def _needs_static_chunked_generate(cache):
    if cache == "static" and not jt_compat.STATIC_CACHE_CHUNKED_GENERATE:
        pytest.skip(f"transformers {transformers.__version__}: generate with a StaticCache fails for chunked "
                    "layers under any attention, eager too (its create_chunked_causal_mask() does not take "
                    "block_sequence_ids; 5.23's does)")


def _texts(lengths=(11, 3, 8), seed=1):
    return [_sample(n, seed=seed + i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama4_chunked_padded_batch(llama4_models, side):
    """chunked_overlay counts positions from each row's first real token (left padding subtracted):
    varlen's chunks, counted from each sequence's first key, are the same."""
    eager, jagged = llama4_models
    unchunked = _pair(llama4(chunk=1000))[0]
    _check_padded_batch(eager, jagged, _texts(), side, token_types=False,
                        overlay_off=lambda s: unchunked(s["input_ids"][None]).logits[0])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama4_chunked_generate(llama4_models, cache):
    """The chunked layer's cache keeps the last C - 1 keys (kv_offset > 0, not on a chunk boundary):
    the keys before the chunk of the row's first query are dropped, so varlen's first key starts it."""
    _needs_static_chunked_generate(cache)
    eager, jagged = llama4_models
    _check_generate(eager, jagged, _texts((7, 2, 5), seed=3), cache, token_types=False)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama4_chunked_generate_without_padding(llama4_models, cache):
    """No padding at all: the chunk travels on a marker mask, and the decode steps still drop the
    cached keys of earlier chunks."""
    _needs_static_chunked_generate(cache)
    eager, jagged = llama4_models
    prompt = _texts((5,), seed=6)[0]["input_ids"][None]
    greedy = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = eager.generate(prompt, **greedy)
        past = StaticCache(config=jagged.config, max_cache_len=20) if cache == "static" else DynamicCache(
            config=jagged.config)
        out = jagged.generate(prompt, past_key_values=past, **greedy)
    assert out.sequences.tolist() == ref.sequences.tolist()
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_llama4_chunked_packed_sequences(llama4_models):
    """Padding-free (DataCollatorWithFlattening): eager remaps positions per sequence, so its chunks
    start at each sequence's first token, as varlen's do. (Llama 4's layers do not hand position_ids
    to the attention function: the collator's cu_seq_lens kwargs carry the boundaries.)"""
    eager, jagged = llama4_models
    samples = _texts()
    with torch.no_grad():
        refs = [eager(s["input_ids"][None]).logits[0] for s in samples]
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": s["input_ids"].tolist()} for s in samples], return_tensors="pt")
        batch.pop("labels")
        logits = jagged(**batch, use_cache=False).logits[0]
    for part, ref in zip(logits.split([len(s["input_ids"]) for s in samples]), refs):
        torch.testing.assert_close(part, ref, **TOL)
    # position_ids alone: eager (without a cache) separates the sequences, the attention never sees them
    with pytest.raises(ValueError, match="position_ids: eager separates the sequences packed in a row"):
        jagged(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)


def test_llama4_padding_inside_a_row(llama4_models):
    """Padding between real tokens: eager's chunk positions count it. Refused where the chunks of several
    queries would differ (decoding past it: test_decoding_past_padding_inside_a_row);
    a chunk at least as long as every key changes nothing and is not refused (equal to eager's batch)."""
    eager, jagged = llama4_models
    ids = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"attention_mask: with chunked attention \(config.attention_chunk_size=3\)"):
        jagged(ids, attention_mask=mask)
    eager_wide, jagged_wide = _pair(llama4(chunk=9))
    with torch.no_grad():
        got = jagged_wide(ids, attention_mask=mask).logits
        want = eager_wide(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], **TOL)


# --- PaliGemma: prefix-LM --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def paligemma_models():
    return _pair(paligemma(), AutoModelForImageTextToText)


def _paligemma_samples(seed=1):
    return [_sample(3, "paligemma", suffix=4, seed=seed), _sample(1, "paligemma", suffix=2, seed=seed + 1),
            _sample(5, "paligemma", suffix=1, seed=seed + 2)]


@pytest.mark.parametrize("side", ["left", "right"])
def test_paligemma_prefix_padded_batch(paligemma_models, side):
    """token_type_ids 0 (image + prompt) attend bidirectionally: prefix_lens = their number."""
    eager, jagged = paligemma_models
    _check_padded_batch(eager, jagged, _paligemma_samples(), side,
                        overlay_off=lambda s: eager(s["input_ids"][None], pixel_values=s["pixel_values"]).logits[0])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_paligemma_prefix_generate(paligemma_models, cache):
    eager, jagged = paligemma_models
    _check_generate(eager, jagged, _paligemma_samples(seed=4), cache, new=6)


@pytest.mark.parametrize("side", ["left", "right"])
def test_paligemma2_prefix_longer_than_the_sliding_window(side):
    """PaliGemma 2 (Gemma2 text: sliding layers, softcap): its sliding mask ORs the prefix block on the
    windowed causal pattern, so prefix tokens see the whole prefix even beyond the window (3 here),
    as varlen's prefix_lens do."""
    from transformers import Gemma2Config

    text = Gemma2Config(**TEXT, sliding_window=3, query_pre_attn_scalar=16, attn_logit_softcapping=2.0)
    eager, jagged = _pair(paligemma(text), AutoModelForImageTextToText)
    _check_padded_batch(eager, jagged, _paligemma_samples(), side,
                        overlay_off=lambda s: eager(s["input_ids"][None], pixel_values=s["pixel_values"]).logits[0])


def test_paligemma_block_not_at_the_start_is_refused(paligemma_models):
    _, jagged = paligemma_models
    s = _sample(3, "paligemma", suffix=3)
    s["token_type_ids"] = torch.tensor([1, 1, 0, 0, 0, 0, 1, 1, 1, 1])  # the bidirectional block is not a prefix
    with pytest.raises(ValueError, match="block_sequence_ids: a bidirectional block"):
        jagged(**_alone(s))


# --- Gemma3 --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_bidirectional_models():
    cfg = gemma3_text(sliding_window=6, use_bidirectional_attention=True)
    assert cfg.sliding_window == 4  # Gemma3 halves it: |q - kv| < 4, an exclusive window
    return _pair(cfg)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gemma3_bidirectional_padded_batch(gemma3_bidirectional_models, side):
    """Full layers: or_mask_function "everything" (non-causal); sliding layers: |q - kv| < w, i.e. a
    (w-1, w-1) window where the module's sliding_window alone would say (w, w)."""
    eager, jagged = gemma3_bidirectional_models
    causal = _pair(gemma3_text(sliding_window=6))[0]
    _check_padded_batch(eager, jagged, _texts(), side, token_types=False,
                        overlay_off=lambda s: causal(s["input_ids"][None]).logits[0])


def test_gemma3_bidirectional_unpadded_packed_and_generate(gemma3_bidirectional_models):
    eager, jagged = gemma3_bidirectional_models
    ids = _texts((11,))[0]["input_ids"][None]
    with torch.no_grad():  # no padding: the window and the pattern travel on a marker
        torch.testing.assert_close(jagged(ids).logits, eager(ids).logits, **TOL)
        # packed (position_ids restarting, no cache): eager remaps the overlays' positions per sequence
        samples = _texts()
        packed = jagged(torch.cat([s["input_ids"] for s in samples])[None], use_cache=False,
                        position_ids=torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None]).logits[0]
        for part, s in zip(packed.split([len(s["input_ids"]) for s in samples]), samples):
            torch.testing.assert_close(part, eager(s["input_ids"][None]).logits[0], **TOL)
    _check_generate(eager, jagged, _texts((7, 2, 5), seed=3), token_types=False, new=5)


@pytest.fixture(scope="module")
def gemma3_models():
    return _pair(gemma3(), AutoModelForImageTextToText)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gemma3_token_type_ids_without_images(gemma3_models, side):
    """All block ids -1: the overlay changes nothing, and is not refused."""
    eager, jagged = gemma3_models
    _check_padded_batch(eager, jagged, _texts(), side)


def _gemma3_samples(seed=1):
    return [_sample(6, "gemma3", seed=seed), _sample(2, "gemma3", seed=seed + 1), _sample(4, "gemma3", seed=seed + 2)]


@pytest.mark.parametrize("side", ["left", "right"])
def test_gemma3_image_at_the_start_is_a_prefix(gemma3_models, side):
    """An image block at the start of each sequence: a prefix (here shorter than the sliding window 5,
    which Gemma3 applies after the blocks)."""
    eager, jagged = gemma3_models
    _check_padded_batch(eager, jagged, _gemma3_samples(), side,
                        overlay_off=lambda s: eager(s["input_ids"][None], pixel_values=s["pixel_values"]).logits[0])


def test_gemma3_image_generate(gemma3_models):
    eager, jagged = gemma3_models
    _check_generate(eager, jagged, _gemma3_samples(seed=4) + [_texts((3,))[0]], new=5)


def test_gemma3_images_that_are_not_a_prefix_are_refused(gemma3_models):
    _, jagged = gemma3_models
    s = _sample(3, "gemma3")
    s["input_ids"] = torch.cat([s["input_ids"][N_IMG:], s["input_ids"][:N_IMG]])  # text, then the image
    s["token_type_ids"] = s["token_type_ids"].flip(0)
    with pytest.raises(ValueError, match="block_sequence_ids: a bidirectional block"):
        jagged(**_alone(s))
    _, narrow = _pair(gemma3(sliding_window=3), AutoModelForImageTextToText)
    with pytest.raises(ValueError, match="block_sequence_ids: a bidirectional block of 4 tokens is longer than the "
                                         "sliding window"):
        narrow(**_alone(_sample(3, "gemma3")))


# --- the mask hook -----------------------------------------------------------------------------------------

def test_the_hook_reads_overlays_and_refuses_others():
    causal = masking_utils.causal_mask_function
    # a chunk that covers every key slot changes nothing: plain causal (None without padding)
    chunked = masking_utils.chunked_causal_mask_function(8, torch.zeros(2, dtype=torch.long))
    assert jt.jagged_attention_mask(2, 5, 5, mask_function=chunked) is None
    m = jt.jagged_attention_mask(2, 5, 5, mask_function=masking_utils.chunked_causal_mask_function(
        4, torch.zeros(2, dtype=torch.long)))
    assert getattr(m, jt_unpad.UNPAD_ATTR).chunk == 4
    blocks = torch.tensor([[0, 0, 0, -1, -1], [-1, -1, -1, -1, -1]])
    m = jt.jagged_attention_mask(2, 5, 5, mask_function=masking_utils.or_masks(
        causal, masking_utils.blockwise_overlay(blocks)))
    assert getattr(m, jt_unpad.UNPAD_ATTR).prefix_lens.tolist() == [3, 0]
    # arbitrary overlays are refused by name, whatever they compute; so are transformers' own overlays
    # passed as and_mask_function, whose window or sequence ids the module does not know (t5gemma2, esmc)
    ids = torch.tensor([[0, 0, 1, 1, 1]] * 2)
    for custom in (masking_utils.or_masks(causal, lambda b, h, q, kv: q >= kv),
                   masking_utils.and_masks(causal, lambda b, h, q, kv: q >= kv),
                   masking_utils.or_masks(causal, lambda *args: torch.tensor(False)),
                   masking_utils.and_masks(causal, masking_utils.sliding_window_overlay(3)),
                   masking_utils.and_masks(masking_utils.bidirectional_mask_function,
                                           masking_utils.sliding_window_bidirectional_overlay(2)),
                   masking_utils.and_masks(masking_utils.bidirectional_mask_function,
                                           masking_utils.packed_sequence_mask_function(ids)),
                   # an OR on a bidirectional window reaches past it (even a known overlay)
                   masking_utils.or_masks(masking_utils.sliding_window_bidirectional_mask_function(2),
                                          masking_utils.blockwise_overlay(ids))):
        with pytest.raises(ValueError, match="mask_function: this model adds a custom mask overlay"):
            jt.jagged_attention_mask(2, 5, 5, mask_function=custom, use_vmap=True)
    # blocks over a packed row are numbered across its sequences: refused
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    packed = jt_compat.packed_mask_function(causal, positions, masking_utils.find_packed_sequence_indices(positions))
    with pytest.raises(ValueError, match="block_sequence_ids: bidirectional blocks .* in packed sequences"):
        jt.jagged_attention_mask(1, 5, 5, mask_function=masking_utils.or_masks(
            packed, masking_utils.blockwise_overlay(torch.zeros(1, 5, dtype=torch.long))))


# --- sliding windows over padding inside a row ----------------------------------------------------------------

@pytest.mark.parametrize("family,cache", [("mistral", "sliding"), ("mistral", "full"), ("qwen2", "sliding"),
                                          ("llama4", "sliding"), ("llama4", "full")])
def test_decoding_past_padding_inside_a_row(family, cache):
    """A right-padded prompt batch continued token by token (a chat turn appended after the padding):
    each short row has padding between its prompt and its new tokens, which eager's window counts.
    Decoding (one query per row) keeps exactly the real keys of the window, so each step equals eager on
    the same batch and cache ("sliding": transformers' sliding layers keep w - 1 keys; "full": a cache
    without config keeps every key, and the hook drops those before the window). The same for Llama 4's
    chunks (eager's chunk positions count the padding too). A forward with padding inside the window or
    chunks of later queries stays refused."""
    from transformers import MistralConfig, Qwen2Config

    common = {k: v for k, v in TEXT.items() if k != "head_dim"}
    cfg = {"mistral": lambda: MistralConfig(**common, sliding_window=4),
           "qwen2": lambda: Qwen2Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=1),
           "llama4": lambda: llama4(chunk=4)}[family]()  # chunk 4: the 5-token row's first step has a hole
    eager, jagged = _pair(cfg)
    batch = _batch(_texts((7, 2, 5), seed=3), "right", token_types=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    caches = [DynamicCache(config=m.config) if cache == "sliding" else DynamicCache() for m in (eager, jagged)]
    nxt = torch.randint(1, V, (3, 1), generator=torch.Generator().manual_seed(7))  # the appended turn's first token
    with torch.no_grad():
        for m, cache in zip((eager, jagged), caches):
            m(ids, attention_mask=mask, past_key_values=cache)
        for step in range(6):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            pos = mask.sum(1, keepdim=True) - 1
            want, got = (m(nxt, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
                         for m, cache in zip((eager, jagged), caches))
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, step=step: f"step {step}: {m}")
            nxt = want.argmax(-1, keepdim=True)
    ids = torch.randint(1, V, (1, 9), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="attention_mask: (a row has padding between real tokens inside the "
                                         "sliding|with chunked attention)"):
        jagged(ids, attention_mask=torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 1]]))
