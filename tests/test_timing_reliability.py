"""eval-speedup's timing-reliability check on synthetic report data: quiet runs (the README's CPU,
a slower Xeon, a GPU) stay reliable; each busy-machine signal alone withholds the verdict."""

import re

import pytest

from decode.eval_results import print_headline, verdict
from decode.report import reliability_lines
from decode.timing import timing_reliability

# Target-only tokens/s of the 6 in-domain prompts of a quiet run on the Xeon (relative MAD 0.071,
# the largest quiet spread seen; the 10.1 is a prompt whose output stopped at EOS after 32 tokens).
QUIET_XEON_TOK_S = [14.0, 10.1, 11.9, 13.9, 12.2, 13.9]


def synthetic_report(tok_s=(40.1, 39.0, 41.2, 38.5, 40.6, 39.7), measured_over_predicted=(0.89, 1.09),
                     step_ms=(22.7, 23.4), hf_over_ours=0.43) -> dict:
    """The parts of report.json the check reads; defaults are the README's quiet demo figures."""
    runs = [{"prompt_set": "data:eval", "temperature": t, "prompt_id": f"p{i}", "proposer": proposer, "k": k,
             "baseline_tokens": 64, "baseline_s": 64 / v}
            for t in (0.0, 0.7) for i, v in enumerate(tok_s) for proposer in ("draft", "draft+lookup")
            for k in (1, 4)]
    results = [{"measured_over_predicted": r} for r in measured_over_predicted]
    results.append({"measured_over_predicted": None})  # a k beyond the cost model's r(k)
    hf = [{"prompt_set": "data:eval", "method": "hf greedy", "k": None, "vs_our_baseline": hf_over_ours},
          {"prompt_set": "data:eval", "method": "hf assisted", "k": 4, "vs_our_baseline": 0.3}]
    return {"runs": runs, "results": results, "hf": hf,
            "cost_model": {"target_step_ms": step_ms[0]}, "cost_model_end": {"target_step_ms": step_ms[1]}}


@pytest.mark.parametrize("report, device_type", [
    (synthetic_report(), "cpu"),  # the README's demo on a 2-core AMD EPYC
    # A slower CPU, quiet: the Xeon's 3x slower target step and its own spread and band, with HF
    # greedy as fast as on the AMD EPYC (58 ms per token) against our 77.
    (synthetic_report(QUIET_XEON_TOK_S, (0.87, 1.01), (76.6, 70.1), 1.3), "cpu"),
    # An H200: the cost model leaves out host work there (measured ÷ predicted 0.69-1.42), not checked.
    (synthetic_report((234.0, 230.1, 240.3, 228.8, 236.0), (0.69, 1.42), (3.17, 3.2), 0.13), "cuda"),
])
def test_quiet_runs_are_reliable(report, device_type):
    reliability = timing_reliability(report, device_type)
    assert reliability["reliable"] and reliability["reasons"] == []
    figures = reliability["figures"]
    assert set(figures["target_only_spread"]) == {"data:eval T=0.0", "data:eval T=0.7"}
    assert figures["target_step_ms"] == {"start": report["cost_model"]["target_step_ms"],
                                         "end": report["cost_model_end"]["target_step_ms"]}
    assert verdict([{"speedup": 1.41, "proposer": "draft+lookup", "k": 4, "temperature": 0.0,
                     "prompt_set": "data:eval", "alpha": 0.26, "tau": 1.99}], reliability).startswith("GO")


@pytest.mark.parametrize("busy, reason", [
    # Half the prompts slowed ~2x by a competing process: relative MAD 0.32.
    (synthetic_report(tok_s=(40.1, 19.0, 41.2, 18.5, 40.6, 21.7)),
     "varies by 0.32 .* across the prompts of data:eval T=0.0"),
    # The busy demo's 2.56x "GO", had it been predicted at the quiet demo's 1.48x.
    (synthetic_report(measured_over_predicted=(0.95, 1.73)), "measured ÷ predicted speedup 0.95-1.73"),
    (synthetic_report(measured_over_predicted=(0.6, 1.0)), "measured ÷ predicted speedup 0.60-1.00"),
    (synthetic_report(step_ms=(22.7, 48.0)), r"22.7 ms before the timed runs and 48.0 ms after \(\+111%"),
    (synthetic_report(step_ms=(48.0, 22.7)), r"\(-53%"),
    (synthetic_report(hf_over_ours=6.0), "HF greedy ran at 6.0x our target-only loop on data:eval"),
])
def test_each_busy_signal_withholds_the_verdict(busy, reason, capsys, tmp_path):
    reliability = timing_reliability(busy, "cpu")
    assert not reliability["reliable"]
    assert len(reliability["reasons"]) in (1, 2)  # the spread case trips both temperatures
    assert any(re.search(reason, r) for r in reliability["reasons"])
    best = [{"speedup": 2.56, "proposer": "draft+lookup", "k": 4, "temperature": 0.0, "prompt_set": "data:eval",
             "alpha": 0.2, "tau": 1.9}]
    withheld = verdict(best, reliability)
    assert "WITHHELD" in withheld and "machine busy" in withheld and "GO" not in withheld.replace("WITHHELD", "")
    top = reliability_lines(reliability)
    assert top[0].startswith("**Timings unreliable: machine busy.**") and "withheld" in top[0]
    assert [line[2:] for line in top if line.startswith("- ")] == reliability["reasons"]
    print_headline({"timing_reliability": reliability, "results": [], "hf": [], "verdict": withheld}, tmp_path)
    printed = capsys.readouterr().out
    assert printed.lstrip().startswith("timings unreliable: machine busy; the go/no-go verdict is withheld")
    assert all(r in printed for r in reliability["reasons"]) and withheld in printed


def test_tree_rows_off_the_cost_model_do_not_call_the_machine_busy():
    """A tree row's measured ÷ predicted outside the band is the model's gap (tree host work), reported
    beside the chains' band; the same figure on a chain row withholds the verdict."""
    report = synthetic_report()
    report["results"].append({"measured_over_predicted": 0.63, "tree": "dynamic:depth=6,branch=4,nodes=auto"})
    reliability = timing_reliability(report, "cpu")
    assert reliability["reliable"] and reliability["figures"]["measured_over_predicted"] == [0.89, 1.09]
    assert reliability["figures"]["tree_measured_over_predicted"] == [0.63, 0.63]
    (line, _) = reliability_lines(reliability)
    assert "0.89–1.09 (chains)" in line and "Tree rows: measured ÷ predicted 0.63–0.63" in line
    del report["results"][-1]["tree"]
    assert not timing_reliability(report, "cpu")["reliable"]


def test_small_prompt_sets_give_no_spread():
    # Two prompts, one twice as fast: a median absolute deviation of 2 values says nothing.
    reliability = timing_reliability(synthetic_report(tok_s=(40.0, 20.0)), "cpu")
    assert reliability["figures"]["target_only_spread"] == {} and reliability["reliable"]


def test_reliable_report_says_so_at_the_top():
    reliability = timing_reliability(synthetic_report(), "cpu")
    (line, blank) = reliability_lines(reliability)
    assert line.startswith("Timings reliable:") and "measured ÷ predicted 0.89–1.09" in line
    assert "target step 22.7 ms before the timed runs and 23.4 ms after" in line and blank == ""
