"""Model families whose own code uses the attention mask, through attn_implementation="jagged" (issue 20, item 4).

Each family is built tiny by ``family_sweep.py`` (the sweep over every causal-LM and seq2seq family) and
checked as the sweep checks it: logits of the real tokens equal eager's on a batch without padding, a
left- and a right-padded batch, and greedy generation is token-identical. Families that jagged attention
cannot serve must raise a ValueError naming the feature, at the first call, not crash in their modeling
code. The last test runs the sweep script itself on three families so that it cannot rot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import masking_utils  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import family_sweep as sweep  # noqa: E402

from jagged_sdpa.integrations import transformers as jt  # noqa: E402
from jagged_sdpa.integrations.transformers import compat as jt_compat  # noqa: E402


def _check(family, class_index=-1):
    """The sweep's check of one model class of ``family`` (the causal-LM class by default)."""
    cls = sweep.model_classes(family)[class_index]
    return sweep.check_class(cls, family, jt.register())


@pytest.mark.parametrize("family", ["bloom", "mpt", "xglm", "gpt_neox_japanese", "mvp"])
def test_family_with_its_own_attention_code_equals_eager(family):
    # these compute attention themselves and add the mask to their scores (Bloom adds ALiBi to it): they get
    # eager's mask; before, they crashed on the compact mask and, without padding, silently lost causality
    result = _check(family)
    assert "wrong" not in result, result["wrong"]
    assert result["checks"] == ["logits full", "logits left", "logits right", "generate"]


@pytest.mark.parametrize("family", ["falcon", "gpt_neo", "gptj", "git"])
def test_family_with_its_own_attention_table_builds_and_equals_eager(family):
    # FALCON_ATTENTION_CLASSES[config._attn_implementation] and alike: a KeyError at construction for any
    # registered name before; now the table adopts the name with the family's eager module (told once)
    result = _check(family)
    assert "wrong" not in result, result["wrong"]
    assert result["checks"] == ["logits full", "logits left", "logits right", "generate"]
    module = sys.modules[sweep.model_classes(family)[-1].__module__]
    tables = [t for name, t in vars(module).items() if name.endswith("ATTENTION_CLASSES") and isinstance(t, dict)]
    assert tables and all(t[jt.DEFAULT_NAME] is t["eager"] for t in tables)


def test_bigbird_pegasus_decoder_alone_keeps_its_causal_pattern_without_padding():
    # BigBirdPegasusForCausalLM: is_decoder, self-attention declares is_causal=False, eager's mask is causal
    result = _check("bigbird_pegasus")
    assert result["class"] == "BigBirdPegasusForCausalLM"
    assert "wrong" not in result, result["wrong"]


@pytest.mark.parametrize("family, message", [
    ("deepseek_v32", "indices: this model's sparse-attention indexer"),  # the indexer reads the mask, then selects
    ("deepseek_v4", "config.compress_rates: "),  # keys appended inside the layer
    ("doge", "attention_mask: jagged attention got a torch.float32 mask of shape \\(3, 4, 9, 9\\)"),  # per-head mask
])
def test_unservable_families_are_refused_at_the_first_call(family, message):
    with pytest.raises(sweep._Stage) as caught:
        _check(family)
    stage = caught.value
    assert (stage.side, stage.step) == ("jagged", "forward full")
    assert isinstance(stage.error, ValueError) and sweep._by_jagged(stage.error), stage
    assert pytest.importorskip("re").search(message, str(stage.error)), str(stage.error)


def _padding():
    return torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def test_a_caller_that_needs_the_mask_gets_eagers_with_the_unpadding_data():
    # allow_is_causal_skip=False: the caller overlays the mask (indexers, Falcon's ALiBi, Doge): eager's mask,
    # and jagged attention unpads from it exactly as from the compact one
    padding = _padding()
    args = dict(mask_function=masking_utils.causal_mask_function, attention_mask=padding.bool())
    compact = jt.jagged_attention_mask(2, 5, 5, **args)
    eager = jt.jagged_attention_mask(2, 5, 5, allow_is_causal_skip=False, dtype=torch.float32, **args)
    expected = masking_utils.eager_mask(2, 5, 5, dtype=torch.float32, **args)
    assert compact.shape == (2, 1, 1, 10) and torch.equal(eager, expected)
    module = torch.nn.Module().eval()
    q, k, v = (torch.randn(2, 4, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out_compact, _ = jt.jagged_attention_forward(module, q, k, v, compact)
    out_eager, _ = jt.jagged_attention_forward(module, q, k, v, eager)
    assert torch.equal(out_compact, out_eager)
    # without padding the caller still gets a tensor (eager's causal mask) that carries the pattern
    full = jt.jagged_attention_mask(2, 5, 5, mask_function=masking_utils.causal_mask_function,
                                    attention_mask=torch.ones(2, 5, dtype=torch.bool), allow_is_causal_skip=False)
    assert full.shape == (2, 1, 5, 5) and torch.equal(full[1, 0] < 0, torch.ones(5, 5, dtype=torch.bool).triu(1))
    # a model that edits eager's mask in place is refused, not silently ignored
    eager[0, 0, 4, 0] = 0.0
    with pytest.raises(ValueError, match="modified its attention mask in place"):
        jt.jagged_attention_forward(module, q, k, v, eager)


def test_packed_sequences_keep_the_mask_free_path():
    # transformers sets allow_is_causal_skip=False itself for packed sequences: not a caller that reads the mask
    position_ids = torch.tensor([[0, 1, 2, 0, 1]])
    packed = jt_compat.packed_mask_function(masking_utils.causal_mask_function, position_ids,
                                            masking_utils.find_packed_sequence_indices(position_ids))
    assert jt.jagged_attention_mask(1, 5, 5, mask_function=packed, allow_is_causal_skip=False) is None


def test_the_sweep_script_runs(tmp_path):
    out = tmp_path / "records.json"
    env = dict(os.environ, PYTHONPATH=sweep.ROOT)
    proc = subprocess.run([sys.executable, os.path.join(sweep.ROOT, "tests", "support", "family_sweep.py"), "--families",
                           "llama,bloom,t5", "--jobs", "2", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=sweep.ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = {r["family"]: r for r in json.loads(out.read_text())}
    assert {f: r["status"] for f, r in records.items()} == {"llama": "pass", "bloom": "pass", "t5": "refused"}
    assert "position_bias" in records["t5"]["detail"]
    assert records["llama"]["classes"][0]["attention_calls"] > 0  # the sweep sees jagged attention run
    assert "3 buildable families: 2 pass, 0 wrong, 0 crash, 1 refused" in proc.stdout
