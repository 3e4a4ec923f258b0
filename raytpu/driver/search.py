"""How ``raytpu tune`` searches: its flags, search spaces (``KEY=DOMAIN(ARGS)`` strings parsed,
checked against the config before any trial starts, and turned into Ray Tune domains), the search
algorithm and the trial scheduler."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytpu.config import Config, ConfigError, with_values
from raytpu.config.args import extract
from raytpu.config.plan import Plan
from raytpu.config.validation import validate
from raytpu.errors import install_hint
from raytpu.job import Job

if TYPE_CHECKING:
    from raytpu.driver.tune import Sweep

#: ``raytpu tune`` flags -> ``tune.*`` keys (they win over a job's seed-flag aliases of the same name)
FLAGS = {
    "--samples": "tune.num_samples",
    "--metric": "tune.metric",
    "--mode": "tune.mode",
    "--scheduler": "tune.scheduler",
    "--max-concurrent": "tune.max_concurrent",
    "--name": "tune.name",
    "--lr-scaling": "tune.lr_scaling",
    "--max-t": "tune.max_t",
    "--grace-period": "tune.grace_period",
    "--reduction-factor": "tune.reduction_factor",
    "--search-alg": "tune.search_alg",
    "--perturbation-interval": "tune.perturbation_interval",
    "--quantile-fraction": "tune.quantile_fraction",
}


#: domain name -> number of arguments (None = one or more)
DOMAINS: dict[str, int | None] = {"choice": None, "grid": None, "uniform": 2, "loguniform": 2, "randint": 2}


@dataclass(frozen=True)
class Search:
    """One searched key: ``optim.lr=loguniform(1e-4, 1e-1)``."""

    key: str
    kind: str
    args: tuple[Any, ...]

    def domain(self) -> Any:
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        if self.kind == "grid":
            return tune.grid_search(list(self.args))
        if self.kind == "uniform":
            return tune.uniform(*self.args)
        if self.kind == "loguniform":
            return tune.loguniform(*self.args)
        return tune.randint(*self.args)

    def values(self) -> list[Any] | None:
        """Every value a discrete domain may take (None for a range, or a randint of more than
        :data:`MOST_VALUES`)."""
        if self.kind in ("choice", "grid"):
            return list(self.args)
        if self.kind == "randint" and self.args[1] - self.args[0] <= MOST_VALUES:
            return list(range(self.args[0], self.args[1]))
        return None

    def keeping(self, values: list[Any]) -> Search:
        """This search over ``values`` only (a randint's become a choice)."""
        return Search(self.key, "grid" if self.kind == "grid" else "choice", tuple(values))

    def candidates(self) -> list[Any]:
        """Values to check against the config before any trial starts."""
        if self.kind in ("choice", "grid"):
            return list(self.args)
        if self.kind == "randint":
            return [self.args[0], self.args[1] - 1]
        return [float(self.args[0]), float(self.args[1])]


#: the most values of a randint domain that are each checked against the memory estimate
MOST_VALUES = 64

SEARCH_PATTERN = re.compile(r"^\s*([\w.]+)\s*=\s*(\w+)\s*\((.*)\)\s*$")


def parse_search(text: str) -> Search:
    """``"optim.lr=loguniform(1e-4,1e-1)"`` -> ``Search("optim.lr", "loguniform", (1e-4, 0.1))``."""
    example = "e.g. --search 'optim.lr=loguniform(1e-4,1e-1)'"
    match = SEARCH_PATTERN.match(text)
    if not match:
        raise ConfigError(f"search {text!r} is not key=domain(args); {example}")
    key, kind, body = match.groups()
    return make_search(key, kind, body, text)


def make_search(key: str, kind: str, body: str, text: str) -> Search:
    from raytpu.config.yaml_core import YAMLError, load_yaml

    if kind not in DOMAINS:
        raise ConfigError(f"search {text!r}: unknown domain {kind!r}; use one of {', '.join(DOMAINS)}")
    try:
        args = load_yaml(f"[{body}]")
    except YAMLError as exc:
        raise ConfigError(f"search {text!r}: cannot read the arguments {body!r}") from exc
    args = [float(a) if isinstance(a, str) and _is_number(a) else a for a in args]
    arity = DOMAINS[kind]
    if arity is None and not args:
        raise ConfigError(f"search {text!r}: {kind}() needs at least one value")
    if arity is not None:
        if len(args) != arity or not all(_is_real(a) for a in args):
            raise ConfigError(f"search {text!r}: {kind}() takes two numbers, lower and upper")
        lower, upper = args
        if not lower < upper:
            raise ConfigError(f"search {text!r}: the lower bound must be below the upper bound")
        if kind == "loguniform" and lower <= 0:
            raise ConfigError(f"search {text!r}: loguniform() needs a positive lower bound")
        if kind == "randint" and not all(isinstance(a, int) for a in args):
            raise ConfigError(f"search {text!r}: randint() takes two integers (upper bound excluded)")
    return Search(key, kind, tuple(args))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def searches_of(cfg: Config) -> list[Search]:
    """The config's ``tune.search`` mapping, parsed and checked against the config and against the
    search algorithm and scheduler that draw from it."""
    if not cfg.tune.search:
        raise ConfigError(
            "nothing to search: pass --search 'optim.lr=loguniform(1e-4,1e-1)' (repeatable) or set tune.search"
        )
    searches = checked([parse_search(f"{key}={expr}") for key, expr in cfg.tune.search.items()], cfg, "search")
    if cfg.tune.search_alg == "optuna":
        check_optuna(cfg, searches)
    return searches


def check_optuna(cfg: Config, searches: list[Search]) -> None:
    """Optuna's TPE draws from ranges and choices and learns from the trials; Tune's grid and PBT's
    population sampling are not its."""
    import importlib.util

    if importlib.util.find_spec("optuna") is None:
        raise ConfigError(f"--search-alg optuna needs Optuna: {install_hint('optuna')}")
    grids = [search.key for search in searches if search.kind == "grid"]
    if grids:
        raise ConfigError(
            f"--search-alg optuna draws each trial's values itself: {', '.join(grids)} is a grid(), Tune's own "
            "enumeration; use choice(...) with Optuna, or grid() with --search-alg random"
        )
    if cfg.tune.scheduler == "pbt":
        raise ConfigError(
            "--scheduler pbt draws its population at random and then copies and perturbs it: use it with "
            "--search-alg random (Optuna's TPE goes with asha or fifo)"
        )


def mutations_of(cfg: Config, searches: list[Search]) -> list[Search]:
    """PBT's ``tune.mutations``: the keys it may perturb and the domains it resamples them from
    (default: ``optim.lr``, from its searched domain, else a decade either side of the config's)."""
    if cfg.tune.scheduler != "pbt":
        if cfg.tune.mutations:
            raise ConfigError("tune.mutations (--mutate) is what --scheduler pbt perturbs; add --scheduler pbt")
        return []
    if not cfg.tune.mutations:
        return [lr_mutation(cfg, next((search for search in searches if search.key == "optim.lr"), None))]
    mutations = checked([parse_search(f"{key}={expr}") for key, expr in cfg.tune.mutations.items()], cfg, "mutation")
    grids = [mutation.key for mutation in mutations if mutation.kind == "grid"]
    if grids:
        raise ConfigError(f"--mutate {grids[0]}: PBT resamples a mutation: give choice(...) or a range, not grid()")
    return mutations


def lr_mutation(cfg: Config, searched: Search | None) -> Search:
    """What PBT perturbs by default: ``optim.lr`` within its searched range (a grid's or choice's
    lowest to highest value), else a decade either side of the config's."""
    if searched is not None and searched.kind in ("uniform", "loguniform"):
        return searched
    values = [float(value) for value in (searched.values() or []) if _is_real(value)] if searched else []
    if values and 0 < min(values) < max(values):
        return Search("optim.lr", "loguniform", (min(values), max(values)))
    return Search("optim.lr", "loguniform", (cfg.optim.lr / 10, cfg.optim.lr * 10))


def checked(searches: list[Search], cfg: Config, what: str) -> list[Search]:
    """``searches`` whose keys may be searched and whose every value the config accepts."""
    for search in searches:
        if search.key.startswith("tune.") or search.key in ("job.name", "run.name", "run.storage_path"):
            raise ConfigError(f"{what} key {search.key!r} cannot be searched; search training settings")
        for value in search.candidates():
            validate(with_values(cfg, {search.key: value}))
    return searches


def within_memory(searches: list[Search], plan: Plan, job: Job) -> list[Search]:
    """Trials that cannot fit are never started: each value of a discrete domain (the other keys at
    the config's values) checked against the memory estimate for the cluster's devices, those
    that cannot fit left out and named in one line, a ConfigError when a domain keeps none; with no
    such domain, the config itself checked. Nothing where the device memory is unknown (a CPU)."""
    from raytpu.config.memory import GB, USABLE, check_memory, device_memory, estimate_run, size

    gpu_kinds = plan.facts.offer.accelerator_types("GPU")
    memory, what = device_memory(plan.config, gpu_kinds)
    discrete = [search for search in searches if search.values() is not None]
    if memory is None or not discrete:
        say_notes(check_memory(plan.config, job, gpu_kinds))
        return searches
    kept = []
    for search in searches:
        values = search.values()
        needs = {value: estimate_run(plan.remade({search.key: value}).config, job).total for value in values or []}
        too_big = [value for value, need in needs.items() if need > USABLE * memory * GB]
        if not too_big:
            kept.append(search)
            continue
        named = ", ".join(f"{value} (about {size(needs[value])})" for value in too_big)
        if len(too_big) == len(needs):
            raise ConfigError(
                f"{search.key}: no value fits {USABLE:.0%} of the {memory:g} GB of {what}: {named}; search smaller "
                "values, or shard the model (sharding.strategy=full_shard)"
            )
        say_notes([f"{search.key}: {named} cannot fit {USABLE:.0%} of the {memory:g} GB of {what}: left out"])
        kept.append(search.keeping([value for value in values or [] if value not in too_big]))
    return kept


def say_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"raytpu: {note}", flush=True)


