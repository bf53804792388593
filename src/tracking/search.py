"""Sweeps that search (hydra/sweeper=optuna): the search space checked before any trial starts,
the objective each trial returns to the sweeper, and which way is better.

Hydra's basic sweeper lists its jobs and src/run.py's preflight composes each one. A searching
sweeper draws its trials as it goes (`optim.lr=interval(1e-4,1e-2)`, `hydra.sweeper.params`), so
no job list exists before it starts; preflight composes instead the corners of the space: every
choice() option with each range's and interval's low ends, then with their high ends. A key that
is not in the config, an option that is not in its group, or a bound the schema refuses is one
line, before the sweep's parent run or any trial exists.

Optuna reads a trial's result from the job's return value: a float, the summary.json figure that
`sweep.objective` names (the task's headline when empty). A failed job returns its error as a
string, which Optuna records as a FAIL trial ("must be float-castable") and the sweep goes on.
Pruning needs the objective's curve inside the trial (trial.report / should_prune), but
hydra-optuna-sweeper runs each trial as a whole Hydra job and gets only its return value: it has
no pruning hook, and none is made up here.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("src.sweep")

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def is_searching(sweeper_target: str | None) -> bool:
    """A sweeper that reads each job's return value as its objective (Optuna, Nevergrad, Ax): any
    but Hydra's basic one, which only lists jobs."""
    return bool(sweeper_target) and sweeper_target != BASIC_SWEEPER


def objective_of(cfg: Any) -> str:
    """The figure a sweep is judged by: sweep.objective, else the task's headline."""
    from src.tracking.figures import headline

    return str(OmegaConf.select(cfg, "sweep.objective", default="") or "") or headline(cfg.task.name)


def directions(sweeper: Any) -> list[str]:
    """hydra.sweeper.direction as Optuna takes it ("minimize", Direction.maximize, or a list); [] where
    none is given (the sweeper then takes the objective's better side: better_direction)."""
    value = OmegaConf.select(sweeper, "direction", default=None) if isinstance(sweeper, DictConfig) else getattr(sweeper, "direction", None)
    if value is None:
        return []
    values = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else [value]
    return [str(getattr(v, "name", v)).split(".")[-1].lower() for v in values]


def better_direction(cfg: Any) -> str:
    """The direction that searches for the best of the sweep's objective."""
    from src.tracking.figures import lower_is_better

    return "minimize" if lower_is_better(objective_of(cfg)) else "maximize"


def job_return(summary: dict | None, cfg: DictConfig, sweeper_target: str | None) -> Any:
    """What a sweep job hands back to Hydra: its summary for the basic sweeper; for a searching one,
    the objective as a float, or a string saying why there is none (a failed job, a figure the run
    did not measure), which the sweeper records as a failed trial."""
    if not is_searching(sweeper_target):
        return summary
    from src.tracking.figures import is_number

    objective = objective_of(cfg)
    summary = summary or {}
    if summary.get("status") != "finished":
        return f"job {summary.get('status', 'failed')}: {summary.get('error') or 'no summary'}"
    value = summary.get(objective)
    if not is_number(value):
        return f"no {objective} in the job's summary.json (it is {value!r})"
    log.info("objective %s = %.6g", objective, value)
    return float(value)


# --- preflight ---------------------------------------------------------------------------------

def _corners(key: str, text: str) -> tuple[list[str], list[str]] | None:
    """The values to check for one search-space entry `key=text`: (choices, [low, high]) for a
    sweep; None for a fixed value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep, RangeSweep

    override = OverridesParser.create().parse_override(f"{key}={text}")
    if not override.is_sweep_override():
        return None
    value = override.value()
    if isinstance(value, IntervalSweep):
        return [], [repr(value.start), repr(value.end)]  # repr: 0.0001 and 1e-05 as Hydra reads them back
    if isinstance(value, RangeSweep) and not value.shuffle:
        listed = list(override.sweep_string_iterator())  # a range's last value is below its stop
        return [], [listed[0], listed[-1]] if listed else []
    return list(override.sweep_string_iterator()), []


# The tags Optuna's sweeper reads: `log` on an interval (a log-uniform draw); it ignores any other
# tag, so a misspelt one would search linearly without a word.
OPTUNA_TAGS = {"interval": {"log"}, "range": set(), "choice": set()}


def check_searchable(key: str, text: str, given: str) -> bool:
    """One search-space entry as Optuna will draw it: bounds in order, a log scale above 0, only the
    tags it reads. True where the entry searches more than one value. Raises ConfigError."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    from src.config.compose import ConfigError

    override = OverridesParser.create().parse_override(f"{key}={text}")
    if not override.is_sweep_override():
        return False
    value = override.value()
    kind = "interval" if isinstance(value, IntervalSweep) else "range" if isinstance(value, RangeSweep) else "choice"
    unknown = sorted(set(getattr(value, "tags", set()) or set()) - OPTUNA_TAGS[kind])
    if unknown:
        read = "tag(log,interval(LOW,HIGH)) for a log scale" if kind == "interval" else f"no tag on a {kind}"
        raise ConfigError(f"{given}: Optuna does not read the tag {', '.join(unknown)} and would ignore it; it reads {read}")
    if isinstance(value, IntervalSweep):
        if value.start > value.end:
            raise ConfigError(f"{given}: the low bound {value.start} is above the high bound {value.end}; "
                              f"write {key}=interval({value.end},{value.start})")
        if "log" in value.tags and value.start <= 0:
            raise ConfigError(f"{given}: a log scale needs a low bound above 0 (it is {value.start}); "
                              f"e.g. {key}=tag(log,interval({value.end / 1000:g},{value.end}))")
        return value.start < value.end
    if isinstance(value, RangeSweep):
        listed = list(override.sweep_string_iterator())
        if not listed:
            raise ConfigError(f"{given}: the range holds no value: range(start,stop,step) runs from its start by its step to "
                              f"before its stop, e.g. {key}=range({min(value.start, value.stop)},{max(value.start, value.stop)})")
        return len(listed) > 1
    assert isinstance(value, ChoiceSweep)
    return len(set(override.sweep_string_iterator())) > 1


