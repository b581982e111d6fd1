"""dtype 'auto' per machine (common/precision.py) and progress that tells the truth (common/progress.py)."""

import re
import warnings

import pytest
import torch

from common import precision
from common.precision import machine_class, resolve_decode_dtype, resolve_dtype
from common.progress import BatchProgress, expectation


AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.fixture
def cpu(monkeypatch):
    """cpu(flags, bf16 speedup): a CPU with these flags whose bf16 GEMM runs `speedup` times as fast as fp32."""
    timed = []

    def make(flags, speedup):
        monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
        monkeypatch.setattr(precision, "bf16_gemm_speedup", lambda: timed.append(1) or speedup)
        return timed
    return make


def test_auto_is_bf16_only_where_the_cpu_computes_it_natively(cpu):
    cpu(AMX, 3.6)
    choice = resolve_dtype("auto", "cpu", "generate.dtype")
    assert (choice.name, choice.torch_dtype) == ("bf16", torch.bfloat16)
    assert "amx_bf16/avx512_bf16" in choice.reason and "3.6x as fast" in choice.reason
    assert choice.line.startswith("generate.dtype: auto -> bf16 (")
    cpu(AVX2, 1 / 5.5)
    choice = resolve_dtype("auto", "cpu", "distill.precision")
    assert choice.name == "fp32" and "emulated" in choice.reason and "5.5x slower" in choice.reason
    # The flags say bf16, but the library runs it slowly (e.g. ONEDNN_MAX_CPU_ISA): the timing decides.
    cpu(AMX, 0.2)
    assert resolve_dtype("auto", "cpu", "generate.dtype").name == "fp32"


def test_explicit_bf16_without_native_support_warns_with_the_measured_slowdown(cpu):
    cpu(AVX2, 1 / 5.5)
    with pytest.warns(UserWarning, match=r"generate.dtype=bf16 .*5.5x slower.*generate.dtype=auto would choose fp32"):
        choice = resolve_dtype("bf16", "cpu", "generate.dtype")
    assert choice.name == "bf16"  # runs as asked
    cpu(AMX, 3.6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # native bf16 asked explicitly: no warning
        assert resolve_dtype("bf16", "cpu", "generate.dtype").name == "bf16"


def test_fp32_is_fp32_without_timing_anything(cpu):
    timed = cpu(AMX, 3.6)
    assert resolve_dtype("fp32", "cpu", "generate.dtype").name == "fp32" and not timed
    with pytest.raises(ValueError, match="'float16' is not 'auto', 'fp32' or 'bf16'"):
        resolve_dtype("float16", "cpu", "generate.dtype")


def test_batch_1_decoding_is_bf16_only_on_a_cpu_with_amx(cpu):
    cpu(AMX, 3.6)
    choice = resolve_decode_dtype("auto", "cpu")
    assert choice.name == "bf16" and "AMX" in choice.reason
    cpu(frozenset({"avx2", "avx512f", "avx512_bf16"}), 3.6)  # native bf16, but no AMX: not measured faster
    assert resolve_decode_dtype("auto", "cpu").name == "fp32"
    cpu(AMX, 0.2)  # AMX in the flags, but the library runs bf16 slowly (ONEDNN_MAX_CPU_ISA, say)
    assert resolve_decode_dtype("auto", "cpu").name == "fp32"
    cpu(AVX2, 1 / 5.5)
    assert resolve_decode_dtype("auto", "cpu").name == "fp32"
    assert resolve_decode_dtype("bf16", "cpu").name == "bf16"
    assert resolve_decode_dtype("fp32", "cpu").name == "fp32"


@pytest.mark.parametrize("flags, isa", [(AMX, "AVX-512 BF16 + AMX"), (frozenset({"avx2", "avx512f"}), "AVX-512"),
                                        (AVX2, "AVX2")])
def test_figures_name_the_cpu_class(monkeypatch, flags, isa):
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert f"({isa}), " in machine_class() and re.search(r"\d+ cores, \d+ threads$", machine_class())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert f"({isa}, limited to AVX2)" in machine_class()


def test_the_real_probe_gives_a_positive_ratio():
    assert precision.bf16_gemm_speedup() > 0


def test_progress_moves_by_batches_and_expects_from_the_first(capsys):
    progress = BatchProgress("generate", total=10, unit="rows")
    progress.batch_done(4, 400)
    first = capsys.readouterr().err
    assert "generate: the first 4 of 10 rows took" in first and "expect ~" in first
    progress.batch_done(6, 600)
    progress.close()
    assert progress.bar.n == 10 and progress.tokens == 1000
    assert "the first" not in capsys.readouterr().err  # said once, after the first batch only


def test_progress_expects_from_tokens_where_they_are_known(capsys):
    progress = BatchProgress("score", total=10, unit="rows", total_tokens=10_000)
    progress.batch_done(5, 1_000)  # half the rows, a tenth of the tokens: short texts first
    line = capsys.readouterr().err
    assert "score: the first 1,000 of 10,000 tokens took" in line
    progress.close()


def test_expectation_scales_the_first_units_time():
    line = expectation("distill", 1, 540, 0.8, "steps")
    assert "the first 1 of 540 steps took 1 s; expect ~7 min in all" in line

