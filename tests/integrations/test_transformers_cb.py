"""Continuous batching (docs/api.md section 8, issue 19 item 4): jt.enable_continuous_batching().

transformers' ``generate_batch`` with jagged attention in the "sdpa" entry against the same call with
transformers' own SDPA (and against plain per-sequence ``generate``): greedy tokens identical, log
probabilities close, including chunked prefill (prompts longer than max_batch_tokens), several
steps that mix prefill and decode, shared prefixes (block sharing) and sliding-window layers. Tiny
random-weight models built from configs.
"""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from jagged_sdpa.integrations import transformers as jt  # noqa: E402
from jagged_sdpa.integrations.transformers import continuous_batching as jt_cb  # noqa: E402
# the entry continuous batching calls ("sdpa"; transformers 5.17: "paged|sdpa") and transformers' function in it
from jagged_sdpa.integrations.transformers.compat import CB_ENTRY, CB_ENTRY_DEFAULT  # noqa: E402
from jagged_sdpa.integrations.transformers.compat import (continuous_batching_config,  # noqa: E402
                                                          continuous_batching_sees_memory)

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, pad_token_id=0,
              bos_token_id=None, eos_token_id=None)
NEW = 10


@pytest.fixture(autouse=True)
def _restore_sdpa():
    yield
    jt.disable_continuous_batching()
    assert AttentionInterface._global_mapping[CB_ENTRY] is CB_ENTRY_DEFAULT


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**COMMON), attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def mistral():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MistralConfig(**COMMON, sliding_window=7), attn_implementation="sdpa").eval()


def _prompts(lengths, seed=1, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(1, V, (n,), generator=g).tolist() for n in lengths]


def _needs_cache_memory():
    if not continuous_batching_sees_memory():
        pytest.skip(f"transformers {transformers.__version__} sees no memory on this machine to size the paged cache "
                    "(5.17 reads a CPU's through psutil only, which is not installed; 5.23 reads it from the OS)")


def _generate_batch(model, prompts, max_batch_tokens=32, page_size=16, **cb):
    _needs_cache_memory()
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    cbc = continuous_batching_config(page_size, num_blocks=64, max_batch_tokens=max_batch_tokens,
                                     return_logprobs=True, **cb)
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cbc, progress_bar=False)
    outs = [out[f"req_{i}"] for i in range(len(prompts))]
    return [o.generated_tokens for o in outs], [torch.tensor(o.logprobs) for o in outs]


def _compare(model, prompts, expect_modes, **kw):
    ref_tokens, ref_lp = _generate_batch(model, prompts, **kw)
    jt.enable_continuous_batching()
    before = dict(jt_cb.stats)
    tokens, lp = _generate_batch(model, prompts, **kw)
    used = {m: jt_cb.stats[m] - before[m] for m in before}
    jt.disable_continuous_batching()
    assert tokens == ref_tokens
    for a, b in zip(lp, ref_lp):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for mode in expect_modes:  # the jagged path ran (not a silent fallback)
        assert used[mode] > 0, used
    assert used["fallback"] == 0, used
    # an independent reference: each prompt alone through plain generate (transformers' SDPA, no paging)
    with torch.no_grad():
        for p, t in zip(prompts, tokens):
            alone = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
            assert alone[0, len(p):].tolist() == t
    return used


def test_generate_batch_token_identical_with_chunked_prefill(llama):
    # 70 and 45 > max_batch_tokens=32: chunked prefill; steps mix prefill chunks and decodes
    used = _compare(llama, _prompts((5, 70, 12, 45, 1, 33)), expect_modes=("paged", "packed"))
    assert used["gather"] == 0
    # the step's metadata is built once and reused by both layers
    assert used["paged"] + used["packed"] == 2 * used["groups"]


def test_generate_batch_single_long_prompt_and_small_pages(llama):
    _compare(llama, _prompts((150,), seed=3), expect_modes=("paged",), max_batch_tokens=24, page_size=8)


