"""Backend registry and dispatch.

``backend="auto"`` tries, in order, FlyDSL (AMD gfx950), Triton (CUDA sm89+ and ROCm) and the
torch reference, and takes the first whose ``is_available`` and ``can_handle`` agree. Each
decision is logged on the ``turbo_moe.dispatch`` logger at DEBUG level (``TURBO_MOE_LOG_DISPATCH=1``
prints it to stderr) and kept in :func:`recent_dispatches`, with the reason every other backend was
passed over. Naming a backend that cannot run a call raises :class:`BackendUnavailable` with the
reason, never a silent fallback.
"""

from __future__ import annotations

import collections
import functools
import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Tuple

from .. import host_plan
from .base import BackendUnavailable, GemmKind, GroupedGemmBackend, GroupedGemmProblem

__all__ = [
    "BackendUnavailable",
    "GemmKind",
    "GroupedGemmBackend",
    "GroupedGemmProblem",
    "AUTO_ORDER",
    "available_backends",
    "get_backend",
    "select_backend",
    "recent_dispatches",
    "clear_recent_dispatches",
    "DispatchRecord",
    "clear_dispatch_cache",
]

# name -> module that defines ``BACKEND`` (an instance of GroupedGemmBackend). Modules are imported
# lazily so that importing turbo_moe needs torch alone.
_BACKEND_MODULES: Dict[str, str] = {
    "flydsl": "turbo_moe.backends.flydsl_backend",
    "triton": "turbo_moe.backends.triton_backend",
    "torch": "turbo_moe.backends.torch_backend",
}
AUTO_ORDER: Tuple[str, ...] = ("flydsl", "triton", "torch")

_loaded: Dict[str, object] = {}
_lock = threading.Lock()

logger = logging.getLogger("turbo_moe.dispatch")
if os.environ.get("TURBO_MOE_LOG_DISPATCH", "0") not in ("", "0"):
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[turbo_moe] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.DEBUG)


@dataclass(frozen=True)
class DispatchRecord:
    problem: str
    chosen: str
    passed_over: Tuple[Tuple[str, str], ...]

    def __str__(self) -> str:
        skipped = "; ".join(f"{name}: {why}" for name, why in self.passed_over)
        return f"{self.problem} -> {self.chosen}" + (f" (passed over {skipped})" if skipped else "")


_recent: "collections.deque[DispatchRecord]" = collections.deque(maxlen=256)


def recent_dispatches() -> List[DispatchRecord]:
    """The most recent dispatch decisions, oldest first (at most 256)."""
    host_plan.flush_layer_replays()  # planned layers' C++ backwards (turbo_moe.planned_layer)
    return list(_recent)


def clear_recent_dispatches() -> None:
    """Forget the recorded dispatch decisions (e.g. before a step whose GEMMs you want to see)."""
    host_plan.flush_layer_replays()
    _recent.clear()


def _load(name: str):
    """Return the backend object, or a string saying why it cannot be loaded."""
    with _lock:
        if name not in _loaded:
            try:
                module = importlib.import_module(_BACKEND_MODULES[name])
                _loaded[name] = module.BACKEND
            except Exception as exc:  # an optional dependency that is missing or broken
                _loaded[name] = f"cannot import {_BACKEND_MODULES[name]}: {type(exc).__name__}: {exc}"
        return _loaded[name]


def available_backends() -> Dict[str, str]:
    """Each known backend with ``"available"`` or the reason it is not."""
    out = {}
    for name in _BACKEND_MODULES:
        backend = _load(name)
        if isinstance(backend, str):
            out[name] = backend
        else:
            ok, why = backend.is_available()
            out[name] = "available" if ok else why
    return out


def get_backend(name: str) -> GroupedGemmBackend:
    """The backend object for ``name`` (raises BackendUnavailable if it cannot load)."""
    if name not in _BACKEND_MODULES:
        raise ValueError(f"backend={name!r} is not one of 'auto', {', '.join(map(repr, _BACKEND_MODULES))}")
    backend = _load(name)
    if isinstance(backend, str):
        raise BackendUnavailable(f"backend={name!r} is unavailable: {backend}")
    return backend


def _check(name: str, problem: GroupedGemmProblem) -> Tuple[object, str]:
    backend = _load(name)
    if isinstance(backend, str):
        return None, backend
    ok, why = backend.is_available()
    if not ok:
        return None, why
    ok, why = backend.can_handle(problem)
    if not ok:
        return None, why
    return backend, ""


# (backend argument, problem signature) -> (chosen backend, a callable logging its record again). A decision depends only on
# what the signature holds (see GroupedGemmProblem.signature), so the second call of a shape class
# costs one dict lookup: no availability probes, no validation, no string formatting.
_decisions: Dict[tuple, Tuple[GroupedGemmBackend, "functools.partial"]] = {}
_MAX_DECISIONS = 4096


def select_backend(problem: GroupedGemmProblem, backend: str = "auto") -> GroupedGemmBackend:
    """Pick the backend that runs ``problem``; record and log why (decisions cached per signature)."""
    key = (backend, problem.signature())
    hit = _decisions.get(key)
    if hit is not None:
        log_again = hit[1]
        log_again()
        host_plan.repeat_on_replay(log_again)
        return hit[0]
    chosen = _select_uncached(problem, backend)
    if len(_decisions) >= _MAX_DECISIONS:
        _decisions.clear()
    log_again = functools.partial(_log, _recent[-1])
    _decisions[key] = (chosen, log_again)
    host_plan.repeat_on_replay(log_again)
    return chosen


def _log(record: DispatchRecord) -> None:
    """Keep ``record`` in :func:`recent_dispatches` (and the debug log). A host plan replaying a
    GEMM's launches repeats this for it (``host_plan.repeat_on_replay``)."""
    host_plan.flush_layer_replays()  # earlier GEMMs first: those a planned layer's backward replayed
    _recent.append(record)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s", record)


def clear_dispatch_cache() -> None:
    """Forget cached dispatch decisions (after changing TURBO_MOE_DISABLE_FLYDSL, say), the
    fine-grained recipes' backend choices, their Triton launch plans and the host launch plans
    (``turbo_moe.host_plan``) included."""
    from ..fine_grained import gemm, triton_gemm

    _decisions.clear()
    gemm._CHOSEN.clear()
    triton_gemm._PLANS.clear()
    host_plan.clear_all()  # host plans replay the launches those decisions chose


def _select_uncached(problem: GroupedGemmProblem, backend: str) -> GroupedGemmBackend:
    if backend == "auto":
        passed_over = []
        for name in AUTO_ORDER:
            chosen, why = _check(name, problem)
            if chosen is not None:
                _record(problem, name, passed_over)
                return chosen
            passed_over.append((name, why))
        raise BackendUnavailable(
            "no backend can run " + problem.describe() + ": " + "; ".join(f"{n}: {w}" for n, w in passed_over)
        )
    if backend not in _BACKEND_MODULES:
        raise ValueError(f"backend={backend!r} is not one of 'auto', {', '.join(map(repr, _BACKEND_MODULES))}")
    chosen, why = _check(backend, problem)
    if chosen is None:
        raise BackendUnavailable(f"backend={backend!r} cannot run {problem.describe()}: {why}")
    _record(problem, backend, [])
    return chosen


def _record(problem: GroupedGemmProblem, chosen: str, passed_over) -> None:
    _log(DispatchRecord(problem.describe(), chosen, tuple(passed_over)))
