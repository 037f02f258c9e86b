"""Triton kernels that fuse a decoder layer's small CUDA ops, one launch each.

This module owns three kernels and the switch that routes the layers to them: the residual add
with RMSNorm (engine/layers/norm.py; Gemma's 1 + w is folded into its weight at load, so the same
kernel runs it), the rotary embedding of q and k in place (engine/layers/rotary.py, the
rotate-half layout, partial rotary included) and silu(gate) * up over the gate_up projection's
output (engine/models/llama.py). Each keeps the torch path's float32 arithmetic and its cast
points, so its outputs equal the torch ops' up to the order of a sum and the last bit of exp,
sqrt and division. Lifecycle: importing this module imports no triton; `for_tensor(t)` answers
None unless `t` is a CUDA tensor of float32, bfloat16 or float16 (or FORCE is set, when CPU
tensors run under TRITON_INTERPRET=1, for tests) and triton imports. The kernels are built on
the first use. The first call of each op, outside a CUDA graph capture, is checked against the
torch path the caller passes; an exception or a mismatch switches every kernel off for the
process with one warning, and the caller runs the torch path. Later calls do no host sync,
so they are safe inside a captured graph.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

log = logging.getLogger(__name__)

# Tests set FORCE to run the kernels on CPU tensors under the Triton interpreter.
FORCE = False
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_state: dict = {"kernels": None, "off": os.environ.get("PDSERVE_FUSED_TRITON", "1") == "0"}
_checked: set[str] = set()
_JIT_MODULE = "pdserve.engine.kernels.fused_triton_jit"
# How far a first call may be from the torch path before the kernels are switched off: loose
# enough for a different summation order and exp, tight enough to catch a wrong kernel.
_CHECK_TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}


def reset() -> None:
    """Forget the built kernels and the checks (tests rebuild them under the interpreter)."""
    _state["kernels"] = None
    _state["off"] = os.environ.get("PDSERVE_FUSED_TRITON", "1") == "0"
    _checked.clear()


def for_tensor(t: torch.Tensor):
    """This module where its kernels apply to `t` (see the module docstring), else None."""
    if _state["off"] or not (t.is_cuda or FORCE) or t.dtype not in _DTYPES:
        return None
    if _state["kernels"] is None:
        try:
            _state["kernels"] = _build()
        except Exception as exc:  # no triton, or one that cannot build here
            _switch_off("build", exc)
            return None
    return sys.modules[__name__]


def _switch_off(name: str, exc: BaseException) -> None:
    _state["off"] = True
    log.warning("Triton fused kernels switched off (%s failed: %r); torch runs instead", name, exc)


def _guarded(name: str, t: torch.Tensor, launch, reference):
    """launch() once checked: the first call of `name` (outside a capture) is compared with
    reference(); any failure switches the kernels off and answers None."""
    if _state["off"]:
        return None
    first = name not in _checked
    if first and t.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # an unchecked kernel is never captured into a graph
    try:
        got = launch()
        if first:
            _compare(got, reference(), _CHECK_TOL[t.dtype])
            _checked.add(name)
        return got
    except Exception as exc:
        _switch_off(name, exc)
        return None


def _compare(got, want, tol: tuple[float, float]) -> None:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ValueError(f"shape/dtype {g.shape} {g.dtype} != {w.shape} {w.dtype}")
        rtol, atol = tol  # the activations' dtype's: a float32 output of bf16 rows is as near
        if not torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol):
            raise ValueError("result differs from the torch path")


def _launch_options(n: int) -> dict:
    # No fused multiply-add: the torch ops round each product before the sum.
    return {"num_warps": min(16, max(1, n // 512)), "enable_fp_fusion": False}


def add_rms_norm(x, residual, weight, eps: float, reference):
    """(rms_norm(x + residual) * weight, x + residual) as new tensors, or (normed x, x) without a
    residual; None where the kernel does not apply (the caller runs `reference`)."""
    if x.stride(-1) != 1 or weight.dtype not in _DTYPES or weight.stride(-1) != 1:
        return None
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return None
    if residual is not None and residual.stride(-1) != 1:
        return None
    return _guarded("add_rms_norm", x, lambda: _add_rms_norm(x, residual, weight, eps), reference)


def _add_rms_norm(x, residual, weight, eps):
    import triton

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        res_in, res_out = x2, x
    else:
        res_in, res_out = residual.reshape(-1, n), torch.empty_like(x)
    rows, block = x2.shape[0], triton.next_power_of_2(n)
    if rows:
        _state["kernels"]["norm"][(rows,)](
            x2, res_in, weight, out, res_out, x2.stride(0), res_in.stride(0), n, float(n), eps,
            HAS_RES=residual is not None, BLOCK=block, **_launch_options(block),
        )  # fmt: skip
    return out, res_out


def rope_(q, k, positions, cos, sin, reference):
    """q and k ([T, heads, head_dim]) rotated in place by the rows `positions` of the cos/sin
    cache ([max_position, rot], rot <= head_dim: the first rot dims turn); None where the kernel
    does not apply (the caller runs `reference`, which must not touch q and k)."""
    rot = cos.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or rot % 2 or rot > q.shape[-1]:
        return None
    if k.shape[0] != q.shape[0] or positions.numel() != q.shape[0] or k.shape[-1] != q.shape[-1]:
        return None  # one position per token, or the kernel would read past them
    if (
        q.stride(-1) != 1
        or k.stride(-1) != 1
        or cos.stride(-1) != 1
        or sin.stride() != cos.stride()
    ):
        return None

    if "rope_" not in _checked:  # the first call turns copies, so a bad kernel spoils nothing
        if _state["off"] or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        want = reference()  # computed before q and k turn in place
        copies = lambda: _rope(q.clone(), k.clone(), positions, cos, sin)  # noqa: E731
        if _guarded("rope_", q, copies, lambda: want) is None:
            return None
    return _guarded("rope_", q, lambda: _rope(q, k, positions, cos, sin), None)


def _rope(q, k, positions, cos, sin):
    import triton

    tokens, half = q.shape[0], cos.shape[-1] // 2
    block_h = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_d = triton.next_power_of_2(half)
    pos = positions.reshape(-1).contiguous()
    if tokens:
        _state["kernels"]["rope"][(tokens,)](
            q, k, pos, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), q.shape[1], k.shape[1],
            HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, **_launch_options(block_h * block_d),
        )  # fmt: skip
    return q, k


def silu_mul(gate_up, reference):
    """silu(gate) * up of `gate_up` ([..., 2 * I], gate first) as a new [..., I] tensor; None
    where the kernel does not apply (the caller runs `reference`)."""
    if gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        return None
    return _guarded("silu_mul", gate_up, lambda: _silu_mul(gate_up), reference)


def _silu_mul(gate_up):
    import triton

    width = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, gate_up.shape[-1])
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if gu.shape[0]:
        grid = (gu.shape[0], triton.cdiv(width, block))
        _state["kernels"]["silu"][grid](
            gu, out, gu.stride(0), width, BLOCK=block, **_launch_options(block)
        )
    return out


def _build() -> dict:
    """The @triton.jit kernels (engine/kernels/fused_triton_jit.py), imported now, so that
    TRITON_INTERPRET is read when they are first used; reset() drops them for a rebuild."""
    import importlib

    sys.modules.pop(_JIT_MODULE, None)
    jit = importlib.import_module(_JIT_MODULE)
    return {"norm": jit.norm, "rope": jit.rope, "silu": jit.silu}