def test_generate_batch_shared_prefix_blocks(llama):
    """Prompts with a common 40-token prefix: transformers shares their full blocks (prefix caching),
    so two requests' block tables point at the same pages."""
    prefix = _prompts((40,), seed=5)[0]
    _compare(llama, _prompts((3, 9, 20), seed=6, prefix=prefix), expect_modes=("paged",), page_size=8)


def test_generate_batch_sliding_window(mistral):
    """Sliding-window layers use transformers' ring-buffer cache: read through its update, attended
    ragged with the window, no mask."""
    used = _compare(mistral, _prompts((5, 40, 12, 3)), expect_modes=("gather",))
    assert used["paged"] == 0


def test_generate_batch_hybrid_full_and_sliding_layers():
    """Qwen2's hybrid: layer 0 full attention (paged, block table), layer 1 sliding (ring buffer):
    two cache groups per step, each built once."""
    torch.manual_seed(0)
    cfg = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    used = _compare(model, _prompts((5, 40, 12, 3)), expect_modes=("paged", "gather"))
    assert used["paged"] + used["packed"] + used["gather"] == used["groups"]  # one layer per group


def test_other_calls_run_transformers_sdpa(llama):
    """With continuous batching enabled, an ordinary forward is transformers' SDPA, bit for bit."""
    ids = torch.randint(1, V, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        ref = llama(ids, attention_mask=mask).logits
        jt.enable_continuous_batching()
        before = dict(jt_cb.stats)
        got = llama(ids, attention_mask=mask).logits
    assert torch.equal(got, ref)
    assert jt_cb.stats == before


def test_enable_disable_idempotent_and_scoped():
    assert not jt.continuous_batching_enabled()
    jt.enable_continuous_batching()
    jt.enable_continuous_batching()
    assert jt.continuous_batching_enabled()
    assert AttentionInterface._global_mapping[CB_ENTRY] is jt.continuous_batching_sdpa_forward
    jt.disable_continuous_batching()
    jt.disable_continuous_batching()
    assert AttentionInterface._global_mapping[CB_ENTRY] is CB_ENTRY_DEFAULT
    # an entry someone else put in after enabling is theirs: disable leaves it alone
    jt.enable_continuous_batching()

    def other(*a, **k):
        return CB_ENTRY_DEFAULT(*a, **k)

    AttentionInterface.register(CB_ENTRY, other)
    jt.disable_continuous_batching()
    assert AttentionInterface._global_mapping[CB_ENTRY] is other
    AttentionInterface.register(CB_ENTRY, CB_ENTRY_DEFAULT)


def test_block_table_from_read_indices():
    """The block table derived from transformers' read indices reads exactly the same tokens; read
    indices that are not whole pages in order give None (the cache is then gathered)."""
    page = 4
    # two requests: 6 keys in blocks (pages) 7, 2; 3 keys in page 5
    reads = torch.tensor([28, 29, 30, 31, 8, 9, 20, 21, 22])
    cu_k = torch.tensor([0, 6, 9], dtype=torch.int32)
    table = jt_cb.block_table_of(reads, cu_k, cu_k.diff(), 6, page, 9)
    assert table.dtype == torch.int32 and table.tolist() == [[7, 2], [5, 0]]
    shuffled = torch.tensor([28, 29, 31, 30, 8, 9, 20, 21, 22])  # not in position order within a page
    assert jt_cb.block_table_of(shuffled, cu_k, cu_k.diff(), 6, page, 9) is None
    unaligned = torch.tensor([29, 30, 31, 32, 8, 9, 20, 21, 22])  # a page that starts mid-page
    assert jt_cb.block_table_of(unaligned, cu_k, cu_k.diff(), 6, page, 9) is None


def test_example_runs(monkeypatch, capsys):
    import os
    import runpy

    _needs_cache_memory()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr("sys.argv", ["continuous_batching_hf.py", "--prompts", "3", "--max-len", "80",
                                     "--new-tokens", "4"])
    runpy.run_path(os.path.join(root, "examples", "continuous_batching_hf.py"), run_name="__main__")
    assert "tokens identical: True" in capsys.readouterr().out
