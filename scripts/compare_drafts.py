"""One table comparing drafts from their `make eval-speedup` reports.

Each report already times its own draft against target-only decoding on the same prompts, in one
process; this script only lines the reports up (draft size, acceptance, τ, measured speedup at
k = 1 and at the best k per prompt set and temperature).

    python scripts/compare_drafts.py "KL (demo)=runs/smollm2/eval" "CE only=runs/smollm2-ce/eval" \\
        --out runs/draft-comparison.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", metavar="LABEL=PATH",
                   help="a label and a report folder (or its report.json)")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    return p.parse_args(argv)


def load_report(path: str) -> dict:
    file = Path(path)
    if file.is_dir():
        file = file / "report.json"
    if not file.is_file():
        raise SystemExit(f"error: no report at {file} (run `make eval-speedup` for that draft first)")
    return json.loads(file.read_text())


def rows_of(label: str, report: dict) -> list[list[str]]:
    draft = report["draft"]
    size = f"{draft['params'] / 1e6:.2f}M ({draft['param_ratio']:.2%})"
    vocab = f"{draft['vocab_subset']}" if draft.get("vocab_subset") else "full"
    groups: dict[tuple[str, float], list[dict]] = {}
    for result in report["results"]:
        if result.get("proposer", "draft") == "draft":  # drafts are compared alone, without prompt lookup
            groups.setdefault((result["prompt_set"], result["temperature"]), []).append(result)
    rows = []
    for (prompt_set, temperature), results in groups.items():
        by_k = {r["k"]: r for r in results}
        best = max(results, key=lambda r: r["speedup"])
        first = by_k.get(1, min(results, key=lambda r: r["k"]))
        rows.append([label, size, vocab, prompt_set, f"{temperature:g}", str(first["n_prompts"]),
                     f"{first['token_acceptance']:.2f}", f"{first['speedup']:.2f}×",
                     str(best["k"]), f"{best['tau']:.2f}", f"{best['speedup']:.2f}×"])
    return rows


def markdown(rows: list[list[str]]) -> str:
    header = ["draft", "params (ratio)", "vocab", "prompts", "T", "n", f"α k={1}", "speedup k=1",
              "best k", "τ best k", "speedup best k"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    rows, sources = [], []
    for item in args.reports:
        label, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"error: {item!r} is not LABEL=PATH")
        report = load_report(path)
        rows += rows_of(label, report)
        sources.append(f"- {label}: `{report['command']}` ({report['date'][:10]}, {report['device']}, "
                       f"git {report['git_sha']})")
    table = markdown(rows) + "\nReports:\n" + "\n".join(sources) + "\n"
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
