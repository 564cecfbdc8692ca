"""Megatron options with turbo_moe experts (issue 15, items 2-5): FP8 recipe mapping (refusals
naming the recipe, one-time warnings for the remaining substitutions, TE's ``_extra_state``),
``moe_act`` recompute, the other refused options, install/import errors, the proof script."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

sys.path.insert(0, str(Path(__file__).parent))
from _megatron_harness import make_config, megatron_world, randomize_  # noqa: E402

import turbo_moe.megatron as tm  # noqa: E402
from turbo_moe.config import Float8Config, ScalingGranularity  # noqa: E402
from turbo_moe.megatron import options as tm_options  # noqa: E402

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def world():
    with megatron_world("cpu"):
        yield


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(tm_options, "_warned", set())


def _ns(**kw):
    base = dict(fp8="e4m3", fp8_recipe="tensorwise", fp8_margin=0)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("recipe, reason", [("custom", "custom")])
def test_unsupported_recipes_are_refused_naming_the_recipe(recipe, reason):
    with pytest.raises(ValueError, match=f"fp8_recipe='{recipe}'.*{reason}.*fp8_recipe='tensorwise'"):
        tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8_recipe=recipe))
    with pytest.raises(ValueError, match="'nvfp8' is not a recipe turbo_moe knows"):
        tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8_recipe="nvfp8"))


def test_delayed_recipe_maps_to_delayed_tensorwise_with_megatrons_history_settings():
    cfg = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8="hybrid", fp8_recipe="delayed", fp8_margin=1))
    # Megatron's defaults when the config does not carry them: history 1, most_recent
    assert cfg == Float8Config(format="hybrid", strategy="delayed", amax_history_len=1,
                               amax_compute_algo="most_recent", margin=1)
    cfg = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8_recipe="delayed", fp8_amax_history_len=1024,
                                                          fp8_amax_compute_algo="max"))
    assert cfg.delayed and cfg.amax_history_len == 1024 and cfg.amax_compute_algo == "max"
    with pytest.raises(ValueError, match="amax_compute_algo"):
        tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8_recipe="delayed", fp8_amax_compute_algo="mean"))


@pytest.mark.parametrize("recipe, granularity", [("blockwise", "BLOCKWISE"), ("mxfp8", "MXFP8")])
def test_fine_grained_recipes_map_to_their_granularity(recipe, granularity):
    cfg = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8_recipe=recipe, fp8_margin=1))
    assert cfg.granularity is ScalingGranularity[granularity] and cfg.margin == 1


def test_blockwise_recipe_takes_te_power_of_two_scales(monkeypatch):
    """Megatron runs fp8_recipe="blockwise" as TE's Float8BlockScaling(fp8_format=...), whose block
    scales are powers of two unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    cfg = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8="e4m3", fp8_recipe="blockwise"))
    assert cfg == Float8Config(format="e4m3", granularity="blockwise", power_of_two_scales=True)
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    cfg = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8="e4m3", fp8_recipe="blockwise"))
    assert cfg == Float8Config(format="e4m3", granularity="blockwise", power_of_two_scales=False)
    # MXFP8's e8m0 scales are powers of two by construction; an explicit granularity is the user's own
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    assert not tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8_recipe="mxfp8")).power_of_two_scales
    assert not tm.resolve_fp8_config(tm.TurboMoEOptions(granularity="blockwise"), _ns()).power_of_two_scales


def test_megatron_enum_recipe_and_explicit_switches():
    from megatron.core.enums import Fp8Recipe

    cfg = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8="hybrid", fp8_recipe=Fp8Recipe.tensorwise))
    assert cfg.granularity is ScalingGranularity.TENSORWISE and cfg.grad_dtype == torch.float8_e5m2
    # An explicit granularity (or an explicit fp8=) is the user's choice: no recipe mapping.
    assert tm.resolve_fp8_config(tm.TurboMoEOptions(granularity="rowwise"), _ns(fp8_recipe="delayed")) is not None
    assert tm.resolve_fp8_config(tm.TurboMoEOptions(fp8="e4m3"), _ns(fp8_recipe="mxfp8")) is not None


def test_recipe_table_is_where_new_recipes_plug_in(monkeypatch):
    monkeypatch.setitem(tm_options.FP8_RECIPES, "mxfp8", tm_options.RecipeMapping(ScalingGranularity.ROWWISE))
    cfg = tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(fp8_recipe="mxfp8"))
    assert cfg.granularity is ScalingGranularity.ROWWISE
    with pytest.raises(ValueError, match="either a granularity or a refusal"):
        tm_options.RecipeMapping()


@pytest.mark.parametrize("field, value, message", [
    ("fp4", "nvfp4", "config.fp4='nvfp4'"), ("quant_recipe", object(), "config.quant_recipe"),
    ("fp8_quantizer_factory", object(), "config.fp8_quantizer_factory"),
])
def test_fp4_and_custom_quantization_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(**{field: value}))


@pytest.mark.parametrize("field, value", [("fp8_param", True), ("fp8_wgrad", False)])
def test_remaining_substitutions_warn_once(fresh_warnings, field, value):
    with pytest.warns(UserWarning, match=f"config.{field}={value}"):
        assert tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(**{field: value})) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tm.resolve_fp8_config(tm.TurboMoEOptions(), _ns(**{field: value}))  # second time: silent


