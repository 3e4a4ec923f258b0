"""``raytpu`` command line: train, test, tune, launch, submit, export, runs, data, doctor.

Errors a user can fix are printed as one ``raytpu: error: ...`` line with a
non-zero exit, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from raytpu.config.args import ConfigError, Parser, extract, parse_options, take_flag
from raytpu.errors import RunFailed, message_of
from raytpu.job import HasStatistics, Synthesizes, load_job

EXIT_USAGE = 2
EXIT_FAILED = 1


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="raytpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    for name, text in (("train", "train a job (resumes a run of the same name)"), ("test", "evaluate a checkpoint")):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.more_help = flag_list
        cmd.add_argument("config", help="YAML config, e.g. jobs/mshnet/small.yaml")
        cmd.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray instance)")
        cmd.add_argument(
            "--checkpoint",
            help="checkpoint dir or weights file (test: or best / latest of the config's run; train: initial weights)",
        )
        if name == "train":
            cmd.add_argument("--local", action="store_true", help="run in local processes, without Ray")
        cmd.add_argument("--verbose", action="store_true", help="show Ray's own log lines too")
        cmd.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides and seed-script flags")

    export = sub.add_parser("export", help="write a checkpoint in its ecosystem's format (Transformers)")
    export.add_argument("config", help="YAML config of the run, e.g. jobs/causal_lm/small.yaml")
    export.add_argument("--checkpoint", help="checkpoint dir or weights file, or best / latest of the config's run")
    export.add_argument("--out", help="output folder (required)")
    export.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides, as for train")

    runs = sub.add_parser("runs", help="a run's checkpoints (best, latest, metrics), or the runs under a storage path")
    runs.add_argument("path", help="a run folder (run.storage_path/run.name) or a run.storage_path; local or a bucket")

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

    tune = sub.add_parser(
        "tune", help="search hyper-parameters with Ray Tune (random, Optuna, ASHA, PBT), each trial a TorchTrainer"
    )
    tune.more_help = tune_flag_list
    tune.add_argument("config", help="YAML config, e.g. jobs/mshnet/small.yaml")
    tune.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides and the tune flags")

    add_launch_parser(sub)

    submit = sub.add_parser(
        "submit",
        help="submit `raytpu train CONFIG` (or `raytpu launch SCRIPT`: `raytpu submit launch ...`) as a Ray job",
    )
    submit.add_argument("config", help="YAML config, e.g. jobs/mshnet/small.yaml, or `launch`")
    submit.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides, --address URL, --no-wait")

    doctor = sub.add_parser("doctor", help="check versions, devices and the Ray cluster")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--address", help="Ray cluster to check (default: RAY_ADDRESS)")
    doctor.add_argument("--timeout", type=float, help="seconds per probe (default 30)")
    doctor.add_argument("--probe-xla", action="store_true", help="ask torch_xla for its devices (in a subprocess)")
    doctor.add_argument("config", nargs="?", help="a YAML config: its memory per device, estimated")
    doctor.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides of the config")
    return parser


def flag_list() -> str:
    from raytpu.config.flag_list import flag_list

    return flag_list()


def tune_flag_list() -> str:
    from raytpu.config.flag_list import flag_list
    from raytpu.driver.search import FLAGS

    return flag_list(FLAGS, "tune")


def add_launch_parser(sub: argparse._SubParsersAction) -> None:
    from raytpu.driver.launch import LAUNCH_TEXT, add_launch_arguments

    add_launch_arguments(sub.add_parser("launch", help=LAUNCH_TEXT, description=LAUNCH_TEXT))


def main(argv: list[str] | None = None) -> int:
    from raytpu.cluster.connect import KEEP_LOCAL
    from raytpu.records.goodput import command_started

    started = command_started()
    # the driver never touches a device: Transformers (a job's config check) must not load torch_xla
    os.environ.setdefault("USE_TORCH_XLA", "0")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # jobs outside the package load by dotted path, as with `python -m`
    one_command = KEEP_LOCAL.set(False)  # a local Ray instance the command starts ends with it
    try:
        return dispatch(build_parser().parse_args(argv), started)
    except (ConfigError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        print(f"raytpu: error: {message_of(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("raytpu: interrupted; rerun the same command to resume from the last checkpoint", file=sys.stderr)
        return 130
    except Exception as exc:
        if isinstance(exc, RunFailed):
            if exc.details:
                print(exc.details.rstrip(), file=sys.stderr)
            print(f"raytpu: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        raise
    finally:
        KEEP_LOCAL.reset(one_command)


def dispatch(args: argparse.Namespace, started: float) -> int:
    if args.command in ("train", "test"):
        return train_or_test_command(args)
    if args.command == "data":
        return data_command(args)
    if args.command == "export":
        return export_command(args)
    if args.command == "runs":
        from raytpu.driver.listing import describe

        print(describe(args.path), flush=True)
        return 0
    if args.command == "launch":
        from raytpu.driver import launch

        return launch.main(args, args.address, started)
    if args.command == "tune":
        from raytpu import api

        return 0 if api.tune(args.config, *args.overrides).best_config else EXIT_FAILED
    if args.command == "submit":
        from raytpu.driver import submit

        return submit.main(args.config, list(args.overrides))
    if args.command == "doctor":
        from raytpu.driver import doctor

        options = (["--json"] if args.json else []) + (["--probe-xla"] if args.probe_xla else [])
        options += (["--address", args.address] if args.address else []) + (
            ["--timeout", str(args.timeout)] if args.timeout else []
        )
        return doctor.main(options + ([args.config, *args.overrides] if args.config else []))
    raise AssertionError(args.command)


def train_or_test_command(args: argparse.Namespace) -> int:
    from raytpu import api

    switches = ["--local", "--verbose"] if args.command == "train" else ["--verbose"]
    overrides, found = extract(list(args.overrides), valued=["--address", "--checkpoint"], switches=switches)
    verbose = args.verbose or "--verbose" in found
    address = found.get("--address", [args.address])[0]
    checkpoint = found.get("--checkpoint", [args.checkpoint])[0]
    if args.command == "test":
        api.test(args.config, *overrides, address=address, checkpoint=checkpoint, verbose=verbose)
        return 0
    local = args.local or "--local" in found
    summary = api.train(args.config, *overrides, address=address, local=local, checkpoint=checkpoint, verbose=verbose)
    return 128 + summary.stopped_by if summary.stopped_by else 0


def export_command(args: argparse.Namespace) -> int:
    from raytpu import api

    overrides, found = extract(list(args.overrides), valued=["--checkpoint", "--out"])
    checkpoint = found.get("--checkpoint", [args.checkpoint])[0]
    api.export(args.config, *overrides, out=found.get("--out", [args.out])[0] or "", checkpoint=checkpoint or "")
    return 0


def data_command(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    if args.data_command == "synth":
        if not isinstance(job, Synthesizes):
            raise ConfigError(f"job {job.name!r} has no synthetic data generator (the Synthesizes capability)")
        items = list(args.options)
        out = take_flag(items, "--out") or args.out
        if not out:
            raise ValueError(f"data synth needs --out DIR, e.g. raytpu data synth {job.name} --out data/{job.name}")
        options = parse_options(items, job.synthesize)
        job.synthesize(Path(out), **options)
        print(f"wrote a synthetic {job.name} data set to {out}")
        return 0
    if args.data_command == "stats":
        if not isinstance(job, HasStatistics):
            raise ConfigError(f"job {job.name!r} has no normalisation statistics to compute")
        print(json.dumps(job.compute_stats(args.data_path)))
        return 0
    if args.data_command == "prepare":
        from raytpu.storage.tables import prepare

        manifest = prepare(job, args.src, args.out, args.rows_per_file)
        tables = ", ".join(f"{name} {info['rows']} rows" for name, info in manifest["tables"].items())
        verb = "already prepared, unchanged" if manifest.get("unchanged") else "wrote"
        print(f"{verb}: {job.name} parquet tables in {args.out} ({tables})", flush=True)
        return 0
    raise AssertionError(args.data_command)


if __name__ == "__main__":
    sys.exit(main())
