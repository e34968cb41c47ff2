"""Which runs a ``spec-rl train`` command line chooses (``--modes``, or ``--no-spec``/``--reuse``/``--compare``),
and the flag combinations refused because they would silently do something else than they say."""

from __future__ import annotations

import argparse

from .trainer.config import DEMO_MODES, MODE_PRESETS

#: Runs of --modes that verify drafts with the lenient rule, i.e. draw a token at a lenient rejection.
LENIENT_RUNS = ("spec", "auto")


class UsageError(SystemExit):
    """A bad command line or input: :func:`spec_rl.cli.main` prints "spec-rl: error: <message>" and exits with status 2.

    ``str(err)`` is the message (so callers of ``main`` can match it); ``err.code`` is 2.
    """

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def chosen_runs(args: argparse.Namespace, demo: bool) -> list[str]:
    """The run labels (:data:`~spec_rl.trainer.config.MODE_PRESETS`) the flags choose, in order.

    Raises:
        UsageError: an unknown or repeated run in ``--modes``, a flag that would be ignored beside it, or flags
            that do not combine with the chosen runs (each message names the flag and the fix).
    """
    modes = _chosen_modes(args, demo)
    _check_combinations(args, modes)
    return modes


def _check_combinations(args: argparse.Namespace, modes: list[str]) -> None:
    """Refuse flag combinations that would silently do something else than they say."""
    if args.acceptance == "exact" and not {"spec", "exact"} & set(modes):
        raise UsageError("--acceptance exact applies to SPEC-RL runs (spec, exact); the selected runs reuse no drafts")
    if args.acceptance == "exact" and args.lenience not in (None, 1.0):
        raise UsageError("--lenience applies to lenient acceptance only; exact acceptance has no lenience")
    if args.rejection_draw is not None and (args.acceptance == "exact" or not set(LENIENT_RUNS) & set(modes)):
        raise UsageError("--rejection-draw applies to lenient SPEC-RL runs (spec, auto), and the selected runs draw no token "
                         "at a lenient rejection; drop --rejection-draw, or run spec with lenient acceptance")  # fmt: skip
    if "histspec" in modes and (args.history_spec is False or args.spec_tokens == 0):
        raise UsageError("histspec is vanilla with history speculation: drop --no-history-spec / --spec-tokens 0, or run vanilla")
    _check_lenience_applies(args, modes)
    if set(modes) == {"vanilla"}:
        unused = [flag for flag, on in (("--spec-tokens", args.spec_tokens is not None), ("--history-spec", args.history_spec is True),
                                        ("--compare", args.compare is True)) if on]  # fmt: skip
        if unused:
            raise UsageError(f"the selected run is plain vanilla (one token per decode step, no reuse), so {', '.join(unused)} "
                             "would be ignored; drop it, or run histspec (vanilla with history speculation) or spec")  # fmt: skip


def _check_lenience_applies(args: argparse.Namespace, modes: list[str]) -> None:
    """A lenience (other than 0, which selects vanilla) needs a run that uses it: spec (lenient), or auto for
    ``--lenience auto``; 1 is also taken by exact (it means "not set" there, as in the adapters)."""
    lenience = args.lenience
    if lenience is None or lenience == 0:
        return
    if "spec" in modes or (lenience == "auto" and "auto" in modes) or (lenience == 1 and "exact" in modes):
        return
    raise UsageError(f"--lenience {lenience} applies to lenient SPEC-RL runs (spec{', auto' if lenience == 'auto' else ''}), and "
                     f"the selected runs ({', '.join(modes)}) use none (auto adapts its own, exact has none); drop "
                     "--lenience, or run spec")  # fmt: skip


def _chosen_modes(args: argparse.Namespace, demo: bool) -> list[str]:
    if args.modes is not None:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODE_PRESETS]
        if bad or not modes:
            raise UsageError(f"--modes takes {', '.join(MODE_PRESETS)}; got {args.modes!r}")
        if len(set(modes)) != len(modes):
            raise UsageError(f"--modes names a run twice: {args.modes!r} (each run has one folder)")
        _refuse_run_choosers(args)
        return modes
    if args.lenience == 0 and args.reuse is not None:
        raise UsageError(f"--lenience 0 is vanilla GRPO (no reuse), so --reuse {args.reuse} would be ignored; drop one of them")
    main = "vanilla" if (args.no_spec or args.lenience == 0) else (args.reuse or "spec")
    if main == "spec" and args.acceptance == "exact":
        main = "exact"
    compare = args.compare if args.compare is not None else demo
    if demo and args.compare is None and main == "spec":
        return list(DEMO_MODES)
    if compare and main != "vanilla":
        return ["vanilla", main]
    return [main]


def _refuse_run_choosers(args: argparse.Namespace) -> None:
    """--modes lists the runs itself: the flags that would otherwise choose them are refused, not ignored."""
    given = [flag for flag, on in (
        ("--no-spec", args.no_spec), (f"--reuse {args.reuse}", args.reuse is not None),
        ("--compare", args.compare is True), ("--no-compare", args.compare is False), ("--lenience 0", args.lenience == 0),
    ) if on]  # fmt: skip
    if given:
        raise UsageError(f"--modes lists the runs itself, so {', '.join(given)} would be ignored; drop "
                         f"{'it' if len(given) == 1 else 'them'}, or name the runs in --modes ({', '.join(MODE_PRESETS)})")
