"""The command line shared by the three entry points: `--config path.yaml key.sub=value ...`,
and one way of reporting bad input.

    if __name__ == "__main__":
        run_cli(main)

A `UserError` (bad config, model reference, prompt file, data folder) prints one
`error: <message>` on stderr and exits with code 2; any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Callable

from common.config import Config, load_config
from common.errors import UserError


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run an entry point's `main(argv)`, turning a UserError into the one-line message and exit code 2."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cli_config(argv: list[str] | None, description: str) -> Config:
    """Parse `--config path.yaml key.sub=value ...` into a validated Config; `--help` lists every key.
    Raises ConfigError (a UserError) for a bad file or value."""
    parser = argparse.ArgumentParser(description=description, epilog=_help_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. eval.ks=[2,4]")
    args = parser.parse_args(argv)
    return load_config(args.config, args.overrides)


def _help_epilog() -> str:
    lines = ["config keys (defaults):"]
    sections = ("generate", "distill", "onpolicy", "eval", "engines", "wandb")
    for section in (None,) + sections:
        cls = Config if section is None else typing.get_type_hints(Config)[section]
        for f in dataclasses.fields(cls):
            if f.name in sections:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            key = f.name if section is None else f"{section}.{f.name}"
            if dataclasses.is_dataclass(default):  # a nested group, e.g. generate.vllm: one line per key
                lines += [f"  {key}.{name} = {value!r}" for name, value in dataclasses.asdict(default).items()]
            else:
                lines.append(f"  {key} = {default!r}")
    return "\n".join(lines)


def check_main(argv: list[str] | None = None) -> None:
    """`python -m common.cli --config X key=value ...`: read and check a config, print nothing. The Makefile runs it
    before a multi-process launch: a bad setting is then one `error:` line, not one per rank inside torchrun's
    failure report."""
    cli_config(argv, "Check a config and its overrides (every stage reads the same file).")


if __name__ == "__main__":
    run_cli(check_main)