#: the loop's cumulative report counter: ASHA's time unit, unlike Tune's
#: ``training_iteration`` it does not restart when a resumed trial reruns its driver
REPORT_COUNT = "report"


def search_algorithm(sweep: Sweep) -> Any:
    """``tune.search_alg``: None for Tune's random and grid sampling; Optuna's TPE (:func:`tpe_sampler`),
    learning from every finished trial (its state is saved with the sweep, so the same command
    resumes the same search)."""
    if sweep.cfg.tune.search_alg != "optuna":
        return None
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return OptunaSearch(sampler=tpe_sampler(sweep.cfg.run.seed, sweep.cfg.tune.num_samples))


def tpe_sampler(seed: int, trials: int) -> Any:
    """Optuna's TPE, seeded, drawing its first trials at random: a third of the sweep's, 2 to 10
    (Optuna's own 10 would leave a small sweep nothing to learn from)."""
    import optuna

    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, trials // 3)))


def trial_scheduler(sweep: Sweep) -> Any:
    """``tune.scheduler``: ASHA stops the poor trials at its rungs (the loop's report count its
    time), FIFO runs every trial to its end, PBT has the poor ones go on from a better one's
    checkpoint with perturbed values every ``tune.perturbation_interval`` reports."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    tc = sweep.cfg.tune
    if tc.scheduler == "asha":
        return ASHAScheduler(
            time_attr=REPORT_COUNT,
            max_t=sweep.max_t,
            grace_period=tc.grace_period,
            reduction_factor=tc.reduction_factor,
        )
    if tc.scheduler == "pbt":
        # Tune's advice to reuse actors is for class trainables: a trial here is a TorchTrainer's driver
        warnings.filterwarnings("ignore", message="Consider boosting PBT performance")
        return PopulationBasedTraining(
            time_attr=REPORT_COUNT,
            perturbation_interval=tc.perturbation_interval,
            hyperparam_mutations={mutation.key: mutation.domain() for mutation in sweep.mutations},
            quantile_fraction=tc.quantile_fraction,
        )
    return FIFOScheduler()


def split_flags(overrides: list[str]) -> tuple[list[str], list[str], str | None]:
    """Pull the tune flags (and ``--address``) out of the overrides: (overrides, tune overrides, address)."""
    repeated = ["--search", "--mutate"]
    rest, found = extract(overrides, valued=[*FLAGS, "--address"], repeated=repeated, switches=["--verbose"])
    tuned = [f"{FLAGS[flag]}={values[0]}" for flag, values in found.items() if flag in FLAGS]
    tuned += ["logging.verbose=true"] if "--verbose" in found else []
    for flag, key in (("--search", "tune.search"), ("--mutate", "tune.mutations")):
        domains = {parse_search(text).key: text.split("=", 1)[1].strip() for text in found.get(flag, [])}
        if domains:
            tuned.append(f"{key}=" + json.dumps(domains))  # JSON is a YAML flow mapping
    return rest, tuned, found.get("--address", [None])[0]
