"""Lease preflight: every recipe's config loads and its warm start fits, before a lease driver spends the GPU.

A lease driver (``bench/quality_session.sh start``) runs each recipe's 04 only after 01-03, minutes of device time
in; a typo in a recipe's ``--set`` list or a ``train.init_from`` drafter of another shape failed there (lease
2026-12-05b: lease 04c's one-layer export under ``configs/smollm2-135m-127k.yaml``, which had become two-layer, was
refused by 04 six minutes into the lease). This checks both at ``start``, in seconds, with neither the verifier nor
the shards: :func:`eagle3.config.load_config` with the recipe's overrides (every field validated), then
:func:`eagle3.stages.train.check_init_from_config` (the export folder, and the drafter shape fields the config
fixes against the export's record).

Usage::

    python bench/lease_preflight.py --config C --recipe NAME [--set K=V ...] [--recipe NAME2 [--set K=V ...]] ...

Prints one ``preflight NAME: ok`` line per recipe (``, warm start from DIR`` with ``train.init_from``); the first
refused recipe ends it with ``error: recipe NAME: <the refusal>`` and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.errors import UserError  # noqa: E402


class _RecipeSet(argparse.Action):
    """``--set K=V``: appended to the override list of the latest ``--recipe``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not namespace.recipes:
            parser.error("--set before any --recipe")
        namespace.recipes[-1][1].append(values)


class _Recipe(argparse.Action):
    """``--recipe NAME``: starts a recipe with an empty override list."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.recipes.append((values, []))


def check_recipes(config: str, recipes: list[tuple[str, list[str]]]) -> list[str]:
    """Load each recipe's config (``config`` with its overrides) and check its warm start.

    Args:
        config: the run YAML every recipe starts from.
        recipes: ``[(name, ["section.key=value", ...]), ...]``.

    Returns:
        one ``preflight NAME: ok[, warm start from DIR]`` line per recipe.

    Raises:
        UserError: ``recipe NAME: <the config's or the warm start's refusal>`` for the first recipe refused.
    """
    from eagle3.config import load_config
    from eagle3.stages.train import check_init_from_config

    lines = []
    for name, overrides in recipes:
        try:
            cfg = load_config(config, overrides)
            warm = check_init_from_config(cfg)
        except UserError as e:
            raise UserError(f"recipe {name}: {e}") from None
        lines.append(
            f"preflight {name}: ok" + (f", warm start from {cfg.train.init_from}" if warm else "")
        )
    return lines


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", required=True)
    p.add_argument("--recipe", action=_Recipe, dest="recipes", default=[], metavar="NAME")
    p.add_argument("--set", action=_RecipeSet, dest="recipes", metavar="SECTION.KEY=VALUE")
    a = p.parse_args(argv)
    for (
        recipe
    ) in a.recipes:  # one line as each passes: the refused one is the first without its line
        print(check_recipes(a.config, [recipe])[0], flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
