"""The command line: demo (the main job), explain (tensor-free) and bench."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jagged_sdpa.__main__ import main


def test_demo_runs_checks_and_explains(capsys):
    assert main(["demo", "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    assert "check vs padded dense SDPA" in text and "-> OK" in text
    assert "chosen:" in text and "timings" in text


def test_explain_describes_a_cuda_call_without_tensors(capsys):
    assert main(["explain", "--lengths", "5,17,300", "--heads", "8", "--kv-heads", "2", "--head-dim", "64",
                 "--dtype", "float16", "--device", "cuda", "--capability", "9.0", "--causal"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("sdpa call: B=3 Hq=8 Hkv=2 D=64 float16 cuda")
    assert "math" in text and "chosen:" in text


def test_explain_forced_backend_and_options(capsys):
    assert main(["explain", "--lengths", "3,0", "--heads", "2", "--head-dim", "40", "--window", "4,0",
                 "--softcap", "2", "--requires-grad", "--backend", "math"]) == 0
    text = capsys.readouterr().out
    assert "window=(4, 0)" in text and "softcap=2" in text and "chosen: math" in text


def test_explain_builds_the_spec_the_call_builds():
    """The CLI's spec is the call's (one builder): self-attention knows Lq == Lk
    (FLASH_VARLEN takes top-left causal then), and a window past every key is unbounded."""
    from jagged_sdpa.__main__ import build_parser, spec_from_args

    args = build_parser().parse_args(["explain", "--lengths", "5,17,300", "--device", "cuda", "--capability", "9.0",
                                      "--causal", "--window", "1000,0"])
    spec = spec_from_args(args)
    assert spec.equal_lengths and spec.window == (-1, 0) and spec.device_type == "cuda"
    assert spec.capability == (9, 0) and spec.max_seqlen_q == 300
    from jagged_sdpa.backends import IMPLS, Backend

    assert not any("top_left" in r for r in IMPLS[Backend.FLASH_VARLEN].extra_reasons(spec))
    assert any("top_left" in r for r in IMPLS[Backend.FLASH_VARLEN].extra_reasons(spec.replace(equal_lengths=False)))
    args = build_parser().parse_args(["explain", "--lengths", "5,17", "--kv-lengths", "6,17"])
    assert not spec_from_args(args).equal_lengths


def test_explain_takes_section_11_options(capsys):
    """--sinks, --chunk-size and --prefix-lens describe docs/api.md section 11's options; bad values are refused
    by the call's own checks, named as the flags."""
    assert main(["explain", "--lengths", "5,17,30", "--causal", "--sinks", "--chunk-size", "8", "--prefix-lens",
                 "2,0,7", "--requires-grad", "--backend", "math"]) == 0
    text = capsys.readouterr().out
    assert "chunk_size=8" in text and "prefix_lens" in text and "sinks(grad)" in text and "chosen: math" in text
    with pytest.raises(SystemExit, match="--prefix-lens"):
        main(["explain", "--lengths", "5,17", "--prefix-lens", "9,0"])
    with pytest.raises(SystemExit, match="--prefix-lens has 1 entries"):
        main(["explain", "--lengths", "5,17", "--prefix-lens", "3"])
    with pytest.raises(SystemExit, match="--chunk-size"):
        main(["explain", "--lengths", "5,17", "--chunk-size", "0"])


def test_explain_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        main(["explain", "--lengths", "3,x"])
    with pytest.raises(SystemExit):
        main(["explain", "--lengths", "3", "--heads", "3", "--kv-heads", "2"])


def test_bench_prints_a_table(capsys):
    assert main(["bench", "--lengths", "3,9,1", "--heads", "2", "--head-dim", "8", "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    assert "padded+mask SDPA" in text and "torch NJT SDPA" in text and "auto (" in text


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "jagged_sdpa", "explain", "--lengths", "4,2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "chosen:" in result.stdout


@pytest.mark.parametrize("causal", [False, True])
def test_bench_backward_runs_every_round(capsys, causal):
    """``bench --backward`` runs more than one backward: torch cannot accumulate into an NJT leaf's
    ``.grad`` (``aten::stride does not exist``), and the padded contender's backward must map its
    gradient through the transposed NJT. Warm-up plus two rounds run
    three backwards of every contender."""
    argv = ["bench", "--backward", "--lengths", "3,9,1", "--heads", "2", "--head-dim", "8", "--repeats", "2"]
    assert main(argv + (["--causal"] if causal else [])) == 0
    text = capsys.readouterr().out
    assert "fwd+bwd" in text and "padded+mask SDPA" in text and "auto (" in text
    assert ("torch NJT SDPA" in text) != causal     # NJT SDPA refuses causal, so it is left out then


def test_bench_backward_gradients_match_the_padded_reference():
    """The timed backward computes the gradients themselves: sdpa's equal padded dense SDPA's."""
    import torch

    from jagged_sdpa import sdpa
    from jagged_sdpa.__main__ import padded_reference, ragged_batch

    lengths = [3, 9, 0, 1]
    q, k, v = (ragged_batch(lengths, 2, 8, torch.float32, torch.device("cpu"), True, seed=s) for s in (1, 2, 3))
    ours = torch.autograd.grad(sdpa(q, k, v, is_causal=True).values().sum(), (q, k, v))
    padded = torch.cat(padded_reference(q, k, v, lengths, lengths, True, False), dim=1)
    theirs = torch.autograd.grad(padded.sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.values(), b.values(), atol=1e-5, rtol=1e-5)


def test_bench_and_demo_refuse_a_device_torch_cannot_use():
    """``--device cuda`` on a CPU-only torch is a clear error, not a raw AssertionError."""
    import torch

    with pytest.raises(SystemExit, match="is not a torch device"):
        main(["bench", "--device", "nodevice"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: "):
            main(["demo", "--device", "cuda"])
        with pytest.raises(SystemExit, match="--device cuda: "):
            main(["bench", "--device", "cuda", "--repeats", "1"])


def test_help_shows_defaults_and_causal_alignment(capsys):
    """--heads/--head-dim show their defaults; explain's --causal says it is
    top-left (sdpa's) and how to describe varlen_attention's bottom-right causal."""
    from jagged_sdpa.__main__ import build_parser

    for command in ("explain", "bench"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: 8)" in text and "default: 64" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["explain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "top-left" in text and "--bottom-right" in text and "bottom-right" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--repeats", "0"])
