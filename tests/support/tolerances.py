"""Dtype-aware tolerances and a packed comparison that reports the worst ragged location.

Floors (atol, rtol) per dtype: float64 is limited by summation order (~1e-12 seen, 1e-10 kept);
float32 by accumulation over D and Lk (~1e-6 seen on our shapes, 1e-5 kept); float16/bfloat16 by
one rounding of the output (2^-11 / 2^-8 relative) plus fp32 accumulation; the bounds are ~4x the
unit roundoff. ``lowp_ref`` (the same math in the low dtype) widens the bound to
``fudge * |lowp_ref - ref64|.max()`` as flash-attn and PyTorch do. Gradients use a larger fudge
(xformers' backward tolerances are ~10x looser: gradients sum over many more terms).
"""

from __future__ import annotations

import torch

FLOOR = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
GRAD_FACTOR = {torch.float64: 1.0, torch.float32: 10.0, torch.float16: 5.0, torch.bfloat16: 5.0}


def tolerance(dtype: torch.dtype, *, grad: bool = False) -> tuple[float, float]:
    atol, rtol = FLOOR[dtype]
    factor = GRAD_FACTOR[dtype] if grad else 1.0
    return atol * factor, rtol * factor


def locate(index: int, cu_seqlens) -> tuple[int, int]:
    """Packed row -> (sequence b, token t within it)."""
    cu = [int(x) for x in cu_seqlens]
    for b in range(len(cu) - 1):
        if cu[b] <= index < cu[b + 1]:
            return b, index - cu[b]
    return -1, index


def assert_close_packed(out, ref64, *, cu_seqlens, name="out", grad=False, lowp_ref=None, fudge=2.0):
    """Compare a packed (total, H, D) result to a float64 reference; report the worst location."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
    assert not torch.isnan(out).any(), f"{name}: contains NaN"
    atol, rtol = tolerance(out.dtype, grad=grad)
    got = out.detach().double()
    ref = ref64.detach().double().to(got.device)
    if lowp_ref is not None:
        atol = max(atol, fudge * (lowp_ref.detach().double().to(got.device) - ref).abs().max().item())
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    bad = err > bound
    if bad.any():
        flat = int((err - bound).flatten().argmax())
        row, rest = divmod(flat, err[0].numel())
        h, d = divmod(rest, err.shape[-1]) if err.dim() == 3 else (0, rest)
        b, t = locate(row, cu_seqlens)
        raise AssertionError(
            f"{name}: {bad.float().mean().item():.2%} of elements beyond atol={atol:.2e} rtol={rtol:.2e}; "
            f"worst at sequence {b} token {t} head {h} dim {d}: got {got[row].flatten()[rest].item():.6g}, "
            f"expected {ref[row].flatten()[rest].item():.6g}"
        )


def assert_close_lse(lse, ref_lse, name="lse"):
    """float32 lse against float64: -inf exactly where the reference has -inf, tight elsewhere."""
    ref = ref_lse.double().to(lse.device)
    inf_ref = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse) & (lse < 0), inf_ref & (ref < 0)), f"{name}: -inf rows differ"
    finite = ~inf_ref
    if finite.any():
        err = (lse.double()[finite] - ref[finite]).abs().max().item()
        tol = 1e-4 if lse.dtype == torch.float32 else 1e-8
        assert err <= tol * (1 + ref[finite].abs().max().item()), f"{name}: max error {err:.3e}"


def float64_leaves(*tensors):
    """Float64 copies of ``tensors`` that require grad: the reference's inputs."""
    return tuple(t.detach().double().requires_grad_(True) for t in tensors)


def assert_cache_grads_close(q, k_cache, v_cache, q64, kc64, vc64, cu_q):
    """dq (packed rows) and the caches' gradients (rows of their first two dims) against the
    float64 reference's."""
    assert_close_packed(q.grad, q64.grad, cu_seqlens=cu_q, name="dq", grad=True)
    for name, got, want in (("dk_cache", k_cache.grad, kc64.grad), ("dv_cache", v_cache.grad, vc64.grad)):
        assert got is not None and got.shape == want.shape, f"{name}: no gradient of the cache's shape"
        rows = list(range(got.shape[0] * got.shape[1] + 1))
        assert_close_packed(got.flatten(0, 1), want.flatten(0, 1), cu_seqlens=rows, name=name, grad=True)
