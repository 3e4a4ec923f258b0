"""``raytpu`` command line: train, test, tune, submit, data, doctor.

Errors a user can fix are printed as one ``raytpu: error: ...`` line with a
non-zero exit, never as a traceback.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from raytpu.config import ConfigError, load_config, parse_value
from raytpu.job import load_job

EXIT_USAGE = 2
EXIT_FAILED = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    for name, text in (("train", "train a job (resumes a run of the same name)"), ("test", "evaluate a checkpoint")):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("config", help="YAML config, e.g. jobs/mshnet/small.yaml")
        cmd.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray instance)")
        cmd.add_argument("--checkpoint", help="checkpoint dir or weights file (test; or initial weights for train)")
        cmd.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides and seed-script flags")

    data = sub.add_parser("data", help="make, inspect and convert data sets").add_subparsers(
        dest="data_command", required=True
    )
    synth = data.add_parser("synth", help="write a small synthetic data set in the job's native layout")
    synth.add_argument("job")
    synth.add_argument("--out", help="output folder (required)")
    synth.add_argument("options", nargs=argparse.REMAINDER, help="job options, e.g. --n 100 --size 128 --seed 0")
    stats = data.add_parser("stats", help="compute normalisation statistics from the train split")
    stats.add_argument("job")
    stats.add_argument("--data-path", required=True, type=Path)
    prepare = data.add_parser("prepare", help="convert a job's native files to parquet for data.loader=ray")
    prepare.add_argument("job")
    prepare.add_argument("--src", required=True, help="the job's native data folder")
    prepare.add_argument("--out", required=True, help="output folder or filesystem URI")
    prepare.add_argument("--rows-per-file", type=int, default=0, help="rows per parquet file (0 = the job's default)")

    tune = sub.add_parser("tune", help="search hyper-parameters with Ray Tune (ASHA), each trial a TorchTrainer")
    tune.add_argument("config", help="YAML config, e.g. jobs/mshnet/small.yaml")
    tune.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides and the tune flags")

    submit = sub.add_parser("submit", help="submit `raytpu train CONFIG` to a Ray cluster as a Ray job")
    submit.add_argument("config", help="YAML config, e.g. jobs/mshnet/small.yaml")
    submit.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides, --address URL, --no-wait")

    doctor = sub.add_parser("doctor", help="check versions, devices and the Ray cluster")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--address")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # jobs outside the package load by dotted path, as with `python -m`
    try:
        return dispatch(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"raytpu: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("raytpu: interrupted; rerun the same command to resume from the last checkpoint", file=sys.stderr)
        return 130
    except Exception as exc:
        from raytpu.launcher import RunFailed

        if isinstance(exc, RunFailed):
            print(f"raytpu: error: run failed: {exc}", file=sys.stderr)
            return EXIT_FAILED
        raise


def dispatch(args: argparse.Namespace) -> int:
    if args.command in ("train", "test"):
        return run(args)
    if args.command == "data":
        return data_command(args)
    if args.command == "tune":
        from raytpu import tune

        return tune.main(args.config, list(args.overrides))
    if args.command == "submit":
        from raytpu import submit

        return submit.main(args.config, list(args.overrides))
    if args.command == "doctor":
        from raytpu import doctor

        return doctor.main((["--json"] if args.json else []) + (["--address", args.address] if args.address else []))
    raise AssertionError(args.command)


def run(args: argparse.Namespace) -> int:
    from raytpu import launcher

    overrides = list(args.overrides)
    args.address = take_flag(overrides, "--address") or args.address
    args.checkpoint = take_flag(overrides, "--checkpoint") or args.checkpoint
    if args.checkpoint:
        overrides.append(f"checkpoint.weights={args.checkpoint}")
    if args.command == "test":
        overrides.append("run.mode=test")
    cfg, job = load_config(args.config, overrides)
    cfg.run.name = launcher.run_name(cfg, args.config)
    if cfg.run.mode == "test":
        metrics = launcher.test(cfg, job, args.address)
        print(json.dumps(metrics), flush=True)
        return 0
    launcher.train(cfg, job, args.address)
    return 0


def take_flag(items: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` / ``flag=VALUE`` from ``items`` (argparse leaves them in the remainder)."""
    for index, item in enumerate(items):
        if item == flag and index + 1 < len(items):
            value = items[index + 1]
            del items[index : index + 2]
            return value
        if item.startswith(flag + "="):
            del items[index]
            return item.split("=", 1)[1]
    return None


def data_command(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    if args.data_command == "synth":
        items = list(args.options)
        out = take_flag(items, "--out") or args.out
        if not out:
            raise ValueError(f"data synth needs --out DIR, e.g. raytpu data synth {job.name} --out data/{job.name}")
        options = parse_options(items)
        check_options(job.synthesize, options)
        job.synthesize(Path(out), **options)
        print(f"wrote a synthetic {job.name} data set to {out}")
        return 0
    if args.data_command == "stats":
        stats = getattr(job, "compute_stats", None)
        if stats is None:
            raise ValueError(f"job {job.name!r} has no normalisation statistics to compute")
        print(json.dumps(stats(args.data_path)))
        return 0
    if args.data_command == "prepare":
        from raytpu import ingest

        return ingest.prepare_command(job, args.src, args.out, args.rows_per_file)
    raise AssertionError(args.data_command)


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["--n-train", "8", "--size=32"]`` -> ``{"n_train": 8, "size": 32}``."""
    options: dict[str, Any] = {}
    index = 0
    while index < len(items):
        item = items[index]
        if not item.startswith("--"):
            raise ValueError(f"unexpected argument {item!r}; options look like --name value")
        key, sep, value = item[2:].partition("=")
        if not sep:
            if index + 1 >= len(items):
                raise ValueError(f"option --{key} needs a value")
            value = items[index + 1]
            index += 1
        options[key.replace("-", "_")] = parse_value(value)
        index += 1
    return options


def check_options(fn: Any, options: dict[str, Any]) -> None:
    accepted = [p for p in inspect.signature(fn).parameters if p not in ("self", "out")]
    unknown = [k for k in options if k not in accepted]
    if unknown:
        flags = ", ".join("--" + p.replace("_", "-") for p in accepted)
        raise ValueError(f"unknown option --{unknown[0].replace('_', '-')}; this job accepts {flags}")


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, KeyError):
        text = text.strip("'\"")
    return " ".join(text.split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