def search_space(params: Any, user: list[str]) -> dict[str, tuple[str, str]]:
    """{key: (value text, where it was given)}: hydra.sweeper.params, then the command line's sweep
    overrides over them (the Optuna sweeper's own order: a later entry of a key wins)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    space: dict[str, tuple[str, str]] = {}
    for key, value in (params or {}).items():
        space[str(key)] = (str(value), f"hydra.sweeper.params.{key}={value}")
    for given, parsed in zip(user, OverridesParser.create().parse_overrides(user)):
        if parsed.is_sweep_override():
            space[parsed.get_key_element()] = (given.split("=", 1)[1], given)
    return space


def search_jobs(overrides: list[str], multirun: bool, config_dir: str | None = None) -> list[list[str]] | None:
    """The jobs preflight composes for a sweep its basic expansion cannot list; None where it can
    (a single run, Hydra's basic sweeper over lists). Raises ConfigError, in one line, for a search
    the sweep cannot run: a searching sweeper's key or bound the config refuses, an objective the
    task does not report, a direction that would search for the worst; sweep.resume outside -m."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from src.config.compose import ConfigError, compose_config

    user = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    hydra_overrides = [o for o in overrides if o.lstrip("+~").startswith("hydra")]
    if not multirun:
        if any(o.replace(" ", "") in ("sweep.resume=true", "sweep.resume=True") for o in user):
            raise ConfigError("sweep.resume=true resumes a -m sweep under its MLflow parent run; add -m to the same sweep command "
                              "(a single run resumes from its checkpoint: checkpoint.enabled=true, checkpoint.resume=auto)")
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(user)
    except Exception:
        return None  # the basic expansion reports the override it cannot parse
    ranged = any(p.is_sweep_override() and not p.is_discrete_sweep() for p in parsed)
    named_sweeper = any(o.lstrip("+").split("=", 1)[0].startswith(("hydra/sweeper", "hydra.sweeper")) for o in hydra_overrides)
    objective_given = any(p.get_key_element() == "sweep.objective" for p in parsed)
    if not (ranged or named_sweeper or objective_given):
        return None
    nested = next((o for o in hydra_overrides if o.lstrip("+~").startswith("hydra.sweeper.params.")), None)
    if nested:  # hydra.sweeper.params is None until a config file gives it keys: Hydra fails on the dotted key with an AssertionError
        key = nested.lstrip("+~").split("=", 1)[0][len("hydra.sweeper.params."):]
        raise ConfigError(f"{nested}: give a search space entry on the command line as the key itself, {key}={nested.split('=', 1)[1].strip(chr(39))}, "
                          "or under hydra.sweeper.params in a config file (+exp=...)")
    fixed = [o for o, p in zip(user, parsed) if not p.is_sweep_override()]
    fixed_keys = [p.get_key_element() for p in parsed if not p.is_sweep_override()]
    first = compose_config(fixed + hydra_overrides, with_hydra=True, config_dir=config_dir)
    sweeper = first.hydra.sweeper
    target = str(OmegaConf.select(sweeper, "_target_", default="") or "")
    if not is_searching(target):
        if ranged:
            given = next(o for o, p in zip(user, parsed) if p.is_sweep_override() and not p.is_discrete_sweep())
            raise ConfigError(f"{given}: Hydra's basic sweeper runs lists of values, not a range to search; add hydra/sweeper=optuna "
                              "to search it (README: Tracking and sweeps), or list the values, e.g. optim.lr=1e-4,3e-4,1e-3")
        check_objective(first, target, sweeper)
        return None
    check_storage(sweeper, target)
    space = search_space(OmegaConf.select(sweeper, "params", default=None), user)
    choices: dict[str, list[str]] = {}
    low: dict[str, str] = {}
    high: dict[str, str] = {}
    given_as: dict[str, str] = {}
    searched = []
    for key, (text, given) in space.items():
        try:
            corners = _corners(key, text)
        except Exception as err:
            raise ConfigError(f"{given}: cannot parse it as a search space entry ({str(err).splitlines()[0]}); use choice(a,b), "
                              "range(start,stop,step) or interval(low,high) (https://hydra.cc/docs/plugins/optuna_sweeper/)") from None
        if "optuna" in target and check_searchable(key, text, given):
            searched.append(key)
        if corners is None:
            choices[key] = [text]
            continue
        listed, bounds = corners
        if listed:
            choices[key] = listed
        else:
            low[key], high[key] = bounds
        given_as[key] = given
    if "optuna" in target and not searched:
        n_trials = OmegaConf.select(sweeper, "n_trials", default=None)
        raise ConfigError(f"hydra/sweeper=optuna has nothing to search: it would run the same job {n_trials} times; give an entry with "
                          "more than one value, e.g. optim.lr=tag(log,interval(1e-4,1e-2)), or drop -m to run the job once")
    plain = [o for o, key in zip(fixed, fixed_keys) if key not in space]
    jobs = []
    for combo in itertools.product(*([f"{k}={v}" for v in vs] for k, vs in choices.items())):
        for bounds in ((low, high) if low else ({},)):
            jobs.append([*plain, *combo, *(f"{k}={v}" for k, v in bounds.items())])
    # one compose here names the entry as it was given (`optim.lrr=interval(...)`, not its bound)
    for job in jobs[: 2 if low else 1]:
        try:
            cfg = compose_config(job, config_dir=config_dir)
        except ConfigError as err:
            raise ConfigError(_as_given(str(err), job, given_as)) from None
    check_objective(cfg, target, sweeper)
    log.debug("searching sweeper %s: %d corner job(s) checked", target, len(jobs))
    return jobs


def check_storage(sweeper: Any, target: str) -> None:
    """hydra.sweeper.storage (a study kept in a database): hydra-optuna-sweeper pins optuna<3, and
    Optuna 2.10's RDB storage fails on SQLAlchemy 2 (an AssertionError reading alembic's version,
    after the sweep's parent run is made), which MLflow 3 requires."""
    from src.config.compose import ConfigError

    storage = OmegaConf.select(sweeper, "storage", default=None)
    if storage is None or "optuna" not in target:
        return
    import optuna
    import sqlalchemy

    if int(optuna.__version__.split(".")[0]) < 3 and int(sqlalchemy.__version__.split(".")[0]) >= 2:
        raise ConfigError(f"hydra.sweeper.storage={storage}: Optuna {optuna.__version__} (hydra-optuna-sweeper allows no later) cannot open "
                          f"a database under SQLAlchemy {sqlalchemy.__version__}, which MLflow needs; leave the study in memory: "
                          "every trial is a child run in MLflow, and sweep.resume=true continues a sweep from there")


def _as_given(message: str, job: list[str], given_as: dict[str, str]) -> str:
    """A composer's message that starts with a bound (`optim.lrr=0.0001: unknown key ...`) restated
    with the search-space entry the user wrote."""
    for override in job:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in given_as and message.startswith(override):
            return given_as[key] + message[len(override):]
    return message


def check_objective(cfg: DictConfig, sweeper_target: str, sweeper: Any) -> None:
    """sweep.objective must be a figure the task reports; under a sweeper with a direction, that
    direction must be the figure's better one (Optuna's default, minimize, would otherwise search
    for the slowest tokens/s)."""
    from src.config.compose import ConfigError
    from src.tracking.figures import figures_of

    objective = objective_of(cfg)
    task = cfg.task.name
    figures = figures_of(task)
    known = [*figures.shown, *figures.extra]
    if known and objective not in known:
        given = OmegaConf.select(cfg, "sweep.objective", default="")
        raise ConfigError(f"sweep.objective={given}: not a figure task={task} reports; use one of: {', '.join(known)}")
    if not is_searching(sweeper_target):
        return
    wanted = better_direction(cfg)
    found = directions(sweeper)
    if len(found) > 1:
        raise ConfigError(f"hydra.sweeper.direction={found}: sweep.objective names one figure ({objective}); give one direction, "
                          f"hydra.sweeper.direction={wanted}")
    if found and found[0] != wanted:
        better = "lower" if wanted == "minimize" else "higher"
        raise ConfigError(f"hydra.sweeper.direction={found[0]} would search for the worst {objective}, where {better} is better; "
                          f"pass hydra.sweeper.direction={wanted}, or name another figure with sweep.objective=...")