def _pg():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def test_te_fp8_extra_state_is_dropped_with_one_warning(world, fresh_warnings):
    experts = tm.TurboMoEGroupedMLP(4, make_config(num_moe_experts=4), pg_collection=_pg())
    state = experts.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TE's empty extra state (no FP8) is dropped silently
        experts.load_state_dict({**state, "linear_fc1._extra_state1": torch.empty(0, dtype=torch.uint8)})
    with pytest.warns(UserWarning, match="_extra_state with FP8 metadata"):
        experts.load_state_dict({**state, "linear_fc1._extra_state1": torch.ones(16, dtype=torch.uint8)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        experts.linear_fc2.set_extra_state(torch.ones(4, dtype=torch.uint8))  # already warned once


# ----------------------------------------------------------------------------------------------
# moe_act recompute and the refused options
# ----------------------------------------------------------------------------------------------


def _saved_bytes(fn):
    """Bytes of distinct storages autograd saves during ``fn()``."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_moe_act_recompute_equals_no_recompute(world, fp8):
    results = []
    for recompute in (False, True):
        extra = dict(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True)
        config = make_config(num_moe_experts=4, **(extra if recompute else {}))
        experts = tm.TurboMoEGroupedMLP(4, config, pg_collection=_pg(), options=tm.TurboMoEOptions(fp8=fp8))
        assert experts.activation_recompute is recompute
        # Megatron's recompute against the same unfused activation (the FP8 tensorwise path would
        # otherwise fuse it into fc2's quantization: turbo_moe.swiglu, tested in test_megatron.py)
        experts._fuses_activation = lambda: False
        randomize_(experts, seed=5)
        calls = []
        activation = experts._activation
        experts._activation = lambda *a: calls.append(1) or activation(*a)
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(40, config.hidden_size, generator=gen).requires_grad_()
        probs = torch.rand(40, generator=gen) * 0.9 + 0.1
        y, saved = _saved_bytes(lambda: experts(x, torch.tensor([11, 0, 25, 4]), probs)[0])
        assert len(calls) == 1
        y.square().sum().backward()
        assert len(calls) == (2 if recompute else 1)  # recomputed once in backward
        results.append((y.detach(), x.grad, experts.linear_fc1.weight.grad, experts.linear_fc2.weight.grad, saved))
    plain, recomputed = results
    for a, b in zip(plain[:4], recomputed[:4]):
        assert torch.equal(a, b)
    assert recomputed[4] < plain[4], f"recompute saves no memory: {recomputed[4]} vs {plain[4]} bytes"


@pytest.mark.parametrize("overrides, reason", [
    (dict(use_transformer_engine_op_fuser=True), "use_transformer_engine_op_fuser"),
    (dict(use_te_activation_func=True), "use_te_activation_func"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]), "fine_grained_activation_offloading"),
    (dict(moe_paged_stash=True), "moe_paged_stash"),
])
def test_other_options_are_refused_with_the_reason(world, overrides, reason):
    config = make_config(num_moe_experts=4)
    for k, v in overrides.items():
        setattr(config, k, v)  # after __post_init__, whose own checks want TE / CUDA for some of them
    with pytest.raises(NotImplementedError, match=reason):
        tm.TurboMoEGroupedMLP(4, config, pg_collection=_pg())


# ----------------------------------------------------------------------------------------------
# Install, import errors, the GPU proof script's CPU mode
# ----------------------------------------------------------------------------------------------


def test_megatron_extra_brings_triton():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in extras["megatron"]}
    assert {"megatron-core", "triton", "numpy", "packaging", "psutil"} <= names
    assert "turbo_moe.megatron" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


@pytest.mark.parametrize("hidden, expected", [
    ("triton", "megatron-core imports the module 'triton', which is not installed"),
    ("megatron", "megatron-core is not installed"),
])
def test_import_error_names_the_missing_module(hidden, expected):
    code = (f"import sys; sys.modules[{hidden!r}] = None\n"
            "try:\n    import turbo_moe.megatron\nexcept ImportError as e:\n    print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert expected in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "pip install 'turbo_moe[megatron]'" in proc.stdout


def test_gpu_proof_script_cpu_mode():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}  # a port of its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout's turbo_moe
    proc = subprocess.run([sys.executable, "scripts/megatron_gpu_proof.py", "--cpu", "--steps", "3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "VERDICT PASS" in proc.stdout
    assert "FP8 weight quantizations per optimizer step: [2]" in proc.stdout


def test_docs_cpu_run_works_as_written(tmp_path):
    """docs/megatron.md's CPU script (the block after ``<!-- cpu-run -->``), saved and run as is."""
    import os

    text = (ROOT / "docs" / "megatron.md").read_text()
    block = text.split("<!-- cpu-run -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'if __name__ == "__main__":' in block
    script = tmp_path / "moe_cpu.py"
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["MASTER_PORT"] = str(_free_port())
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "checkpoint round trip keys:" in proc.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
