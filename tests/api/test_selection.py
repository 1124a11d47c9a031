"""Priority order, forced backends, use_backends (nesting, threads, asyncio), explain, errors, log."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

import jagged_sdpa
from jagged_sdpa import Backend, NoBackendError
from jagged_sdpa.backends import CPU_ORDER, DEFAULT_ORDER, IMPLS
from jagged_sdpa.selection import choose, current_order, select
from jagged_sdpa.spec import AttnSpec
from support.cases import cu_of, njt, packed


def cpu_spec(**changes) -> AttnSpec:
    base = dict(entry="varlen", device_type="cpu", capability=None, dtype=torch.float32, batch=2, heads_q=4,
                heads_kv=2, head_dim=64, head_dim_v=64, total_q=10, total_k=10, max_seqlen_q=7, max_seqlen_k=7,
                has_empty_q=False, has_empty_k=False, lengths_known=True)
    base.update(changes)
    return AttnSpec(**base)


def small_call():
    q = packed([3, 4], 2, 8)
    return (q, q, q, cu_of([3, 4]), cu_of([3, 4]))


def test_backend_enum_values_and_errors():
    assert Backend("triton") is Backend.TRITON and Backend.MATH == "math"
    assert {b.value for b in Backend} >= {"flash_varlen", "efficient", "triton", "math"}
    with pytest.raises(ValueError, match="valid: 'flash_varlen'"):
        Backend("nope")


def test_math_is_always_eligible_and_last_resort():
    assert DEFAULT_ORDER[-1] is Backend.MATH
    for spec in (cpu_spec(), cpu_spec(dtype=torch.float64, head_dim=333, causal=True, alignment="top_left",
                                     softcap=3.0, alibi="per_batch_head", dropout_p=0.5, needs_grad=True),
                 cpu_spec(device_type="cuda", capability=(7, 0), dtype=torch.bfloat16, paged=True, block_size=3)):
        assert IMPLS[Backend.MATH].reasons(spec) == ()


def test_on_the_cpu_math_comes_before_the_triton_interpreter(monkeypatch):
    """A CPU call CPU_FUSED refuses runs on MATH even where the Triton interpreter could take it
    (TRITON_INTERPRET=1 is for tests); named, TRITON still runs; CUDA calls keep the default order."""
    for refusing in (Backend.FLASH_VARLEN, Backend.EFFICIENT, Backend.CPU_FUSED):
        monkeypatch.setattr(IMPLS[refusing], "reasons", classmethod(lambda cls, spec: ("refused",)))
    monkeypatch.setattr(IMPLS[Backend.TRITON], "reasons", classmethod(lambda cls, spec: ()))
    explained = select(cpu_spec())
    assert explained.order == CPU_ORDER and explained.chosen is Backend.MATH
    assert choose(cpu_spec(), None) is Backend.MATH
    with jagged_sdpa.use_backends("triton", "math"):
        assert select(cpu_spec()).chosen is Backend.TRITON and choose(cpu_spec(), None) is Backend.TRITON
    assert choose(cpu_spec(), Backend.TRITON) is Backend.TRITON
    cuda = select(cpu_spec(device_type="cuda", capability=(9, 0)))
    assert cuda.order == DEFAULT_ORDER and cuda.chosen is Backend.TRITON
    assert str(explained).index("  math ") < str(explained).index("  triton ")


def test_forced_backend_runs_it_or_raises_with_its_reasons():
    q, k, v, cu_q, cu_k = small_call()
    out = jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, backend="math")
    assert out.shape == q.shape
    with pytest.raises(NoBackendError) as info:
        jagged_sdpa.varlen_attention(q, k, v, cu_q, cu_k, backend=Backend.FLASH_VARLEN)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert list(err.explanation.reasons) == [Backend.FLASH_VARLEN]
    assert err.explanation.reasons[Backend.FLASH_VARLEN]
    assert "forced backend flash_varlen cannot take this call" in str(err)
    assert "device cpu not supported" in str(err) or err.explanation.reasons[Backend.FLASH_VARLEN]


def test_use_backends_order_nesting_and_dedup():
    assert current_order() == DEFAULT_ORDER
    with jagged_sdpa.use_backends("math", Backend.TRITON, "math") as order:
        assert order == (Backend.MATH, Backend.TRITON)
        assert current_order() == order
        with jagged_sdpa.use_backends(Backend.FLASH_VARLEN):
            assert current_order() == (Backend.FLASH_VARLEN,)
            with pytest.raises(NoBackendError, match="no backend can take this call"):
                jagged_sdpa.varlen_attention(*small_call())
        assert current_order() == order
        assert jagged_sdpa.explain(*small_call()).chosen is Backend.MATH
    assert current_order() == DEFAULT_ORDER


def test_use_backends_rejects_bad_values():
    with pytest.raises(ValueError, match="at least one backend"):
        with jagged_sdpa.use_backends():
            pass
    with pytest.raises(ValueError, match="is not a Backend"):
        with jagged_sdpa.use_backends("cudnn"):
            pass
    with pytest.raises(TypeError, match="backends must be"):
        with jagged_sdpa.use_backends(1):
            pass


def test_use_backends_is_per_thread():
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def worker():
        with jagged_sdpa.use_backends("triton"):
            entered.set()
            release.wait(5)
            seen["worker"] = current_order()

    t = threading.Thread(target=worker)
    t.start()
    entered.wait(5)
    seen["main"] = current_order()
    release.set()
    t.join()
    assert seen["worker"] == (Backend.TRITON,) and seen["main"] == DEFAULT_ORDER


def test_use_backends_is_per_asyncio_task():
    async def task(backend, delay):
        with jagged_sdpa.use_backends(backend):
            await asyncio.sleep(delay)
            return current_order()

    async def main():
        return await asyncio.gather(task("math", 0.02), task("triton", 0.01))

    assert asyncio.run(main()) == [(Backend.MATH,), (Backend.TRITON,)]


def test_explain_lists_every_backend_and_runs_nothing(monkeypatch):
    for impl in IMPLS.values():
        monkeypatch.setattr(impl, "forward", classmethod(lambda cls, call: pytest.fail("kernel ran")))
    e = jagged_sdpa.explain(*small_call(), causal=True)
    assert list(e.reasons) == list(CPU_ORDER) and set(CPU_ORDER) == set(DEFAULT_ORDER)
    assert e.reasons[Backend.MATH] == [] and e.chosen is not None
    assert all(isinstance(r, list) for r in e.reasons.values())
    text = str(e)
    assert text.splitlines()[0].startswith("varlen call: B=2 Hq=2 Hkv=2 D=8 float32 cpu")
    assert "causal=bottom_right" in text.splitlines()[0]
    for b in DEFAULT_ORDER:
        assert f"  {b.value:<14} " in text
    assert text.splitlines()[-1] == f"chosen: {e.chosen.value}"


def test_explain_recognises_sdpa_and_varlen_calls():
    q = njt([3, 2], 2, 8)
    assert jagged_sdpa.explain(q, q, q).spec.entry == "sdpa"
    assert jagged_sdpa.explain(query=q, key=q, value=q, is_causal=True).spec.causal
    e = jagged_sdpa.explain(*small_call())
    assert e.spec.entry == "varlen" and e.spec.alignment == "bottom_right"
    assert jagged_sdpa.explain(q=small_call()[0], k=small_call()[0], v=small_call()[0],
                               cu_seqlens_q=cu_of([3, 4]), cu_seqlens_k=cu_of([3, 4])).spec.entry == "varlen"


def test_explain_table_snapshot():
    spec = cpu_spec(causal=True, alignment="bottom_right", needs_grad=True)
    e = select(spec, None)
    lines = str(e).splitlines()
    assert lines[0] == ("varlen call: B=2 Hq=4 Hkv=2 D=64 float32 cpu max_seqlen_q=7 max_seqlen_k=7 "
                        "causal=bottom_right grad=yes")
    assert lines[1] == "  backend        eligible  why not"
    assert lines[-1].startswith("chosen: ")


def test_no_backend_error_lists_every_backend():
    with jagged_sdpa.use_backends(Backend.FLASH_VARLEN, Backend.EFFICIENT):
        with pytest.raises(NoBackendError) as info:
            jagged_sdpa.varlen_attention(*small_call())
    message = str(info.value)
    assert "flash_varlen" in message and "efficient" in message
    assert set(info.value.explanation.reasons) == {Backend.FLASH_VARLEN, Backend.EFFICIENT}
    assert all(info.value.explanation.reasons.values())


def test_debug_log_names_choice_and_reasons(caplog):
    with caplog.at_level(logging.DEBUG, logger="jagged_sdpa"):
        jagged_sdpa.varlen_attention(*small_call())
    records = [r for r in caplog.records if r.name == "jagged_sdpa"]
    assert len(records) == 1
    text = records[0].getMessage()
    assert "chosen:" in text and "flash_varlen" in text and "math" in text


def test_no_log_work_when_debug_disabled(caplog, monkeypatch):
    from jagged_sdpa import selection

    monkeypatch.setattr(selection.Explanation, "__str__", lambda self: pytest.fail("table built"))
    with caplog.at_level(logging.INFO, logger="jagged_sdpa"):
        jagged_sdpa.varlen_attention(*small_call())


def test_reasons_never_raise_and_gather_everything():
    spec = cpu_spec(device_type="cuda", capability=(6, 0), dtype=torch.float64, head_dim=512, head_dim_v=100,
                    causal=True, alignment="top_left", softcap=1.0, alibi="per_head", dropout_p=0.1,
                    needs_grad=True, return_lse=True, paged=True, block_size=7, has_empty_q=True)
    for backend, impl in IMPLS.items():
        reasons = impl.reasons(spec)
        assert isinstance(reasons, tuple)
        assert all(isinstance(r, str) and r and not r.endswith(".") for r in reasons)
    from jagged_sdpa.checks.capability import Capabilities, capability_reasons

    narrow = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float16}), head_dim_max=256,
                          head_dim_multiple=8, window=False, softcap=False, alibi=False, dropout=False)
    reasons = capability_reasons(spec, narrow)
    assert len(reasons) >= 7
    assert "device cuda not supported (supported: cpu)" in reasons
    assert "dtype float64 not supported (supported: float16)" in reasons
    assert "head_dim 512 > 256" in reasons and "head_dim_v 100 not a multiple of 8" in reasons
